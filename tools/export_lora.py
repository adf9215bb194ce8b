"""Export a LoRA run's adapters as a Hugging Face PEFT directory (adapter_config.json +
adapter_model.safetensors) that ``peft.PeftModel.from_pretrained`` loads onto the HF base model.

    # the adapters of step 700; the adapter config names the run's HF model.path as its base
    python tools/export_lora.py runs/x/checkpoints/step_700 /ckpt/x-adapter
    # also write the frozen base as an HF directory (a run without an HF model.path needs it)
    python tools/export_lora.py runs/x/checkpoints/step_700 /ckpt/x-adapter --base-out /ckpt/x-base

Then in Python: ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)``.
The fused q/k/v and gate/up adapters become PEFT's per-projection ones (the same A, B's rows
split). A full model with the adapters merged: tools/merge_lora.py. Errors print one line and
exit with status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path
from typing import List, Optional


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="export_lora", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a LoRA run's checkpoint (run_dir/checkpoints/step_N)")
    parser.add_argument("out", type=Path, help="the PEFT directory to write (new or empty)")
    parser.add_argument("--base-out", type=Path, help="also write the frozen base model as an HF directory here")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer files for --base-out (default: the run's)")
    parser.add_argument("-v", "--verbose", action="store_true", help="show library warnings and info logs")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    from megatron_rl.errors import UserError, report

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="export_lora: %(message)s")
    if not args.verbose:
        warnings.filterwarnings("ignore")  # Megatron's optional-kernel notices: nothing about the export
    try:
        from megatron_rl.learner.parallel import init_model_parallel
        from megatron_rl.models.lora_checkpoint import export_peft

        init_model_parallel(1, 1, 1, seed=0)
        out = export_peft(args.checkpoint, args.out, args.base_out, args.tokenizer)
    except (UserError, FileNotFoundError) as err:
        return report(err, "export_lora")
    print(f"export_lora: wrote {out}" + (f" and {args.base_out}" if args.base_out else ""))
    return 0


if __name__ == "__main__":
    from megatron_rl.lifetime import skip_final_gc

    skip_final_gc()  # first: its atexit handler must run last
    sys.exit(main())
