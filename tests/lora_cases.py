"""Functions that run on every rank of a LoRA test world (tests/rank_harness.py)."""

from typing import Dict

import torch

from megatron_rl.config.schema import RootConfig

from parallel_cases import VOCAB


def peft_export_case(cfg: RootConfig, full: Dict[str, torch.Tensor], out: str) -> None:
    """Load the reference's full weights at ``cfg``'s layout and write the PEFT directory as a
    checkpoint's export does (collective: every rank gathers, rank 0 writes)."""
    from pathlib import Path

    from megatron_rl.learner.worker import LearnerWorker
    from megatron_rl.weights.reshard import load_into_learner

    worker = LearnerWorker(cfg, VOCAB, pad_id=0)
    load_into_learner(worker.learner, full)
    worker._export_peft(Path(out))
