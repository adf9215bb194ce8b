"""Rank-side bodies of the multi-process learner tests (module-level, so spawned ranks can
unpickle them) and the shared tiny setup."""

from __future__ import annotations

import copy
from typing import Any, Dict, List

import torch

from megatron_rl.config.schema import RootConfig
from megatron_rl.types import Trajectory

VOCAB = 48  # a multiple of 8 * tp for tp <= 2, so every layout pads it the same


def tiny_cfg(tp: int = 1, pp: int = 1, dp_optimizer: bool = False) -> RootConfig:
    cfg = RootConfig()
    cfg.model.num_layers = 4
    cfg.model.hidden_size, cfg.model.ffn_hidden_size = 64, 128
    cfg.model.num_attention_heads, cfg.model.num_query_groups = 4, 2
    cfg.learner.tp, cfg.learner.pp = tp, pp
    cfg.learner.use_distributed_optimizer = dp_optimizer
    cfg.learner.micro_batch_tokens = 96  # several micro-batches per step
    # Adam's first step moves each weight by about lr·g/(|g| + eps): for gradients near eps the
    # rounding of a different reduction order (TP/DP sums) is magnified to ~1% of lr, so lr sets
    # how closely two exact implementations can agree on the updated weights (1e-3 gave ~1e-5).
    cfg.learner.lr = 1e-4
    return cfg


def batch(n: int = 12) -> List[Trajectory]:
    """Responses of 1..17 tokens with mixed advantages and behaviour logprobs off-policy."""
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 2, 2, 3, 3, 4, 5, 6, 9, 17, 4, 7][:n]
    trajs = []
    for i, k in enumerate(lengths):
        resp = torch.randint(4, VOCAB, (k,), generator=gen).tolist()
        behav = (-3.0 - torch.rand(k, generator=gen)).tolist()
        trajs.append(Trajectory("p", i, [1, 2 + i % 3, 3, 4 + i % 5], resp, behav, [0] * k, "stop",
                                advantage=float(i % 3 - 1)))
    return trajs


def learner_case(cfg: RootConfig, full: Dict[str, torch.Tensor], trajs: List[Trajectory]) -> Dict[str, Any]:
    """Build a learner at ``cfg``'s layout, load the reference's full weights, compute logprobs,
    take one training step, and return what this rank sees plus its stage's gathered weights."""
    from megatron.core import parallel_state as ps

    from megatron_rl.learner.learner import Learner
    from megatron_rl.weights.reshard import full_state, load_into_learner

    learner = Learner(cfg, VOCAB)
    load_into_learner(learner, full)
    loaded_back = full_state(learner.module)
    logprobs = learner.compute_logprobs(trajs, 1.0)
    metrics = learner.train_step(copy.deepcopy(trajs), 1.0, lr=cfg.learner.lr)
    return {
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "dp_rank": ps.get_data_parallel_rank(),
        "roundtrip_max_err": max((loaded_back[k] - full[k]).abs().max().item() for k in loaded_back),
        "logprobs": logprobs,
        "metrics": metrics,
        "weights": full_state(learner.module),
    }
