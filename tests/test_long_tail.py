"""The long-tail benchmark workload's response lengths (rollout/long_tail.py) and its settings."""

import statistics

import numpy as np
import pytest

from megatron_rl.config.validate import ConfigError
from megatron_rl.rollout.long_tail import LongTailLengths


def test_draws_have_the_stated_median_and_p99():
    lengths = LongTailLengths()  # median 1,024, p99 16,384
    drawn = [lengths.draw(f"step3-p{i}-s{j}", 10**6) for i in range(1000) for j in range(8)]
    assert abs(statistics.median(drawn) / 1024 - 1) < 0.05
    assert abs(np.percentile(drawn, 99) / 16384 - 1) < 0.2
    assert lengths.draw("a", 10**6) == lengths.draw("a", 10**6)  # per request id, reproducible
    assert LongTailLengths(seed=1).draw("a", 10**6) != lengths.draw("a", 10**6)
    capped = [lengths.draw(f"r{i}", 2048) for i in range(200)]
    assert max(capped) == 2048 and min(capped) >= 1


def test_engine_options_carry_the_workload_and_bad_settings_are_refused():
    from megatron_rl.checks import load_config
    from megatron_rl.rollout.embedded import engine_options

    cfg = load_config("tiny_cpu", ["rollout.long_tail_median=8", "rollout.long_tail_p99=64"])
    assert engine_options(cfg)["long_tail"] == LongTailLengths(8, 64, cfg.trainer.seed)
    assert engine_options(load_config("tiny_cpu"))["long_tail"] is None
    with pytest.raises(ConfigError, match="rollout.long_tail_p99=8 must be > rollout.long_tail_median=8"):
        load_config("tiny_cpu", ["rollout.long_tail_median=8", "rollout.long_tail_p99=8"])
    with pytest.raises(ConfigError, match="long-tail benchmark workload is the embedded engine's"):
        load_config("tiny_cpu", ["rollout.long_tail_median=8", "rollout.engine=vllm"])
