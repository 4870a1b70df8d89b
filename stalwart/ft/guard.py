"""The worker side of fault tolerance, layered around the training loop.

The loop enters the guard once (``with guard:``: heartbeat thread started, stopped on any exit) and
wraps each step in ``guard.step(n)`` (before-step hooks, then heartbeat progress). The guard's
decisions are taken in its optimizer gate (``guard.gate``, registered on the training core's
:class:`~stalwart.train.optim.GatedOptimizer`), collectively, before the update is applied:

- a non-finite loss or gradient on any rank: skip the step on every rank (``fault.nonfinite = skip``),
  or roll back (``rollback``);
- a step on the skip list (``<run>/ft/skip_steps.json``, written by a rollback): consume its data,
  apply nothing;
- a loss spike (robust z-score): roll back, skipping the offending window;
- stragglers: each rank's forward/backward time, gathered in the same collective.

A rollback raises ``RollbackRequested`` on every rank at the same step (the decision is made on
gathered values): the worker exits with EXIT_ROLLBACK, the supervisor restarts the group from the
last good state, and the steps on the skip list are then not applied (their data is consumed, so the
data order stays deterministic). Fault injection is a separate component (``stalwart.ft.inject``).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from stalwart.ft.detect import SpikeDetector, StragglerDetector
from stalwart.ft.records import Heartbeat, read_skip_steps, record_exclusion, write_skip_steps
from stalwart.paths import RunPaths
from stalwart.ft.gate import Decision, StepOutcome


class RollbackRequested(Exception):
    """Raised on every rank together: restart from the last good state, skipping the given steps."""


class Guard:
    """``cfg`` is the ``fault`` section; ``log_event`` writes events.jsonl (rank 0)."""

    def __init__(self, cfg, paths: RunPaths, rank: int, world_size: int, log_event: Callable[..., None]) -> None:
        self.cfg, self.paths, self.rank, self.world = cfg, paths, rank, world_size
        self.log_event = log_event
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        # A rollback is a restart: without a supervisor that restarts, spikes are only reported and
        # non-finite steps skipped.
        self.can_restart = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
        self.skip_steps = read_skip_steps(paths)
        self.spikes = SpikeDetector(cfg.spike_zscore, cfg.spike_window)
        self.stragglers = StragglerDetector(cfg.straggler_threshold, cfg.straggler_window)
        self.straggler_found: list[dict] = []
        self.skipped: list[int] = []
        self.before_step: list[Callable[[int], None]] = []
        self.heartbeat = Heartbeat(paths, rank, self.attempt, cfg.heartbeat_interval_s, log_event)
        self._step = 0

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Guard":
        self.heartbeat.start()
        return self

    def resumed(self, step: int) -> None:
        """The session continues from ``step`` (0 for a fresh start); the supervisor times recovery from it."""
        self._step = step
        self.heartbeat.resumed(step)

    def __exit__(self, exc_type, exc, tb) -> None:
        self.heartbeat.stop(phase="done" if exc_type is None else "failed")

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        for hook in self.before_step:
            hook(step)
        yield
        self._step = step
        self.heartbeat.progress(step)

    def finishing(self) -> None:
        self.heartbeat.progress(self._step, phase="finishing")

    # ------------------------------------------------------------------ the gate
    def gate(self, out: StepOutcome) -> Decision:
        """Collective: apply this step's update? Also yields the loss averaged over ranks."""
        loss = out.local_loss
        # 2 = this rank's own loss is non-finite (it is the source); 1 = only the (global) gradient norm is.
        bad = 2 if loss is not None and not bool(torch.isfinite(loss.detach()).all()) else 0
        bad = bad or (1 if not math.isfinite(out.grad_norm) else 0)
        mine = torch.tensor([float(bad), out.compute_s, float(loss) if loss is not None else 0.0,
                             1.0 if loss is not None else 0.0], dtype=torch.float64)
        if dist.is_available() and dist.is_initialized() and self.world > 1:
            parts = [torch.zeros(4, dtype=torch.float64) for _ in range(self.world)]
            dist.all_gather(parts, mine)
        else:
            parts = [mine]
        flags = [int(p[0].item()) for p in parts]
        counted = sum(float(p[3]) for p in parts)
        mean_loss = sum(float(p[2]) for p in parts if p[3]) / counted if counted else float("nan")
        self._check_stragglers(out.step, [float(p[1]) for p in parts])
        skip = False
        if out.step in self.skip_steps:
            skip = True
            self.log_event("step_skipped", step=out.step, reason="skip list (rolled-back data window)")
        elif any(flags):
            ranks = [r for r, f in enumerate(flags) if f == 2] or [r for r, f in enumerate(flags) if f]
            self.log_event("failure", kind="nonfinite", step=out.step, ranks=ranks, policy=self.cfg.nonfinite)
            if self.cfg.nonfinite == "rollback" and self.can_restart:
                self._rollback([out.step], f"non-finite loss/gradients on rank(s) {ranks}")
            skip = self.cfg.nonfinite != "off"
        if skip:
            self.skipped.append(out.step)
        elif math.isfinite(mean_loss):
            self._check_spike(out.step, mean_loss)
        return Decision(commit=not skip, mean_loss=mean_loss)

    def _check_spike(self, step: int, loss: float) -> None:
        z = self.spikes.update(loss)
        if z is None:
            return
        self.log_event("failure", kind="loss_spike", step=step, loss=loss, zscore=round(z, 2),
                       policy="rollback" if self.can_restart else "report")
        if self.can_restart:
            window = list(range(max(1, step - self.cfg.spike_skip_steps + 1), step + 1))
            self._rollback(window, f"loss spike at step {step} (robust z = {z:.1f})")

    def _check_stragglers(self, step: int, compute: list[float]) -> None:
        if self.world < 2:
            return
        for s in self.stragglers.update({"forward_backward": compute}):
            rec = {"rank": s.rank, "phase": s.phase, "ratio": round(s.ratio, 3), "steps": s.steps, "step": step,
                   "policy": self.cfg.straggler_policy}
            self.straggler_found.append(rec)
            self.log_event("straggler", **rec)
            if self.cfg.straggler_policy == "exclude" and self.rank == 0:
                # NOTE: recorded for the next launch/scheduler only; this run does not drop the host.
                size = max(1, self.cfg.host_size or int(os.environ.get("LOCAL_WORLD_SIZE", self.world)))
                record_exclusion(self.paths, s.rank // size, size, "straggler", step=step, source="straggler")

    def _rollback(self, steps: list[int], why: str) -> None:
        self.skip_steps.update(steps)
        if self.rank == 0:
            write_skip_steps(self.paths, self.skip_steps)
            self.log_event("rollback", steps=steps, reason=why)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # the skip list is durable before any rank exits
        raise RollbackRequested(why)

    def summary(self) -> dict:
        return {"skipped_steps": self.skipped, "stragglers": self.straggler_found}
