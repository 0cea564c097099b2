"""Rich progress for build steps: one status line per step with elapsed time, a bar when a step reports progress.

``BuildProgress`` is a context manager around ``rich.progress.Progress``; ``with progress.step(name) as s:``
times the step (``progress.timings``) and ``s.update(completed, total)`` turns its spinner into a bar. With
``console=None`` nothing is printed (library use); timings are still recorded.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn


class StepHandle:
    """Handle of a running step: report fractional progress and set a short status note."""

    def __init__(self, progress: Progress | None, task: TaskID | None):
        self._progress = progress
        self._task = task

    def update(self, completed: float, total: float | None = None) -> None:
        """Report ``completed`` units of ``total`` (shows a bar)."""
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=completed, total=total)

    def note(self, text: str) -> None:
        """Show ``text`` next to the step name."""
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, note=f"[dim]{text}")


class BuildProgress:
    """Timed build steps, rendered with rich when a console is given."""

    def __init__(self, console: Console | None = None):
        self.console = console  # None: silent (library use); steps may print their own tables to it
        self.timings: dict[str, float] = {}
        self._progress = (
            Progress(
                SpinnerColumn(finished_text="[green]✓"),
                TextColumn("{task.description}"),
                BarColumn(bar_width=24),
                TimeElapsedColumn(),
                TextColumn("{task.fields[note]}"),
                console=console,
                transient=False,
            )
            if console is not None
            else None
        )

    def __enter__(self) -> "BuildProgress":
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    @contextmanager
    def step(self, name: str) -> Iterator[StepHandle]:
        """Run one step: show it, time it, mark it done (its time lands in ``timings[name]``)."""
        task = None
        if self._progress is not None:
            task = self._progress.add_task(name, total=None, note="")
        start = time.perf_counter()
        handle = StepHandle(self._progress, task)
        try:
            yield handle
        finally:
            self.timings[name] = round(time.perf_counter() - start, 3)
        if self._progress is not None and task is not None:
            self._progress.update(task, total=1, completed=1)
            self._progress.stop_task(task)
