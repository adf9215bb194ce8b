"""Several prompt sources mixed by weight: each draw picks a source with probability
weight / sum of weights, then takes that source's next prompt (each source goes round its own
shuffled epochs).

The picks come from a generator seeded with the run's seed, so the stream is the same in every
run with that seed: a resumed run rebuilds it and skips the prompts the checkpoint says were
drawn (checkpoint/resume.py's CountingIterator), exactly as for one source.
"""

from __future__ import annotations

import random
from typing import Iterable, Iterator, List, Sequence, Tuple

from .datasets import Prompt


class MixedPrompts:
    def __init__(self, sources: Sequence[Tuple[Iterable[Prompt], float]], seed: int):
        if not sources:
            raise ValueError("MixedPrompts needs at least one source")
        self.sources: List[Iterable[Prompt]] = [source for source, _ in sources]
        self.weights = [float(weight) for _, weight in sources]
        # Its own stream, apart from each source's shuffles (seeded from the same run seed).
        self.rng = random.Random(f"mixture-{seed}")

    def __iter__(self) -> Iterator[Prompt]:
        streams = [iter(source) for source in self.sources]
        indices = range(len(streams))
        while True:
            yield next(streams[self.rng.choices(indices, self.weights)[0]])
