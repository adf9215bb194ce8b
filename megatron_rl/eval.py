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

``EvalSuite`` is the part the trainer shares: ``trainer.eval_interval`` scores the same sets
with the trainer's own engine every N steps.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import shutil
import sys
import tempfile
from dataclasses import dataclass
from math import comb
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

logger = logging.getLogger(__name__)

# shared/data beside the repository (a clone), or one level up (a git worktree under a folder).
_REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = next((p / "shared" / "data" for p in (_REPO.parent, _REPO.parent.parent)
                    if (p / "shared" / "data").is_dir()), _REPO.parent / "shared" / "data")
# A synthetic task's eval prompts come from the run's seed plus this, not from its training stream.
EVAL_SEED_OFFSET = 7919


@dataclass(frozen=True)
class BuiltinSet:
    # Dataset format for the loader (data.name) and the prompt template that asks for its answer form.
    data_name: str
    template: str
    reward: str
    default_path: Path
    path_key: str


BUILTIN_SETS = {
    "gsm8k": BuiltinSet("gsm8k", "qa", "gsm8k", SHARED_DATA / "gsm8k" / "test.jsonl", "eval.gsm8k_path"),
    "math500": BuiltinSet("math500", "math", "math", SHARED_DATA / "math500" / "test.jsonl", "eval.math500_path"),
}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` right among ``n`` samples (k <= n)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


@dataclass
class EvalSet:
    """One set's problems, tokenized, and the reward that judges their responses."""
    name: str
    prompts: List[Any]
    reward_fn: Callable
    reward_label: str


def _chat_for_builtin(cfg, tokenizer) -> bool:
    """GSM8K and MATH-500 go through the chat template when the tokenizer has one, unless
    data.apply_chat_template=false."""
    return cfg.data.apply_chat_template is not False and tokenizer.chat_template is not None


def build_eval_sets(cfg, tokenizer, fallback_to_train_data: bool = False) -> List[EvalSet]:
    """The sets ``eval.datasets`` names, tokenized with the run's tokenizer. ``fallback_to_train_data``:
    the ``data`` set reads ``data.path`` when ``data.eval_path`` is unset (the CLI scores whatever
    file it is given; validation during training needs a held-out one)."""
    from .data.build import DIGIT_TASKS, arithmetic_task, wraps_in_chat
    from .data.datasets import PROMPT_KEYS, DatasetError, DigitTask, JsonlPrompts, prompt_key
    from .rewards import REWARDS
    from .rewards.user import build_reward

    e, d = cfg.eval, cfg.data
    sets: List[EvalSet] = []
    for name in e.datasets:
        if name == "data":
            fn, label = build_reward(cfg.reward)
            if d.name == "arithmetic":  # drawn as training draws, from the held-out split
                task = arithmetic_task(cfg, tokenizer, cfg.trainer.seed + EVAL_SEED_OFFSET, "eval")
                prompts = list(itertools.islice(task, e.limit))
            elif d.name in DIGIT_TASKS:
                task = DigitTask(d.name, tokenizer, d.digits, d.min_digits, d.max_digits,
                                 cfg.trainer.seed + EVAL_SEED_OFFSET, distinct=d.distinct_digits,
                                 length_tail=d.length_tail)
                prompts = list(itertools.islice(task, e.limit))
            else:
                path = d.eval_path or (d.path if fallback_to_train_data else None)
                if path is None:
                    raise DatasetError("eval.datasets=[data] needs data.eval_path=<jsonl> (a held-out set in "
                                       f"data.name={d.name}'s format)")
                prompts = JsonlPrompts(path, tokenizer, d.prompt_key, d.answer_key, d.template,
                                       d.max_prompt_tokens, cfg.trainer.seed, shuffle=False, gsm8k=d.name == "gsm8k",
                                       system_key=d.system_key, system_prompt=d.system_prompt, split=d.split,
                                       default_prompt_key=PROMPT_KEYS.get(d.name, "question"),
                                       chat=wraps_in_chat(cfg, tokenizer)).prompts
        else:
            spec = BUILTIN_SETS[name]
            path = getattr(e, f"{name}_path") or spec.default_path
            if not Path(path).is_file():
                raise DatasetError(f"{spec.path_key}={str(path)!r}: file not found; set {spec.path_key}=<jsonl>")
            prompts = JsonlPrompts(str(path), tokenizer, prompt_key(spec.data_name, None), "answer", spec.template,
                                   d.max_prompt_tokens, cfg.trainer.seed, shuffle=False,
                                   gsm8k=spec.data_name == "gsm8k", chat=_chat_for_builtin(cfg, tokenizer)).prompts
            fn, label = REWARDS[spec.reward], f"reward {spec.reward}"
        if e.limit:
            prompts = prompts[:e.limit]
        sets.append(EvalSet(name, prompts, fn, label))
    return sets


class EvalSuite:
    """The eval sets of a config and the reward workers that judge them (started at the first
    score, kept until ``close``). ``score`` generates with any engine: the CLI's, or the
    trainer's between steps."""

    def __init__(self, cfg, tokenizer, fallback_to_train_data: bool = False):
        from .types import SamplingParams

        self.cfg, self.tokenizer = cfg, tokenizer
        self.sets = build_eval_sets(cfg, tokenizer, fallback_to_train_data)
        e, r = cfg.eval, cfg.rollout
        self.samples = e.samples
        self.k = e.k or e.samples
        # Every eval request samples from its own stream keyed by the run's seed and its id: the
        # scores do not depend on what else the engine runs, and the engine's own stream (the
        # training rollouts') is not drawn from.
        self.params = SamplingParams(e.temperature or r.temperature, r.top_p, r.top_k, r.max_new_tokens,
                                     stop_token_ids=tokenizer.stop_ids, stream=False, seed=cfg.trainer.seed)
        self._runners: Dict[str, Any] = {}

    def _runner(self, eval_set: EvalSet):
        from .rewards import RewardRunner

        if eval_set.name not in self._runners:
            rc = self.cfg.reward
            self._runners[eval_set.name] = RewardRunner(eval_set.reward_fn, rc.workers, rc.timeout_s,
                                                        name=f"eval {eval_set.name}: {eval_set.reward_label}")
        return self._runners[eval_set.name]

    async def score_set(self, engine, eval_set: EvalSet, tag: str, progress=None) -> Dict[str, Any]:
        """pass@1, pass@k and the mean reward of one set, with one row per problem."""
        from .rollout.workflow import generate_groups

        runner = self._runner(eval_set)
        errors, timeouts = runner.counts["error"], runner.counts["timeout"]
        task = progress.add_task(eval_set.name, total=len(eval_set.prompts)) if progress else None
        rows: List[Dict] = []
        batch = self.cfg.eval.batch
        for start in range(0, len(eval_set.prompts), batch):
            chunk = eval_set.prompts[start:start + batch]
            groups = await generate_groups(engine, [(p, self.samples) for p in chunk], self.params,
                                           tag=f"{tag}-{eval_set.name}")
            texts = [[self.tokenizer.decode_response(t.response_ids) for t in group] for group in groups]
            scored = await asyncio.gather(*(runner.score_many([(text, p.target) for text in group_texts])
                                            for p, group_texts in zip(chunk, texts)))
            for prompt, group_texts, scores in zip(chunk, texts, scored):
                rows.append({"uid": prompt.uid, "target": prompt.target, "correct": sum(s >= 1.0 for s in scores),
                             "samples": len(scores), "reward": sum(scores) / len(scores),
                             "response": group_texts[0][:2000]})
            if progress:
                progress.advance(task, len(chunk))
        n = len(rows)
        mean = (lambda f: sum(f(r) for r in rows) / n) if n else (lambda f: 0.0)
        return {"problems": n, "samples": self.samples,
                "pass@1": mean(lambda r: pass_at_k(self.samples, r["correct"], 1)),
                f"pass@{self.k}": mean(lambda r: pass_at_k(self.samples, r["correct"], self.k)),
                "reward_mean": mean(lambda r: r["reward"]),
                "reward_errors": runner.counts["error"] - errors, "reward_timeouts": runner.counts["timeout"] - timeouts,
                "rows": rows}

    async def score(self, engine, tag: str = "eval", progress=None) -> Dict[str, Dict[str, Any]]:
        """Every set, one after the other: set name -> its result."""
        return {s.name: await self.score_set(engine, s, tag, progress) for s in self.sets}

    def metrics(self, results: Dict[str, Dict[str, Any]]) -> Dict[str, float]:
        """``eval/<set>/pass@1`` (pass@k, reward_mean) per set, and ``eval/pass@1`` (pass@k) as
        the mean over the sets, for metrics.jsonl and TensorBoard."""
        keys = ["pass@1"] + ([f"pass@{self.k}"] if self.k != 1 else [])
        out = {f"eval/{name}/{key}": float(r[key]) for name, r in results.items() for key in keys + ["reward_mean"]}
        out.update({f"eval/{key}": sum(float(r[key]) for r in results.values()) / len(results) for key in keys})
        return out

    def close(self) -> None:
        for runner in self._runners.values():
            runner.close()
        self._runners.clear()


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
    from .config import ConfigError, load_config
    from .config.validate import validate_eval

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
    from .trainer import Trainer

    trainer = Trainer(cfg)
    suite = None
    progress = None
    if not args.no_progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            transient=False)

    async def run() -> Dict[str, Dict]:
        await trainer.sync_weights()  # the engine serves the checkpoint's weights, as loaded by the learner
        try:
            return await suite.score(trainer.engine, progress=progress)
        finally:
            await trainer.engine.shutdown()

    try:
        suite = EvalSuite(cfg, trainer.tokenizer, fallback_to_train_data=True)
        if progress:
            progress.start()
        results = asyncio.run(run())
    finally:
        if progress:
            progress.stop()
        if suite is not None:
            suite.close()
        for closable in (trainer.learners, trainer.metrics, trainer.timeline, trainer.samples, trainer.rewards):
            closable.close()
        trainer.learner_executor.shutdown(wait=True)
    report = {"model_path": cfg.model.path, "tokenizer": cfg.data.tokenizer, "samples": suite.samples, "k": suite.k,
              "chat_template": trainer.tokenizer.chat_template is not None,
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
