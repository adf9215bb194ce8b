"""A console progress bar (rich) showing the latest reward; silent when disabled or not a TTY."""

from __future__ import annotations

import sys
from typing import Dict


class Progress:
    def __init__(self, total: int, enabled: bool = True, start: int = 0):
        self.total = total
        self.start = start  # steps already done (a resumed run)
        self.enabled = enabled and sys.stderr.isatty()
        self._bar = None

    def __enter__(self) -> "Progress":
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress
            from rich.progress import TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._bar = RichProgress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                                     TimeRemainingColumn(), transient=False)
            self._bar.start()
            self._task = self._bar.add_task("train", total=self.total, completed=self.start, info="")
        return self

    def update(self, step: int, metrics: Dict[str, float]) -> None:
        if self._bar is not None:
            info = f"reward {metrics['reward/mean']:.3f}  {metrics['time/step_s']:.2f}s/step"
            self._bar.update(self._task, completed=step, info=info)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
