"""How CPU cores are split between the learner and the engine (trainer.compute_threads)."""

import pytest
import torch

from megatron_rl.config.schema import RootConfig
from megatron_rl.build import compute_threads


@pytest.mark.parametrize("separate, overlap, expected", [
    (False, False, (5, 5)),  # no overlap: everything gets every core
    (False, True, (2, 2)),   # one process, overlapping: torch's setting is shared, half each
    (True, False, (5, 5)),
    (True, True, (3, 2)),    # engine in its own process: the learner keeps the other half
])
def test_cpu_cores_are_split_only_when_learner_and_engine_overlap(monkeypatch, separate, overlap, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = RootConfig()
    cfg.trainer.cpu_threads, cfg.rollout.separate_process = 5, separate
    assert compute_threads(cfg, overlap) == expected


def test_gpu_keeps_torch_default_unless_cpu_threads_is_set(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = RootConfig()
    cfg.rollout.separate_process = True
    assert compute_threads(cfg, True)[0] is None
    cfg.trainer.cpu_threads = 6
    assert compute_threads(cfg, True) == (6, 3)
