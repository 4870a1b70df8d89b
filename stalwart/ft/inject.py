"""Fault injection on the worker side, for drills and tests: exists only when ``fault.inject`` or chaos
is configured, and registers itself from outside the training step.

- ``kill``, ``exception``, ``hang`` and ``corrupt_checkpoint`` fire before step N starts (a guard
  before-step hook);
- ``nan`` and ``slow`` fire after backward (a training-core backward hook): the rank's gradients
  become NaN, or its compute takes ``factor`` times as long;
- chaos ``exception`` faults arrive from the supervisor as SIGUSR2 and raise where the worker is.

Every fault is marked fired before it fires (``stalwart.ft.plan``), so a restarted worker does not
repeat it. The signal handler is restored on exit.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch

from stalwart.checkpoint.manager import MANIFEST
from stalwart.config.fault_plan import Fault, parse_plan
from stalwart.ft.plan import fired_ids, mark_fired, pending
from stalwart.metrics.records import EventLog
from stalwart.paths import RunPaths


class InjectedFault(RuntimeError):
    """An ``exception`` fault from --fault.inject (or chaos)."""


def _raise_injected(signum, frame) -> None:
    raise InjectedFault("injected fault: exception (chaos, SIGUSR2 from the supervisor)")


def corrupt_checkpoint(paths: RunPaths, step: int) -> bool:
    """Flip one byte in the middle of a shard of complete checkpoint ``step-N``; False if absent."""
    d = paths.checkpoint(step)
    if not (d / MANIFEST).is_file():
        return False
    shard = next(iter(sorted(d.glob("*.distcp"))), None)
    if shard is None:
        return False
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return True


class FaultInjector:
    """This rank's pending faults; ``attach`` registers the hooks, ``with`` scopes the chaos handler."""

    def __init__(self, fault_cfg, paths: RunPaths, rank: int, attempt: int) -> None:
        self.paths, self.rank, self.attempt = paths, rank, attempt
        self.chaos = fault_cfg.chaos_mtbf_s > 0
        self.faults: list[Fault] = pending(parse_plan(fault_cfg.inject), fired_ids(paths))
        self._events = EventLog(paths.events, enabled=True)  # every rank records the faults it fires
        self._prev_handler = None
        self._t_step = 0.0
        self._params: list[torch.Tensor] = []

    @staticmethod
    def wanted(fault_cfg) -> bool:
        return bool(fault_cfg.inject) or fault_cfg.chaos_mtbf_s > 0

    def attach(self, guard, core) -> "FaultInjector":
        guard.before_step.append(self.before_step)
        core.backward_hooks.append(self.after_backward)
        self._params = core.params
        return self

    def __enter__(self) -> "FaultInjector":
        if self.chaos and threading.current_thread() is threading.main_thread():
            self._prev_handler = signal.signal(signal.SIGUSR2, _raise_injected)
        return self

    def __exit__(self, *exc) -> None:
        if self._prev_handler is not None:
            signal.signal(signal.SIGUSR2, self._prev_handler)
            self._prev_handler = None
        self._events.close()

    # ------------------------------------------------------------------ firing
    def _mine(self, kind: str, step: int) -> list[Fault]:
        return [f for f in self.faults if f.kind == kind and f.rank == self.rank and f.step == step]

    def _fire(self, fault: Fault, step: int) -> None:
        now = time.time()
        rec = mark_fired(self.paths, fault, step, now, attempt=self.attempt)
        self._events.write({"time": now, "event": "fault_injected", **rec})
        self.faults.remove(fault)

    def before_step(self, step: int) -> None:
        """Before step ``step`` (1-based) runs."""
        self._t_step = time.perf_counter()
        for f in [f for f in self.faults if f.kind == "corrupt_checkpoint"]:
            if self.rank == 0 and step > f.step and corrupt_checkpoint(self.paths, f.step):
                self._fire(f, step)
        for f in self._mine("kill", step):
            self._fire(f, step)
            os.kill(os.getpid(), signal.SIGKILL)
        for f in self._mine("exception", step):
            self._fire(f, step)
            raise InjectedFault(f"injected fault {f.describe()} (--fault.inject)")
        for f in self._mine("hang", step):
            self._fire(f, step)
            while True:  # the heartbeat thread keeps beating: only the progress watchdog can see this
                time.sleep(3600)

    def after_backward(self, step: int, local_loss: torch.Tensor | None) -> torch.Tensor | None:
        for f in self._mine("nan", step):
            self._fire(f, step)
            with torch.no_grad():
                for p in self._params:
                    if p.grad is not None:
                        p.grad.mul_(float("nan"))
            local_loss = torch.full((), float("nan")) if local_loss is None else local_loss * float("nan")
        for f in self.faults:
            if f.kind == "slow" and f.rank == self.rank and f.first <= step <= f.last:
                time.sleep((f.factor - 1.0) * (time.perf_counter() - self._t_step))
        return local_loss
