"""Training batches for learner tests: trajectories with the advantages a recipe would give them."""

from typing import Sequence

from megatron_rl.learner.train_batch import TrainBatch
from megatron_rl.types import Trajectory


def advantaged(trajs: Sequence[Trajectory], advantages: Sequence[float], **fields) -> TrainBatch:
    """``trajs`` as one batch, each trajectory's sequence advantage on every one of its tokens."""
    return TrainBatch.of(trajs, advantages=[[float(a)] * len(t.response_ids) for t, a in zip(trajs, advantages)],
                         **fields)


def gae_batch(critic, trajs: Sequence[Trajectory], gamma: float, lam: float, whiten: bool = True) -> TrainBatch:
    """What the gae recipe prepares: rewards, the critic's values, GAE advantages and returns."""
    from megatron_rl.learner.recipes import gae_advantages_and_returns

    batch = TrainBatch.of(trajs, rewards=[t.reward for t in trajs])
    batch = batch.with_fields(values=critic.compute_values(batch))
    advantages, returns = gae_advantages_and_returns(batch, gamma, lam, whiten)
    return batch.with_fields(advantages=advantages, returns=returns)


def replacing(batch: TrainBatch, **per_trajectory: Sequence) -> TrainBatch:
    """``batch`` with its trajectories' fields replaced (one value per trajectory for each
    keyword), as an engine would have returned them; the batch's own fields kept."""
    import dataclasses

    trajs = [dataclasses.replace(t, **{k: v[i] for k, v in per_trajectory.items()}) for i, t in enumerate(batch)]
    return TrainBatch(tuple(t.freeze() for t in trajs), batch.groups, dict(batch.fields), batch.teachers)
