"""The eval sets of a config and the suite that scores them with any engine.

``EvalSuite`` is what the trainer (``trainer.eval_interval``, every N steps with its own engine)
and the command line (``python -m megatron_rl.eval``, eval.py) share: the sets of ``eval.datasets``
(``data``: the config's dataset; ``gsm8k``; ``math500``), their rewards, pass@1 and pass@k with the
unbiased estimator of Chen et al. (2021).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from math import comb
from pathlib import Path
from typing import Any, Callable, Dict, List

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
