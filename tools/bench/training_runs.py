"""One run for a benchmark: a fresh `python -m megatron_rl.main` process (or a torchrun world of
`ranks` processes, `-m megatron_rl.launch`), its metrics read back."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence, Tuple


def train(recipe: str, steps: int, eta: int, run_dir: Path, overrides: Sequence[str], label: str,
          echo: bool = False, ranks: int = 1) -> Tuple[List[Dict], float]:
    """Run ``recipe`` for ``steps`` steps at η = ``eta`` into ``run_dir``; return its metric rows
    (one per step) and its wall time. A failed run ends the benchmark with its stderr's tail."""
    entry = (["-m", "megatron_rl.main"] if ranks == 1 else
             ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m", "megatron_rl.launch"])
    cmd = [sys.executable, *entry, f"recipe={recipe}", f"trainer.total_steps={steps}",
           f"scheduler.max_staleness={eta}", f"trainer.run_dir={run_dir}", "trainer.progress=false",
           "trainer.save_final_checkpoint=false", *overrides]
    if echo:
        print("+", " ".join(cmd), flush=True)
    start = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{label} run failed (exit {result.returncode}):\n{(result.stderr or result.stdout)[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, wall
