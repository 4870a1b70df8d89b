"""Detectors as pure functions and small state machines: no processes, no torch, clocks passed in.

- ``check_heartbeat``: is a rank unresponsive (no heartbeat) or hung (no step progress)?
- ``SpikeDetector``: robust z-score of the loss over a trailing window.
- ``StragglerDetector``: a rank consistently slower than its peers in a phase.
- ``RestartPolicy``: restart, or stop because of a crash loop / an exhausted budget.
"""

from __future__ import annotations

import re
import statistics
from collections import deque
from dataclasses import dataclass

# Exit codes of `stalwart train` (documented in docs/fault-tolerance.md).
EXIT_OK = 0
EXIT_FAILED = 1            # a worker failed and no restarts were configured
EXIT_USER_ERROR = 2        # a config/data/layout mistake; the message says what to fix
EXIT_ROLLBACK = 3          # worker -> supervisor only: "restart me from the last good state"
EXIT_RESTART_BUDGET = 75   # launch.max_restarts used up while the job still progressed: requeue is fine
EXIT_CRASH_LOOP = 76       # fault.crash_loop_restarts failures in a row without progress: do NOT requeue
EXIT_EXCLUDE = 77          # supervisor -> launcher only: relaunch without the excluded host


# How gloo reports a collective whose peer has gone (exited, killed, or stopped its process group): a
# rank that fails with this is not the root cause of a failure, a peer of it.
PEER_LOST = re.compile(r"Connection (?:closed|reset) by peer|Broken pipe|Socket closed|connectFullMesh failed")
# How gloo reports a collective whose peer never arrived (process-group timeout).
PEER_TIMEOUT = re.compile(r"Timed out waiting \d+ms for (?:recv|send)")

# ---------------------------------------------------------------------- heartbeat / progress
@dataclass(frozen=True)
class Beat:
    """One rank's heartbeat file: written by a thread every ``heartbeat_interval_s``."""

    rank: int
    attempt: int
    step: int             # last completed step
    resumed_step: int     # the step this attempt started from
    phase: str            # init | train | finishing
    progress_time: float  # unix time the last step completed (or the phase began)
    beat_time: float      # unix time the thread last wrote
    peers: bool = False   # waiting on other replica groups (group_recovery's exchange), not on itself

    @classmethod
    def from_dict(cls, d: dict) -> Beat:
        return cls(int(d["rank"]), int(d["attempt"]), int(d["step"]), int(d.get("resumed_step", 0)),
                   str(d.get("phase", "train")), float(d["progress_time"]), float(d["beat_time"]),
                   bool(d.get("peers", False)))


@dataclass(frozen=True)
class Stall:
    kind: str          # "unresponsive" (no heartbeat) or "hang" (heartbeat, but no progress)
    rank: int
    step: int
    since: float       # unix time of the last sign of life / progress: the fault's latest possible start
    detail: str


def check_heartbeat(beat: Beat | None, rank: int, now: float, attempt_start: float, attempt: int,
                    heartbeat_timeout_s: float, progress_timeout_s: float, init_timeout_s: float) -> Stall | None:
    """Return a Stall if ``rank`` is unresponsive or makes no progress, else None."""
    if beat is None or beat.attempt != attempt or beat.beat_time < attempt_start:  # none yet, or an older launch's
        if now - attempt_start > init_timeout_s:
            return Stall("hang", rank, -1, attempt_start, f"no heartbeat {now - attempt_start:.1f} s after start "
                         f"(fault.init_timeout_s = {init_timeout_s:g})")
        return None
    # Start-up (imports, torch.compile) and shutdown (process-group teardown) may hold the GIL for long
    # stretches, so heartbeat staleness is judged only while training; the init timeout covers the rest.
    if beat.phase == "train" and now - beat.beat_time > heartbeat_timeout_s:
        return Stall("unresponsive", rank, beat.step, beat.beat_time,
                     f"no heartbeat for {now - beat.beat_time:.1f} s (fault.heartbeat_timeout_s = "
                     f"{heartbeat_timeout_s:g})")
    limit, name = (progress_timeout_s, "progress_timeout_s") if beat.phase == "train" else (
        init_timeout_s, "init_timeout_s")
    if beat.phase == "train" and beat.peers:  # another group's hang is caught by its own watchdog first
        limit, name = 2 * progress_timeout_s, "progress_timeout_s x 2: waiting on another replica group"
    if now - beat.progress_time > limit:
        return Stall("hang", rank, beat.step, beat.progress_time,
                     f"no step completed for {now - beat.progress_time:.1f} s after step {beat.step} "
                     f"in phase {beat.phase} (fault.{name} = {limit:g})")
    return None


# ---------------------------------------------------------------------- loss spikes
class SpikeDetector:
    """Flag a loss whose robust z-score (median/MAD of the trailing window) exceeds ``threshold``."""

    def __init__(self, threshold: float, window: int, min_history: int | None = None) -> None:
        self.threshold, self.window = threshold, window
        self.min_history = min_history if min_history is not None else max(8, window // 2)
        self.history: deque[float] = deque(maxlen=window)

    def zscore(self, loss: float) -> float | None:
        if len(self.history) < self.min_history:
            return None
        med = statistics.median(self.history)
        mad = statistics.median(abs(x - med) for x in self.history)
        scale = 1.4826 * mad if mad > 0 else max(abs(med) * 1e-3, 1e-12)
        return (loss - med) / scale

    def update(self, loss: float) -> float | None:
        """Return the z-score if ``loss`` is a spike (not added to the history), else None."""
        if self.threshold <= 0:
            return None
        z = self.zscore(loss)
        if z is not None and z > self.threshold:
            return z
        self.history.append(loss)
        return None


# ---------------------------------------------------------------------- stragglers
@dataclass(frozen=True)
class Straggler:
    rank: int
    phase: str
    ratio: float      # the rank's median time / the median of its peers' medians
    steps: int        # over this many steps


class StragglerDetector:
    """A rank whose median per-phase time over ``window`` steps is ``threshold`` x its peers'.

    ``update(times)`` takes ``{phase: [seconds per rank]}`` for one step and returns stragglers newly
    found (each (rank, phase) reported once). Needs >= 2 ranks.
    """

    def __init__(self, threshold: float, window: int, min_seconds: float = 1e-3) -> None:
        self.threshold, self.window, self.min_seconds = threshold, window, min_seconds
        self.samples: dict[str, deque[list[float]]] = {}
        self.reported: set[tuple[int, str]] = set()

    def update(self, times: dict[str, list[float]]) -> list[Straggler]:
        found = []
        for phase, per_rank in times.items():
            q = self.samples.setdefault(phase, deque(maxlen=self.window))
            q.append(list(per_rank))
            if len(q) < self.window or len(per_rank) < 2 or self.threshold <= 0:
                continue
            medians = [statistics.median(s[r] for s in q) for r in range(len(per_rank))]
            for r, m in enumerate(medians):
                peers = statistics.median(medians[:r] + medians[r + 1:])
                ratio = m / max(peers, self.min_seconds)
                if m > self.min_seconds and ratio >= self.threshold and (r, phase) not in self.reported:
                    self.reported.add((r, phase))
                    found.append(Straggler(r, phase, ratio, len(q)))
        return found


# ---------------------------------------------------------------------- restarts
RESTART, CRASH_LOOP, BUDGET_EXHAUSTED, EXCLUDE = "restart", "crash_loop", "budget_exhausted", "exclude"


class RestartPolicy:
    """After each failure: restart, or stop. Progress = the newest saved state's step advanced.

    A crash loop is ``crash_loop_restarts`` failures of the job's own in a row, none separated by
    progress, that fail *the same way*: while training every such failure without progress counts (a
    job that keeps failing before it saves anything is a loop, whatever the cause); a failure during
    start-up counts only when it is the same as the failure before it, the same start-up phase failing
    with the same signature (``FailureSig``). A different start-up failure resets the count instead of
    adding to it, so bad luck is restarted and a start-up that fails deterministically is still stopped.

    A fault from outside the job (``FailureSig.outside``: a SIGKILL or SIGSTOP the job did not send
    itself and the OOM killer did not send; ``ft/origin.py``) is not counted at all, in any phase: it
    neither adds to the row nor ends it, and the failure before it stays the one the next is compared
    with. It still uses a restart, so the budget bounds a job that outside faults keep down (exit 75)."""

    def __init__(self, max_restarts: int, crash_loop_restarts: int, initial_progress: int) -> None:
        self.max_restarts, self.crash_loop_restarts = max_restarts, crash_loop_restarts
        self.restarts = 0
        self.no_progress = 0
        self.progress = initial_progress
        self._last: FailureSig | None = None

    def on_failure(self, progress: int, sig: "FailureSig | None" = None) -> str:
        sig = sig or FailureSig("train", "", None, "")
        if progress > self.progress:
            self.progress, self.no_progress = progress, 0
            self._last = None if sig.outside else sig
        elif sig.outside:
            pass  # not the job's failure: the row of its own failures is left as it was
        elif self.no_progress and (sig.startup or self._last.startup) and not sig.same(self._last):
            self.no_progress, self._last = 1, sig  # not the same failure again: luck, not a loop
        else:
            self.no_progress, self._last = self.no_progress + 1, sig
        if self.crash_loop_restarts and self.no_progress >= self.crash_loop_restarts:
            return CRASH_LOOP
        if self.restarts >= self.max_restarts:
            return BUDGET_EXHAUSTED
        self.restarts += 1
        return RESTART


@dataclass(frozen=True)
class FailureSig:
    """How a failure looked, to tell the same failure again from a different one: the phase it hit
    (a start-up phase, or 'train'), its kind, the exit code, and the first line of the rank's own
    error (numbers and addresses removed, so a pid or a timestamp in it does not make it new)."""

    phase: str
    kind: str
    exitcode: int | None
    error: str
    outside: bool = False  # a fault from outside the job (ft/origin.py): never part of a crash loop

    @property
    def startup(self) -> bool:
        return self.phase != "train"

    def same(self, other: "FailureSig | None") -> bool:
        """The same failure again: phase, kind, exit code and error."""
        return other is not None and (self.phase, self.kind, self.exitcode, self.error) == (
            other.phase, other.kind, other.exitcode, other.error)

    @classmethod
    def of(cls, phase: str, kind: str, exitcode: int | None, error: str | None, outside: bool = False) -> "FailureSig":
        head = (error or "").strip().splitlines()[0] if (error or "").strip() else ""
        return cls(phase, kind, exitcode, re.sub(r"0x[0-9a-fA-F]+|\d+", "#", head)[:300], outside)
