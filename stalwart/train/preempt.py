"""Saving on preemption: SIGTERM makes every rank finish its step, checkpoint that step, and exit 75.

SIGTERM is what Kubernetes sends at eviction and what the Slurm template sends ahead of preemption
(through the launcher, which forwards it to its workers). While training runs, the first SIGTERM only
raises a flag; at the end of each step every rank learns whether any rank has it (one one-element
all-reduce per step, ``agreed``), so all ranks stop after the same step. The checkpointer then saves
that step (blocking, after any in-flight async save commits) and raises :class:`Preempted`; the
worker exits with :data:`EXIT_REQUEUE` (75), the code the Slurm template and the JobSet policy treat
as "requeue", and the rerun resumes from that checkpoint bit for bit.

A second SIGTERM exits at once (143) from wherever the process is, a save in progress included: a
checkpoint is committed by one rename, so the newest complete one stays what it was. SIGINT (Ctrl-C)
keeps its own behaviour (stop now, no save); SIGUSR1 stays the flight recorder's dump.

NOTE: a scheduler that signals every process of a job (``scancel`` without ``--batch``) reaches a
worker both directly and through its launcher, a few milliseconds apart; a second SIGTERM within
``DUPLICATE_S`` of the first is taken as the same request, not as "exit now".
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from stalwart.ft.detect import EXIT_RESTART_BUDGET

EXIT_REQUEUE = EXIT_RESTART_BUDGET  # 75: stopped with its state saved; requeue to continue
DUPLICATE_S = 1.0


class Preempted(Exception):
    """Raised on every rank together after the preemption checkpoint: leave with EXIT_REQUEUE."""

    def __init__(self, step: int, checkpoint: str | None, seconds: float, error: str | None = None) -> None:
        self.step, self.checkpoint, self.seconds, self.error = step, checkpoint, seconds, error
        super().__init__(self.describe())

    def describe(self) -> str:
        if self.checkpoint is not None:
            return (f"SIGTERM: saved checkpoint {self.checkpoint} (step {self.step}) {self.seconds:.1f} s after the "
                    f"signal; exit {EXIT_REQUEUE}: requeue, the same command resumes from it")
        return (f"SIGTERM: the checkpoint of step {self.step} could not be saved ({self.error}); exit {EXIT_REQUEUE}: "
                "requeue, the same command resumes from the newest complete checkpoint")


class PreemptionSignal:
    """The SIGTERM handler of a training session (entered around the loop; the previous handler is put
    back on exit). ``clock`` is injectable for tests."""

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self.requested_at: float | None = None  # clock() at the first SIGTERM
        self.active = False
        self._previous = None

    def __enter__(self) -> "PreemptionSignal":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self.on_signal)
            self.active = True
        return self

    def __exit__(self, *exc) -> None:
        if self.active:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self.active = False

    def on_signal(self, signum: int = signal.SIGTERM, frame=None) -> None:
        now = self.clock()
        if self.requested_at is None:
            self.requested_at = now
            return
        if now - self.requested_at < DUPLICATE_S:
            return  # the same request, delivered directly and through the launcher
        sys.stderr.write("stalwart train: second SIGTERM: exiting now; the newest complete checkpoint is kept\n")
        sys.stderr.flush()
        os._exit(128 + signal.SIGTERM)

    def agreed(self) -> bool:
        """Collective, at a step boundary on every rank: has any rank been asked to stop? False (and no
        collective) when no handler is installed, which is then so on every rank."""
        if not self.active:
            return False
        mine = self.requested_at is not None
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return mine
        flag = torch.tensor([int(mine)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self.requested_at is None:
            self.requested_at = self.clock()  # a peer had it first: time this rank's save from now
        return bool(flag.item())

    def seconds_since(self) -> float:
        return self.clock() - self.requested_at if self.requested_at is not None else 0.0


def preempted_since(events_path, since: float) -> dict | None:
    """The ``preempted`` event rank 0 wrote after unix time ``since`` (the launcher reads it after
    stopping its workers on SIGTERM), or None."""
    from stalwart.metrics.records import read_jsonl

    found = [e for e in read_jsonl(events_path) if e.get("event") == "preempted" and e.get("time", 0) >= since]
    return found[-1] if found else None
