"""tools/convert_checkpoint.py and megatron_rl.models.convert: HF -> Megatron dist checkpoint -> HF,
the result loading in transformers; one-line errors naming the tensor."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_helpers import hf_logits, save_random_hf_model

transformers = pytest.importorskip("transformers")
TOOL = Path(__file__).resolve().parents[1] / "tools" / "convert_checkpoint.py"
TOKENS = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(3))


def _tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args, "--no-progress"], capture_output=True, text=True,
                          timeout=300)


def _equal_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_cli_roundtrip_loads_in_transformers(tmp_path):
    """HF -> Megatron -> HF. The Megatron checkpoint sits where a run keeps its checkpoints, and
    the run directory holds only tokenizer.json (as runs saved it before they also wrote
    tokenizer_config.json): megatron-to-hf copies it without --tokenizer and writes the config
    files that give transformers the run's EOS and PAD."""
    from safetensors.torch import load_file

    from megatron_rl.data.tokenizer import char_tokenizer

    src, run, back = tmp_path / "hf", tmp_path / "run", tmp_path / "back"
    mcore = run / "checkpoints" / "step_3"
    original = save_random_hf_model("qwen3_moe", src)
    mcore.parent.mkdir(parents=True)
    (run / "config.yaml").write_text("trainer:\n  total_steps: 3\n")
    tokenizer = char_tokenizer("0123456789=")
    tokenizer.save(run / "tokenizer.json")

    done = _tool("hf-to-megatron", str(src), str(mcore), "--tp", "2", "--ep", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (mcore / "metadata.json").is_file() and (mcore / "model_config.json").is_file()
    done = _tool("megatron-to-hf", str(mcore), str(back), "--max-shard-size", "40KB")
    assert done.returncode == 0, done.stderr[-3000:]

    index = json.loads((back / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((back / s).is_file() for s in shards)
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert (back / "tokenizer.json").read_text() == (run / "tokenizer.json").read_text()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(back)
    assert (hf_tokenizer.eos_token, hf_tokenizer.pad_token, hf_tokenizer.eos_token_id) == ("<eos>", "<pad>", tokenizer.eos_id)
    assert hf_tokenizer.decode(hf_tokenizer("12=3")["input_ids"]) == "12=3"
    generation = transformers.GenerationConfig.from_pretrained(back)
    assert (generation.eos_token_id, generation.pad_token_id) == (tokenizer.eos_id, tokenizer.pad_id)
    theirs = load_file(str(src / "model.safetensors"))
    ours = {}
    for shard in shards:
        ours.update(load_file(str(back / shard)))
    assert sorted(ours) == sorted(theirs)
    assert all(_equal_bits(ours[k], theirs[k]) for k in theirs)

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
    assert type(reloaded).__name__ == "Qwen3MoeForCausalLM"
    assert torch.equal(hf_logits(reloaded, TOKENS), hf_logits(original, TOKENS))


def test_tokenizer_source_and_config_files(tmp_path):
    """Where megatron-to-hf takes the tokenizer from (--tokenizer, beside the checkpoint, the run
    directory), and the config files written for it: keys a checkpoint's own files have are kept."""
    from megatron_rl.data.tokenizer import char_tokenizer, complete_hf_tokenizer_dir, load_pretrained_tokenizer
    from megatron_rl.models.convert import tokenizer_source

    run = tmp_path / "run"
    step = run / "checkpoints" / "step_5"
    step.mkdir(parents=True)
    assert tokenizer_source(step) is None  # no config.yaml: not a run
    (run / "config.yaml").write_text("{}\n")
    assert tokenizer_source(step) is None  # a run without a tokenizer
    char_tokenizer("0123").save_pretrained(run)
    assert tokenizer_source(step) == run and tokenizer_source(step, tmp_path / "x") == tmp_path / "x"
    assert json.loads((run / "generation_config.json").read_text()) == {"eos_token_id": 2, "pad_token_id": 0,
                                                                        "bos_token_id": 1}
    char_tokenizer("0123").save(step / "tokenizer.json")
    assert tokenizer_source(step) == step  # saved beside the checkpoint (a converted one)

    hf = tmp_path / "hf"  # a checkpoint's tokenizer: EOS in generation_config.json only, sampling defaults
    hf.mkdir()
    (hf / "tokenizer.json").write_text((run / "tokenizer.json").read_text())
    (hf / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64, "bos_token": None}))
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 2], "temperature": 0.6}))
    loaded = load_pretrained_tokenizer(str(hf))
    out = tmp_path / "out"
    out.mkdir()
    loaded.save_pretrained(out)
    assert json.loads((out / "tokenizer_config.json").read_text()) == {
        "model_max_length": 64, "bos_token": None, "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "0",
        "pad_token": "0", "add_bos_token": False}
    assert json.loads((out / "generation_config.json").read_text()) == {"eos_token_id": [3, 2], "temperature": 0.6,
                                                                        "pad_token_id": 3}
    assert complete_hf_tokenizer_dir(hf) and json.loads((hf / "tokenizer_config.json").read_text())["eos_token"] == "0"
    (hf / "tokenizer.json").write_text("{}")
    assert not complete_hf_tokenizer_dir(hf)  # unreadable: left alone


@pytest.mark.parametrize("family", ["mixtral", "qwen2", "deepseek_v3"])
def test_megatron_checkpoint_gives_hf_logits(megatron_world, tmp_path, family):
    """HF -> dist checkpoint -> a model built from model_config.json: same logits as transformers."""
    from megatron_rl.learner.learner import forward_logits
    from megatron_rl.models.convert import hf_to_megatron_checkpoint, load_pretrained, pretrained_model_config
    from megatron_rl.models.gpt import build_gpt_model

    hf_model = save_random_hf_model(family, tmp_path / "hf")
    hf_to_megatron_checkpoint(tmp_path / "hf", tmp_path / "mcore")
    cfg, vocab = pretrained_model_config(tmp_path / "mcore", "fp32")
    model = build_gpt_model(cfg, vocab).eval()
    load_pretrained(model, cfg, tmp_path / "mcore")
    with torch.no_grad():
        gap = (forward_logits(model, TOKENS) - hf_logits(hf_model, TOKENS)).abs().max().item()
    assert gap <= 1e-4


def test_megatron_to_megatron_bf16(megatron_world, tmp_path):
    from megatron_rl.models.convert import (hf_to_megatron_checkpoint, load_pretrained, megatron_to_megatron_checkpoint,
                                            pretrained_model_config, read_model_config)
    from megatron_rl.models.gpt import build_gpt_model
    from megatron_rl.models.hf_checkpoint import HFTensorReader

    save_random_hf_model("llama", tmp_path / "hf")
    hf_to_megatron_checkpoint(tmp_path / "hf", tmp_path / "m32")
    megatron_to_megatron_checkpoint(tmp_path / "m32", tmp_path / "m16", dtype="bf16")
    assert read_model_config(tmp_path / "m16")[0].dtype == "bf16"
    cfg, vocab = pretrained_model_config(tmp_path / "m16", "bf16")
    model = build_gpt_model(cfg, vocab)
    load_pretrained(model, cfg, tmp_path / "m16")
    want = HFTensorReader(tmp_path / "hf").get("model.layers.1.self_attn.o_proj.weight").to(torch.bfloat16)
    assert torch.equal(model.state_dict()["decoder.layers.1.self_attention.linear_proj.weight"], want)


# ---------------------------------------------------------------- errors name the tensor
def _broken(tmp_path: Path, family: str, edit) -> Path:
    from safetensors.torch import load_file, save_file

    src = tmp_path / "hf"
    save_random_hf_model(family, src)
    tensors = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    edit(tensors, config)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    (src / "config.json").write_text(json.dumps(config))
    return src


def _convert_error(megatron_world, src: Path, out: Path) -> str:
    from megatron_rl.models.convert import hf_to_megatron_checkpoint
    from megatron_rl.models.hf_checkpoint import ConversionError
    from megatron_rl.models.hf_config import UnsupportedConfigError

    with pytest.raises((ConversionError, UnsupportedConfigError)) as info:
        hf_to_megatron_checkpoint(src, out)
    assert not (out / "metadata.json").exists()
    return str(info.value)


def test_error_unknown_architecture(megatron_world, tmp_path):
    src = _broken(tmp_path, "llama", lambda t, c: c.update(architectures=["GPT2LMHeadModel"]))
    message = _convert_error(megatron_world, src, tmp_path / "out")
    assert "unsupported architecture 'GPT2LMHeadModel'" in message and "Qwen3MoeForCausalLM" in message


def test_error_missing_tensor(megatron_world, tmp_path):
    src = _broken(tmp_path, "mixtral", lambda t, c: t.pop("model.layers.1.block_sparse_moe.experts.2.w3.weight"))
    message = _convert_error(megatron_world, src, tmp_path / "out")
    assert "'model.layers.1.block_sparse_moe.experts.2.w3.weight'" in message and "missing" in message


def test_error_shape_mismatch(megatron_world, tmp_path):
    def edit(tensors, config):
        tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"][:8]

    message = _convert_error(megatron_world, _broken(tmp_path, "qwen2", edit), tmp_path / "out")
    assert "'model.layers.0.self_attn.k_proj.weight' has shape (8, 32), expected (16, 32)" in message


def test_error_dtype(megatron_world, tmp_path):
    def edit(tensors, config):
        tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"].to(torch.int8)

    message = _convert_error(megatron_world, _broken(tmp_path, "qwen3", edit), tmp_path / "out")
    assert "'model.layers.1.mlp.up_proj.weight' has dtype int8" in message and "dequantized" in message


def test_error_unsupported_config_key(megatron_world, tmp_path):
    src = _broken(tmp_path, "llama", lambda t, c: c.update(hidden_act="gelu"))
    assert "hidden_act='gelu' is not supported" in _convert_error(megatron_world, src, tmp_path / "out")


def test_error_layout_that_does_not_divide(megatron_world, tmp_path):
    from megatron_rl.models.convert import hf_to_megatron_checkpoint
    from megatron_rl.models.hf_checkpoint import ConversionError

    save_random_hf_model("qwen3", tmp_path / "hf")
    with pytest.raises(ConversionError, match=r"--tp=4 must divide model.num_attention_heads=4 and model.num_query_groups=2"):
        hf_to_megatron_checkpoint(tmp_path / "hf", tmp_path / "out", layout=(4, 1, 1))


def test_cli_error_is_one_line_with_status_2(tmp_path):
    src = _broken(tmp_path, "llama", lambda t, c: t.pop("model.norm.weight"))
    done = _tool("hf-to-megatron", str(src), str(tmp_path / "out"))
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("convert_checkpoint: error: tensor 'model.norm.weight'") and "missing" in last


def test_bf16_checkpoint_keeps_its_dtype_both_ways(megatron_world, tmp_path):
    """A bf16 HF checkpoint becomes a bf16 Megatron checkpoint (dtype from config.json) and comes
    back bitwise, still bf16."""
    from safetensors.torch import load_file

    from megatron_rl.models.convert import hf_to_megatron_checkpoint, megatron_to_hf_checkpoint, read_model_config
    from megatron_rl.models.hf_checkpoint import HFTensorReader

    model = save_random_hf_model("qwen2", tmp_path / "hf32")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    hf_to_megatron_checkpoint(tmp_path / "hf", tmp_path / "mcore")
    assert read_model_config(tmp_path / "mcore")[0].dtype == "bf16"
    megatron_to_hf_checkpoint(tmp_path / "mcore", tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["dtype"] == "bfloat16"
    original, back = load_file(str(tmp_path / "hf" / "model.safetensors")), HFTensorReader(tmp_path / "back")
    assert sorted(back.names()) == sorted(original)
    assert all(original[k].dtype == torch.bfloat16 and _equal_bits(back.get(k), original[k]) for k in original)


@pytest.mark.parametrize("overrides", [[], ["model.family=mixtral", "model.num_experts=4"]], ids=["llama", "mixtral"])
def test_random_init_learner_exports_to_transformers(megatron_world, tmp_path, overrides):
    """A model trained from scratch (no HF config to start from) exports a config.json of its own
    that transformers builds the same model from."""
    from megatron_rl.checks import load_config
    from megatron_rl.learner.learner import Learner, forward_logits
    from megatron_rl.models.convert import export_hf_checkpoint

    cfg = load_config("tiny_cpu", overrides)
    learner = Learner(cfg, 96)
    export_hf_checkpoint(learner.export_hf_weights(), cfg.model, 96, tmp_path / "hf")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = TOKENS[:, :16]
    with torch.no_grad():
        ours = forward_logits(learner.module.eval(), tokens)
    assert (hf_logits(reloaded, tokens) - ours).abs().max().item() <= 1e-4
