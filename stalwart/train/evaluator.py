"""Periodic evaluation on the held-out split: the evaluator decides when it runs (``eval`` section)."""

from __future__ import annotations

from stalwart.data.loader import Batch


class Evaluator:
    def __init__(self, cfg, core, batches: list[Batch], observer) -> None:
        self.cfg, self.core, self.batches, self.observer = cfg, core, batches, observer
        self.first: float | None = None   # this session's first evaluation (the curve's baseline)
        self.last: float | None = None

    def at_start(self, step: int) -> None:
        """Before the first step of a fresh run, when ``eval.at_start``."""
        if self.cfg.at_start and step == 0:
            self.run(step)

    def maybe_run(self, step: int, end: int) -> None:
        """After step ``step``: every ``eval.interval`` steps (the final step is evaluated by the caller)."""
        if self.cfg.interval and step % self.cfg.interval == 0 and step != end:
            self.run(step)

    def run(self, step: int) -> float:
        loss = self.core.evaluate(self.batches)
        self.observer.eval(step, loss)
        self.last = loss
        if self.first is None:
            self.first = loss
        return loss
