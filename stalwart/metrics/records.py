"""Append-only JSON-lines files: metrics.jsonl, events.jsonl, timings (see docs/run-directory.md)."""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import Any

from stalwart.atomic import storage_errors


def _clean(value: Any) -> Any:
    # JSON has no NaN/Inf; write them as strings so a bad step is still visible and parseable.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class JsonlWriter:
    def __init__(self, path: Path, enabled: bool = True) -> None:
        self.path, self.enabled = Path(path), enabled
        self._fh = None

    def write(self, record: dict[str, Any]) -> None:
        self.write_many([record])

    def write_many(self, records: list[dict[str, Any]]) -> None:
        """Append and flush; a full or read-only disk is a ``StorageError`` naming the file."""
        if not self.enabled or not records:
            return
        with storage_errors(self.path):
            if self._fh is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fh = self.path.open("a", encoding="utf-8")
            self._fh.write("".join(json.dumps({k: _clean(v) for k, v in r.items()}) + "\n" for r in records))
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            with contextlib.suppress(OSError):  # already reported by the write that failed
                self._fh.close()
            self._fh = None


class EventLog(JsonlWriter):
    """events.jsonl: one object per event, ``{"time": unix_s, "event": name, ...}``."""

    def __call__(self, event: str, **fields: Any) -> None:
        self.write({"time": time.time(), "event": event, **fields})


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Read a JSON-lines file of records (objects), skipping a torn last line (a crash mid-write) and any
    line that is not an object."""
    out = []
    p = Path(path)
    if not p.is_file():
        return out
    for line in p.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out
