"""Progress bars on a terminal, silence elsewhere.

A thin wrapper over :class:`rich.progress.Progress` so pipeline code can always call
``task``/``advance`` without checking whether bars are shown.
"""
from __future__ import annotations

import sys

from packer_cli._console import LIVE, Console
from rich.progress import BarColumn, MofNCompleteColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as _RichProgress


class Progress:
    """Context manager; with ``enabled=False`` (or stderr not a terminal) every call is a no-op."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and sys.stderr.isatty()
        self._bar = None

    def __enter__(self) -> "Progress":
        if self.enabled:
            self._bar = _RichProgress(
                SpinnerColumn(), TextColumn("{task.description:<9}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[unit]}"), TimeElapsedColumn(),
                console=Console(stderr=True), transient=False,
            )
            self._bar.__enter__()
            LIVE.append(self._bar)  # say() prints above it meanwhile
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            if self._bar in LIVE:
                LIVE.remove(self._bar)
            self._bar.__exit__(*exc)

    def task(self, description: str, total: int | None, unit: str):
        return self._bar.add_task(description, total=total, unit=unit) if self._bar else None

    def advance(self, task, amount: int) -> None:
        if self._bar is not None and task is not None:
            self._bar.advance(task, amount)
