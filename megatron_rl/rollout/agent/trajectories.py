"""One agent run's model calls -> token-exact trajectories (pure functions, no I/O).

Every call the agent made through the chat server is a ``Turn``: the exact prompt ids the engine
saw and what it generated (ids, logprobs, the policy version of each token). Consecutive turns
whose prompt extends the previous turn's whole sequence (prompt + completion) are one trajectory:
its response is every token after the first prompt, with loss mask 1 on the tokens the model
generated and 0 on what came from elsewhere (chat-template markers, tool results, user turns).
A turn whose prompt does not extend the previous sequence (the agent edited its history, or the
template re-rendered a past answer differently) starts a new trajectory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

from ...types import Trajectory
from ..routed_experts import first_records


@dataclass
class Turn:
    """One chat-completion call as the engine served it."""

    prompt_ids: List[int]
    completion_ids: List[int]
    logprobs: List[float]
    versions: List[int]
    finish_reason: str
    # The experts each MoE layer chose for the positions the engine computed in this call (its
    # prompt and completion but the last token), [positions, moe_layers, top_k]; None if unrecorded.
    routed_experts: Optional[Any] = None


def extends(turn: Turn, sequence: Sequence[int]) -> bool:
    """True when ``turn``'s prompt starts with ``sequence`` (and is longer or equal)."""
    n = len(sequence)
    return len(turn.prompt_ids) >= n and list(turn.prompt_ids[:n]) == list(sequence)


def run_trajectories(turns: Sequence[Turn], prompt_uid: str, sample_index: int, reward: float,
                     turn_discount: float = 1.0) -> List[Trajectory]:
    """The trajectories of one run, in call order, all with the run's ``reward``.

    Tokens that the model did not generate get loss mask 0, logprob 0 and the policy version of
    the model token before them (so they never make a trajectory look staler than it is). With
    ``turn_discount`` < 1 each trajectory's ``advantage_scale`` is ``turn_discount`` to the power
    of the number of model turns after its last one: earlier turns get less of the run's credit."""
    pieces: List[dict] = []
    for turn in turns:
        last = pieces[-1] if pieces else None
        if last is not None and extends(turn, last["prompt"] + last["response"]):
            gap = turn.prompt_ids[len(last["prompt"]) + len(last["response"]):]
            filler = last["versions"][-1] if last["versions"] else turn.versions[0] if turn.versions else 0
            last["response"] += list(gap)
            last["logprobs"] += [0.0] * len(gap)
            last["versions"] += [filler] * len(gap)
            last["mask"] += [0] * len(gap)
        else:
            last = {"prompt": list(turn.prompt_ids), "response": [], "logprobs": [], "versions": [],
                    "mask": [], "turns": 0, "finish": "stop", "routed": []}
            pieces.append(last)
        last["response"] += list(turn.completion_ids)
        last["logprobs"] += list(turn.logprobs)
        last["versions"] += list(turn.versions)
        last["mask"] += [1] * len(turn.completion_ids)
        last["routed"].append(turn.routed_experts)  # positions numbered as the piece's: its prompt extends it
        last["turns"] += 1
        last["finish"] = turn.finish_reason
    trajectories, later_turns = [], 0
    for piece in reversed(pieces):
        traj = Trajectory(prompt_uid, sample_index, piece["prompt"], piece["response"], piece["logprobs"],
                          piece["versions"], piece["finish"], loss_mask=piece["mask"], reward=reward,
                          routed_experts=first_records(piece["routed"], len(piece["prompt"]) + len(piece["response"])))
        traj.advantage_scale = turn_discount ** later_turns
        later_turns += piece["turns"]
        trajectories.append(traj)
    return trajectories[::-1]
