"""A benchmark workload with long-tailed response lengths, for random-weight models.

Reasoning models' responses run from hundreds to tens of thousands of tokens; synchronous RL then
waits for the longest while the engine decodes a handful of rows, the idle tail that asynchrony
fills. Random weights never stop early (every response runs to ``max_new_tokens``), so the engine
gives each request a length drawn from a log-normal and ignores its stop tokens until then: a
forced length, not a product setting (``rollout.long_tail_median``, off by default).

The draw is ``median * exp(sigma * z)``, ``z`` standard normal, ``sigma = ln(p99 / median) /
2.3263`` (the normal's 99th percentile), so half the responses are shorter than ``median`` and
1 % longer than ``p99``; the defaults (median 1,024, p99 16,384) give sigma = 1.19 and a mean of
~2,070 tokens. Each length is capped at the request's ``max_new_tokens`` and is at least 1.
Stop tokens are ignored rather than masked out of the sampled distribution, so the recorded
logprobs stay those of the distribution the learner scores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .sampling import request_key

# The standard normal's 99th percentile.
Z99 = 2.3263478740408408


@dataclass(frozen=True)
class LongTailLengths:
    """Response lengths from a log-normal of this ``median`` and 99th percentile ``p99`` (tokens),
    drawn per request id (``seed``: the run's; the same id draws the same length)."""

    median: int = 1024
    p99: int = 16384
    seed: int = 0

    @property
    def sigma(self) -> float:
        return math.log(self.p99 / self.median) / Z99

    def draw(self, request_id: str, max_new_tokens: int) -> int:
        """The response length of request ``request_id``, at most ``max_new_tokens``."""
        rng = np.random.default_rng(request_key(self.seed, request_id) & (2**63 - 1))
        length = round(self.median * math.exp(self.sigma * rng.standard_normal()))
        return max(1, min(length, max_new_tokens))
