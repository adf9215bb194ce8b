"""PPO's critic runs with the policy's parallel layout: at TP=2, PP=2 and DP=2 (DistributedOptimizer)
on real gloo ranks (or GPUs over NCCL: MEGATRON_RL_TEST_BACKEND=nccl) it computes the single-process critic's values, and one training step gives the
same value loss and updated weights."""

import copy
import dataclasses

import pytest
import torch

from megatron_rl.learner.critic import Critic

from batches import gae_batch

from rank_harness import backend, run_ranks
from parallel_cases import VOCAB, batch, critic_case, tiny_cfg

TOL = 1e-5


@pytest.fixture(scope="module")
def reference(megatron_world):
    cfg = tiny_cfg()
    critic = Critic(cfg, VOCAB)
    with torch.no_grad():  # off Megatron's init, value head included (it starts at zero)
        gen = torch.Generator().manual_seed(11)
        for p in critic.module.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen).to(p.device))
    full = _cpu_state(critic.module)
    trajs = list(batch())
    trajs = [dataclasses.replace(t, reward=float(i % 2)) for i, t in enumerate(trajs)]
    trajs = gae_batch(critic, trajs, gamma=1.0, lam=0.9)
    values = [list(v) for v in trajs.get("values")]
    metrics = critic.train_step(trajs)
    updated = _cpu_state(critic.module)
    return full, trajs, values, metrics, updated


def _cpu_state(module):
    # CPU copies: ranks get them as arguments and return theirs on the CPU (GPU runs included).
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("tp, pp, dp", [(2, 1, 1), (1, 2, 1), (1, 1, 2)], ids=["tp2", "pp2", "dp2-distopt"])
def test_sharded_critic_equals_single_process(reference, tp, pp, dp):
    full, trajs, ref_values, ref_metrics, ref_updated = reference
    cfg = tiny_cfg(tp, pp, dp_optimizer=dp > 1)
    out = run_ranks(critic_case, tp * pp * dp, args=(cfg, full, trajs), timeout_s=180)
    weights = {}
    for o in out:
        weights.update(o["weights"])
    # Every gap printed before the checks (a GPU run reports its figures even past a tolerance).
    gap = max(abs(a - b) for o in out for ra, rb in zip(o["values"], ref_values) for a, b in zip(ra, rb))
    worst = max((weights[k] - ref_updated[k]).abs().max().item() for k in weights if k in ref_updated)
    print(f"critic tp={tp} pp={pp} dp={dp} [{backend()}]: value gap {gap:.1e}, weight gap {worst:.1e}")
    for o in out:
        gap = max(abs(a - b) for ra, rb in zip(o["values"], ref_values) for a, b in zip(ra, rb))
        assert gap <= TOL, ("values", o["tp_rank"], o["pp_rank"], gap)
        for key in ("critic/value_loss", "critic/value_mse", "critic/grad_norm"):
            assert abs(o["metrics"][key] - ref_metrics[key]) <= TOL, (key, o["metrics"][key], ref_metrics[key])
    assert sorted(weights) == sorted(ref_updated)
    assert max((ref_updated[k] - full[k]).abs().max().item() for k in full) > 5e-5  # the step moved weights
    assert worst <= TOL, worst
