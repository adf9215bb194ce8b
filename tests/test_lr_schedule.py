"""The learning-rate schedule: warm-up, then constant / linear / cosine down to min_lr."""

import math

import pytest

from megatron_rl.config.schema import RootConfig
from megatron_rl.trainer import lr_at


def _cfg(style: str) -> RootConfig:
    cfg = RootConfig()
    cfg.learner.lr, cfg.learner.min_lr, cfg.learner.lr_warmup_steps = 1e-3, 1e-4, 4
    cfg.learner.lr_decay_style = style
    cfg.trainer.total_steps = 104
    return cfg


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_warmup_is_linear_and_shared(style):
    cfg = _cfg(style)
    assert [lr_at(cfg, s) for s in (1, 2, 3)] == pytest.approx([5e-4, 7.5e-4, 1e-3])
    assert lr_at(cfg, 4) == pytest.approx(1e-3)  # decay starts from the peak


def test_decay_styles_by_hand():
    # 100 decay steps after 4 of warm-up; step 54 is half way, 104 the end.
    assert lr_at(_cfg("constant"), 104) == pytest.approx(1e-3)
    assert lr_at(_cfg("linear"), 54) == pytest.approx(1e-4 + 0.5 * 9e-4)
    assert lr_at(_cfg("linear"), 104) == pytest.approx(1e-4)
    assert lr_at(_cfg("cosine"), 29) == pytest.approx(1e-4 + 9e-4 * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert lr_at(_cfg("cosine"), 104) == pytest.approx(1e-4)
    assert lr_at(_cfg("cosine"), 500) == pytest.approx(1e-4)  # past the end: stays at min_lr


def test_decay_steps_end_the_decay_before_total_steps():
    # A 130-step run on a 104-step schedule: the first 104 learning rates are the shorter run's.
    short, long = _cfg("cosine"), _cfg("cosine")
    long.trainer.total_steps, long.learner.lr_decay_steps = 130, 104
    assert [lr_at(long, s) for s in range(1, 105)] == [lr_at(short, s) for s in range(1, 105)]
    assert lr_at(long, 120) == pytest.approx(1e-4)
    long.learner.lr_decay_steps = None  # default: the decay spans the whole run
    assert lr_at(long, 104) > 1e-4 + 1e-6
