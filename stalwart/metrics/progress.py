"""Progress display for rank 0: a rich progress bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, start: int, show_bar: bool, enabled: bool = True) -> None:
        """``enabled``: this process prints at all (rank 0); ``show_bar``: progress updates too."""
        self.total, self.enabled, self.show_bar = total, enabled, show_bar and enabled
        self.tty = self.show_bar and sys.stdout.isatty()
        self._bar = None
        self._last_print = 0.0
        if self.tty:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, \
                TimeRemainingColumn

            self._bar = RichProgress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False)
            self._task = self._bar.add_task("train", total=total, completed=start, info="")
            self._bar.start()

    def update(self, step: int, info: str) -> None:
        if not self.show_bar:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=info)
        elif time.monotonic() - self._last_print > 5.0 or step == self.total:
            self._last_print = time.monotonic()
            print(f"step {step}/{self.total} {info}", flush=True)

    def log(self, message: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
