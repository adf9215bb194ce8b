"""Supervised fine-tuning's samples: each prompt's response is the one its dataset row holds,
not one the engine generates (algo.name=sft; learner/recipes.py trains on it with the
response-token NLL).

The response is the row's answer as written (``Prompt.ground_truth`` when it is text, e.g. a
worked solution with its ``#### 42``; a chat row's final assistant message), tokenized and ended
with the tokenizer's end-of-sequence token, at most ``rollout.max_new_tokens`` tokens (a longer
one is cut and counted as finish reason "length"). Samples carry the current policy version, so
staleness reads 0, and no logprobs (an SFT loss needs none)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, List, Sequence

from ..types import SamplingParams, Trajectory
from .workflow import Workflow

if TYPE_CHECKING:
    from ..data.datasets import Prompt


class DatasetResponses(Workflow):
    """A group workflow: one trajectory per request id with the row's own response."""

    # The trainer scores nothing: an SFT sample's reward is not a signal.
    sets_rewards = True

    def __init__(self, tokenizer: Any, version: Callable[[], int]):
        self.tokenizer = tokenizer
        self.version = version

    def response_ids(self, prompt: "Prompt", max_tokens: int) -> List[int]:
        text = prompt.ground_truth if isinstance(prompt.ground_truth, str) else prompt.target
        return (self.tokenizer.encode(text) + [self.tokenizer.eos_id])[:max_tokens]

    async def __call__(self, engine: Any, prompt: "Prompt", params: SamplingParams,
                       request_ids: Sequence[str]) -> List[Trajectory]:
        ids = self.response_ids(prompt, params.max_new_tokens)
        finish = "stop" if ids and ids[-1] == self.tokenizer.eos_id else "length"
        version = self.version()
        return [Trajectory(prompt.uid, i, list(prompt.prompt_ids), list(ids), [0.0] * len(ids), [version] * len(ids),
                           finish) for i in range(len(request_ids))]
