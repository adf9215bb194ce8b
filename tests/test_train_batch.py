"""The learner's batch: trajectories frozen once it is built, each derived quantity written once,
slices carry their fields (data-parallel shares, mini-batches), and it travels to other ranks."""

import copy
import pickle

import pytest

from megatron_rl.learner.train_batch import TrainBatch
from megatron_rl.types import Trajectory


def _groups():
    return [[Trajectory(f"p{g}", i, [1, 2], [3] * (i + 1), [-1.0] * (i + 1), [0] * (i + 1), "stop", reward=float(i))
             for i in range(3)] for g in range(2)]


def test_trajectories_are_frozen_once_in_a_batch():
    groups = _groups()
    groups[0][0].reward = 5.0  # scoring may still write
    batch = TrainBatch.of_groups(groups)
    assert batch.groups == ((0, 1, 2), (3, 4, 5)) and batch[0].reward == 5.0
    with pytest.raises(AttributeError, match="p0/0 is frozen after scoring; reward belongs in the learner's TrainBatch"):
        groups[0][0].reward = 1.0
    with pytest.raises(AttributeError, match="frozen"):
        batch[4].routed_experts = None


def test_each_field_is_written_once_and_checked():
    batch = TrainBatch.of_groups(_groups()).with_fields(rewards=[0, 1, 2, 0, 1, 2])
    with pytest.raises(ValueError, match="already has 'rewards'"):
        batch.with_fields(rewards=[0.0] * 6)
    with pytest.raises(KeyError, match="unknown batch field 'advantage'"):
        batch.with_fields(advantage=[0.0] * 6)
    with pytest.raises(ValueError, match="p0/1: advantages has 1 values for 2 response tokens"):
        batch.with_fields(advantages=[[1.0]] * 6)
    with pytest.raises(KeyError, match="no 'values' yet"):
        batch.get("values")
    with_adv = batch.with_fields(advantages=[[float(i)] * len(t.response_ids) for i, t in enumerate(batch)])
    assert not batch.has("advantages") and with_adv.has("advantages")  # a new batch; the old one unchanged


def test_slices_keep_fields_and_groups_and_the_batch_travels():
    batch = TrainBatch.of_groups(_groups())
    batch = batch.with_fields(advantages=[[float(i)] * len(t.response_ids) for i, t in enumerate(batch)])
    part = batch[2:5]
    assert [t.prompt_uid for t in part] == ["p0", "p1", "p1"] and part.groups == ((0,), (1, 2))
    assert part.get("advantages") == ((2.0,) * 3, (3.0,), (4.0,) * 2)
    assert part.token_values(1)["advantages"] == (3.0,)
    for other in (pickle.loads(pickle.dumps(batch)), copy.deepcopy(batch)):
        assert other.get("advantages") == batch.get("advantages") and other.groups == batch.groups
        with pytest.raises(AttributeError, match="frozen"):
            other[0].reward = 1.0


def test_micro_batches_place_each_row_and_refuse_a_sample_without_a_prompt():
    """Packing into micro-batches: tokens, labels (the next token) and per-token values at the
    logits that predict each response token, padding elsewhere; a sample with no prompt token (no
    logit predicts its first response token) gets an error naming it."""
    from megatron_rl.learner.batch import build_micro_batches

    groups = _groups()
    batch = TrainBatch.of_groups(groups)
    batch = batch.with_fields(advantages=[[float(i)] * len(t.response_ids) for i, t in enumerate(batch)])
    mb, = build_micro_batches(batch, token_budget=1000, pad_id=9)
    assert mb.tokens[2].tolist() == [1, 2, 3, 3, 3] and mb.tokens[0].tolist() == [1, 2, 3, 9, 9]
    assert mb.labels[2].tolist() == [2, 3, 3, 3, 9] and mb.labels[0].tolist() == [2, 3, 9, 9, 9]
    assert mb.advantages[2].tolist() == [0.0, 2.0, 2.0, 2.0, 0.0]
    assert mb.behav_logprobs[1].tolist() == [0.0, -1.0, -1.0, 0.0, 0.0]
    empty = Trajectory("q", 0, [], [3, 4], [-1.0, -1.0], [0, 0], "stop")
    with pytest.raises(ValueError, match="q/0 has no prompt token"):
        build_micro_batches([empty], token_budget=1000)
