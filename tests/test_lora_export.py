"""A LoRA run's adapters out to Hugging Face: the PEFT directory (tools/export_lora.py, and
trainer.export_hf's ``peft`` beside ``hf``) loads in peft + transformers onto the HF base and gives
the learner's logits; the merge tool (tools/merge_lora.py) writes a full HF checkpoint whose
logits equal the PEFT model's, from a run's checkpoint or from a base and a PEFT directory."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_helpers import hf_logits, save_random_hf_model

from megatron_rl.checks import load_config

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
TOOLS = Path(__file__).resolve().parents[1] / "tools"
TOKENS = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(5))
TOL = 1e-5
SMALL_RUN = ["trainer.progress=false", "algo.groups_per_batch=2", "algo.group_size=2", "learner.mini_batches=1"]


def _learner_logits(learner, base_only: bool = False):
    import contextlib

    from megatron_rl.learner.learner import forward_logits
    from megatron_rl.models.lora import adapters_disabled

    with torch.no_grad(), (adapters_disabled(learner.module) if base_only else contextlib.nullcontext()):
        return forward_logits(learner.module.eval(), TOKENS)


def _peft_logits(base_dir, adapter_dir):
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return hf_logits(peft.PeftModel.from_pretrained(base, adapter_dir).eval(), TOKENS)


def _lora_run_checkpoint(tmp_path, family: str):
    """A LoRA learner on an HF model of ``family`` with random adapters (A and B off their init),
    saved as a run's checkpoint (run_dir/checkpoints/step_1 beside run_dir/config.yaml)."""
    from omegaconf import OmegaConf

    from megatron_rl.checkpoint import save_checkpoint
    from megatron_rl.learner.learner import Learner
    from megatron_rl.models.lora import is_adapter_name
    from megatron_rl.models.pretrained import vocab_size_for

    save_random_hf_model(family, tmp_path / "hf")
    cfg = load_config("tiny_cpu", [f"model.path={tmp_path / 'hf'}", "lora.rank=4", "lora.alpha=8", *SMALL_RUN])
    learner = Learner(cfg, vocab_size_for(cfg.model, tokenizer_vocab=20))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in learner.module.named_parameters():
            if is_adapter_name(name):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    run = tmp_path / "run"
    run.mkdir()
    OmegaConf.save(OmegaConf.structured(cfg), run / "config.yaml")
    return learner, save_checkpoint(learner, run / "checkpoints", step=1, trainer_state={})


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_peft_export_and_merge_give_the_learners_logits(megatron_world, tmp_path, family):
    """qwen3: head_dim != hidden/heads and q/k norms; qwen2: q/k/v biases and tied embeddings.
    The fused q/k/v and gate/up adapters split into PEFT's per-projection ones."""
    from safetensors.torch import load_file

    from megatron_rl.models.hf_checkpoint import HFTensorReader
    from megatron_rl.models.lora_checkpoint import export_peft, merge_checkpoint, merge_peft

    learner, step = _lora_run_checkpoint(tmp_path, family)
    ours, base_logits = _learner_logits(learner), _learner_logits(learner, base_only=True)
    export_peft(step, tmp_path / "adapter", base_out=tmp_path / "base")

    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8.0, str(tmp_path / "base"))
    names = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names
    assert len(names) == 2 * 7 * 2  # A and B of q, k, v, o, gate, up, down in each of 2 layers
    original, base = HFTensorReader(tmp_path / "hf"), HFTensorReader(tmp_path / "base")
    assert sorted(base.names()) == sorted(original.names())
    assert all(torch.equal(base.get(k), original.get(k)) for k in original.names())  # the frozen base

    with_peft = _peft_logits(tmp_path / "base", tmp_path / "adapter")
    gap, effect = (with_peft - ours).abs().max().item(), (ours - base_logits).abs().max().item()
    print(f"{family}: PEFT vs learner logits {gap:.1e} (the adapters move them by {effect:.1e})")
    assert gap <= TOL and effect > 0.1

    merge_checkpoint(step, tmp_path / "merged", dtype="fp32")
    merge_peft(tmp_path / "hf", tmp_path / "adapter", tmp_path / "merged_peft")
    for merged in ("merged", "merged_peft"):
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / merged, dtype=torch.float32).eval()
        gap = (hf_logits(model, TOKENS) - with_peft).abs().max().item()
        print(f"{family}: {merged} vs PEFT logits {gap:.1e}")
        assert gap <= TOL


def _tool(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOLS / name), *args], capture_output=True, text=True, timeout=300)


def test_trainer_export_hf_writes_the_adapters_as_peft_beside_the_merged_model(megatron_world, tmp_path):
    """Two LoRA steps from an HF model with trainer.export_hf: step_N/peft (naming model.path as
    its base) on the HF base, and step_N/hf (merged), both give the trained learner's logits."""
    from megatron_rl.build import build_trainer

    save_random_hf_model("qwen3", tmp_path / "hf")
    cfg = load_config("tiny_cpu", [f"model.path={tmp_path / 'hf'}", f"trainer.run_dir={tmp_path / 'run'}",
                                   "trainer.total_steps=2", "trainer.save_final_checkpoint=true",
                                   "trainer.export_hf=true", "scheduler.max_staleness=0", "lora.rank=4",
                                   "learner.lr=5e-2", *SMALL_RUN])
    trainer = build_trainer(cfg)
    trainer.run()
    learner = trainer.worker.learner
    ours, base_logits = _learner_logits(learner), _learner_logits(learner, base_only=True)
    step = tmp_path / "run" / "checkpoints" / "step_2"
    config = json.loads((step / "peft" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "hf").resolve())
    with_peft = _peft_logits(config["base_model_name_or_path"], step / "peft")
    merged = hf_logits(transformers.AutoModelForCausalLM.from_pretrained(step / "hf").eval(), TOKENS)
    gaps = [(with_peft - ours).abs().max().item(), (merged - ours).abs().max().item()]
    effect = (ours - base_logits).abs().max().item()
    print(f"PEFT vs learner {gaps[0]:.1e}, merged export vs learner {gaps[1]:.1e}; adapters' effect {effect:.1e}")
    assert max(gaps) <= TOL and effect > 10 * TOL


def test_tools_export_and_merge_from_the_command_line(megatron_world, tmp_path):
    """tools/export_lora.py writes the PEFT directory, tools/merge_lora.py merges it into the HF
    base (any PEFT LoRA directory), both as the library functions do; bad input is one line."""
    from megatron_rl.models.hf_checkpoint import HFTensorReader
    from megatron_rl.models.lora_checkpoint import merge_checkpoint

    learner, step = _lora_run_checkpoint(tmp_path, "llama")
    done = _tool("export_lora.py", str(step), str(tmp_path / "adapter"))
    assert done.returncode == 0, done.stderr[-3000:]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "hf").resolve())  # the run's model.path
    done = _tool("merge_lora.py", str(tmp_path / "hf"), str(tmp_path / "merged"),
                 "--adapter", str(tmp_path / "adapter"), "--max-shard-size", "40KB")
    assert done.returncode == 0, done.stderr[-3000:]
    merge_checkpoint(step, tmp_path / "reference")
    merged, reference = HFTensorReader(tmp_path / "merged"), HFTensorReader(tmp_path / "reference")
    assert len(set(merged.weight_map.values())) > 1  # sharded as asked
    assert sorted(merged.names()) == sorted(reference.names())
    worst = max((merged.get(k) - reference.get(k)).abs().max().item() for k in reference.names())
    assert worst <= 1e-6

    done = _tool("merge_lora.py", str(tmp_path / "hf"), str(tmp_path / "x"), "--adapter", str(tmp_path / "hf"))
    assert done.returncode == 2 and "is not a PEFT adapter directory" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    (tmp_path / "run" / "config.yaml").write_text("lora:\n  rank: 0\n")
    done = _tool("export_lora.py", str(step), str(tmp_path / "y"))
    assert done.returncode == 2 and "run without LoRA" in done.stderr


def test_peft_export_of_a_pipeline_parallel_learner_equals_one_process(megatron_world, tmp_path):
    """At PP=2 every stage's adapters reach rank 0's PEFT directory: the same files as one process."""
    from safetensors.torch import load_file

    from megatron_rl.learner.learner import Learner
    from megatron_rl.models.lora import is_adapter_name
    from megatron_rl.models.lora_checkpoint import write_peft_from_learner

    from lora_cases import peft_export_case
    from parallel_cases import VOCAB, tiny_cfg
    from rank_harness import run_ranks

    cfg = tiny_cfg()
    cfg.lora.rank, cfg.lora.alpha = 4, 8.0
    learner = Learner(cfg, VOCAB)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in learner.module.named_parameters():
            if is_adapter_name(name):
                p.copy_(torch.randn(p.shape, generator=gen))
    full = {k: v.detach().clone() for k, v in learner.module.state_dict().items() if isinstance(v, torch.Tensor)}
    adapters = {k: v for k, v in full.items() if is_adapter_name(k)}
    write_peft_from_learner(tmp_path / "one", adapters, cfg.model, cfg.lora, None)
    pp_cfg = tiny_cfg(pp=2)
    pp_cfg.lora.rank, pp_cfg.lora.alpha = 4, 8.0
    run_ranks(peft_export_case, 2, args=(pp_cfg, full, str(tmp_path / "pp2")), timeout_s=180)
    one = load_file(str(tmp_path / "one" / "adapter_model.safetensors"))
    pp2 = load_file(str(tmp_path / "pp2" / "adapter_model.safetensors"))
    assert len(one) == 4 * 7 * 2 and one.keys() == pp2.keys()  # 4 layers, over both stages
    assert all(torch.equal(one[k], pp2[k]) for k in one)
    configs = [(tmp_path / d / "adapter_config.json").read_text() for d in ("one", "pp2")]
    assert configs[0] == configs[1]
