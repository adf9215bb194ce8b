"""Config composition, overrides and one-line errors for bad values."""

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.checks import load_config

from megatron_rl.config import ConfigError


def test_tiny_cpu_loads_and_overrides():
    cfg = load_config("tiny_cpu", ["trainer.total_steps=7", "algo.group_size=4", "learner.lr=1e-4"])
    assert cfg.trainer.total_steps == 7
    assert cfg.algo.group_size == 4
    assert cfg.learner.lr == 1e-4
    assert cfg.model.num_layers == 2


def test_a_path_from_the_home_folder_on_the_command_line(tmp_path, monkeypatch):
    """bash leaves ~ after a dotted key (data.path=~/x) as it is; Hydra's grammar would refuse it."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "rows.jsonl").write_text('{"question": "7434=", "answer": "3447"}\n')
    cfg = load_config("tiny_cpu", ["data.name=file", "data.path=~/rows.jsonl", "trainer.run_dir=~"])
    assert cfg.data.path == str(tmp_path / "rows.jsonl") and cfg.trainer.run_dir == str(tmp_path)
    from megatron_rl.config.load import _home_expanded

    kept = ["~trainer.run_dir", "data.system_prompt=a~b"]  # Hydra's delete; a ~ inside a value
    assert _home_expanded(kept) == kept


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("algo.name=ppo_typo", "algo.name='ppo_typo' is not allowed; choose one of"),
        ("rollout.engine=sglang", "rollout.engine='sglang' is not allowed"),
        ("rollout.top_p=1.5", "rollout.top_p=1.5 must be in (0, 1]"),
        ("algo.group_size=1", "algo.group_size=1 must be >= 2"),
        ("learner.lr=-1", "learner.lr=-1.0 must be > 0"),
        ("model.num_attention_heads=3", "must be divisible by model.num_attention_heads=3"),
        ("trainer.total_steps=abc", "trainer.total_steps"),
        ("trainer.totl_steps=5", "totl_steps"),
        ("data.name=gsm8k", "data.path is required"),
        ("learner.tp=2", "learner.tp=2 is not available in one process"),
        ("rollout.engines=4", "rollout.engines=4 is not available in one process"),
        ("learner.dp=2", "learner.dp=2 is not available in one process"),
        ("data.distinct_digits=true data.digits=0123 data.max_digits=5", "exceeds the 4 distinct symbols"),
        ("model.path=/ckpt/qwen2", "model.path='/ckpt/qwen2' is not a directory"),
        ("rollout.max_new_tokens=100", "exceeds model.max_position_embeddings"),
        ("learner.min_lr=0.5", "learner.min_lr=0.5 must be <= learner.lr"),
        ("learner.lr_decay_style=step", "learner.lr_decay_style='step' is not allowed"),
        ("learner.lr_decay_steps=0", "learner.lr_decay_steps=0 must be > 0"),
        ("data.length_tail=-1", "data.length_tail=-1.0 must be >= 0"),
        ("algo.dual_clip=0.5", "algo.dual_clip=0.5 must be > 1"),
        ("algo.cispo_trust_mask=true", "algo.cispo_trust_mask=true is read by algo.policy_loss=cispo only"),
        ("scheduler.max_ahead_batches=0.5", "scheduler.max_ahead_batches=0.5 is less than one batch"),
        ("algo.kl_in_reward=true", "algo.kl_in_reward=true needs algo.kl_coef > 0"),
        ("algo.lam=1.5", "algo.lam=1.5 must be in [0, 1]"),
        ("critic.lr=0", "critic.lr=0.0 must be > 0 (or null to use learner.lr)"),
        ("critic.value_clip=-1", "critic.value_clip=-1.0 must be >= 0"),
        ("learner.micro_batch_overhead_tokens=-1", "learner.micro_batch_overhead_tokens=-1 must be >= 0"),
        ("reward.overlong_buffer=8", "reward.overlong_buffer=8 exceeds rollout.max_new_tokens=7"),
        ("model.family=mixtral model.num_experts=4 model.moe_router_topk=5",
         "model.moe_router_topk=5 must be in [1, model.num_experts=4]"),
        ("model.family=qwen3_moe model.num_experts=4 model.moe_layer_pattern=[1]", "model.moe_layer_pattern has 1 entries"),
        ("model.family=qwen3_moe", "model.family=qwen3_moe is a mixture of experts: set model.num_experts"),
        ("model.num_experts=4", "model.num_experts=4 needs an MoE family"),
        ("model.family=deepseek_v3 model.num_experts=4", "set model.kv_lora_rank"),
        ("model.moe_token_dispatcher=flex", "model.moe_token_dispatcher='flex' is not allowed"),
    ],
)
def test_bad_values_name_the_key(override, fragment):
    with pytest.raises(ConfigError) as info:
        load_config("tiny_cpu", override.split())
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message


RECIPES = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))
# Recipes whose model is the checkpoint's (model.path required): their sizes come from it.
NEED_A_CHECKPOINT = {"agent_calculator_gpu"}


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r not in NEED_A_CHECKPOINT])
def test_every_recipe_loads_and_validates(recipe):
    try:
        cfg = load_config(recipe, ["trainer.progress=false"])
    except ConfigError as err:
        if "needs vLLM, which is not installed" in str(err):
            pytest.skip(f"{recipe} needs vLLM")
        raise
    assert cfg.trainer.total_steps > 0


def test_moe_gpu_recipe_is_qwen3_30b_a3b_cut_to_four_layers():
    """gsm8k_qwen3_moe_gpu's model is Qwen3-30B-A3B's config.json (Qwen/Qwen3-30B-A3B) but for the
    layer count and the context, with gsm8k_qwen2_gpu's RL settings."""
    from megatron_rl.models.hf_config import hf_config_from_model

    cfg = load_config("gsm8k_qwen3_moe_gpu", ["trainer.progress=false"])
    hf = hf_config_from_model(cfg.model, 151936)
    qwen3_30b_a3b = dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, intermediate_size=6144,
                         moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                         num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6,
                         rope_theta=1000000.0, tie_word_embeddings=False, attention_bias=False,
                         decoder_sparse_step=1, mlp_only_layers=[], hidden_act="silu", vocab_size=151936)
    assert {k: hf[k] for k in qwen3_30b_a3b} == qwen3_30b_a3b
    assert hf["num_hidden_layers"] == 4 and cfg.model.dtype == "bf16" and cfg.rollout.engine == "embedded"
    dense = load_config("gsm8k_qwen2_gpu", ["trainer.progress=false"])
    assert (cfg.algo, cfg.data, cfg.rollout, cfg.learner) == (dense.algo, dense.data, dense.rollout, dense.learner)


def test_lora_gpu_recipe_is_qwen3_14b_with_rank_32_adapters():
    """gsm8k_qwen3_14b_lora_gpu's model is Qwen3-14B's config.json (Qwen/Qwen3-14B) but for the
    context, trained through rank-32 adapters on all four projections that the embedded engine
    receives alone, with gsm8k_qwen2_gpu's data and algorithm."""
    from megatron_rl.models.hf_config import hf_config_from_model

    cfg = load_config("gsm8k_qwen3_14b_lora_gpu", ["trainer.progress=false"])
    hf = hf_config_from_model(cfg.model, 151936)
    qwen3_14b = dict(architectures=["Qwen3ForCausalLM"], num_hidden_layers=40, hidden_size=5120,
                     intermediate_size=17408, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, attention_bias=False,
                     hidden_act="silu", vocab_size=151936)
    assert {k: hf[k] for k in qwen3_14b} == qwen3_14b
    assert (cfg.lora.rank, cfg.lora.sync, len(cfg.lora.targets)) == (32, "adapters", 4)
    assert cfg.model.dtype == "bf16" and cfg.rollout.engine == "embedded" and cfg.learner.recompute_activations
    dense = load_config("gsm8k_qwen2_gpu", ["trainer.progress=false"])
    assert (cfg.algo, cfg.data, cfg.reward) == (dense.algo, dense.data, dense.reward)


def test_unknown_recipe():
    with pytest.raises(ConfigError, match="nope"):
        load_config("nope")


def test_recipe_given_as_a_yaml_file(tmp_path, monkeypatch):
    """recipe=<path>.yaml loads that file: a run's config.yaml (no defaults list: overrides are
    type-checked against the schema all the same) or a recipe of one's own kept elsewhere."""
    from omegaconf import OmegaConf

    run = tmp_path / "run"
    run.mkdir()
    original = load_config("tiny_cpu", ["learner.lr=0.0005", "trainer.progress=false"])
    original.trainer.recipe = "tiny_cpu"  # as the launcher records it
    OmegaConf.save(OmegaConf.structured(original), run / "config.yaml")
    monkeypatch.chdir(tmp_path)
    again = load_config("run/config.yaml")
    assert again == original
    assert load_config(str(run / "config.yaml"), ["learner.lr=0.002"]).learner.lr == 0.002
    with pytest.raises(ConfigError, match=r"learner.lr='x' is not a number \(command line: learner.lr=x\)"):
        load_config("run/config.yaml", ["learner.lr=x"])
    mine = tmp_path / "my.recipe.yaml"  # with the schema in its defaults, as recipes/ are
    mine.write_text((Path(__file__).resolve().parents[1] / "recipes" / "tiny_cpu.yaml").read_text()
                    .replace("num_layers: 2", "num_layers: 3"))
    assert load_config(str(mine)).model.num_layers == 3
    # trainer.recipe, which names the default run directory: the run's recipe, else the file's stem
    from megatron_rl.config.load import recipe_name

    assert recipe_name("run/config.yaml", "tiny_cpu") == "tiny_cpu" and recipe_name(str(mine), "custom") == "my.recipe"
    assert recipe_name("tiny_cpu", "custom") == "tiny_cpu"
    printed = _cli(f"recipe={run / 'config.yaml'}", "--print-config", "trainer.total_steps=7")
    assert printed.returncode == 0, printed.stderr
    assert "  total_steps: 7\n" in printed.stdout and "  recipe: tiny_cpu\n" in printed.stdout


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "megatron_rl.main", *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_bad_value_prints_one_error_line():
    result = _cli("algo.name=nope")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines == ["megatron_rl: error: algo.name='nope' is not allowed; choose one of grpo, dr_grpo, "
                     "rloo, reinforce_pp, reinforce_pp_baseline, gae, opd, sft"]


def test_cli_missing_dataset_prints_one_error_line(tmp_path):
    result = _cli("data.name=gsm8k", f"data.path={tmp_path}/none.jsonl", "data.tokenizer=bpe",
                  f"trainer.run_dir={tmp_path}/run")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("megatron_rl: error: data.path=")
    assert "file not found" in result.stderr


def test_cli_print_config():
    result = _cli("--print-config", "trainer.total_steps=3")
    assert result.returncode == 0, result.stderr
    assert "total_steps: 3" in result.stdout


def test_cli_malformed_row_prints_one_error_line(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?"}\n')
    result = _cli("data.name=gsm8k", f"data.path={data}", "data.tokenizer=bpe", "data.template=qa",
                  f"trainer.run_dir={tmp_path}/run")
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("megatron_rl: error: ") and "train.jsonl:2: missing field 'answer'" in last
    assert "Traceback" not in result.stderr


def test_vllm_engine_is_accepted_where_vllm_is_installed():
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ConfigError, match=r"rollout.engine=vllm needs vLLM, which is not installed"):
            load_config("tiny_cpu", ["rollout.engine=vllm"])
    else:
        assert load_config("tiny_cpu", ["rollout.engine=vllm"]).rollout.engine == "vllm"


def test_vllm_refuses_adapters_above_its_largest_lora_rank():
    with pytest.raises(ConfigError, match=r"lora.rank=1024 with lora.sync=adapters and rollout.engine=vllm: vLLM "
                       r"serves LoRA adapters of rank 512 at most; use lora.rank<=512 or lora.sync=merged"):
        load_config("tiny_cpu", ["rollout.engine=vllm", "lora.rank=1024"])


def test_torchrun_world_takes_every_algorithm_and_vllm_engines_by_broadcast():
    from megatron_rl.checks import WORLD, load_config
    from megatron_rl.config import ConfigError

    assert load_config("tiny_cpu", ["algo.name=gae"], WORLD).algo.name == "gae"
    # vLLM in the world: past the world checks (here it fails only for want of vLLM, or loads).
    try:
        cfg = load_config("tiny_cpu", ["rollout.engine=vllm"], WORLD)
        assert cfg.rollout.weight_transport == "broadcast"
    except ConfigError as err:
        assert "needs vLLM, which is not installed" in str(err)
    with pytest.raises(ConfigError, match="rollout.weight_transport=file with rollout.engine=vllm is not available in "
                       "the torchrun world"):
        load_config("tiny_cpu", ["rollout.engine=vllm", "rollout.weight_transport=file"], WORLD)


@pytest.mark.parametrize("overrides, on", [
    ([], False),  # tiny_cpu: a dense model
    (["model.family=qwen3_moe", "model.num_experts=4"], True),  # MoE with the embedded engine
    (["model.family=qwen3_moe", "model.num_experts=4", "algo.routing_replay=none"], False),
    (["model.family=qwen3_moe", "model.num_experts=4", "model.moe_grouped_experts=false"], False),
    (["model.family=qwen3_moe", "model.num_experts=4", "algo.routing_replay=rollout"], True),
])
def test_routing_replay_auto_is_on_for_moe_with_the_embedded_engine(overrides, on):
    from megatron_rl.models.routing import routing_replay_on

    assert routing_replay_on(load_config("tiny_cpu", overrides)) is on
