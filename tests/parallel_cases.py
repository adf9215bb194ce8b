"""Rank-side bodies of the multi-process learner tests (module-level, so spawned ranks can
unpickle them) and the shared tiny setup."""

from __future__ import annotations

import copy
from typing import Any, Dict, List

import torch

from megatron_rl.config.schema import RootConfig
from megatron_rl.learner.train_batch import TrainBatch
from megatron_rl.types import Trajectory

from batches import advantaged

VOCAB = 48  # a multiple of 8 * tp for tp <= 2, so every layout pads it the same


def tiny_cfg(tp: int = 1, pp: int = 1, dp_optimizer: bool = False, ep: int = 1, moe: bool = False) -> RootConfig:
    cfg = RootConfig()
    cfg.model.num_layers = 4
    cfg.model.hidden_size, cfg.model.ffn_hidden_size = 64, 128
    cfg.model.num_attention_heads, cfg.model.num_query_groups = 4, 2
    if moe:  # 4 experts, top-2, every other layer (dense and MoE layers both exercised)
        cfg.model.family = "mixtral"  # HF names for the experts (block_sparse_moe.experts.E.w1/w2/w3)
        cfg.model.num_experts, cfg.model.moe_router_topk, cfg.model.moe_ffn_hidden_size = 4, 2, 48
        cfg.model.moe_layer_pattern = [0, 1, 0, 1]
    cfg.learner.tp, cfg.learner.pp, cfg.learner.ep = tp, pp, ep
    cfg.learner.use_distributed_optimizer = dp_optimizer
    cfg.learner.micro_batch_tokens = 96  # several micro-batches per step
    # Adam's first step moves each weight by about lr·g/(|g| + eps): for gradients near eps the
    # rounding of a different reduction order (TP/DP sums) is magnified to ~1% of lr, so lr sets
    # how closely two exact implementations can agree on the updated weights (1e-3 gave ~1e-5).
    cfg.learner.lr = 1e-4
    return cfg


def batch(n: int = 12) -> TrainBatch:
    """Responses of 1..17 tokens with mixed advantages and behaviour logprobs off-policy, four
    samples per prompt."""
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 2, 2, 3, 3, 4, 5, 6, 9, 17, 4, 7][:n]
    trajs = []
    for i, k in enumerate(lengths):
        resp = torch.randint(4, VOCAB, (k,), generator=gen).tolist()
        behav = (-3.0 - torch.rand(k, generator=gen)).tolist()
        # Three prompts, four samples each: GRPO groups (learner.share_prompts trains each once).
        trajs.append(Trajectory("p", i, [1, 2 + i % 3, 3, 4 + i % 3], resp, behav, [0] * k, "stop"))
    return advantaged(trajs, [float(i % 3 - 1) for i in range(len(trajs))])


def engine_view(model: torch.nn.Module, trajs: List[Trajectory]):
    """What the embedded engine returns for ``trajs`` when it runs ``model`` (a bare MoE GPTModel at
    EP = TP = 1): each response's logprobs, and each sequence's routing, [positions, moe_layers,
    top_k] uint8, recorded one sequence at a time, its last position unrecorded (255)."""
    from megatron_rl.learner.learner import forward_logits
    from megatron_rl.learner.logprobs import token_logprobs
    from megatron_rl.models.routing import record_routing, recorded_choices

    record_routing(model)
    logprobs, routed = [], []
    with torch.no_grad():
        for t in trajs:
            full = torch.tensor([t.prompt_ids + t.response_ids], device=next(model.parameters()).device)
            p, n = len(t.prompt_ids), full.shape[1]
            logits = forward_logits(model, full)
            logprobs.append(token_logprobs(logits[0, p - 1 : n - 1], full[0, p:]).tolist())
            choices = recorded_choices(model).permute(1, 0, 2).cpu().numpy().copy()
            choices[-1] = 255
            routed.append(choices)
    record_routing(model, False)
    return logprobs, routed


def learner_case(cfg: RootConfig, full: Dict[str, torch.Tensor], trajs: List[Trajectory]) -> Dict[str, Any]:
    """Build a learner at ``cfg``'s layout, load the reference's full weights, compute logprobs,
    take one training step, and return what this rank sees plus its stage's gathered weights."""
    from megatron.core import parallel_state as ps

    from megatron_rl.learner import logprobs as logprobs_module
    from megatron_rl.learner.learner import Learner
    from megatron_rl.weights.reshard import full_state, load_into_learner

    # Several vocabulary chunks per micro-batch (and per TP shard), against the reference's one.
    logprobs_module.CHUNK_ELEMENTS = 5 * VOCAB
    learner = Learner(cfg, VOCAB)
    load_into_learner(learner, full)
    loaded_back = full_state(learner.module)
    logprobs = learner.compute_logprobs(trajs, 1.0)
    metrics = learner.train_step(copy.deepcopy(trajs), 1.0, lr=cfg.learner.lr)
    lora = {}
    if cfg.lora.rank:  # what the engines get (merged), the adapters alone, what the optimizer holds
        from megatron_rl.weights.reshard import full_tensors

        lora = {"merged": dict(full_tensors(learner.module, merged=True)),
                "adapters": dict(learner.adapter_tensors()),
                "trainable": sorted(n for n, p in learner.module.named_parameters() if p.requires_grad),
                "optimizer_numel": sum(p.numel() for g in learner.optimizer.param_groups for p in g["params"]),
                "trainable_numel": sum(p.numel() for p in learner.module.parameters() if p.requires_grad)}
    return {
        **lora,
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "dp_rank": ps.get_data_parallel_rank(),
        "ep_rank": ps.get_expert_model_parallel_rank(),
        # (full is on the CPU; on a GPU rank the model's tensors are on its cuda device)
        "roundtrip_max_err": max((loaded_back[k] - full[k].to(loaded_back[k].device)).abs().max().item()
                                 for k in loaded_back),
        "logprobs": logprobs,
        "metrics": metrics,
        "weights": full_state(learner.module),
    }


def sync_case(cfg: RootConfig, num_learner_ranks: int, bucket_bytes: int) -> Dict[str, Any]:
    """A world of learners (ranks [0, L)) and one embedded engine (rank L): the learner trains a
    step, sends version 1 over the weight-sync groups, the engine loads it and generates, and the
    learner scores the engine's tokens. Returns per rank what it saw."""
    import asyncio

    import torch.distributed as dist

    from megatron_rl.launch.groups import init_split_parallel_state
    from megatron_rl.weights.sync import build_sync_groups, receive_weights, send_weights, sync_topology

    world = dist.get_world_size()
    lc = cfg.learner
    role = init_split_parallel_state(num_learner_ranks, lc.tp, lc.pp, lc.ep, seed=cfg.trainer.seed)
    groups = build_sync_groups(sync_topology(num_learner_ranks, lc.tp, lc.pp, lc.cp, range(num_learner_ranks, world)))
    engine_rank = num_learner_ranks
    out: Dict[str, Any] = {"role": role}
    if role == "learner":
        from megatron_rl.learner.learner import Learner
        from megatron_rl.weights.reshard import full_state

        learner = Learner(cfg, VOCAB)
        learner.train_step(copy.deepcopy(batch()), 1.0, lr=1e-2)  # weights that differ from any init
        stats = send_weights(learner.module, cfg.model, groups, version=1, bucket_bytes=bucket_bytes)
        out["send"] = None if stats is None else (stats.bytes, stats.buckets, stats.seconds)
        out["stage_state"] = full_state(learner.module)
        box = [None]
        dist.broadcast_object_list(box, src=engine_rank, group=dist.group.WORLD)  # the engine's trajectories
        trajs = box[0]
        out["learner_logprobs"] = learner.compute_logprobs(trajs, 1.0)
        out["engine_logprobs"] = [t.logprobs for t in trajs]
        out["versions"] = sorted({v for t in trajs for v in t.versions})
    else:
        from megatron_rl.rollout.embedded import EmbeddedEngine
        from megatron_rl.types import SamplingParams

        version, tensors, stats = receive_weights(groups)
        out["received"] = (version, len(tensors), stats.bytes, stats.buckets)

        async def generate():
            from engine_helpers import generate_all

            engine = EmbeddedEngine(cfg.model, VOCAB, seed=3)
            await engine.pause()
            await engine.update_weights(tensors.items(), version=version)
            await engine.resume()
            prompts = [[(7 * i + j) % 40 + 1 for j in range(2 + 3 * i)] for i in range(6)]
            trajs = await generate_all(engine, prompts, SamplingParams(max_new_tokens=12))
            state = {k: v.clone() for k, v in engine.model.state_dict().items() if isinstance(v, torch.Tensor)}
            await engine.shutdown()
            return trajs, state

        trajs, out["engine_state"] = asyncio.run(generate())
        dist.broadcast_object_list([trajs], src=engine_rank, group=dist.group.WORLD)
    return out


def critic_case(cfg: RootConfig, full: Dict[str, torch.Tensor], trajs: List[Trajectory]) -> Dict[str, Any]:
    """Build a critic (PPO's value model) at ``cfg``'s layout with the reference's full weights:
    its values for ``trajs``, one training step on their returns, and its stage's gathered weights."""
    from megatron.core import parallel_state as ps

    from megatron_rl.learner.critic import Critic
    from megatron_rl.weights.reshard import full_state, load_into_learner

    critic = Critic(cfg, VOCAB)
    load_into_learner(critic, full)
    values = critic.compute_values(trajs)
    metrics = critic.train_step(copy.deepcopy(trajs))
    return {"tp_rank": ps.get_tensor_model_parallel_rank(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "values": values, "metrics": metrics, "weights": full_state(critic.module)}


def replica_init_case(cfg: RootConfig) -> Dict[str, torch.Tensor]:
    """Build a learner whose freshly built model differs on every rank (each rank shifts its
    weights by its rank, as a rank-dependent random draw during a real build would: on a GPU
    megatron-core initialises the MoE router from the CPU generator and the rest from CUDA
    ones); return its stage weights after the learner has wrapped it for training."""
    import torch.distributed as dist

    import megatron_rl.learner.learner as learner_module
    from megatron_rl.weights.reshard import full_state

    build = learner_module.build_gpt_model

    def build_differently(*args, **kwargs):
        model = build(*args, **kwargs)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.01 * dist.get_rank())
        return model

    learner_module.build_gpt_model = build_differently
    try:
        return full_state(learner_module.Learner(cfg, VOCAB).module)
    finally:
        learner_module.build_gpt_model = build


def teacher_case(cfg: RootConfig, trajs) -> Dict[str, Any]:
    """A learner at ``cfg``'s layout with the teacher of ``cfg.teacher.path``: the teacher's
    logprobs of ``trajs`` (on every rank)."""
    from megatron_rl.learner.learner import Learner

    learner = Learner(cfg, VOCAB)
    return {"logprobs": learner.compute_logprobs(trajs, 1.0, teacher=True)}


def resumed_step_case(cfg: RootConfig, checkpoint: str, trajs: List[Trajectory]) -> Dict[str, Any]:
    """A learner at ``cfg``'s layout loads a training checkpoint (written at another layout), takes
    one training step, and returns its stage's gathered weights."""
    from pathlib import Path

    from megatron_rl.checkpoint import load_checkpoint
    from megatron_rl.learner.learner import Learner
    from megatron_rl.weights.reshard import full_state

    learner = Learner(cfg, VOCAB)
    load_checkpoint(learner, Path(checkpoint))
    metrics = learner.train_step(copy.deepcopy(trajs), 1.0, lr=cfg.learner.lr)
    return {"metrics": metrics, "weights": full_state(learner.module)}


def routed_teachers_case(cfg: RootConfig, trajs, routing) -> Dict[str, Any]:
    """A learner at ``cfg``'s layout with the named teachers of ``cfg.teacher.paths``: each of
    ``trajs`` (a group of its own) scored by the teacher ``routing`` names (on every rank)."""
    from megatron_rl.learner.learner import Learner
    from megatron_rl.learner.teachers import teacher_logprobs

    learner = Learner(cfg, VOCAB)
    batch = TrainBatch.of_groups([[t] for t in trajs], routing)
    return {"logprobs": teacher_logprobs(batch, lambda ts, name: learner.compute_logprobs(ts, 1.0, teacher=name))}


def export_case(cfg: RootConfig, full: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A learner at ``cfg``'s layout with the reference's full weights: what the one export
    (``weights/export.py``) hands this rank, every stage's tensors under HF names."""
    from megatron_rl.learner.learner import Learner
    from megatron_rl.weights.reshard import load_into_learner

    learner = Learner(cfg, VOCAB)
    load_into_learner(learner, full)
    return {name: tensor.clone() for name, tensor in learner.export_hf_weights()}
