"""tools/bench/e2e_gpu.py: its steady-state rule, its η orders, and a CPU smoke run of the script
on tiny_cpu with the long-tail workload (the GPU figures come from the same code)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    sys.path.insert(0, str(ROOT / "tools/bench"))
    spec = importlib.util.spec_from_file_location("e2e_gpu", ROOT / "tools/bench/e2e_gpu.py")
    module = sys.modules["e2e_gpu"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_warm_up_rule_and_eta_orders():
    bench = _bench()
    # Start-up, then a stall (a capture) at step 3, then steady.
    steps = [9.0, 2.5, 3.7, 1.08, 1.1, 1.05, 1.07, 1.1]
    assert bench.warmup_steps(steps, 2, 0.25) == 3
    assert bench.warmup_steps([9.0, 1.0, 1.0, 1.0], 2, 0.25) == 2  # never fewer than min_warmup
    assert bench.warmup_steps([5.0, 4.0, 3.0], 2, 0.25) == 2  # one step is always kept
    assert bench.eta_sequence([0, 4], "both") == [(0, 0), (4, 0), (4, 1), (0, 1)]
    assert bench.eta_sequence([0, 4], "given") == [(0, 0), (4, 0)]


def test_eta_ratios_per_step_and_per_trained_token():
    """By hand: η = 4 twice as fast per step but training responses 3/4 as long is 1.5x per token."""
    bench = _bench()
    run = lambda eta, step_s, length, order: bench.RunResult(  # noqa: E731
        "r", eta, [step_s] * 3, 2, 0.0, 0.0, 0.0, 0.0, 0.0, length, 0.0, 0.0, 0.0, order)
    results = [run(0, 2.0, 200.0, 0), run(4, 1.0, 150.0, 0), run(4, 1.0, 150.0, 1), run(0, 2.0, 200.0, 1)]
    lines = bench.eta_ratio_lines(results, [0, 4])
    assert lines[0].startswith("r: eta=4 over eta=0 steady-state steps/hour forward 2.00x, reversed 2.00x; "
                               "pooled 2.00x")
    assert lines[1] == ("r: eta=4 over eta=0 per trained response token forward 1.50x, reversed 1.50x; pooled 1.50x "
                        "(mean response 200.0 vs 150.0 tokens)")


def test_the_bench_runs_on_cpu_with_the_long_tail(tmp_path):
    """Two fresh tiny_cpu runs (η = 0, 4) of 3 steps, response lengths drawn (median 3, p99 7),
    LoRA at rank 4: the table, the printed rule, the η ratio, the not-steady-state warning and each
    step's adapter-only push (38,912 bytes: sync/bytes)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools/bench/e2e_gpu.py"), "--recipe", "tiny_cpu", "--steps", "3",
         "--order", "given", "--long-tail", "--long-tail-median", "3", "--long-tail-p99", "7",
         "--long-tail-max", "7", "--root", str(tmp_path), "lora.rank=4"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "rollout.long_tail_median=3 rollout.long_tail_p99=7 rollout.max_new_tokens=7" in text
    assert "warm-up excluded: the first 2 steps, then each next step slower than 1.25x" in text
    assert "tiny_cpu: eta=4 over eta=0 steady-state steps/hour forward" in text
    assert "tiny_cpu: eta=4 over eta=0 per trained response token forward" in text
    assert "NOT steady-state: 2 run(s) kept fewer than 20 measured steps" in text
    rows = [r for r in (line.split() for line in text.splitlines()) if r[:1] == ["tiny_cpu"] and r[1].isdigit()]
    assert [(r[1], r[2], r[3], r[4]) for r in rows] == [("0", "fwd", "2", "1"), ("4", "fwd", "2", "1")]
    assert all(1.0 < float(r[15]) < 7.0 for r in rows)  # mean response length: drawn, not all 7
    assert all(float(r[16]) >= 0 for r in rows)  # groups returned to the queue
    assert all(float(r[17]) >= 0 for r in rows)  # seconds a finished batch was held (overdue=wait)
    assert [r[12] for r in rows] == ["0.04", "0.04"]  # sync MB: the adapters alone at every step
    assert text.count("; sync MB 0.04 0.04 0.04") == 2, text
    lines = next(tmp_path.glob("run0_*")).joinpath("metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(line) for line in lines]
    assert all(row["engine/late_captures"] == 0 for row in metrics)
