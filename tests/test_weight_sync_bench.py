"""tools/bench/weight_sync.py runs (tiny model, PP=2 learner, 2 engines) and prints its table."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_weight_sync_bench_prints_seconds_and_gb_per_s():
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools/bench/weight_sync.py"), "--tp", "1", "--pp", "2", "--engines", "2",
         "--layers", "2", "--hidden", "64", "--heads", "4", "--groups", "2", "--ffn", "128", "--vocab", "512",
         "--buckets", "1,4", "--repeats", "1"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    # 2 x 512 x 64 (embedding, output) + 2 layers x (qkv 128x64 + proj 64x64 + fc1 256x64 + fc2 64x128 + 2 norms) + final norm
    params = 2 * 512 * 64 + 2 * (128 * 64 + 64 * 64 + 256 * 64 + 64 * 128 + 2 * 64) + 64
    assert f"{params * 4 / 1e6:.1f} MB per sync" in lines[0], lines[0]
    rows = [line.split() for line in lines if line.split()[:1] in (["1"], ["4"])]
    assert len(rows) == 2 and all(float(r[2]) > 0 for r in rows), out.stdout


def test_weight_sync_bench_times_the_learner_side_alone_without_engines():
    """--engines 0 (a TP=2 learner on a 2-GPU machine has no GPU left for an engine): source side only."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools/bench/weight_sync.py"), "--tp", "2", "--engines", "0",
         "--layers", "2", "--hidden", "64", "--heads", "4", "--groups", "2", "--ffn", "128", "--vocab", "512",
         "--buckets", "4", "--repeats", "1"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "-> 0 engine(s)" in out.stdout
    row = next(line.split() for line in out.stdout.splitlines() if line.split()[:1] == ["4"])
    assert row[1] == "-" and float(row[4]) > 0, out.stdout  # no engine columns; source GB/s
