"""Per-rank, per-phase step timing: one ``timings/rank-<r>.jsonl`` record per step.

Usage in a training loop (the trainer owns one ``PhaseTimer`` per rank)::

    timer = PhaseTimer(rank, device, TimingsWriter(run_dir, rank))
    timer.begin_step(step)
    with timer.phase("data"):
        batch = next(loader)
    with timer.phase("forward"):
        loss = model(batch)
    ...
    timer.end_step()

On CPU a phase is timed with ``time.perf_counter``. On CUDA a phase is a pair of CUDA events on the
current stream, so its duration is GPU execution time without a synchronisation on the hot path; the
events are resolved every ``flush_every`` steps (one ``Event.synchronize`` on the newest event).
NOTE: with CUDA events the "data" phase measures how long the GPU stream sat between the two events,
which equals the loader wait when the GPU has no backlog (the usual reason the loader matters).

No rank talks to another: each rank appends its own file and the tools (``stalwart report``,
``dashboard``, :mod:`stalwart.observe.aggregate`) merge them, so there is no barrier on the hot path.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from stalwart.metrics.records import JsonlWriter
from stalwart.paths import RunPaths
from stalwart.runtime.device import HOST, is_accelerator

# The standard phase names; any other name is accepted and becomes its own lane.
PHASES = ("data", "forward", "backward", "optimizer", "comm", "checkpoint")


class TimingsWriter(JsonlWriter):
    """Appends timing records to ``<run_dir>/timings/rank-<r>.jsonl`` (line-buffered by flush)."""

    def __init__(self, run_dir: str | Path, rank: int) -> None:
        super().__init__(RunPaths(run_dir).timings(rank))


class _Phase:
    """A reusable context manager for one phase name (cheaper than a generator context manager)."""

    __slots__ = ("timer", "name")

    def __init__(self, timer: "PhaseTimer", name: str) -> None:
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        self.timer._enter(self.name)

    def __exit__(self, *exc: Any) -> None:
        self.timer._exit(self.name)


class _NullPhase:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_NULL = _NullPhase()


class PhaseTimer:
    """Times named phases of each step on one rank and emits one record per step.

    ``sink`` receives lists of finished records (a :class:`TimingsWriter`, or any callable taking a
    list); ``on_phase`` (optional) is told the phase a rank enters, e.g. ``FlightRecorder.set_phase``,
    so a hang dump says what the rank was doing; ``on_flush`` (optional) also receives each batch of
    finished records, e.g. a Prometheus exporter's per-rank phase counters. A phase entered several
    times in one step (gradient accumulation) accumulates. Nested phases are each timed in full (their times overlap).

    ``comm_clock`` (optional, CPU only), e.g. ``FlightRecorder.blocked_seconds``: a counter of seconds
    spent blocked in collectives. Collective time inside another phase (FSDP's all-gather in
    ``forward``, reduce-scatter in ``backward``) is then moved from that phase to ``comm``, so ``comm``
    is all exposed communication and a rank waiting for a straggler is not mistaken for a slow one.
    """

    def __init__(self, rank: int = 0, device: Any = HOST, sink: TimingsWriter | Callable | None = None,
                 flush_every: int = 10, enabled: bool = True,
                 on_phase: Callable[[str | None, int | None], None] | None = None,
                 comm_clock: Callable[[], float] | None = None,
                 on_flush: Callable[[list[dict[str, Any]]], None] | None = None) -> None:
        self.rank, self.enabled, self.flush_every = rank, enabled, max(1, flush_every)
        self.cuda = is_accelerator(device)
        self._sink = sink
        self._on_phase = on_phase
        self._on_flush = on_flush
        self._comm_clock = None if self.cuda else comm_clock
        self._comm_open: dict[str, float] = {}
        self._phases: dict[str, _Phase] = {}
        self._step: int | None = None
        self._t0 = 0.0            # perf_counter (CPU) at begin_step
        self._t0_unix = 0.0
        self._open: dict[str, Any] = {}   # name -> start (float, or a CUDA event)
        self._acc: dict[str, float] = {}  # CPU: name -> seconds
        self._starts: dict[str, float] = {}
        self._cuda_spans: list[tuple[str, Any, Any]] = []
        self._step_start_event: Any = None
        self._pending: list[tuple[dict[str, Any], Any, Any, list]] = []  # CUDA records awaiting events
        self._done: list[dict[str, Any]] = []
        self.last: dict[str, Any] | None = None  # newest resolved record

    # -- hot path -----------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        if not self.enabled:
            return
        self._step = step
        self._t0_unix = time.time()
        self._t0 = time.perf_counter()
        self._acc, self._starts, self._open = {}, {}, {}
        if self.cuda:
            self._cuda_spans = []
            self._step_start_event = self._event()

    def phase(self, name: str) -> _Phase | _NullPhase:
        if not self.enabled:
            return _NULL
        p = self._phases.get(name)
        if p is None:
            p = self._phases[name] = _Phase(self, name)
        return p

    def _enter(self, name: str) -> None:
        now = time.perf_counter()
        if name not in self._starts:
            self._starts[name] = now - self._t0
        self._open[name] = self._event() if self.cuda else now
        if self._comm_clock is not None:
            self._comm_open[name] = self._comm_clock()
        if self._on_phase is not None:
            self._on_phase(name, self._step)

    def _exit(self, name: str) -> None:
        start = self._open.pop(name, None)
        if start is None:
            return
        if self.cuda:
            self._cuda_spans.append((name, start, self._event()))
        else:
            dur = time.perf_counter() - start
            if self._comm_clock is not None and name != "comm":
                blocked = self._comm_clock() - self._comm_open.get(name, 0.0)
                if blocked > 0:
                    dur -= blocked
                    self._acc["comm"] = self._acc.get("comm", 0.0) + blocked
            self._acc[name] = self._acc.get(name, 0.0) + dur
        if self._on_phase is not None:
            self._on_phase(None, self._step)

    def end_step(self, **extra: Any) -> dict[str, Any] | None:
        """Close the step; returns its record on CPU (on CUDA records are resolved at flush)."""
        if not self.enabled or self._step is None:
            return None
        wall = time.perf_counter() - self._t0
        rec: dict[str, Any] = {"step": self._step, "rank": self.rank, "t_start": self._t0_unix,
                               "step_time_s": wall, "phases": self._acc,
                               "phase_starts": {k: round(v, 6) for k, v in self._starts.items()}, **extra}
        self._step = None
        if self.cuda:
            self._pending.append((rec, self._step_start_event, self._event(), self._cuda_spans))
            if len(self._pending) >= self.flush_every:
                self.flush()
            return None
        self.last = rec
        self._done.append(rec)
        if len(self._done) >= self.flush_every:
            self.flush()
        return rec

    # -- off the hot path ---------------------------------------------------------------------
    def flush(self) -> None:
        if self._pending:
            self._pending[-1][2].synchronize()  # the newest end event; all older ones are done too
            for rec, start, end, spans in self._pending:
                rec["step_time_s"] = start.elapsed_time(end) / 1e3
                phases: dict[str, float] = {}
                for name, a, b in spans:
                    phases[name] = phases.get(name, 0.0) + a.elapsed_time(b) / 1e3
                rec["phases"] = phases
                self._done.append(rec)
            self.last = self._pending[-1][0]
            self._pending = []
        if self._done:
            if self._on_flush is not None:
                self._on_flush(self._done)
            if isinstance(self._sink, TimingsWriter):
                self._sink.write_many(self._done)
            elif self._sink is not None:
                self._sink(self._done)
            self._done = []

    def close(self) -> None:
        self.flush()
        if isinstance(self._sink, TimingsWriter):
            self._sink.close()

    @staticmethod
    def _event() -> Any:
        import torch

        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
