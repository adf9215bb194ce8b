"""Whether a model's shape can be split at a parallel layout: one set of checks for the placement
planner (``launch --dry-run``, the submit tool), config validation and checkpoint conversion, so
a layout the model cannot take is refused before any rank starts."""

from __future__ import annotations

from typing import List, Optional

from ..errors import ConfigError


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_problems(model, tp: int = 1, pp: int = 1, ep: int = 1, prefix: str = "learner.",
                    vocab_size: Optional[int] = None) -> List[str]:
    """One line per way ``model`` (a ModelConfig) cannot be split at tensor-parallel ``tp``,
    pipeline-parallel ``pp`` and expert-parallel ``ep``; each names the keys and a value that fits.
    ``prefix`` names where the sizes come from: ``learner.``, ``rollout.`` (config keys) or ``--``
    (the conversion tool's flags)."""
    problems = []
    heads, groups = model.num_attention_heads, model.num_query_groups
    if tp > 1 and (heads % tp or groups % tp):
        fits = [d for d in _divisors(groups) if heads % d == 0]
        problems.append(f"{prefix}tp={tp} must divide model.num_attention_heads={heads} and "
                        f"model.num_query_groups={groups} (each TP rank holds whole heads and KV groups): "
                        f"use {prefix}tp in {fits}")
    if vocab_size is not None and tp > 1 and vocab_size % tp:
        problems.append(f"{prefix}tp={tp} must divide the vocabulary size {vocab_size}: pad the vocabulary "
                        f"or use a {prefix}tp that divides it")
    if pp > 1 and model.num_layers % pp:
        problems.append(f"{prefix}pp={pp} must divide model.num_layers={model.num_layers} (each stage holds "
                        f"whole layers): use {prefix}pp in {_divisors(model.num_layers)}")
    if ep > 1 and (not model.num_experts or model.num_experts % ep):
        if not model.num_experts:
            problems.append(f"{prefix}ep={ep} needs a mixture-of-experts model (model.num_experts=0): "
                            f"use {prefix}ep=1")
        else:
            problems.append(f"{prefix}ep={ep} must divide model.num_experts={model.num_experts}: "
                            f"use {prefix}ep in {_divisors(model.num_experts)}")
    return problems


def check_layouts(cfg) -> None:
    """The learner's and the engines' parallel layouts fit the model's shape (the torchrun world
    split, whose placement planner places them)."""
    lc, m = cfg.learner, cfg.model
    problems = layout_problems(m, lc.tp, lc.pp, lc.ep) + layout_problems(m, cfg.rollout.tp, prefix="rollout.")
    if problems:
        raise ConfigError(problems[0])
