"""rollout.device: the engine process's GPU in the single-process trainer (learner on cuda:0,
engine on cuda:N). The rules are checked here on a CPU; the GPU runs are tools/gpu/validate_2gpu.sh."""

import pytest

from megatron_rl.checks import load_config

from megatron_rl.config import ConfigError
from megatron_rl.rollout.device import parse_engine_device, resolve_engine_device


def test_auto_keeps_the_default_device_everywhere():
    assert parse_engine_device("auto") is None
    for gpus in (0, 1, 8):
        assert resolve_engine_device("auto", gpus) is None  # harmless on a CPU machine


@pytest.mark.parametrize("spec, index", [("cuda:0", 0), ("cuda:1", 1), (" CUDA:3 ", 3)])
def test_a_gpu_is_named_cuda_n(spec, index):
    assert parse_engine_device(spec) == index
    assert resolve_engine_device(spec, 4) == index


@pytest.mark.parametrize("spec", ["gpu1", "cuda", "cuda:-1", "1", "cpu", ""])
def test_anything_else_is_refused_with_the_forms_that_work(spec):
    with pytest.raises(ValueError, match="use auto .* or cuda:N"):
        parse_engine_device(spec)


def test_a_gpu_the_machine_lacks_is_an_error():
    with pytest.raises(ValueError, match=r"has 2 GPU\(s\), cuda:0 to cuda:1"):
        resolve_engine_device("cuda:2", 2)
    with pytest.raises(ValueError, match="no GPU"):
        resolve_engine_device("cuda:0", 0)


def test_config_needs_an_engine_process_of_its_own():
    with pytest.raises(ConfigError, match="rollout.separate_process=true"):
        load_config("tiny_cpu", ["rollout.device=cuda:1"])
    with pytest.raises(ConfigError, match="not a device"):
        load_config("tiny_cpu", ["rollout.device=gpu:1", "rollout.separate_process=true"])
    cfg = load_config("tiny_cpu", ["rollout.device=cuda:1", "rollout.separate_process=true"])
    assert cfg.rollout.device == "cuda:1"  # valid config; the GPU is checked where it runs


def test_the_trainer_refuses_a_missing_gpu_before_building_anything(tmp_path, capsys):
    import torch

    from megatron_rl.main import main

    missing = torch.cuda.device_count() if torch.cuda.is_available() else 0
    code = main(["recipe=tiny_cpu", f"rollout.device=cuda:{missing}", "rollout.separate_process=true",
                 f"trainer.run_dir={tmp_path / 'run'}", "trainer.progress=false"])
    assert code == 2
    assert f"rollout.device=cuda:{missing}" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # failed before the run directory was made
