"""Convert checkpoints between Hugging Face and Megatron layouts.

    # HF directory (config.json + *.safetensors) -> Megatron dist checkpoint
    python tools/convert_checkpoint.py hf-to-megatron /ckpt/Qwen3-8B /ckpt/qwen3-8b-mcore --tp 4 --pp 2
    # Megatron dist checkpoint (converted, or a training run's checkpoints/step_N) -> HF directory
    python tools/convert_checkpoint.py megatron-to-hf runs/x/checkpoints/step_700 /ckpt/x-hf   # + the run's tokenizer
    # Megatron -> Megatron (weights only, optionally another dtype)
    python tools/convert_checkpoint.py megatron-to-megatron runs/x/checkpoints/step_700 /ckpt/x-mcore --dtype bf16

A Megatron dist checkpoint stores global tensors, so the one written here loads at any TP/PP/EP
layout the model divides into; --tp/--pp/--ep check that layout before anything is written. A
model too large for one process converts under torchrun, each rank reading only its shard:

    torchrun --nproc-per-node 8 tools/convert_checkpoint.py hf-to-megatron /ckpt/big /ckpt/big-mcore --tp 2 --ep 4

Tensors are streamed: the converter holds the model once plus one layer / one output shard.
Errors (unknown architecture, missing tensor, shape mismatch, unusable dtype) print one line
naming the tensor and exit with status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import warnings
from pathlib import Path
from typing import List, Optional

_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMG]?B)?$", re.IGNORECASE)
_UNITS = {None: 1, "B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30}


def parse_size(text: str) -> int:
    """'5GB' / '500MB' / '1024' -> bytes."""
    match = _SIZE.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; e.g. 5GB, 500MB")
    unit = match.group(2).upper() if match.group(2) else None
    return int(float(match.group(1)) * _UNITS[unit])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="convert_checkpoint", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="direction", required=True)
    h2m = sub.add_parser("hf-to-megatron", help="HF safetensors directory -> Megatron dist checkpoint")
    m2h = sub.add_parser("megatron-to-hf", help="Megatron dist checkpoint -> HF directory")
    m2m = sub.add_parser("megatron-to-megatron", help="Megatron dist checkpoint -> Megatron dist checkpoint")
    for p in (h2m, m2h, m2m):
        p.add_argument("src", type=Path)
        p.add_argument("out", type=Path)
        p.add_argument("--dtype", choices=("fp32", "bf16") if p is not m2h else ("fp32", "bf16", "fp16"),
                       help="weights' dtype in the output (default: the source's)")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
        p.add_argument("-v", "--verbose", action="store_true",
                       help="show library warnings (Megatron's 'TransformerEngine not installed' etc.) and info logs")
    for p in (h2m, m2m):
        p.add_argument("--tp", type=int, default=1, help="target tensor-parallel size to check the model against")
        p.add_argument("--pp", type=int, default=1, help="target pipeline-parallel size to check against")
        p.add_argument("--ep", type=int, default=1, help="target expert-parallel size to check against")
    m2h.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"),
                     help="largest safetensors shard (default 5GB)")
    m2h.add_argument("--tokenizer", type=Path, help="copy tokenizer files from this directory (default: those "
                     "saved beside the checkpoint, else the run directory's for a run's checkpoints/step_N)")
    return parser


class _Bar:
    """A rich progress bar fed by the converters' (total, advance) callbacks; silent if disabled."""

    def __init__(self, label: str, enabled: bool):
        self.progress = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            self.task = self.progress.add_task(label, total=None)

    def __enter__(self) -> "_Bar":
        if self.progress:
            self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.progress:
            self.progress.stop()

    def total(self, n: int) -> None:
        if self.progress:
            self.progress.update(self.task, total=n)

    def advance(self, n: int) -> None:
        if self.progress:
            self.progress.advance(self.task, n)


def _init_parallel(args: argparse.Namespace) -> bool:
    """One process: a one-rank Megatron state. Under torchrun (hf-to-megatron only): the state at
    --tp/--pp/--ep, whose product must be the world size. Returns whether this rank shows progress."""
    from megatron_rl.learner.parallel import init_model_parallel
    from megatron_rl.models.hf_checkpoint import ConversionError

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        init_model_parallel(1, 1, 1, seed=0)
        return True
    layout = (getattr(args, "tp", 1), getattr(args, "pp", 1), getattr(args, "ep", 1))
    if args.direction != "hf-to-megatron" or layout[0] * layout[1] * layout[2] != world:
        raise ConversionError(f"under torchrun only hf-to-megatron runs, with --tp x --pp x --ep = WORLD_SIZE "
                              f"({world}); got {args.direction} at tp/pp/ep={layout}")
    init_model_parallel(*layout, seed=0)
    return int(os.environ.get("RANK", "0")) == 0


def run(args: argparse.Namespace) -> Path:
    from megatron_rl.models import convert

    show = _init_parallel(args)
    with _Bar(args.direction, show and not args.no_progress and sys.stderr.isatty()) as bar:
        if args.direction == "hf-to-megatron":
            return convert.hf_to_megatron_checkpoint(args.src, args.out, args.dtype, (args.tp, args.pp, args.ep),
                                                     progress=bar.advance, total=bar.total)
        if args.direction == "megatron-to-hf":
            return convert.megatron_to_hf_checkpoint(args.src, args.out, args.dtype, args.max_shard_size,
                                                     args.tokenizer, progress=bar.advance, total=bar.total)
        cfg, vocab, _ = convert.read_model_config(args.src)
        convert.check_layout(cfg, vocab, args.tp, args.pp, args.ep)
        return convert.megatron_to_megatron_checkpoint(args.src, args.out, args.dtype)


def main(argv: Optional[List[str]] = None) -> int:
    from megatron_rl.errors import UserError, report

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="convert_checkpoint: %(message)s")
    if not args.verbose:
        # Megatron and torch.distributed.checkpoint warn about optional kernels and deprecations on
        # every run; none of it concerns the conversion, and it buries the progress bar.
        warnings.filterwarnings("ignore")
    try:
        out = run(args)
    except (UserError, FileNotFoundError) as err:  # ConversionError, UnsupportedConfigError among them
        return report(err, "convert_checkpoint")
    print(f"convert_checkpoint: wrote {out}")
    return 0


if __name__ == "__main__":  # dist_checkpointing's save starts worker processes: keep the guard
    from megatron_rl.lifetime import skip_final_gc

    skip_final_gc()  # first: its atexit handler must run last
    sys.exit(main())
