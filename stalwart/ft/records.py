"""The files fault tolerance keeps under ``<run>/ft/``, each with one writer format and one reader.

- ``heartbeat/rank-<r>.json``  each rank's liveness and progress (``Heartbeat``, read by the supervisor)
- ``startup/rank-<r>.json``    the start-up phases a rank has begun, with when (``mark_startup``)
- ``exit/rank-<r>.json``       when and why a rank is failing (the supervisor names the earliest)
- ``skip_steps.json``          steps whose update is not applied after a rollback
- ``excluded.json``            hosts taken out of the job (by the supervisor, or a straggler report)

Paths come from :class:`stalwart.paths.RunPaths`; writes are atomic (:mod:`stalwart.atomic`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

from stalwart.atomic import write_json_atomic
from stalwart.paths import RunPaths, rank_files


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------- heartbeats
class Heartbeat:
    """A daemon thread writing ``heartbeat/rank-<r>.json`` every ``interval`` seconds."""

    def __init__(self, paths: RunPaths, rank: int, attempt: int, interval: float,
                 log_event: Callable[..., None] | None = None) -> None:
        """``log_event``: where a process that runs alone (no supervisor) reports its start-up."""
        self.paths, self.path = paths, paths.heartbeat(rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.interval = interval
        self.log_event = log_event
        self.state = {"rank": rank, "attempt": attempt, "pid": os.getpid(), "step": 0, "resumed_step": 0,
                      "phase": "init", "progress_time": time.time()}
        self._trained = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stalwart-heartbeat", daemon=True)

    def start(self) -> None:
        mark_startup(self.paths, "restore", rank=self.state["rank"])  # the guard starts right before the resume
        self.beat()
        self._thread.start()

    def resumed(self, step: int) -> None:
        mark_startup(self.paths, "first_step", rank=self.state["rank"])
        self.state["resumed_step"] = step
        self.progress(step, phase="init")

    def waiting_for_peers(self, waiting: bool) -> None:
        """While true, this rank waits on other replica groups (``fault.group_recovery``): a stall is
        theirs to report first (the supervisor allows it twice ``fault.progress_timeout_s``)."""
        self.state = {**self.state, "peers": waiting}

    def progress(self, step: int, phase: str = "train") -> None:
        self.state = {**self.state, "step": step, "phase": phase, "progress_time": time.time()}
        self.beat()  # at once: the supervisor times recovery from the step's completion
        if phase == "train" and not self._trained:  # start-up ends
            self._trained = True
            mark_startup(self.paths, "training", rank=self.state["rank"])
            if self.log_event is not None and "TORCHELASTIC_RUN_ID" not in os.environ:
                self._report_alone()

    def _report_alone(self) -> None:
        """The ``startup`` event of a process without a supervisor (which would write it otherwise): the
        process is the command's own, so its start is the command's (``from_command_s``)."""
        rank = self.state["rank"]
        rec = read_startup(self.paths, [rank]).get(rank)
        start = rec.get("process_start") if rec else None
        event = startup_event({rank: rec}, start, start) if start else None
        if event is not None:
            self.log_event("startup", attempt=self.state["attempt"], **event)

    def beat(self) -> None:
        try:  # rewritten twice a second: atomic, but not fsynced
            write_json_atomic(self.path, {**self.state, "beat_time": time.time()}, durable=False, indent=None)
        except OSError:
            pass  # a full disk must not kill training; the watchdog will notice missing beats

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.beat()

    def stop(self, phase: str = "done") -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval + 1)
        self.progress(self.state["step"], phase=phase)


def read_heartbeats(paths: RunPaths, ranks: list[int]) -> dict[int, dict]:
    out = {}
    for r in ranks:
        rec = _read_json(paths.heartbeat(r))
        if isinstance(rec, dict):
            out[r] = rec
    return out


# ---------------------------------------------------------------------- start-up phases
# What a worker does before its first step, in order. ``imports`` runs from the process's start to the
# worker's entry; each later phase begins with its mark; the ``training`` mark (its first completed
# step) ends ``first_step``, which holds the evaluation of a fresh start.
STARTUP_PHASES = ("imports", "group", "data", "model", "restore", "first_step")


def process_start_time(pid: int) -> float | None:
    """When process ``pid`` started (unix time), from /proc; None where that cannot be read."""
    try:  # field 22: clock ticks after boot; /proc/uptime: seconds since boot, to 10 ms (btime is whole seconds)
        with open(f"/proc/{pid}/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def mark_startup(paths: RunPaths, phase: str, rank: int | None = None, **info: Any) -> None:
    """This worker begins start-up ``phase`` now. The record (one file per rank, rewritten whole) holds
    this process's phases in order, its start time and ``info`` given with a phase (e.g. the data set-up's
    cache use); the supervisor reads it to report the phases and to know where a failed rank was."""
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    path = paths.startup(rank)
    rec = _read_json(path)
    if not isinstance(rec, dict) or rec.get("pid") != os.getpid():
        rec = {"rank": rank, "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "pid": os.getpid(),
               "process_start": process_start_time(os.getpid()), "phases": [], "info": {}}
    if any(name == phase for name, _ in rec["phases"]):
        return  # once per process: a second trainer in one process (tests, RL) is not a new start-up
    rec["phases"].append([phase, time.time()])
    rec["info"].update(info)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, rec, durable=False)
    except OSError:
        pass  # start-up records are for reports; a full disk must not stop training


def read_startup(paths: RunPaths, ranks: list[int], since: float = 0.0) -> dict[int, dict]:
    """rank -> its start-up record, for processes started at or after ``since``."""
    out = {}
    for r in ranks:
        rec = _read_json(paths.startup(r))
        if isinstance(rec, dict) and rec.get("phases") and rec["phases"][0][1] >= since:
            out[r] = rec
    return out


def startup_phase(rec: dict | None) -> str:
    """The start-up phase a worker is in (or was in when it failed): its newest mark, else imports;
    'train' once it completed a step."""
    phase = rec["phases"][-1][0] if rec and rec.get("phases") else "imports"
    return "train" if phase == "training" else phase


def startup_done(rec: dict) -> float | None:
    """When a worker completed its first step (None before)."""
    return next((t for name, t in rec.get("phases", []) if name == "training"), None)


def startup_seconds(rec: dict) -> dict[str, float]:
    """Seconds in each phase of one worker's start-up (those it completed)."""
    marks = list(rec["phases"])
    if rec.get("process_start"):
        marks.insert(0, ["imports", rec["process_start"]])
    return {f"{name}_s": round(max(0.0, end - t), 3) for (name, t), (_, end) in zip(marks, marks[1:])}


def startup_event(recs: dict[int, dict], begun: float, command_start: float | None = None) -> dict | None:
    """The fields of a ``startup`` event from the start-up records of every rank of one attempt (None
    until each has completed a step): ``to_first_step_s`` from ``begun`` (the launch, or the failure's
    handling), per rank ``spawn_s`` (until its process existed) and its phases' seconds, the data
    set-up's parts, and with ``command_start`` (the command's process start) ``from_command_s``."""
    done = [startup_done(rec) for rec in recs.values()]
    if not recs or None in done:
        return None
    ranks = {str(r): {"spawn_s": round(rec["process_start"] - begun, 3) if rec.get("process_start") else None,
                      **startup_seconds(rec), "pid": rec.get("pid")} for r, rec in sorted(recs.items())}
    data = next((rec["info"]["data"] for rec in recs.values() if rec.get("info", {}).get("data")), None)
    out = {"to_first_step_s": round(max(done) - begun, 3), "ranks": ranks, "data": data}
    if command_start:
        out["from_command_s"] = round(max(done) - command_start, 3)
        out["launcher_s"] = round(begun - command_start, 3)
    return out


# ---------------------------------------------------------------------- exits
def record_exit(paths: RunPaths, rank: int, error: BaseException, user_error: bool = False,
                peer: bool = False) -> bool:
    """Note when and why this rank is failing: the supervisor names the earliest as the root cause
    (and prints a user error's message, which is then the whole of what the user sees). ``peer``: this
    rank stops only because another one failed. Returns whether the record was written."""
    text = str(error) if user_error else f"{type(error).__name__}: {error}"
    try:
        paths.exit_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(paths.exit_record(rank), {"rank": rank, "time": time.time(), "pid": os.getpid(),
                                                    "error": text[:2000], "user_error": user_error,
                                                    "peer": peer})
    except OSError:
        return False
    return True


def read_exit_records(paths: RunPaths, since: float = 0.0) -> dict[int, dict]:
    """rank -> its exit record (``rank``, ``time``, ``error``, ``user_error``, ``peer``), recorded at or
    after ``since``."""
    out = {}
    for p in rank_files(paths.exit_dir, ".json").values():
        rec = _read_json(p)
        try:
            rank, when = int(rec["rank"]), float(rec["time"])
        except (KeyError, TypeError, ValueError):
            continue
        if when >= since:
            out[rank] = {**rec, "rank": rank, "time": when}
    return out


# ---------------------------------------------------------------------- skip list
def read_skip_steps(paths: RunPaths) -> set[int]:
    rec = _read_json(paths.skip_steps)
    try:
        return {int(s) for s in rec["steps"]} if rec else set()
    except (KeyError, TypeError, ValueError):
        return set()


def write_skip_steps(paths: RunPaths, steps: set[int]) -> None:
    paths.ft_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(paths.skip_steps, {"steps": sorted(steps)})


# ---------------------------------------------------------------------- exclusions
def read_exclusions(paths: RunPaths) -> list[dict]:
    rec = _read_json(paths.excluded)
    try:
        return list(rec["excluded"]) if rec else []
    except (KeyError, TypeError):
        return []


def record_exclusion(paths: RunPaths, host: int, host_size: int, reason: str, *, step: int | None = None,
                     restarts_used: int = 0, source: str = "supervisor") -> dict:
    """Append one excluded host. Every record has the same fields, whoever writes it."""
    rec = {"host": host, "ranks": list(range(host * host_size, (host + 1) * host_size)), "size": host_size,
           "reason": reason, "step": step, "restarts_used": restarts_used, "source": source, "time": time.time()}
    paths.ft_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(paths.excluded, {"excluded": [*read_exclusions(paths), rec]})
    return rec
