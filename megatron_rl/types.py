"""Plain data types shared by rollout, rewards, scheduler and learner (numpy, no framework imports)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    # 0 disables top-k.
    top_k: int = 0
    max_new_tokens: int = 16
    # Token ids that end a response (the EOS token is included by the caller).
    stop_token_ids: tuple = ()
    seed: Optional[int] = None
    # True: a chunk per engine step (streaming, e.g. for agent tools or HTTP). False: one chunk
    # when the request ends (RL rollouts; far less event-loop traffic per generated token).
    stream: bool = True


@dataclass
class GenerationChunk:
    """Tokens produced since the previous chunk of one request, with their logprobs and the
    policy version that produced each token. ``finish_reason`` is set on the last chunk only.
    Streamed chunks hold lists; the whole responses of ``generate_n`` hold numpy arrays (int32
    ids and versions, float32 logprobs unless that would round them), one buffer per field."""

    request_id: str
    token_ids: List[int]
    logprobs: List[float]
    versions: List[int]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort"
    # Mixture-of-experts routing replay (models/routing.py): the experts each MoE layer chose for
    # the positions the engine computed since the previous chunk, a [positions, moe_layers, top_k]
    # uint8/int16 numpy array (255 / -1 where nothing was recorded); None when not recorded.
    routed_experts: Optional[Any] = None


def token_list(values: Sequence[Any]) -> List[Any]:
    """A token field as a Python list: engines behind a connection send a group's responses as
    numpy arrays (one buffer per field, not an object per token; rollout/serve.py)."""
    return values.tolist() if hasattr(values, "tolist") else list(values)


def token_count(values: Sequence[Any]) -> int:
    """The sum of a token field (e.g. the trained tokens of a loss mask), list or numpy array."""
    return int(values.sum()) if hasattr(values, "sum") else int(sum(values))


@dataclass
class Trajectory:
    """One sampled response to one prompt, as rollout and scoring made it. From the moment the
    learner's batch is built it is frozen (``freeze``): what the learner derives from it
    (advantages, logprobs, values) lives in learner/train_batch.py's TrainBatch."""

    prompt_uid: str
    sample_index: int
    prompt_ids: List[int]
    response_ids: List[int]
    # Behaviour logprobs (from the engine) and policy versions, one per response token.
    logprobs: List[float]
    versions: List[int]
    finish_reason: str
    # 1 where the learner trains on the response token (0 for e.g. tool outputs in agent turns).
    loss_mask: List[int] = field(default_factory=list)
    # Set by scoring (the verifier's reward; the learner derives what it trains on, e.g. a
    # KL-charged reward, in its TrainBatch).
    reward: float = 0.0
    reward_info: Dict[str, Any] = field(default_factory=dict)
    # Agent runs: the share of the run's advantage this trajectory gets (the per-turn discount of
    # earlier turns; 1 for single-turn samples).
    advantage_scale: float = 1.0
    # Agent runs: the run's counts (turns, tool_calls, context_overflows, trajectories), the same
    # dict on each of its trajectories, for per-run metrics (rollout/agent/metrics.py).
    agent_run: Optional[Dict[str, int]] = None
    # Mixture-of-experts routing replay: the experts the engine chose in each MoE layer for every
    # position of prompt + response, a [positions, moe_layers, top_k] uint8/int16 numpy array
    # (255 / -1 where the engine computed nothing, e.g. the last response token); None if unrecorded.
    routed_experts: Optional[Any] = None

    def __post_init__(self) -> None:
        if len(self.loss_mask) == 0:
            ids = self.response_ids
            object.__setattr__(self, "loss_mask", [1] * len(ids) if isinstance(ids, list) else _ones(len(ids)))
        n = len(self.response_ids)
        if not (len(self.logprobs) == len(self.versions) == len(self.loss_mask) == n):
            raise ValueError(
                f"trajectory {self.prompt_uid}/{self.sample_index}: response has {n} tokens but "
                f"{len(self.logprobs)} logprobs, {len(self.versions)} versions, "
                f"{len(self.loss_mask)} mask entries"
            )

    def freeze(self) -> "Trajectory":
        """Refuse any later change of this trajectory (returns it). Its class becomes
        ``FrozenTrajectory``: an unfrozen trajectory pays nothing per attribute it sets."""
        if type(self) is Trajectory:
            self.__class__ = FrozenTrajectory
        return self

    @property
    def oldest_version(self) -> int:
        if len(self.versions) == 0:
            return -1
        return int(self.versions.min()) if hasattr(self.versions, "min") else min(self.versions)

    def listed(self) -> "Trajectory":
        """This trajectory with Python lists as token fields (itself when they are already)."""
        names = ("prompt_ids", "response_ids", "logprobs", "versions", "loss_mask")
        if all(isinstance(getattr(self, name), list) for name in names):
            return self
        return replace(self, **{name: token_list(getattr(self, name)) for name in names})


class FrozenTrajectory(Trajectory):
    """A trajectory after scoring: none of its attributes changes (``dataclasses.replace`` makes a
    new, frozen one). What the learner derives belongs in its TrainBatch."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__:  # set already: a change (a replace's __init__ sets each once)
            raise AttributeError(f"trajectory {self.prompt_uid}/{self.sample_index} is frozen after scoring; "
                                 f"{name} belongs in the learner's TrainBatch (learner/train_batch.py)")
        super().__setattr__(name, value)


_ONES = np.ones(0, dtype=np.uint8)


def _ones(n: int) -> np.ndarray:
    """A read-only loss mask of ``n`` ones, a view of one shared buffer (no allocation per row)."""
    global _ONES
    if _ONES.size < n:
        _ONES = np.ones(max(n, 2 * _ONES.size), dtype=np.uint8)
        _ONES.flags.writeable = False
    return _ONES[:n]
