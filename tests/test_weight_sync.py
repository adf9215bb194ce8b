"""Weight sync from a sharded learner to an embedded engine on another rank: after one sync the
engine holds exactly the learner's weights (bit for bit) and its sampling logprobs are the
learner's, for TP=2, PP=2 and EP=2 (MoE) learners."""

import pytest

from rank_harness import run_ranks
from parallel_cases import sync_case, tiny_cfg


@pytest.mark.parametrize("tp, pp, ep", [(2, 1, 1), (1, 2, 1), (1, 1, 2)], ids=["tp2", "pp2", "ep2-moe"])
def test_engine_on_another_rank_matches_learner_after_sync(tp, pp, ep):
    cfg = tiny_cfg(tp, pp, ep=ep, moe=ep > 1)
    n = tp * pp * ep  # learner ranks (an EP=2 learner on 2 ranks is also dense DP=2)
    # Small buckets, so a send is many buckets and a stage spans several.
    out = run_ranks(sync_case, n + 1, args=(cfg, n, 16 << 10), timeout_s=240)
    learners, engine = out[:-1], out[-1]
    assert [o["role"] for o in out] == ["learner"] * n + ["engine"]
    version, count, nbytes, buckets = engine["received"]
    assert version == 1 and buckets > pp  # several buckets per stage
    sent = [o["send"] for o in learners if o["send"] is not None]
    assert len(sent) == pp and sum(s[0] for s in sent) == nbytes  # one source per pipeline stage
    # The engine's Megatron tensors are the learner's gathered full tensors, exactly.
    learner_state = {}
    for o in learners:
        learner_state.update(o["stage_state"])
    assert sorted(learner_state) == sorted(engine["engine_state"])
    for name, tensor in learner_state.items():
        assert (engine["engine_state"][name] == tensor).all(), name
    for o in learners:
        assert o["versions"] == [1]
        gap = max(abs(a - b) for ra, rb in zip(o["learner_logprobs"], o["engine_logprobs"]) for a, b in zip(ra, rb))
        print(f"tp={tp} pp={pp} ep={ep}: {count} tensors, {nbytes} bytes in {buckets} buckets; max logprob gap {gap:.1e}")
        assert gap <= 1e-5, gap
