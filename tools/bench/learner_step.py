"""Benchmark: the learner's train step two ways, A/B (--compare attention or packing).

    python tools/bench/learner_step.py [--compare attention|packing|sharing] [--recipe longtail_cpu] [--digits 60,120]
        [--threads 1,2] [--steps 8] [override ...]

Builds the recipe's learner once and trains it on synthetic GRPO batches shaped like the
benchmark workload's (sort_digits: groups of ``algo.group_size`` samples sharing a prompt of n
digits, P(n) ∝ (n-1)^-1.5 up to --digits, responses of n+1 tokens), timing ``train_step`` two
ways per row:
- ``attention``: the learner's forward as it is (no mask: models/causal_attention.py's fused
  kernel) vs the same forward given the explicit causal mask, which takes megatron-core's local
  attention;
- ``packing``: micro-batches cut where padding costs more than another micro-batch (the default,
  learner/batch.py's split_by_length) vs cut only where the token budget forces it;
- ``sharing``: a row of prompt + response per sample vs one row per group, its prompt trained
  once (``learner.share_prompts``, models/shared_prefix.py).
Prints seconds per step for both (medians of --repeats alternating runs) and the ratio, per digit
range and thread count.
Extra arguments are config overrides (e.g. model.hidden_size=128).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def sort_digit_batch(rng: random.Random, groups: int, group_size: int, max_digits: int, tail: float = 1.5):
    from megatron_rl.learner.train_batch import TrainBatch
    from megatron_rl.types import Trajectory

    lengths = list(range(2, max_digits + 1))
    weights = [(n - 1) ** -tail for n in lengths]
    batch: List[Trajectory] = []
    advantages: List[float] = []
    for g in range(groups):
        n = rng.choices(lengths, weights)[0]
        prompt = [1] + [rng.randint(3, 12) for _ in range(n)] + [2]
        for s in range(group_size):
            response = [rng.randint(3, 12) for _ in range(n + 1)]
            batch.append(Trajectory(f"p{g}", s, prompt, response, [-2.0] * len(response), [0] * len(response),
                                    "stop"))
            advantages.append(rng.gauss(0.0, 1.0))
    return TrainBatch.of(batch, advantages=[[a] * len(t.response_ids) for t, a in zip(batch, advantages)])


def masked_forward(model, tokens):
    """The learner's forward with an explicit causal mask: megatron-core's attention path."""
    from megatron_rl.models.causal_attention import causal_mask

    b, s = tokens.shape
    positions = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    return model(tokens, positions, causal_mask(s, tokens.device))


def seconds_per_step(learner, batches, temperature: float = 1.0) -> float:
    learner.train_step(batches[0], temperature, lr=1e-5)  # warm-up
    start = time.perf_counter()
    for batch in batches[1:]:
        learner.train_step(batch, temperature, lr=1e-5)
    return (time.perf_counter() - start) / (len(batches) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", choices=("attention", "packing", "sharing"), default="attention")
    parser.add_argument("--recipe", default="longtail_cpu")
    parser.add_argument("--digits", default="60,120", help="largest digit count of each row's workload")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="alternate the two ways this many times; medians")
    args, overrides = parser.parse_known_args()

    from megatron_rl.checks import load_config
    from megatron_rl.learner import learner as learner_module
    from megatron_rl.learner.learner import Learner
    from megatron_rl.learner.parallel import init_model_parallel

    digits = [int(d) for d in args.digits.split(",")]
    longest = 2 * max(digits) + 4
    cfg = load_config(args.recipe, [f"model.max_position_embeddings={max(longest, 32)}", "trainer.progress=false",
                                    *overrides])
    init_model_parallel(1, 1, seed=cfg.trainer.seed)
    learner = Learner(cfg, vocab_size=16)
    fused_forward = learner_module.forward_logits
    default_overhead = learner.cfg.learner.micro_batch_overhead_tokens

    def use_masked(on: bool) -> None:
        learner_module.forward_logits = masked_forward if on else fused_forward

    def use_fewest(on: bool) -> None:
        # As few micro-batches as the token budget allows: a prohibitive cost per micro-batch.
        learner.cfg.learner.micro_batch_overhead_tokens = 10**9 if on else default_overhead

    def use_rows(on: bool) -> None:
        # A row of prompt + response per sample, or one row per group (learner.share_prompts).
        learner.cfg.learner.share_prompts = not on

    names, switch = {"attention": (("megatron s", "fused s"), use_masked),
                     "packing": (("fewest s", "split s"), use_fewest),
                     "sharing": (("rows s", "shared s"), use_rows)}[args.compare]
    groups, size = cfg.algo.groups_per_batch, cfg.algo.group_size
    print(f"recipe={args.recipe} groups={groups}x{size} hidden={cfg.model.hidden_size} layers={cfg.model.num_layers} "
          f"steps={args.steps} compare={args.compare} {' '.join(overrides)}")
    print(f"{'digits':>7} {'tokens/step':>12} {'threads':>8} {names[0]:>11} {names[1]:>8} {'ratio':>6}")
    for max_digits in digits:
        rng = random.Random(max_digits)
        batches = [sort_digit_batch(rng, groups, size, max_digits) for _ in range(args.steps + 1)]
        tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in batches[0])
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            timings = {"a": [], "b": []}
            for _ in range(args.repeats):  # alternating: a machine's speed drifts from minute to minute
                switch(True)
                try:
                    timings["a"].append(seconds_per_step(learner, batches))
                finally:
                    switch(False)
                timings["b"].append(seconds_per_step(learner, batches))
            a, b = (statistics.median(timings[k]) for k in ("a", "b"))
            print(f"{max_digits:>7} {tokens:>12} {threads:>8} {a:>11.3f} {b:>8.3f} {a / b:>5.2f}x")


if __name__ == "__main__":
    main()
