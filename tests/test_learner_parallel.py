"""A sharded learner equals a single-process one with the same weights: logprobs, one training
step's loss and the updated weights, at TP=2, PP=2, TP=2xPP=2 and DP=2 (DistributedOptimizer), and
at TP=2 with each prompt trained once (learner.share_prompts), and an MoE model at EP=2 and PP=2
replaying recorded routing (algo.routing_replay), each run on real gloo ranks (or on GPUs over NCCL: MEGATRON_RL_TEST_BACKEND=nccl, see rank_harness.py)."""

import copy

import pytest
import torch

from megatron_rl.learner.learner import Learner

from batches import replacing
from rank_harness import backend, run_ranks
from parallel_cases import VOCAB, batch, learner_case, tiny_cfg

TOL = 1e-5


def _reference(moe: bool):
    learner = Learner(tiny_cfg(moe=moe), VOCAB)
    with torch.no_grad():  # move every weight off Megatron's init so no layout hides behind symmetry
        gen = torch.Generator().manual_seed(7)
        for p in learner.module.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen).to(p.device))
    full = _cpu_state(learner.module)
    trajs = batch()
    if moe:  # routing replay: the trajectories carry routing the learner's own router partly disagrees with
        trajs = _attach_other_routing(learner.module, trajs)
        learner.replay_routing = False
        free = learner.compute_logprobs(trajs, 1.0)
        learner.replay_routing = True
        learner.routing_stats.pop_metrics()  # the step's routing metrics: the passes below, as on the ranks
    logprobs = learner.compute_logprobs(trajs, 1.0)
    if moe:  # the replay matters: routing by the learner's own routers gives other logprobs
        assert _max_gap(free, logprobs) > 100 * TOL
    metrics = learner.train_step(copy.deepcopy(trajs), 1.0, lr=learner.cfg.learner.lr)
    updated = _cpu_state(learner.module)
    return full, trajs, logprobs, metrics, updated


def _attach_other_routing(model, trajs):
    """Record each trajectory's routing as an engine whose routers differ a little from ``model``'s
    would choose (about 5 % of the choices differ), so that replaying it changes the forward."""
    from parallel_cases import engine_view

    routers = {n: p for n, p in model.named_parameters() if n.endswith("router.weight")}
    saved = {n: p.detach().clone() for n, p in routers.items()}
    with torch.no_grad():
        gen = torch.Generator().manual_seed(11)
        for p in routers.values():
            p.add_(0.003 * torch.randn(p.shape, generator=gen).to(p.device))
        _, routed = engine_view(model, trajs)
        for n, p in routers.items():
            p.copy_(saved[n])
    return replacing(trajs, routed_experts=routed)


def _cpu_state(module):
    # CPU copies: the ranks get them as arguments and their results come back on the CPU (on a GPU
    # machine the reference model lives on cuda:0).
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module")
def reference(megatron_world):
    return _reference(moe=False)


@pytest.fixture(scope="module")
def moe_reference(megatron_world):
    return _reference(moe=True)


def _max_gap(a, b) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.mark.parametrize("tp, pp, dp", [(2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2)],
                         ids=["tp2", "pp2", "tp2xpp2", "dp2-distopt"])
def test_sharded_learner_equals_single_process(reference, tp, pp, dp):
    cfg = tiny_cfg(tp, pp, dp_optimizer=dp > 1)
    out = _check(reference, cfg, tp * pp * dp)
    assert sorted((o["dp_rank"], o["pp_rank"], o["tp_rank"]) for o in out) == sorted(
        (d, p, t) for d in range(dp) for p in range(pp) for t in range(tp))


@pytest.mark.skipif(backend() == "nccl", reason="the learner refuses shared prompts on a GPU")
def test_tensor_parallel_learner_with_shared_prompts_equals_single_process(reference):
    """TP=2 with learner.share_prompts (one forward row per prompt, models/shared_prefix.py)
    against the single-process learner on plain rows."""
    cfg = tiny_cfg(2, 1)
    cfg.learner.share_prompts = True
    _check(reference, cfg, 2)


@pytest.mark.parametrize("ep, pp", [(2, 1), (1, 2)], ids=["ep2", "pp2"])
def test_moe_learner_with_routing_replay_equals_single_process(moe_reference, ep, pp):
    """EP=2 on 2 ranks: each holds 2 of the 4 experts (and is a dense data-parallel replica); PP=2:
    each stage holds one of the two MoE layers. The trajectories carry recorded routing that the
    learners replay (algo.routing_replay's default for MoE): under EP each rank routes its own
    rows before the token exchange, under PP each stage replays its own layers' rows; the routing
    metrics summed over the ranks equal the single process's."""
    out = _check(moe_reference, tiny_cfg(ep=ep, pp=pp, moe=True), 2)
    if ep > 1:
        assert sorted((o["ep_rank"], o["dp_rank"]) for o in out) == [(0, 0), (1, 1)]
        assert any(".local_experts.3." in k for k in out[1]["weights"])  # rank 1 gathered all experts
    else:
        assert sorted(o["pp_rank"] for o in out) == [0, 1]
    ref_metrics = moe_reference[3]
    assert 0.5 < ref_metrics["moe/router_agreement"] < 1.0  # the replay overrode some choices
    for o in out:
        for key in ("moe/router_agreement", "moe/expert_load_max_over_mean"):
            assert abs(o["metrics"][key] - ref_metrics[key]) <= 1e-12, (key, o["metrics"][key], ref_metrics[key])
    ref_metrics = moe_reference[3]
    assert 0.5 < ref_metrics["moe/router_agreement"] < 1.0  # the replay overrode some choices
    for o in out:
        for key in ("moe/router_agreement", "moe/expert_load_max_over_mean"):
            assert abs(o["metrics"][key] - ref_metrics[key]) <= 1e-12, (key, o["metrics"][key], ref_metrics[key])


def _check(reference, cfg, world):
    full, trajs, ref_lp, ref_metrics, ref_updated = reference
    tp, pp = cfg.learner.tp, cfg.learner.pp
    dp = world // (tp * pp)
    out = run_ranks(learner_case, world, args=(cfg, full, trajs), timeout_s=180)
    weights = {}
    for o in out:
        weights.update(o["weights"])
    # Every gap first, printed, then the checks: a run on another machine (GPUs) reports its
    # figures even where one is over the tolerance.
    lp_gap = max(_max_gap(o["logprobs"], ref_lp) for o in out)
    metric_gap = {key: max(abs(o["metrics"][key] - ref_metrics[key]) for o in out)
                  for key in ("train/loss", "train/entropy", "train/clip_fraction", "train/grad_norm")}
    common = [k for k in weights if k in ref_updated]
    worst = max((weights[k] - ref_updated[k]).abs().max().item() for k in common)
    print(f"tp={tp} pp={pp} dp={dp} ep={cfg.learner.ep} [{backend()}]: logprob gap {lp_gap:.1e}, "
          f"loss {out[0]['metrics']['train/loss']:.6f} vs {ref_metrics['train/loss']:.6f}, "
          f"metric gaps {' '.join(f'{k[6:]}={v:.1e}' for k, v in metric_gap.items())}, weight gap {worst:.1e}")
    for o in out:
        assert o["roundtrip_max_err"] == 0.0  # load then gather gives back the same tensors
        assert len(o["logprobs"]) == len(trajs)
        gap = _max_gap(o["logprobs"], ref_lp)
        assert gap <= TOL, ("logprobs", o["tp_rank"], o["pp_rank"], gap)
        for key in metric_gap:
            assert abs(o["metrics"][key] - ref_metrics[key]) <= TOL, (key, o["metrics"][key], ref_metrics[key])
    assert sorted(weights) == sorted(ref_updated)
    moved = max((ref_updated[k] - full[k]).abs().max().item() for k in full)
    assert moved > 5e-5  # the step did something (Adam moves weights by about lr)
    assert worst <= TOL, worst
    return out


@pytest.mark.parametrize("ep", [1, 2], ids=["dp2", "ep2-moe"])
def test_replicas_start_identical_whatever_each_rank_drew(ep):
    """Two data-parallel replicas (dense DP=2, or EP=2 where the experts differ and the router and
    attention are replicated) whose freshly built weights differ start training from the same
    replicated weights: the first rank's. Without the broadcast each rank keeps its own and the
    replicas train different models (seen on 3 H200s: the EP=2 learner's two routers differed,
    so the engine synced from rank 0 did not match rank 1)."""
    from parallel_cases import replica_init_case

    out = run_ranks(replica_init_case, 2, args=(tiny_cfg(ep=ep, moe=ep > 1),), timeout_s=180)
    shared = [name for name in out[0] if "experts" not in name]
    assert any("router" in name for name in shared) or ep == 1
    for name in shared:
        assert torch.equal(out[0][name], out[1][name]), name
