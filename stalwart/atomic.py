"""Atomic, durable file writes: the one implementation every writer of the run directory uses.

A reader sees either the old file or the new one, never a torn one: the content goes to a temporary
file in the same directory (unique per process and thread, so concurrent writers never share one),
is flushed and fsynced, then renamed over the target. ``durable=False`` skips the fsync for files
that are rewritten many times a second and need only atomicity (heartbeats).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (best effort: some filesystems refuse)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path: Path, data: bytes | bytearray | memoryview, durable: bool = True) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with tmp.open("wb") as fh:
            fh.write(data)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str, durable: bool = True) -> None:
    write_bytes_atomic(path, text.encode("utf-8"), durable)


def write_json_atomic(path: Path, obj: Any, durable: bool = True, indent: int | None = 1) -> None:
    write_text_atomic(path, json.dumps(obj, indent=indent, sort_keys=True), durable)
