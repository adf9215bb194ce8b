"""Score a checkpoint: ``python -m megatron_rl.eval [recipe=NAME] model.path=CKPT [key=value ...]``.

The config is composed as for training (a recipe and overrides), so eval takes any dataset,
template, tokenizer and reward that training takes; the eval's own keys are ``eval.*`` (the
flags ``--datasets``, ``--limit``, ``--samples``, ``--k``, ``--batch``, ``--gsm8k``, ``--math500``
set them too). The sets (``eval.datasets``):

- ``data``: the config's dataset (``data.name``, ``data.template``, ``data.prompt_key``, ...) read
  from ``data.eval_path`` (the CLI falls back to ``data.path``), scored by the config's reward
  (``reward.name`` or ``reward.fn``); a synthetic digit task draws ``eval.limit`` fresh prompts,
  ``arithmetic`` draws them from its held-out split;
- ``gsm8k``: GSM8K test, the ``qa`` template and the ``gsm8k`` reward;
- ``math500``: MATH-500, the ``math`` template and the ``math`` reward (math-verify).

Prompts go through the tokenizer's chat template when it has one (``data.apply_chat_template``).
The checkpoint (a Hugging Face directory or a Megatron checkpoint; ``--random-init``: none, the
recipe's model as a run from scratch initialises it, a baseline) is loaded the way the trainer
loads it and served by the configured engine; each problem gets ``eval.samples`` responses, right
when their reward is >= 1. Reports pass@1 and pass@k with the unbiased estimator of Chen et al.
(2021): for n samples of which c are right, pass@k = 1 - C(n-c, k) / C(n, k), averaged over
problems. Prints a table and writes a JSON report.

``EvalSuite`` (eval_sets.py) is the part the trainer shares: ``trainer.eval_interval`` scores the same sets
with the trainer's own engine every N steps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .eval_sets import EvalSuite

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------- the command line
USAGE_DESCRIPTION = ("pass@1 / pass@k of a checkpoint on the eval sets (eval.datasets: data, gsm8k, math500; "
                     "default gsm8k,math500); other arguments are config overrides as for training "
                     "(recipe=NAME, model.path=..., data.*, reward.*, rollout.max_new_tokens=..., eval.*)")
# Flags kept as short names of eval.* keys.
FLAG_KEYS = {"datasets": "eval.datasets", "limit": "eval.limit", "samples": "eval.samples", "k": "eval.k",
             "batch": "eval.batch", "gsm8k": "eval.gsm8k_path", "math500": "eval.math500_path"}


def parse_args(argv: Sequence[str]) -> tuple:
    parser = argparse.ArgumentParser(prog="python -m megatron_rl.eval", description=USAGE_DESCRIPTION)
    parser.add_argument("--datasets", default=None, help="comma-separated: data, gsm8k, math500 (eval.datasets)")
    parser.add_argument("--limit", type=int, default=None, help="first N problems of each set, 0: all (eval.limit)")
    parser.add_argument("--samples", type=int, default=None, help="responses per problem, n (eval.samples)")
    parser.add_argument("--k", type=int, default=None, help="pass@k besides pass@1 (eval.k; default: n)")
    parser.add_argument("--report", type=Path, default=None,
                        help="JSON report path (default: <trainer.run_dir>/eval.json, else eval.json in the current "
                             "directory)")
    parser.add_argument("--gsm8k", type=Path, default=None, help="GSM8K test JSONL (eval.gsm8k_path)")
    parser.add_argument("--math500", type=Path, default=None, help="MATH-500 JSONL (eval.math500_path)")
    parser.add_argument("--recipe", default=None, help="recipe the overrides start from (as recipe=NAME; tiny_cpu)")
    parser.add_argument("--batch", type=int, default=None, help="problems generated at once (eval.batch)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--random-init", action="store_true",
                        help="score the recipe's randomly initialised model instead of a model.path (the weights a "
                             "run from scratch with this trainer.seed starts from): the baseline before training")
    args, rest = parser.parse_known_args(list(argv))
    recipe = args.recipe or "tiny_cpu"
    overrides: List[str] = []
    for arg in rest:
        if arg.startswith("recipe="):
            recipe = arg.split("=", 1)[1]
        else:
            overrides.append(arg)
    for flag, key in FLAG_KEYS.items():
        value = getattr(args, flag)
        if value is not None:
            value = f"[{value}]" if flag == "datasets" else value
            overrides.append(f"{key}={value}")
    if not any(o.startswith("eval.datasets=") for o in overrides):
        overrides.append("eval.datasets=[gsm8k,math500]")
    return args, recipe, overrides


def _given(overrides: Sequence[str], key: str) -> bool:
    return any(o.lstrip("+").partition("=")[0] == key for o in overrides)


def load_eval_config(recipe: str, overrides: List[str], run_dir: str, random_init: bool = False):
    """The config composed as training composes it, with what an eval needs: no training state
    written, synchronous, the given run directory; checked for the eval (``eval.*``) and for a
    tokenizer that can read the checkpoint's tokens. ``random_init``: no checkpoint, the recipe's
    model as a run from scratch initialises it."""
    from .checks import load_config, validate_eval
    from .errors import ConfigError

    cfg = load_config(recipe, ["trainer.progress=false", "trainer.save_final_checkpoint=false", "trainer.resume=false",
                               f"trainer.run_dir={run_dir}", "scheduler.max_staleness=0", "trainer.eval_interval=0",
                               *overrides])
    validate_eval(cfg, held_out=False)
    if random_init:
        if cfg.model.path:
            raise ConfigError(f"--random-init scores a randomly initialised model, and model.path={cfg.model.path!r} "
                              "names a checkpoint: drop one of them")
        return cfg
    if not cfg.model.path:
        raise ConfigError("model.path is required: the checkpoint to score (a Hugging Face directory or a Megatron "
                          "checkpoint), e.g. model.path=/ckpt/qwen2-1.5b")
    if cfg.data.tokenizer != "model" and not _given(overrides, "data.tokenizer"):
        raise ConfigError(f"model.path={cfg.model.path!r} has no tokenizer (tokenizer.json), so the tokens it was "
                          "trained with are unknown: set data.tokenizer_path=<the directory of its tokenizer>, or "
                          "data.tokenizer=bpe|char to score through one built here from the config's data")
    return cfg


def _table(results: Dict[str, Dict], k: int) -> str:
    headers = ["dataset", "problems", "samples", "pass@1"] + ([f"pass@{k}"] if k != 1 else [])
    lines = [headers] + [[name, str(r["problems"]), str(r["samples"]), f"{r['pass@1']:.4f}"]
                         + ([f"{r[f'pass@{k}']:.4f}"] if k != 1 else []) for name, r in results.items()]
    widths = [max(len(row[i]) for row in lines) for i in range(len(headers))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt.format(*lines[0]), rule] + [fmt.format(*row) for row in lines[1:]])


def evaluate(argv: Sequence[str]) -> Dict:
    """Run the evaluation the arguments ask for; returns the report (also written as JSON)."""
    args, recipe, overrides = parse_args(argv)
    # The trainer needs a run directory for its logs and metrics: the one given, else a temporary one
    # that is removed at the end (the report then goes to the current directory).
    given_run_dir = next((o.split("=", 1)[1] for o in overrides if o.startswith("trainer.run_dir=")), None)
    run_dir = given_run_dir or tempfile.mkdtemp(prefix="megatron_rl_eval_")
    out = args.report or (Path(given_run_dir) / "eval.json" if given_run_dir else Path("eval.json"))
    try:
        return _run(args, load_eval_config(recipe, overrides, run_dir, args.random_init), out)
    finally:
        if not given_run_dir:
            _remove_run_dir(Path(run_dir))


def _remove_run_dir(run_dir: Path) -> None:
    """Close the log file the trainer opened in ``run_dir``, then remove the directory."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).is_relative_to(run_dir.resolve()):
            root.removeHandler(handler)
            handler.close()
    shutil.rmtree(run_dir, ignore_errors=True)


def _run(args, cfg, out: Path) -> Dict:
    from .build import build, one_process_plan, open_run

    # The same run context and components as a training run: the learner loads the checkpoint
    # and its weights reach the engine through the run's weight transport.
    context, device_index = open_run(cfg)
    parts = build(cfg, one_process_plan(cfg), context, device_index=device_index)
    suite = None
    progress = None
    if not args.no_progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            transient=False)

    async def run() -> Dict[str, Dict]:
        await parts.transport.push(0)  # the engine serves the checkpoint's weights, as loaded by the learner
        try:
            return await suite.score(parts.engine, progress=progress)
        finally:
            await parts.engine.shutdown()

    finished = False
    try:
        suite = EvalSuite(cfg, parts.tokenizer, fallback_to_train_data=True)
        if progress:
            progress.start()
        results = asyncio.run(run())
        finished = True
    finally:
        if progress:
            progress.stop()
        if suite is not None:
            suite.close()
        parts.close(finished)
        context.close(finished)
    report = {"model_path": cfg.model.path, "tokenizer": cfg.data.tokenizer, "samples": suite.samples, "k": suite.k,
              "chat_template": parts.tokenizer.chat_template is not None,
              "sampling": {"temperature": suite.params.temperature, "top_p": cfg.rollout.top_p,
                           "max_new_tokens": cfg.rollout.max_new_tokens},
              "datasets": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(_table(results, suite.k))
    print(f"report: {out}")
    return report


def main(argv: Optional[List[str]] = None) -> int:
    from .main import run_guarded

    argv = sys.argv[1:] if argv is None else argv
    return run_guarded(lambda: (evaluate(argv), None)[1], prog="megatron_rl.eval")


if __name__ == "__main__":
    from megatron_rl.lifetime import skip_final_gc

    skip_final_gc()  # first: its atexit handler must run last
    sys.exit(main())
