"""Write a full Hugging Face checkpoint with LoRA adapters merged in: each adapted weight becomes
``W + (alpha / rank)·B·A``, computed in fp32 and written in the model's dtype (or --dtype).

    # a LoRA run's checkpoint (its frozen base and its adapters)
    python tools/merge_lora.py runs/x/checkpoints/step_700 /ckpt/x-merged
    # an HF base directory and a PEFT adapter directory (ours, or any PEFT LoRA adapter)
    python tools/merge_lora.py /ckpt/Qwen3-8B /ckpt/x-merged --adapter /ckpt/x-adapter --dtype fp32

The result loads in transformers (and vLLM) as a plain model. Errors print one line and exit
with status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path
from typing import List, Optional


def build_parser() -> argparse.ArgumentParser:
    from convert_checkpoint import parse_size

    parser = argparse.ArgumentParser(prog="merge_lora", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="a LoRA run's checkpoint (run_dir/checkpoints/step_N), or with "
                        "--adapter an HF base directory")
    parser.add_argument("out", type=Path, help="the HF directory to write (new or empty)")
    parser.add_argument("--adapter", type=Path, help="a PEFT LoRA directory to merge into the HF base at src")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="weights' dtype in the output "
                        "(default: the model's)")
    parser.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"),
                        help="largest safetensors shard (default 5GB)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer files (default: the run's, or the base's)")
    parser.add_argument("-v", "--verbose", action="store_true", help="show library warnings and info logs")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    from megatron_rl.errors import UserError, report

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="merge_lora: %(message)s")
    if not args.verbose:
        warnings.filterwarnings("ignore")  # Megatron's optional-kernel notices: nothing about the merge
    try:
        from megatron_rl.models import lora_checkpoint

        if args.adapter is not None:
            out = lora_checkpoint.merge_peft(args.src, args.adapter, args.out, args.dtype, args.max_shard_size,
                                             args.tokenizer)
        else:
            from megatron_rl.learner.parallel import init_model_parallel

            init_model_parallel(1, 1, 1, seed=0)
            out = lora_checkpoint.merge_checkpoint(args.src, args.out, args.dtype, args.max_shard_size,
                                                   args.tokenizer)
    except (UserError, FileNotFoundError) as err:
        return report(err, "merge_lora")
    print(f"merge_lora: wrote {out}")
    return 0


if __name__ == "__main__":
    from megatron_rl.lifetime import skip_final_gc

    skip_final_gc()  # first: its atexit handler must run last
    sys.exit(main())
