"""What `stalwart rl` shows while it runs, the way `stalwart train` does (``metrics.progress``): the phase
(spawning the actors, the warm-up fine-tuning, an evaluation), then a bar over the RL steps with each
step's reward, loss and time and the time left. On a terminal the bar is drawn in place; otherwise plain
lines, at most one every few seconds (and the last step's)."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from stalwart.metrics.progress import Progress

PLAIN_EVERY_S = 5.0
ETA_WINDOW = 10  # the time left is the mean of this many recent steps times the steps left


def clock(seconds: float) -> str:
    """``1h02m``, ``3m05s`` or ``42s``."""
    s = int(round(max(0.0, seconds)))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class RLProgress:
    def __init__(self, steps: int, show: bool) -> None:
        self.steps, self.show = steps, show
        self.bar: Progress | None = None
        self.recent: deque[float] = deque(maxlen=ETA_WINDOW)
        self._last_sft = 0.0

    def phase(self, text: str) -> None:
        """A line naming what the run is doing now (always shown)."""
        if self.bar is not None:
            self.bar.log(f"stalwart rl: {text}")
        else:
            print(f"stalwart rl: {text}", flush=True)

    def sft(self, step: int, total: int, loss: float) -> None:
        now = time.monotonic()
        if self.show and (now - self._last_sft > PLAIN_EVERY_S or step == total):
            self._last_sft = now
            self.phase(f"SFT warm-up step {step}/{total}, loss {loss:.4f}")

    def start(self, first: int = 0) -> None:
        """The RL steps begin after step ``first`` (0, or where a resumed run goes on): the bar from here."""
        self.bar = Progress(self.steps, first, self.show, label="rl", time_left=False)  # the info's ETA is the one

    def step(self, record: dict[str, Any]) -> str:
        """Show one RL step's record; returns the text shown after the step counter."""
        self.recent.append(record["step_s"])
        left = (self.steps - record["step"]) * sum(self.recent) / len(self.recent)
        info = (f"reward {record['reward_mean']:.3f}  loss {record['loss']:.4f}  {record['step_s']:.1f} s/step  "
                f"ETA {clock(left)}")
        if self.bar is not None:
            self.bar.update(record["step"], info)
        return info

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
