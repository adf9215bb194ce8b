"""Plain data types shared by rollout, rewards, scheduler and learner (no framework imports)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


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
    policy version that produced each token. ``finish_reason`` is set on the last chunk only."""

    request_id: str
    token_ids: List[int]
    logprobs: List[float]
    versions: List[int]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort"
    # Mixture-of-experts routing replay (models/routing.py): the experts each MoE layer chose for
    # the positions the engine computed since the previous chunk, a [positions, moe_layers, top_k]
    # uint8/int16 numpy array (255 / -1 where nothing was recorded); None when not recorded.
    routed_experts: Optional[Any] = None


@dataclass
class Trajectory:
    """One sampled response to one prompt, as the learner needs it."""

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
    reward: float = 0.0
    reward_info: Dict[str, Any] = field(default_factory=dict)
    advantage: float = 0.0
    # Agent runs: the share of the run's advantage this trajectory gets (the per-turn discount of
    # earlier turns; 1 for single-turn samples).
    advantage_scale: float = 1.0
    # Agent runs: the run's counts (turns, tool_calls, context_overflows, trajectories), the same
    # dict on each of its trajectories, for per-run metrics (rollout/agent/metrics.py).
    agent_run: Optional[Dict[str, int]] = None
    # Per-token advantages (PPO with a critic: GAE); when set they replace ``advantage``.
    token_advantages: Optional[List[float]] = None
    # The critic's values before its update and the GAE returns it regresses on, per response token.
    values: Optional[List[float]] = None
    returns: Optional[List[float]] = None
    # Filled by the learner before the update: logprobs of the response under the weights about
    # to be updated (PPO's "old" policy) and under the frozen reference model (for KL).
    proximal_logprobs: Optional[List[float]] = None
    ref_logprobs: Optional[List[float]] = None
    # Mixture-of-experts routing replay: the experts the engine chose in each MoE layer for every
    # position of prompt + response, a [positions, moe_layers, top_k] uint8/int16 numpy array
    # (255 / -1 where the engine computed nothing, e.g. the last response token); None if unrecorded.
    routed_experts: Optional[Any] = None

    def __post_init__(self) -> None:
        if not self.loss_mask:
            self.loss_mask = [1] * len(self.response_ids)
        n = len(self.response_ids)
        if not (len(self.logprobs) == len(self.versions) == len(self.loss_mask) == n):
            raise ValueError(
                f"trajectory {self.prompt_uid}/{self.sample_index}: response has {n} tokens but "
                f"{len(self.logprobs)} logprobs, {len(self.versions)} versions, "
                f"{len(self.loss_mask)} mask entries"
            )

    @property
    def oldest_version(self) -> int:
        return min(self.versions) if self.versions else -1
