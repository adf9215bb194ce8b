"""The arithmetic demo: a model trained from scratch by SFT on worked solutions, then by GRPO with
the math reward, with held-out pass@1 / pass@k before SFT, after SFT and after RL.

    .venv/bin/python tools/arithmetic_demo.py                       # CPU recipes, a few minutes
    .venv/bin/python tools/arithmetic_demo.py --size gpu            # the H200 pair
    .venv/bin/python tools/arithmetic_demo.py --sft-steps 100 --rl-steps 20 model.num_layers=2

Three processes, each the project's own command: ``python -m megatron_rl.eval --random-init`` (the
model an SFT run starts from), the SFT run (``recipe=arithmetic_sft_<size>``), and the RL run from
its last checkpoint (``recipe=arithmetic_rl_<size> model.path=<sft>/checkpoints/step_N``). Each
run scores the held-out split with ``trainer.eval_interval`` at its last step. All three use the
same seed, so they score the same problems. Other arguments are config overrides for all three
(the RL run takes the model's shape from the checkpoint). Prints a table and writes it as JSON
(``arithmetic_demo.json`` in the run directory).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence

PROJECT = Path(__file__).resolve().parents[1]
REPORT = "arithmetic_demo.json"


def parse_args(argv: Sequence[str]) -> tuple:
    parser = argparse.ArgumentParser(prog="tools/arithmetic_demo.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("cpu", "gpu"), default="cpu",
                        help="recipes arithmetic_sft_<size> and arithmetic_rl_<size>")
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="where the runs go (default runs/arithmetic_demo/<time>); must not hold a demo yet")
    parser.add_argument("--sft-steps", type=int, default=None, help="SFT steps (default: the recipe's)")
    parser.add_argument("--rl-steps", type=int, default=None, help="RL steps (default: the recipe's)")
    parser.add_argument("--seed", type=int, default=1234, help="trainer.seed of every stage")
    parser.add_argument("--limit", type=int, default=None, help="held-out problems scored (eval.limit)")
    parser.add_argument("--samples", type=int, default=None, help="responses per problem, the k of pass@k")
    args, overrides = parser.parse_known_args(list(argv))
    bad = [o for o in overrides if "=" not in o or o.startswith("-")]
    if bad:
        parser.error(f"unknown argument {bad[0]!r}: config overrides are key=value")
    return args, overrides


def _run(cmd: List[str], log: Path) -> float:
    """Run one stage, its output in ``log``; its wall seconds. A failure ends the demo, naming the log."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PROJECT), os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run(cmd, cwd=PROJECT, env=env, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        tail = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise SystemExit(f"arithmetic_demo: {' '.join(cmd[2:4])} failed ({tail[0]}); see {log}")
    return time.perf_counter() - start


def _last_eval(run_dir: Path) -> Dict[str, float]:
    """pass@1 and pass@k of the run's last eval (its last step)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    row = next(r for r in reversed(rows) if "eval/data/pass@1" in r)
    return {key.split("/")[-1]: value for key, value in row.items()
            if key.startswith("eval/data/pass@")} | {"step": row["step"]}


def run_demo(argv: Sequence[str]) -> Dict:
    args, overrides = parse_args(argv)
    root = args.run_dir or PROJECT / "runs" / "arithmetic_demo" / time.strftime("%Y%m%d-%H%M%S")
    if (root / REPORT).exists():
        raise SystemExit(f"arithmetic_demo: {root} holds a demo already; give another --run-dir")
    root.mkdir(parents=True, exist_ok=True)
    python = [sys.executable, "-m"]
    common = [f"trainer.seed={args.seed}", "trainer.progress=false", "eval.datasets=[data]", *overrides]
    if args.limit:
        common.append(f"eval.limit={args.limit}")
    if args.samples:
        common.append(f"eval.samples={args.samples}")
    sft_recipe, rl_recipe = f"arithmetic_sft_{args.size}", f"arithmetic_rl_{args.size}"
    stages: Dict[str, Dict] = {}
    seconds = _run([*python, "megatron_rl.eval", f"recipe={sft_recipe}", "--random-init", "--no-progress",
                    f"--report={root / 'eval_before.json'}", f"trainer.run_dir={root / 'before'}", *common],
                   root / "before.log")
    before = json.loads((root / "eval_before.json").read_text())["datasets"]["data"]
    stages["before SFT"] = {key: value for key, value in before.items() if key.startswith("pass@")} | {
        "seconds": seconds}
    steps = [f"trainer.total_steps={args.sft_steps}"] if args.sft_steps else []
    # The run's last step is scored: eval_interval = total_steps (read back from its config).
    seconds = _run([*python, "megatron_rl.main", f"recipe={sft_recipe}", f"trainer.run_dir={root / 'sft'}", *common,
                    *steps, *_eval_at_end(sft_recipe, [*common, *steps])], root / "sft.log")
    stages["after SFT"] = _last_eval(root / "sft") | {"seconds": seconds}
    checkpoint = root / "sft" / "checkpoints" / f"step_{stages['after SFT']['step']}"
    steps = [f"trainer.total_steps={args.rl_steps}"] if args.rl_steps else []
    rl = [f"model.path={checkpoint}", *common, *steps]
    seconds = _run([*python, "megatron_rl.main", f"recipe={rl_recipe}", f"trainer.run_dir={root / 'rl'}", *rl,
                    *_eval_at_end(rl_recipe, rl)], root / "rl.log")
    stages["after RL"] = _last_eval(root / "rl") | {"seconds": seconds}
    k = next(key for key in stages["before SFT"] if key.startswith("pass@") and key != "pass@1")
    report = {"size": args.size, "seed": args.seed, "run_dir": str(root), "k": int(k.split("@")[1]),
              "problems": before["problems"], "stages": stages}
    (root / REPORT).write_text(json.dumps(report, indent=1))
    print(table(report))
    print(f"report: {root / REPORT}")
    return report


def _eval_at_end(recipe: str, overrides: List[str]) -> List[str]:
    """``trainer.eval_interval`` at the run's total steps, so that its last step is scored."""
    from megatron_rl.checks import load_config

    return [f"trainer.eval_interval={load_config(recipe, overrides).trainer.total_steps}"]


def table(report: Dict) -> str:
    k = f"pass@{report['k']}"
    lines = [f"{'stage':<11} {'step':>5} {'pass@1':>7} {k:>7} {'seconds':>8}"]
    for name, stage in report["stages"].items():
        lines.append(f"{name:<11} {stage.get('step', 0):>5} {stage['pass@1']:>7.3f} {stage[k]:>7.3f} "
                     f"{stage['seconds']:>8.0f}")
    lines.append(f"held-out problems: {report['problems']}, {report['k']} samples each, seed {report['seed']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(PROJECT))
    run_demo(sys.argv[1:])
