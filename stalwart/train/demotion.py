"""Demoting a restore source whose state goes non-finite: a bad state is never restored twice.

After every restore the checkpointer watches the steps that follow. If the first ``demote_after``
steps all go non-finite (loss or global gradient norm; both are agreed between the ranks, so every
rank counts alike), the state that was restored is taken to be poisoned: its source (the in-memory
snapshot of step N, or the disk checkpoint of step N) is recorded in ``<run>/ft/demoted.json`` and the
checkpointer restores from the next one, in the order memory snapshot -> newest disk checkpoint ->
older disk checkpoints. The first finite step ends the watch.

Under ``fault.nonfinite = rollback`` each non-finite step restarts the group; the count of bad steps
since the restore is kept in ``<run>/ft/restore_watch.json`` across those restarts, so a poisoned
source is still demoted after ``demote_after`` of them instead of looping until the crash-loop guard.

NOTE: a source is named by its kind and step. A later trajectory that saves the same step again (after
a demotion sent the run back to an older state) is not restored from either; recovery then falls back
to an older checkpoint, which is safe.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from stalwart.atomic import write_json_atomic
from stalwart.paths import RunPaths


def read_demoted(paths: RunPaths) -> list[dict[str, Any]]:
    try:
        data = json.loads(paths.demoted.read_text())
        return [d for d in data.get("demoted", []) if isinstance(d, dict)]
    except (OSError, ValueError, AttributeError):
        return []


class RestoreWatch:
    """What was restored, and how its first steps went. ``after`` is ``checkpoint.demote_after`` (0 = off)."""

    def __init__(self, paths: RunPaths, is_main: bool, after: int, log_event) -> None:
        self.paths, self.is_main, self.after, self.log_event = paths, is_main, after, log_event
        self.demoted = read_demoted(paths)
        self.source: dict[str, Any] | None = None  # {"source", "step", "bad"} while watching

    def steps(self, kind: str) -> set[int]:
        """Steps of demoted sources of ``kind`` (``memory`` or ``disk``)."""
        return {int(d["step"]) for d in self.demoted if d.get("source") == kind}

    def restored(self, kind: str, step: int) -> None:
        """A restore from ``kind`` at ``step``: watch its next steps (the count survives a rollback restart)."""
        if not self.after:
            return
        bad = 0
        try:
            prev = json.loads(self._file().read_text())
            if prev.get("source") == kind and int(prev.get("step", -1)) == step:
                bad = int(prev.get("bad", 0))
        except (OSError, ValueError, AttributeError, TypeError):
            pass
        self.source = {"source": kind, "step": step, "bad": bad}

    @property
    def suspect(self) -> bool:
        """Watching a restore whose steps so far all went non-finite (its state is not saved meanwhile)."""
        return self.source is not None and self.source["bad"] > 0

    def step_done(self, record: dict[str, Any]) -> bool:
        """After a step of the watch: True when the source is to be demoted now."""
        if self.source is None:
            return False
        finite = math.isfinite(float(record.get("loss", math.nan))) and math.isfinite(
            float(record.get("grad_norm", math.nan)))
        if finite:
            self.source = None
            self._clear()
            return False
        return self._count()

    def rolled_back(self) -> None:
        """A non-finite step under ``nonfinite = rollback`` is about to restart the group: count it, durably."""
        if self.source is not None and self._count():
            self.demote()

    def _count(self) -> bool:
        self.source["bad"] += 1
        if self.source["bad"] >= self.after:
            return True
        if self.is_main:
            write_json_atomic(self._file(), self.source)
        return False

    def demote(self) -> dict[str, Any]:
        """Record the watched source as demoted (rank 0 writes the file) and stop watching."""
        entry = {"source": self.source["source"], "step": self.source["step"], "bad_steps": self.source["bad"],
                 "time": time.time()}
        self.demoted.append(entry)
        self.source = None
        if self.is_main:
            write_json_atomic(self.paths.demoted, {"demoted": self.demoted})
            self._clear()
        self.log_event("source_demoted", **entry)
        return entry

    def _file(self):
        return self.paths.restore_watch

    def _clear(self) -> None:
        if self.is_main:
            self._file().unlink(missing_ok=True)
