"""Score a checkpoint on GSM8K test and MATH-500: ``python -m megatron_rl.eval model.path=CKPT``.

The checkpoint (a Hugging Face directory or a Megatron checkpoint, as ``model.path`` takes) is
loaded the way the trainer loads it and served by the configured engine; each problem gets
``--samples`` responses, each scored by its dataset's reward (GSM8K: the number after '####';
MATH-500: math-verify equivalence of the last \\boxed{} answer). Reports pass@1 and pass@k with
the unbiased estimator of Chen et al. (2021): for n samples of which c are right,
pass@k = 1 - C(n-c, k) / C(n, k), averaged over problems. Prints a table and writes a JSON report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import sys
import tempfile
from dataclasses import dataclass
from math import comb
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

logger = logging.getLogger(__name__)

# shared/data beside the repository (a clone), or one level up (a git worktree under a folder).
_REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = next((p / "shared" / "data" for p in (_REPO.parent, _REPO.parent.parent)
                    if (p / "shared" / "data").is_dir()), _REPO.parent / "shared" / "data")


@dataclass(frozen=True)
class EvalSet:
    name: str
    # Dataset format for the loader (data.name) and the prompt template that asks for its answer form.
    data_name: str
    template: str
    reward: str
    default_path: Path


EVAL_SETS = {
    "gsm8k": EvalSet("gsm8k", "gsm8k", "qa", "gsm8k", SHARED_DATA / "gsm8k" / "test.jsonl"),
    "math500": EvalSet("math500", "math500", "math", "math", SHARED_DATA / "math500" / "test.jsonl"),
}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` right among ``n`` samples (k <= n)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def parse_args(argv: Sequence[str]) -> tuple:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_rl.eval",
        description="pass@1 / pass@k of a checkpoint on GSM8K test and MATH-500; other arguments are "
                    "config overrides (model.path=..., rollout.max_new_tokens=..., rollout.temperature=...)")
    parser.add_argument("--datasets", default="gsm8k,math500", help="comma-separated: gsm8k, math500")
    parser.add_argument("--limit", type=int, default=0, help="first N problems of each set (0: all)")
    parser.add_argument("--samples", type=int, default=1, help="responses per problem (n)")
    parser.add_argument("--k", type=int, default=None, help="pass@k to report besides pass@1 (default: --samples)")
    parser.add_argument("--report", type=Path, default=None, help="JSON report path (default: <trainer.run_dir>/eval.json, else eval.json in the current directory)")
    parser.add_argument("--gsm8k", type=Path, default=None, help="GSM8K test JSONL (default: shared/data)")
    parser.add_argument("--math500", type=Path, default=None, help="MATH-500 JSONL (default: shared/data)")
    parser.add_argument("--recipe", default="tiny_cpu", help="recipe whose settings the overrides start from")
    parser.add_argument("--batch", type=int, default=16, help="problems generated at once")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_known_args(list(argv))


def _build_trainer(recipe: str, overrides: List[str], first: EvalSet, first_path: Path, run_dir: str):
    from .config import ConfigError, load_config
    from .config.validate import validate
    from .trainer import Trainer

    cfg = load_config(recipe, [f"data.name={first.data_name}", f"data.path={first_path}", f"data.template={first.template}",
                               "trainer.progress=false", "trainer.save_final_checkpoint=false", "trainer.resume=false",
                               f"trainer.run_dir={run_dir}", "scheduler.max_staleness=0", *overrides])
    if not cfg.model.path:
        raise ConfigError("model.path is required: the checkpoint to score (a Hugging Face directory or a Megatron "
                          "checkpoint), e.g. model.path=/ckpt/qwen2-1.5b")
    return Trainer(validate(cfg))


async def _evaluate_set(trainer, spec: EvalSet, path: Path, limit: int, samples: int, k: int, batch: int,
                        progress) -> Dict:
    from .data.datasets import JsonlPrompts, prompt_key
    from .rewards import REWARDS, RewardRunner
    from .rollout.workflow import generate_groups

    cfg = trainer.cfg
    prompts = JsonlPrompts(str(path), trainer.tokenizer, prompt_key(spec.data_name, None), "answer", spec.template,
                           cfg.data.max_prompt_tokens, cfg.trainer.seed, shuffle=False,
                           gsm8k=spec.data_name == "gsm8k").prompts
    if limit:
        prompts = prompts[:limit]
    runner = RewardRunner(REWARDS[spec.reward], cfg.reward.workers, cfg.reward.timeout_s, name=f"reward {spec.reward}")
    task = progress.add_task(spec.name, total=len(prompts)) if progress else None
    rows: List[Dict] = []
    try:
        for start in range(0, len(prompts), batch):
            chunk = prompts[start:start + batch]
            groups = await generate_groups(trainer.engine, [(p, samples) for p in chunk], trainer.params,
                                           tag=f"eval-{spec.name}")
            for prompt, group in zip(chunk, groups):
                texts = [trainer.tokenizer.decode_response(t.response_ids) for t in group]
                scores = await runner.score_many([(text, prompt.target) for text in texts])
                right = sum(s >= 1.0 for s in scores)
                rows.append({"uid": prompt.uid, "target": prompt.target, "correct": right, "samples": len(scores),
                             "response": texts[0][:2000]})
            if progress:
                progress.advance(task, len(chunk))
    finally:
        runner.close()
    n = len(rows)
    result = {"problems": n, "samples": samples,
              "pass@1": sum(pass_at_k(samples, r["correct"], 1) for r in rows) / n if n else 0.0,
              f"pass@{k}": sum(pass_at_k(samples, r["correct"], k) for r in rows) / n if n else 0.0,
              "reward_errors": runner.counts["error"], "reward_timeouts": runner.counts["timeout"], "rows": rows}
    return result


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
    from .config import ConfigError

    args, overrides = parse_args(argv)
    names = [n.strip() for n in args.datasets.split(",") if n.strip()]
    unknown = [n for n in names if n not in EVAL_SETS]
    if unknown or not names:
        raise ConfigError(f"--datasets={args.datasets!r}: unknown {', '.join(unknown) or 'none given'}; "
                          f"choose from {', '.join(EVAL_SETS)}")
    k = args.k or args.samples
    if args.samples < 1 or not 1 <= k <= args.samples:
        raise ConfigError(f"--k={k} must be between 1 and --samples={args.samples} (pass@k needs k <= n samples)")
    paths = {n: getattr(args, n) or EVAL_SETS[n].default_path for n in names}
    for name, path in paths.items():
        if not Path(path).is_file():
            raise ConfigError(f"--{name}={str(path)!r}: file not found; pass --{name}=<jsonl>")
    # The trainer needs a run directory for its logs and metrics: the one given, else a temporary one
    # that is removed at the end (the report then goes to the current directory).
    given_run_dir = next((o.split("=", 1)[1] for o in overrides if o.startswith("trainer.run_dir=")), None)
    run_dir = given_run_dir or tempfile.mkdtemp(prefix="megatron_rl_eval_")
    out = args.report or (Path(given_run_dir) / "eval.json" if given_run_dir else Path("eval.json"))
    try:
        return _run(args, overrides, names, paths, k, run_dir, out)
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


def _run(args, overrides: List[str], names: List[str], paths: Dict, k: int, run_dir: str, out: Path) -> Dict:
    trainer = _build_trainer(args.recipe, overrides, EVAL_SETS[names[0]], paths[names[0]], run_dir)
    progress = None
    if not args.no_progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            transient=False)

    async def run() -> Dict[str, Dict]:
        await trainer.sync_weights()  # the engine serves the checkpoint's weights, as loaded by the learner
        try:
            return {name: await _evaluate_set(trainer, EVAL_SETS[name], Path(paths[name]), args.limit, args.samples,
                                              k, args.batch, progress) for name in names}
        finally:
            await trainer.engine.shutdown()

    try:
        if progress:
            progress.start()
        results = asyncio.run(run())
    finally:
        if progress:
            progress.stop()
        for closable in (trainer.learners, trainer.metrics, trainer.timeline, trainer.samples, trainer.rewards):
            closable.close()
        trainer.learner_executor.shutdown(wait=True)
    cfg = trainer.cfg
    report = {"model_path": cfg.model.path, "samples": args.samples, "k": k,
              "sampling": {"temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p,
                           "max_new_tokens": cfg.rollout.max_new_tokens},
              "datasets": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(_table(results, k))
    print(f"report: {out}")
    return report


def main(argv: Optional[List[str]] = None) -> int:
    from .main import run_guarded

    argv = sys.argv[1:] if argv is None else argv
    return run_guarded(lambda: (evaluate(argv), None)[1], prog="megatron_rl.eval")


if __name__ == "__main__":
    sys.exit(main())
