"""model.path: the trainer starts from a Hugging Face directory or a Megatron dist checkpoint, with
the checkpoint's architecture; a run's checkpoint converts back to a directory transformers loads."""

import pytest
import torch

from hf_helpers import hf_logits, save_random_hf_model

from megatron_rl.checks import load_config

from megatron_rl.config import ConfigError

transformers = pytest.importorskip("transformers")
TOKENS = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(5))
SMALL_RUN = ["trainer.progress=false", "algo.groups_per_batch=2", "algo.group_size=2", "learner.mini_batches=1"]


def _learner_logits(learner):
    from megatron_rl.learner.learner import forward_logits

    with torch.no_grad():
        return forward_logits(learner.module.eval(), TOKENS)


def test_config_takes_the_architecture_from_the_checkpoint(tmp_path):
    save_random_hf_model("qwen3", tmp_path / "hf")
    cfg = load_config("tiny_cpu", [f"model.path={tmp_path / 'hf'}", "model.num_layers=7"])
    m = cfg.model
    assert (m.family, m.num_layers, m.hidden_size, m.head_dim, m.ffn_hidden_size) == ("qwen3", 2, 32, 16, 48)
    assert m.path == str(tmp_path / "hf") and m.dtype == "fp32"


def test_config_error_names_model_path(tmp_path):
    save_random_hf_model("llama", tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text('{"architectures": ["BertModel"]}')
    with pytest.raises(ConfigError, match=r"model.path=.*unsupported architecture 'BertModel'"):
        load_config("tiny_cpu", [f"model.path={tmp_path / 'hf'}"])


def test_learner_starts_from_hf_weights(megatron_world, tmp_path):
    from safetensors.torch import load_file

    from megatron_rl.learner.learner import Learner
    from megatron_rl.models.pretrained import vocab_size_for

    hf_model = save_random_hf_model("qwen2_moe", tmp_path / "hf")
    cfg = load_config("tiny_cpu", [f"model.path={tmp_path / 'hf'}", *SMALL_RUN])
    learner = Learner(cfg, vocab_size_for(cfg.model, tokenizer_vocab=20))
    assert (_learner_logits(learner) - hf_logits(hf_model, TOKENS)).abs().max().item() <= 1e-4
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    exported = dict(learner.export_hf_weights())
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], original[k]) for k in original)


def test_learner_starts_from_megatron_checkpoint(megatron_world, tmp_path):
    from megatron_rl.learner.learner import Learner
    from megatron_rl.models.convert import hf_to_megatron_checkpoint
    from megatron_rl.models.pretrained import vocab_size_for

    hf_model = save_random_hf_model("llama", tmp_path / "hf")
    hf_to_megatron_checkpoint(tmp_path / "hf", tmp_path / "mcore")
    cfg = load_config("tiny_cpu", [f"model.path={tmp_path / 'mcore'}", *SMALL_RUN])
    assert cfg.model.rope_scaling_factor == 8.0
    learner = Learner(cfg, vocab_size_for(cfg.model, tokenizer_vocab=20))
    assert (_learner_logits(learner) - hf_logits(hf_model, TOKENS)).abs().max().item() <= 1e-4


def test_tokenizer_larger_than_checkpoint_vocab_is_refused(tmp_path):
    from megatron_rl.models.pretrained import vocab_size_for

    save_random_hf_model("llama", tmp_path / "hf")
    cfg = load_config("tiny_cpu", [f"model.path={tmp_path / 'hf'}"])
    assert vocab_size_for(cfg.model, 90) == 96
    with pytest.raises(ValueError, match="tokenizer has 100 ids"):
        vocab_size_for(cfg.model, 100)


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_run_from_hf_then_export_its_checkpoint_to_hf(megatron_world, tmp_path, family):
    """Two training steps from an HF model (engine and learner agreeing on logprobs); the run's
    checkpoint converts to an HF directory holding the trained (changed) weights, which
    transformers loads and runs with the trained learner's logits; trainer.export_hf writes the same."""
    import json

    from megatron_rl.models.convert import megatron_to_hf_checkpoint
    from megatron_rl.models.hf_checkpoint import HFTensorReader
    from megatron_rl.build import build_trainer

    save_random_hf_model(family, tmp_path / "hf")
    cfg = load_config("tiny_cpu", [f"model.path={tmp_path / 'hf'}", f"trainer.run_dir={tmp_path / 'run'}",
                                   "trainer.total_steps=2", "trainer.save_final_checkpoint=true", "trainer.export_hf=true",
                                   "scheduler.max_staleness=0", *SMALL_RUN])
    trainer = build_trainer(cfg)
    trainer.run()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["train/behav_logprob_gap"] < 1e-5 for r in rows)
    trained = dict(trainer.worker.learner.export_hf_weights())
    step = tmp_path / "run" / "checkpoints" / "step_2"
    megatron_to_hf_checkpoint(step, tmp_path / "export")
    # trainer.export_hf wrote the same weights beside the checkpoint, with the run's tokenizer.
    for directory in (tmp_path / "export", step / "hf"):
        written = HFTensorReader(directory)
        assert sorted(written.names()) == sorted(trained)
        assert all(torch.equal(written.get(k), v) for k, v in trained.items())
    assert (step / "hf" / "tokenizer.json").is_file()
    # Both carry the run's tokenizer with the EOS and PAD that transformers reads (no --tokenizer needed).
    for directory in (tmp_path / "export", step / "hf"):
        assert transformers.AutoTokenizer.from_pretrained(directory).eos_token == trainer.tokenizer.eos_token
        generation = transformers.GenerationConfig.from_pretrained(directory)
        assert (generation.eos_token_id, generation.pad_token_id) == (trainer.tokenizer.eos_id, trainer.tokenizer.pad_id)
    original = HFTensorReader(tmp_path / "hf")
    assert not torch.equal(original.get("model.layers.0.self_attn.o_proj.weight"),
                           trained["model.layers.0.self_attn.o_proj.weight"])
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    gap = (hf_logits(reloaded, TOKENS) - _learner_logits(trainer.worker.learner)).abs().max().item()
    assert gap <= 1e-4
