"""The controller's command history: every command that changes training state, in order, durable.

One JSON object per line in ``<run>/controller/journal.jsonl`` (:attr:`RunPaths.journal`), each with
a sequence number ``seq`` (continuing across sessions of the run) and ``cmd``:

- ``session``   a controller session starts: ``step`` (where the actors resumed), ``actors``, ``config``
                (:func:`config_key` of what defines the run's numbers), ``source`` and ``checks`` (the steps
                an earlier session completed after ``step``, to be computed again and checked)
- ``step``      step N is issued: ``step``, ``batch`` (the data loader's position before the step: the
                batch is rebuilt from it, so the journal never holds token data)
- ``applied``   step N's optimizer step completed on every actor: ``step``, ``lr``, ``loss``, ``grad_norm``
- ``snapshot``  every actor holds its in-memory snapshot of ``step``
- ``recovery``  actor ``rank`` failed (``cause``); state restored to ``step`` from ``source``

Lines are appended and flushed; a ``step`` line is fsync'd (with every line before it) before the
command is sent, so after any crash the journal holds every command that reached an actor. The
results (``applied``, ``snapshot``) ride on the next step's fsync (a group commit) or the close. Reading skips a torn
last line (and cuts it off before appending). :func:`issued_steps` and :func:`applied_records` are pure: a
recovery (``stalwart.controller.replay``) plans its replay from them, tested without processes.

The journal also outlives the controller: a controller killed at any moment is run again with the same
command, resumes from the newest state that survived (in-memory snapshots, else a checkpoint on disk)
and computes again the steps an earlier session had completed after it; :func:`earlier_results` names
them, and each must reproduce its journaled result bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from stalwart.metrics.records import read_jsonl


class Journal:
    """Append-only, fsync'd JSON lines with sequence numbers."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _drop_torn_tail(self.path)
        self.entries: list[dict[str, Any]] = read_jsonl(self.path)
        self.seq = max((int(e.get("seq", 0)) for e in self.entries), default=0)
        self._f = open(self.path, "a", encoding="utf-8")

    def append(self, cmd: str, sync: bool = True, **fields: Any) -> dict[str, Any]:
        """Append one command; ``sync`` makes it (and every line before it) durable before returning.
        An unsynced entry becomes durable with the next synced one (a group commit)."""
        self.seq += 1
        entry = {"seq": self.seq, "time": time.time(), "cmd": cmd, **fields}
        self._f.write(json.dumps(entry, separators=(",", ":")) + "\n")
        self._f.flush()
        if sync:
            os.fsync(self._f.fileno())
        self.entries.append(entry)
        return entry

    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line without its newline (a crash mid-append) so the next entry starts a line."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)
            f.flush()
            os.fsync(f.fileno())


def _this_session(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Entries since the newest ``session`` command (earlier sessions were resumed from a checkpoint)."""
    start = max((i for i, e in enumerate(entries) if e.get("cmd") == "session"), default=-1)
    return entries[start + 1:]


def issued_steps(entries: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Step -> its ``step`` command this session; a step issued again (retried after a failure) is
    represented by its newest issue. Its ``batch`` rebuilds the step's data for a replay."""
    issued: dict[int, dict[str, Any]] = {}
    for e in _this_session(entries):
        if e.get("cmd") == "step":
            issued[int(e["step"])] = e
    return issued


def applied_records(entries: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Step -> its first ``applied`` entry this session: what a replay must reproduce bit for bit."""
    out: dict[int, dict[str, Any]] = {}
    for e in _this_session(entries):
        if e.get("cmd") == "applied":
            out.setdefault(int(e["step"]), e)
    return out


def newest_snapshot(entries: list[dict[str, Any]]) -> int | None:
    """The newest step every actor acknowledged a snapshot of, this session."""
    steps = [int(e["step"]) for e in _this_session(entries) if e.get("cmd") == "snapshot"]
    return max(steps, default=None)


def config_key(sections: dict[str, Any]) -> str:
    """A short digest of the settings that define a run's numbers (the caller picks them): two sessions
    with equal keys must compute every step alike, so one may check the other's results."""
    text = json.dumps(sections, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def earlier_results(entries: list[dict[str, Any]], after: int, key: str) -> dict[int, dict[str, Any]]:
    """Step -> ``{"issued": its step command, "applied": its result}`` for every step after ``after`` that a
    session of the same ``config`` key completed before this session: what a resumed run computes again
    and must reproduce bit for bit. Sessions of another key (the settings changed) are not evidence; of
    several results of one step the first counts (they are equal when the run is deterministic)."""
    out: dict[int, dict[str, Any]] = {}
    issued: dict[int, dict[str, Any]] = {}
    same = False
    for e in entries:
        cmd = e.get("cmd")
        if cmd == "session":
            same, issued = e.get("config") == key, {}
        elif not same:
            continue
        elif cmd == "step":
            issued[int(e["step"])] = e
        elif cmd == "applied" and (s := int(e["step"])) > after and s in issued:
            out.setdefault(s, {"issued": issued[s], "applied": e})
    return out
