"""Slurm submission: ``python -m megatron_rl.slurm submit recipe=... nodes=... [overrides]``."""

from .script import STOPPED_EXIT, STOP_FILE, JobSpec, render

__all__ = ["STOPPED_EXIT", "STOP_FILE", "JobSpec", "render"]
