"""Megatron's parallel_state over a subset of the world (launch/groups.py): learners see a world of
learners with their TP layout, engines keep their own one-rank layout, and the whole world is
still reachable explicitly."""

import torch
import torch.distributed as dist

from rank_harness import run_ranks


def test_learners_get_megatron_groups_engines_their_own():
    out = run_ranks(_split_case_world3, 3, timeout_s=180)
    learners, engine = out[:2], out[2]
    assert [o["role"] for o in out] == ["learner", "learner", "engine"]
    assert [(o["tp"], o["tp_rank"], o["dp"]) for o in learners] == [(2, 0, 1), (2, 1, 1)]
    assert (engine["tp"], engine["tp_rank"], engine["dp"]) == (1, 0, 1)
    assert [o["world_seen"] for o in out] == [2, 2, 3]  # Megatron on a learner sees learners only
    assert [o["default_sum"] for o in learners] == [2.0, 2.0]
    assert all(o["world_sum"] == 3.0 for o in out)


def _split_case_world3():
    # On the engine, a default-group all-reduce would wait for learners that never join it, so
    # the engine skips that one collective (learners reduce over their own group).
    from megatron.core import parallel_state as ps

    from megatron_rl.launch.groups import init_split_parallel_state

    role = init_split_parallel_state(2, tp=2, pp=1)
    default_sum = None
    if role == "learner":
        t = torch.tensor([1.0])
        dist.all_reduce(t)
        default_sum = t.item()
    world = torch.tensor([1.0])
    dist.all_reduce(world, group=dist.group.WORLD)
    return {"role": role, "tp": ps.get_tensor_model_parallel_world_size(),
            "tp_rank": ps.get_tensor_model_parallel_rank(), "dp": ps.get_data_parallel_world_size(),
            "world_seen": dist.get_world_size(), "default_sum": default_sum, "world_sum": world.item()}
