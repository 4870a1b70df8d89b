"""Progress display for rank 0: a rich progress bar on a terminal, plain log lines otherwise.

Text is printed as given: rich's markup is off for messages and the bar's info field, so a banner
such as ``layout [single process]`` shows its brackets.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from typing import Any


class RateWindow:
    """Tokens per second over the last ``window`` steps: sum of tokens / sum of step times.

    One step's rate swings with every pause (an evaluation, a checkpoint, the first compiled step);
    the window ratio is what the run sustains, weighted by time, so a slow step counts for how long
    it took rather than as one sample among many.
    """

    def __init__(self, window: int = 20) -> None:
        self._steps: deque[tuple[float, float]] = deque(maxlen=max(1, window))
        self._tokens = self._seconds = 0.0

    def add(self, tokens: float, seconds: float) -> float:
        if len(self._steps) == self._steps.maxlen:
            t, s = self._steps[0]
            self._tokens -= t
            self._seconds -= s
        self._steps.append((tokens, seconds))
        self._tokens += tokens
        self._seconds += seconds
        return self.rate

    @property
    def rate(self) -> float:
        return self._tokens / self._seconds if self._seconds > 0 else 0.0


class Progress:
    def __init__(self, total: int, start: int, show_bar: bool, enabled: bool = True, console: Any = None,
                 label: str = "train", time_left: bool = True) -> None:
        """``enabled``: this process prints at all (rank 0); ``show_bar``: progress updates too.
        ``console``: a rich ``Console`` to draw on (default: stdout when it is a terminal); ``label``:
        the bar's name and the plain lines' first word's prefix (``train``, ``rl``); ``time_left``: the
        bar shows rich's estimate of the time left (off where the caller's info carries its own)."""
        self.label = label
        self.total, self.enabled, self.show_bar = total, enabled, show_bar and enabled
        self.tty = self.show_bar and (console is not None or sys.stdout.isatty())
        self._bar = None
        self._last_print = 0.0
        if self.tty:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, \
                TimeRemainingColumn

            columns = [TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(),
                       TextColumn("{task.fields[info]}", markup=False)] + ([TimeRemainingColumn()] if time_left else [])
            self._bar = RichProgress(*columns, transient=False, console=console)
            self._task = self._bar.add_task(label, total=total, completed=start, info="")
            self._bar.start()

    def update(self, step: int, info: str) -> None:
        if not self.show_bar:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=info)
        elif time.monotonic() - self._last_print > 5.0 or step == self.total:
            self._last_print = time.monotonic()
            prefix = "" if self.label == "train" else f"{self.label} "
            print(f"{prefix}step {step}/{self.total} {info}", flush=True)

    def log(self, message: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(message, markup=False, highlight=False)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
