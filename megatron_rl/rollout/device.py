"""Which GPU the single-process trainer's engine process computes on (``rollout.device``).

``auto`` keeps today's behaviour: the engine shares the learner's device (cuda:0 on a GPU
machine, the CPU elsewhere). ``cuda:N`` puts the embedded engine's child process on GPU N, so the
learner (cuda:0) and the engine do not share a GPU: the disaggregated layout of one machine,
without the torchrun world split. Pure functions over strings and a GPU count, so the rules are
tested on a CPU.
"""

from __future__ import annotations

import re
from typing import Optional

from ..config.validate import WORLD, refuse
from ..errors import ConfigError

AUTO = "auto"
_CUDA = re.compile(r"^cuda:(\d+)$")


def parse_engine_device(spec: str) -> Optional[int]:
    """The GPU index that ``spec`` names, or None for ``auto``; ValueError for anything else."""
    text = str(spec).strip().lower()
    if text == AUTO:
        return None
    match = _CUDA.match(text)
    if match is None:
        raise ValueError(f"rollout.device={spec!r} is not a device: use auto (the learner's device) or cuda:N "
                         "(e.g. cuda:1 puts the engine process on the second GPU)")
    return int(match.group(1))


def resolve_engine_device(spec: str, gpu_count: int) -> Optional[int]:
    """The GPU index the engine process sets as its device (None: the default, as before).

    ``gpu_count`` is what this machine has (``torch.cuda.device_count()``, 0 without CUDA). A GPU
    that does not exist is an error here rather than a CUDA failure inside the child."""
    index = parse_engine_device(spec)
    if index is None:
        return None
    if gpu_count <= 0:
        raise ValueError(f"rollout.device={spec} needs CUDA, and this machine has no GPU; "
                         "use rollout.device=auto")
    if index >= gpu_count:
        raise ValueError(f"rollout.device={spec}: this machine has {gpu_count} GPU(s), cuda:0 to "
                         f"cuda:{gpu_count - 1}; pick one of them or rollout.device=auto")
    return index


def check_engine_device(rollout_cfg, placement: str) -> None:
    """rollout.device: its syntax and the settings it needs. Whether the GPU exists is checked
    where the engine starts (a config may be written on a machine without GPUs)."""
    r = rollout_cfg
    try:
        index = parse_engine_device(r.device)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if index is None:
        return
    if placement == WORLD:
        raise refuse(f"rollout.device={r.device}", WORLD, "the launcher places engines by rank "
                     "(rollout.placement), so leave rollout.device=auto")
    if r.engine != "embedded" or not r.separate_process:
        raise ConfigError(f"rollout.device={r.device} places the embedded engine's own process: it needs "
                          "rollout.engine=embedded and rollout.separate_process=true")
