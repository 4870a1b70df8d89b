"""Collective flight recorder: each rank remembers its last N collectives and dumps them on trouble.

:meth:`FlightRecorder.install` wraps the collective functions of ``torch.distributed`` (both the
``torch.distributed.X`` names and ``torch.distributed.distributed_c10d.X``, which are the same
functions). FSDP2 in torch 2.13 calls ``dist.all_gather_single`` / ``dist.reduce_scatter_single`` /
``dist.all_reduce`` through the module attribute at call time, so its collectives are recorded too.
NOTE: functional collectives (``torch.distributed._functional_collectives``, used by DTensor / tensor
parallel redistribution) are dispatcher ops, not these Python functions, and are not recorded.

Each entry: ``id`` (per rank), ``seq`` (per process group, collectives only; point-to-point ops
count separately), ``op``, ``group``, ``group_ranks``, ``peer``, ``sizes``, ``dtype``, ``t_start``,
``t_end`` (unix s), ``state`` (started | issued | completed | failed), ``step`` and ``phase`` (from
the :class:`~stalwart.observe.timer.PhaseTimer`). Calls made from inside a recorded collective (e.g.
``all_gather_object`` -> ``all_gather``) are not recorded twice.

The recorder writes ``<run_dir>/flight/rank-<r>.json`` when its watchdog sees a collective in flight
or no progress for ``hang_timeout_s``, when a collective raises, on an uncaught exception, and on
SIGUSR1 (dump and continue) or SIGTERM (dump, then the previous handler).
"""

from __future__ import annotations

import collections
import inspect
import itertools
import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from stalwart.atomic import write_text_atomic
from stalwart.paths import RunPaths

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
               "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
               "broadcast", "reduce", "gather", "scatter", "barrier", "monitored_barrier",
               "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
P2P = ("send", "recv", "isend", "irecv", "batch_isend_irecv")


def _tensors(value: Any, out: list) -> None:
    import torch

    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)) and value and len(out) < 8:
        for v in value[:8]:
            _tensors(v, out)


class FlightRecorder:
    def __init__(self, rank: int, world_size: int, run_dir: str | Path, capacity: int = 2000,
                 hang_timeout_s: float = 300.0, clock: Callable[[], float] = time.time) -> None:
        self.rank, self.world_size = rank, world_size
        self.path = RunPaths(run_dir).flight(rank)
        self.hang_timeout_s = hang_timeout_s
        self.clock = clock
        self.entries: collections.deque[dict[str, Any]] = collections.deque(maxlen=capacity)
        self.in_flight: dict[int, dict[str, Any]] = {}
        self._ids = itertools.count()
        self._seq: dict[str, int] = {}
        self._groups: dict[int, tuple[str, list[int]]] = {}
        self._local = threading.local()
        self._patched: list[tuple[Any, str, Any]] = []
        self._prev_handlers: dict[int, Any] = {}
        self._prev_excepthook: Any = None
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        self.step: int | None = None
        self.phase: str | None = None
        self.phase_since = self.last_progress = clock()
        self._armed = False  # "no progress" counts only after the first set_phase / mark_progress
        self.dumps = 0
        self.reasons: list[str] = []  # every dump's reason, oldest first (a later dump replaces the file)
        self.blocked_s = 0.0  # perf_counter seconds the loop's thread spent inside synchronous collectives
        self._loop_thread: int | None = None  # the thread that installed the recorder (the loop's)
        self._wait_clocks: list[Callable[[], float]] = []

    # -- progress markers (called by the PhaseTimer / trainer) ----------------------------------
    def set_phase(self, phase: str | None, step: int | None = None) -> None:
        self.phase, self.phase_since = phase, self.clock()
        self._armed = True
        if step is not None:
            self.step = step
        self.last_progress = self.phase_since

    def blocked_seconds(self) -> float:
        """Seconds this rank's loop spent blocked in synchronous collectives so far (a PhaseTimer
        comm_clock), with what every added wait clock counts (collectives run on another thread)."""
        return self.blocked_s + sum(clock() for clock in self._wait_clocks)

    def add_wait_clock(self, clock: Callable[[], float]) -> None:
        """Also count ``clock()`` seconds as blocked: e.g. a communication thread's ``exposed_s``, the
        loop's waits for collectives that thread runs (its own time there is not the loop's)."""
        self._wait_clocks.append(clock)

    def mark_progress(self, step: int | None = None) -> None:
        if step is not None:
            self.step = step
        self._armed = True
        self.last_progress = self.clock()

    # -- recording ------------------------------------------------------------------------------
    def start(self, op: str, group: str = "default", group_ranks: list[int] | None = None,
              sizes: list[list[int]] | None = None, dtype: str | None = None, peer: int | None = None,
              async_op: bool = False) -> dict[str, Any]:
        """Record that this rank entered a collective; returns the entry to pass to :meth:`finish`."""
        p2p = op in P2P
        key = f"{group}/p2p" if p2p else group
        seq = self._seq.get(key, 0)
        self._seq[key] = seq + 1
        now = self.clock()
        e = {"id": next(self._ids), "seq": seq, "op": op, "group": group, "group_ranks": group_ranks,
             "p2p": p2p, "peer": peer, "sizes": sizes or [], "dtype": dtype, "async": async_op,
             "t_start": now, "t_end": None, "state": "started", "step": self.step, "phase": self.phase}
        self.entries.append(e)
        self.in_flight[e["id"]] = e
        self.last_progress = now
        return e

    def finish(self, entry: dict[str, Any], state: str = "completed", error: str | None = None) -> None:
        entry["state"], entry["t_end"] = state, self.clock()
        if error:
            entry["error"] = error
        self.in_flight.pop(entry["id"], None)
        self.last_progress = entry["t_end"]

    def _group_info(self, pg: Any) -> tuple[str, list[int] | None]:
        import torch.distributed as dist

        info = self._groups.get(id(pg))
        if info is None:
            try:
                real = pg if pg is not None else dist.distributed_c10d._get_default_group()
                name = dist.distributed_c10d._get_process_group_name(real)
                ranks = dist.get_process_group_ranks(real)
                name = "default" if pg is None or real is dist.distributed_c10d._get_default_group() else name
            except Exception:  # not initialised, or a group object this version cannot name
                name, ranks = "unknown", None
            info = self._groups[id(pg)] = (name, ranks)
        return info

    def _wrap(self, name: str, fn: Callable) -> Callable:
        params = list(inspect.signature(fn).parameters)
        g_idx = params.index("group") if "group" in params else None
        peer_name = next((p for p in ("dst", "src", "group_dst", "group_src") if p in params), None)
        peer_idx = params.index(peer_name) if peer_name else None
        rec, local = self, self._local

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if getattr(local, "depth", 0):
                return fn(*args, **kwargs)
            pg = kwargs.get("group", args[g_idx] if g_idx is not None and len(args) > g_idx else None)
            gname, granks = rec._group_info(pg)
            ts: list = []
            for a in args[:3]:
                _tensors(a, ts)
            sizes = [list(t.shape) for t in ts[:8]]
            peer = kwargs.get(peer_name, args[peer_idx] if peer_idx is not None and len(args) > peer_idx
                              else None) if peer_name else None
            async_op = bool(kwargs.get("async_op", False)) or name in ("isend", "irecv", "batch_isend_irecv")
            e = rec.start(name, gname, granks, sizes, str(ts[0].dtype).replace("torch.", "") if ts else None,
                          peer if isinstance(peer, int) else None, async_op)
            local.depth = 1
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            except BaseException as exc:
                rec.finish(e, "failed", f"{type(exc).__name__}: {exc}"[:500])
                rec.dump(f"collective {name} #{e['seq']} raised {type(exc).__name__}")
                raise
            finally:
                local.depth = 0
                if not async_op and threading.get_ident() == rec._loop_thread:
                    rec.blocked_s += time.perf_counter() - t0
            if async_op and out is not None:
                rec._track_async(e, out)
            else:
                rec.finish(e)
            return out

        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        wrapper.__name__ = name
        wrapper._stalwart_flight = True  # type: ignore[attr-defined]
        return wrapper

    def _track_async(self, e: dict[str, Any], work: Any) -> None:
        e["state"] = "issued"
        works = work if isinstance(work, list) else [work]
        remaining = [len(works)]

        def done(_fut: Any) -> None:
            remaining[0] -= 1
            if remaining[0] == 0:
                self.finish(e)

        try:
            for w in works:
                w.get_future().add_done_callback(done)
        except Exception:  # a backend without futures: the entry stays "issued"
            self.in_flight.pop(e["id"], None)

    # -- install / uninstall --------------------------------------------------------------------
    def install(self, signals: bool = True, excepthook: bool = True, watchdog: bool = True) -> "FlightRecorder":
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self._loop_thread = threading.get_ident()
        for name in COLLECTIVES + P2P:
            orig = getattr(c10d, name, None)
            if orig is None or getattr(orig, "_stalwart_flight", False):
                continue
            w = self._wrap(name, orig)
            for mod in (c10d, dist):
                if getattr(mod, name, None) is orig:
                    self._patched.append((mod, name, orig))
                    setattr(mod, name, w)
        if signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGUSR1, signal.SIGTERM):
                self._prev_handlers[sig] = signal.signal(sig, self._on_signal)
        if excepthook:
            self._prev_excepthook = sys.excepthook
            sys.excepthook = self._on_exception
        if watchdog and self.hang_timeout_s > 0:
            self._stop.clear()
            self._watchdog = threading.Thread(target=self._watch, name="stalwart-flight-watchdog", daemon=True)
            self._watchdog.start()
        return self

    def uninstall(self) -> None:
        for mod, name, orig in reversed(self._patched):
            setattr(mod, name, orig)
        self._patched = []
        for sig, prev in self._prev_handlers.items():
            signal.signal(sig, prev)
        self._prev_handlers = {}
        if self._prev_excepthook is not None:
            sys.excepthook, self._prev_excepthook = self._prev_excepthook, None
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.join(timeout=2)
            self._watchdog = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._dump_quietly(f"signal {signal.Signals(signum).name}")
        if signum == signal.SIGTERM:
            prev = self._prev_handlers.get(signum, signal.SIG_DFL)
            if callable(prev):
                prev(signum, frame)
            else:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

    def _on_exception(self, tp: Any, value: Any, tb: Any) -> None:
        self._dump_quietly(f"exception {tp.__name__}: {value}"[:300])
        (self._prev_excepthook or sys.__excepthook__)(tp, value, tb)

    def check(self, now: float | None = None) -> str | None:
        """The watchdog's test, as a pure function of the clock: a reason to dump, or None."""
        now = self.clock() if now is None else now
        flying = [e for e in list(self.in_flight.values()) if e["state"] == "started"]
        if flying:
            oldest = min(flying, key=lambda e: e["t_start"])
            if now - oldest["t_start"] > self.hang_timeout_s:
                return (f"hang: {oldest['op']} #{oldest['seq']} on group {oldest['group']} in flight for "
                        f"{now - oldest['t_start']:.1f}s")
        if self._armed and now - self.last_progress > self.hang_timeout_s:
            return f"no progress for {now - self.last_progress:.1f}s (phase {self.phase}, step {self.step})"
        return None

    def _watch(self) -> None:
        fired_at = None
        interval = min(1.0, self.hang_timeout_s / 4)
        while not self._stop.wait(interval):
            reason = self.check()
            if reason is None:
                fired_at = None
            elif fired_at is None or fired_at != self.last_progress:
                fired_at = self.last_progress
                self._dump_quietly(reason)

    # -- dumping --------------------------------------------------------------------------------
    def snapshot(self, reason: str = "") -> dict[str, Any]:
        entries = [dict(e) for e in list(self.entries)]
        return {"rank": self.rank, "world_size": self.world_size, "pid": os.getpid(),
                "job": os.environ.get("TORCHELASTIC_RUN_ID", ""),  # which launch and attempt wrote it
                "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                "host": socket.gethostname(), "reason": reason, "time": self.clock(), "step": self.step,
                "phase": self.phase, "phase_since": self.phase_since, "last_progress": self.last_progress,
                "dump_count": self.dumps + 1, "earlier_reasons": list(self.reasons), "entries": entries}

    def _dump_quietly(self, reason: str) -> None:
        """An automatic dump (signal, exception, watchdog) must not add a failure of its own: a full
        disk is reported by the writer that meets it first."""
        with contextlib.suppress(OSError):
            self.dump(reason)

    def dump(self, reason: str = "requested") -> Path:
        data = self.snapshot(reason)
        self.dumps += 1
        self.reasons.append(reason)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.path, json.dumps(data, indent=0))
        return self.path
