"""The config's own value checks: types the schema cannot say, finite numbers, positives and
checks across groups. Each error names the key, the bad value and the fix.

A check that needs a component's implementation (a registry's names, a model family, a data
source) lives with its owner; ``megatron_rl/checks.py`` runs these and the owners' in order.
This module imports only the errors and the schema, so every layer can read a config."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Tuple

from ..errors import ConfigError
from .schema import RootConfig

__all__ = [
    "ConfigError", "EVAL_SETS", "ONE_PROCESS", "PLACEMENTS", "WORLD", "check_batch_split", "check_choice",
    "check_coefficients", "check_context", "check_data_digits", "check_eval", "check_finite", "check_model_shape",
    "check_moe_layer_pattern", "check_placement", "check_positives", "check_reward_bounds", "check_top_p",
    "check_long_tail", "check_weight_sync", "refuse", "validate_eval",
]

# Where a run's processes are: the checks see it, so a key means the same in every placement or
# is refused with one line naming the placement (``refuse``).
ONE_PROCESS = "one_process"   # python -m megatron_rl.main: learner, engine and driver in one process
WORLD = "world"               # python -m megatron_rl.launch under torchrun: ranks placed by the planner
PLACEMENTS = {
    ONE_PROCESS: "in one process (python -m megatron_rl.main)",
    WORLD: "in the torchrun world (python -m megatron_rl.launch)",
}


def refuse(setting: str, placement: str, fix: str) -> ConfigError:
    """The one line that refuses ``setting`` (``key=value``, or several) in ``placement``."""
    return ConfigError(f"{setting} is not available {PLACEMENTS[placement]}: {fix}")


def check_placement_name(placement: str) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r}: choose one of {', '.join(PLACEMENTS)}")


def _get(cfg: Any, dotted: str) -> Any:
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def check_choice(cfg: Any, key: str, choices: Tuple[str, ...]) -> None:
    """Config key ``key`` holds one of ``choices``."""
    value = _get(cfg, key)
    if value in choices:
        return
    raise ConfigError(f"{key}={value!r} is not allowed; choose one of {', '.join(choices)}")


def _positive(cfg: Any, keys: Iterable[str], strict: bool = True) -> None:
    for key in keys:
        value = _get(cfg, key)
        if value is None:
            continue
        if (strict and value <= 0) or (not strict and value < 0):
            bound = "> 0" if strict else ">= 0"
            raise ConfigError(f"{key}={value!r} must be {bound}")


def check_finite(cfg: Any, prefix: str = "") -> None:
    """Every number is finite: a NaN passes every ``<`` and ``>`` check and would surface steps
    later as a NaN loss."""
    for f in dataclasses.fields(cfg):
        value, key = getattr(cfg, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            check_finite(value, key + ".")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value} is not a finite number: give a real value (see "
                              "megatron_rl/config/schema.py for its meaning)")


def check_reward_bounds(cfg: RootConfig) -> None:
    """reward.min_value <= reward.max_value where both are set."""
    rw = cfg.reward
    if rw.min_value is not None and rw.max_value is not None and rw.min_value > rw.max_value:
        raise ConfigError(f"reward.min_value={rw.min_value} must be <= reward.max_value={rw.max_value}")


def check_positives(cfg: RootConfig) -> None:
    """Sizes, rates and counts that must be > 0 (or >= 0), and scheduler.max_ahead_batches."""
    _positive(
        cfg,
        [
            "model.num_layers", "model.hidden_size", "model.num_attention_heads",
            "model.num_query_groups", "model.ffn_hidden_size", "model.max_position_embeddings",
            "learner.tp", "learner.pp", "learner.ep", "learner.cp", "learner.dp", "learner.lr",
            "learner.micro_batch_tokens", "learner.ppo_epochs", "learner.mini_batches",
            "rollout.engines", "rollout.tp", "rollout.temperature", "rollout.max_new_tokens",
            "rollout.max_batch_size", "algo.group_size", "algo.groups_per_batch",
            "trainer.total_steps", "reward.timeout_s", "reward.workers",
            "data.min_digits", "data.max_prompt_tokens", "learner.lr_decay_steps", "trainer.rank_timeout_s",
            "reward.max_abs",
        ],
    )
    _positive(
        cfg,
        ["rollout.top_k", "learner.clip_grad", "algo.kl_coef", "algo.entropy_coef",
         "algo.clip_low", "algo.clip_high", "algo.behav_imp_weight_cap", "scheduler.max_staleness", "learner.weight_decay",
         "trainer.checkpoint_interval", "trainer.cpu_threads", "learner.lr_warmup_steps", "learner.min_lr",
         "scheduler.max_ahead_batches", "learner.micro_batch_overhead_tokens", "reward.overlong_buffer", "critic.value_clip",
         "learner.max_skipped_steps", "correction.veto_below", "correction.max_version_gap",
         "trainer.gpu_telemetry_interval_s"],
        strict=False,
    )
    ahead = cfg.scheduler.max_ahead_batches
    if 0 < ahead < 1:
        raise ConfigError(f"scheduler.max_ahead_batches={ahead} is less than one batch, so no batch could "
                          "ever fill; use 0 (no limit but η) or a value >= 1 (e.g. 1.5)")


def check_model_shape(cfg: RootConfig) -> None:
    """Heads, query groups, RoPE scaling and the experts' top-k fit together."""
    m = cfg.model
    if m.head_dim is None and m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} must be divisible by "
            f"model.num_attention_heads={m.num_attention_heads}"
        )
    if m.rope_scaling_factor is not None and not (0 < m.rope_low_freq_factor < m.rope_high_freq_factor
                                                  and m.rope_original_max_position_embeddings > 0):
        raise ConfigError(f"model.rope_low_freq_factor={m.rope_low_freq_factor} must be > 0 and < "
                          f"model.rope_high_freq_factor={m.rope_high_freq_factor}, and "
                          "model.rope_original_max_position_embeddings > 0 (Llama-3 RoPE scaling; e.g. 1, 4, 8192)")
    if m.num_attention_heads % m.num_query_groups:
        raise ConfigError(
            f"model.num_attention_heads={m.num_attention_heads} must be divisible by "
            f"model.num_query_groups={m.num_query_groups}"
        )
    if m.num_experts < 0 or (m.num_experts and not 0 < m.moe_router_topk <= m.num_experts):
        raise ConfigError(f"model.moe_router_topk={m.moe_router_topk} must be in [1, model.num_experts="
                          f"{m.num_experts}] (model.num_experts=0 builds a dense model)")


def check_moe_layer_pattern(cfg: RootConfig) -> None:
    """model.moe_layer_pattern has one entry per layer."""
    m = cfg.model
    if m.moe_layer_pattern is not None and len(m.moe_layer_pattern) != m.num_layers:
        raise ConfigError(f"model.moe_layer_pattern has {len(m.moe_layer_pattern)} entries; it needs one "
                          f"per layer (model.num_layers={m.num_layers})")


def check_top_p(cfg: RootConfig) -> None:
    """rollout.top_p is a probability mass in (0, 1]."""
    if not 0.0 < cfg.rollout.top_p <= 1.0:
        raise ConfigError(f"rollout.top_p={cfg.rollout.top_p!r} must be in (0, 1]")


def check_long_tail(cfg: RootConfig) -> None:
    """rollout.long_tail_median (0: off) below rollout.long_tail_p99."""
    r = cfg.rollout
    if r.long_tail_median < 0:
        raise ConfigError(f"rollout.long_tail_median={r.long_tail_median} must be >= 0 (0: off)")
    if r.long_tail_median and not r.long_tail_p99 > r.long_tail_median:
        raise ConfigError(f"rollout.long_tail_p99={r.long_tail_p99} must be > rollout.long_tail_median="
                          f"{r.long_tail_median} (a log-normal's 99th percentile above its median)")


def check_batch_split(cfg: RootConfig) -> None:
    """Mini-batches divide the batch; the overlong buffer fits the response."""
    if cfg.algo.groups_per_batch % cfg.learner.mini_batches:
        raise ConfigError(
            f"learner.mini_batches={cfg.learner.mini_batches} must divide "
            f"algo.groups_per_batch={cfg.algo.groups_per_batch}"
        )
    if cfg.reward.overlong_buffer > cfg.rollout.max_new_tokens:
        raise ConfigError(f"reward.overlong_buffer={cfg.reward.overlong_buffer} exceeds "
                          f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}")


def check_coefficients(cfg: RootConfig) -> None:
    """algo.* coefficients that need each other, the critic's and the learner's learning rates."""
    if cfg.algo.kl_in_reward and cfg.algo.kl_coef <= 0:
        raise ConfigError("algo.kl_in_reward=true needs algo.kl_coef > 0 (e.g. algo.kl_coef=0.001)")
    if cfg.algo.cispo_trust_mask and cfg.algo.policy_loss != "cispo":
        raise ConfigError(f"algo.cispo_trust_mask=true is read by algo.policy_loss=cispo only (it is "
                          f"{cfg.algo.policy_loss}); set algo.policy_loss=cispo, or drop algo.cispo_trust_mask")
    if cfg.algo.dual_clip and cfg.algo.dual_clip <= 1:
        raise ConfigError(f"algo.dual_clip={cfg.algo.dual_clip} must be > 1 (e.g. 3), or 0 to disable")
    for key in ("algo.gamma", "algo.lam"):
        if not 0.0 <= _get(cfg, key) <= 1.0:
            raise ConfigError(f"{key}={_get(cfg, key)!r} must be in [0, 1]")
    if cfg.critic.lr is not None and cfg.critic.lr <= 0:
        raise ConfigError(f"critic.lr={cfg.critic.lr!r} must be > 0 (or null to use learner.lr)")
    if cfg.learner.min_lr > cfg.learner.lr:
        raise ConfigError(f"learner.min_lr={cfg.learner.min_lr} must be <= learner.lr={cfg.learner.lr}")


def check_data_digits(cfg: RootConfig) -> None:
    """The digit datasets' lengths and symbols."""
    d = cfg.data
    if d.max_digits < d.min_digits:
        raise ConfigError(f"data.max_digits={d.max_digits} must be >= data.min_digits={d.min_digits}")
    if d.length_tail < 0:
        raise ConfigError(f"data.length_tail={d.length_tail} must be >= 0 (0 = uniform lengths)")
    if d.distinct_digits and d.max_digits > len(set(d.digits)):
        raise ConfigError(
            f"data.max_digits={d.max_digits} exceeds the {len(set(d.digits))} distinct symbols of "
            f"data.digits={d.digits!r}; lower it or set data.distinct_digits=false"
        )


def check_context(cfg: RootConfig) -> None:
    """Prompt plus response fit the model's positions and rollout.max_model_len."""
    d, m = cfg.data, cfg.model
    needed = d.max_prompt_tokens + cfg.rollout.max_new_tokens
    if needed > m.max_position_embeddings:
        raise ConfigError(
            f"data.max_prompt_tokens + rollout.max_new_tokens = {needed} exceeds "
            f"model.max_position_embeddings={m.max_position_embeddings}; raise it or shorten them"
        )
    context = cfg.rollout.max_model_len
    if context is not None and not needed <= context <= m.max_position_embeddings:
        raise ConfigError(
            f"rollout.max_model_len={context} must lie between data.max_prompt_tokens + rollout.max_new_tokens "
            f"= {needed} and model.max_position_embeddings={m.max_position_embeddings}; leave it unset for the former"
        )


EVAL_SETS = ("data", "gsm8k", "math500")


def validate_eval(cfg: RootConfig, held_out: bool = True) -> None:
    """eval.* for a run that scores the eval sets (trainer.eval_interval, python -m
    megatron_rl.eval): the sets exist, a pass@k can be computed and each set has problems.
    ``held_out=False``: the data set may be data.path itself (the eval command scores any file)."""
    e, d = cfg.eval, cfg.data
    unknown = [n for n in e.datasets if n not in EVAL_SETS]
    if unknown or not e.datasets:
        raise ConfigError(f"eval.datasets={list(e.datasets)}: unknown {', '.join(unknown) or 'none given'}; choose "
                          f"from {', '.join(EVAL_SETS)} (e.g. eval.datasets=[data,gsm8k])")
    if e.k is not None and e.k > e.samples:
        raise ConfigError(f"eval.k={e.k} must be between 1 and eval.samples={e.samples} (pass@k needs k <= n samples)")
    if "data" not in e.datasets:
        return
    synthetic = d.name in ("reverse_digits", "sort_digits", "arithmetic")
    if synthetic and not e.limit:
        raise ConfigError(f"eval.datasets has data, and data.name={d.name} draws prompts without end: set eval.limit "
                          "(e.g. eval.limit=64)")
    if not synthetic and not d.eval_path and (held_out or not d.path):
        raise ConfigError("eval.datasets=[data] scores a held-out set of the run's dataset: set data.eval_path=<jsonl>, "
                          "or eval.datasets=[gsm8k] (or math500)")


def check_eval(cfg: RootConfig) -> None:
    """eval.* sizes, and the eval sets when the run scores them (trainer.eval_interval)."""
    _positive(cfg, ["eval.samples", "eval.batch", "eval.temperature", "eval.k"])
    _positive(cfg, ["eval.limit", "trainer.eval_interval"], strict=False)
    if cfg.trainer.eval_interval:
        validate_eval(cfg)


def check_weight_sync(cfg: RootConfig) -> None:
    """rollout.weight_transport and its timeout (what an engine allows is its entry's check)."""
    if cfg.rollout.weight_transport not in ("broadcast", "file"):
        raise ConfigError(f"rollout.weight_transport={cfg.rollout.weight_transport!r}: choose broadcast or file")
    if not cfg.rollout.weight_timeout_s > 0:
        raise ConfigError(f"rollout.weight_timeout_s={cfg.rollout.weight_timeout_s} must be > 0 (seconds)")


# Sizes that need ranks of a torchrun world: one process holds one learner and one engine.
MULTI_RANK_KEYS = ("learner.tp", "learner.pp", "learner.ep", "learner.cp", "learner.dp", "rollout.tp",
                   "rollout.engines")


def check_placement(cfg: RootConfig, placement: str) -> None:
    """What one process cannot hold: multi-rank sizes and engines on ranks of their own."""
    check_placement_name(placement)
    if placement != ONE_PROCESS:
        return
    for key in MULTI_RANK_KEYS:
        if _get(cfg, key) not in (None, 1):
            raise refuse(f"{key}={_get(cfg, key)}", ONE_PROCESS, "launch the torchrun world "
                         f"(`torchrun --nproc-per-node N -m megatron_rl.launch ...`) or use {key}=1")
    if cfg.rollout.placement == "disaggregated":
        raise refuse("rollout.placement=disaggregated", ONE_PROCESS, "launch the torchrun world "
                     "(`torchrun --nproc-per-node N -m megatron_rl.launch ... rollout.placement=disaggregated`) "
                     "or use rollout.placement=colocated")
