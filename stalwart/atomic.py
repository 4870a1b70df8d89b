"""Atomic, durable file writes: the one implementation every writer of the run directory uses.

A reader sees either the old file or the new one, never a torn one: the content goes to a temporary
file in the same directory (unique per process and thread, so concurrent writers never share one),
is flushed and fsynced, then renamed over the target. ``durable=False`` skips the fsync for files
that are rewritten many times a second and need only atomicity (heartbeats).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

from stalwart.errors import StorageError


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


_WORDS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
          errno.EROFS: "read-only file system", errno.EACCES: "permission denied", errno.EFBIG: "file too large"}


def storage_problem(error: BaseException, where: Path) -> str | None:
    """What a failed write under ``where`` ran into, in words, or None when storage is not the cause.
    Some writers (torch's zip writer) report a short write only as a position mismatch, so the
    filesystem is probed too: no free space, or not writable."""
    words = _WORDS.get(getattr(error, "errno", None))
    probe = Path(where)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = None
    try:
        st = os.statvfs(probe)
        free = st.f_bavail * st.f_frsize
        if words is None and st.f_flag & os.ST_RDONLY:
            words = _WORDS[errno.EROFS]
        elif words is None and free < 1 << 20 and isinstance(error, (OSError, RuntimeError)):
            words = _WORDS[errno.ENOSPC]
    except OSError:
        pass
    if words is None:
        return None
    return f"{words} writing {where}" + (f" ({free / 2**20:.1f} MiB free)" if free is not None else "")


def describe_write_failure(error: BaseException, where: Path) -> str:
    """One line for a failed write: the storage problem in words when there is one, else the error."""
    return storage_problem(error, where) or f"{type(error).__name__}: {error}"


@contextlib.contextmanager
def storage_errors(where: Path):
    """Turn a write's storage failure (full, quota, read-only) into a ``StorageError`` naming it."""
    try:
        yield
    except StorageError:
        raise
    except OSError as e:
        words = storage_problem(e, where)
        if words is None:
            raise
        raise StorageError(words) from None


def write_bytes_atomic(path: Path, data: bytes | bytearray | memoryview, durable: bool = True) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with storage_errors(path), tmp.open("wb") as fh:
            fh.write(data)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        with storage_errors(path):
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str, durable: bool = True) -> None:
    write_bytes_atomic(path, text.encode("utf-8"), durable)


def write_json_atomic(path: Path, obj: Any, durable: bool = True, indent: int | None = 1) -> None:
    write_text_atomic(path, json.dumps(obj, indent=indent, sort_keys=True), durable)


def output_file(path: str | Path, flag: str) -> Path:
    """The file a command writes when its work is done, checked before the work starts: its directory
    is made if missing, and it must not be a directory. A UserError names ``flag`` otherwise."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StorageError(f"{flag}: cannot make the directory of {p} ({e.strerror})") from None
    if p.is_dir():
        raise StorageError(f"{flag}: {p} is a directory; give a file path")
    try:  # a real write: permissions alone say nothing for root or for /proc-like filesystems
        probe = p.with_name(f".{p.name}.{os.getpid()}.probe")
        probe.open("wb").close()
        probe.unlink()
    except OSError as e:
        raise StorageError(f"{flag}: cannot write into {p.parent} ({_WORDS.get(e.errno) or e.strerror})") from None
    return p


def output_dir(path: str | Path, flag: str) -> Path:
    """A directory a command writes into, made if missing; a StorageError naming ``flag`` when it cannot be
    (a file stands there, a parent is a file, no permission)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise StorageError(f"{flag}: {p} is a file, not a directory; give a directory path")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StorageError(f"{flag}: cannot make the directory {p} ({_WORDS.get(e.errno) or e.strerror})") from None
    return p


@contextlib.contextmanager
def writing_output(path: Path, flag: str):
    """Around the write of an :func:`output_file`: a failure is one line naming ``flag`` and the file."""
    try:
        yield
    except OSError as e:
        raise StorageError(f"{flag}: cannot write {path} ({_WORDS.get(e.errno) or e.strerror or e})") from None


@contextlib.contextmanager
def staged_output(out: str | Path, flag: str, last: tuple[str, ...] = (), prune=None):
    """Write a command's output into a temporary directory beside ``out`` (yielded), then move each
    entry into ``out``, the names in ``last`` last (a reader that opens ``last`` finds the rest in
    place). ``prune(names)``, if given, runs before ``last`` are moved: it removes what an earlier
    output left that this one replaces. Any failure while writing leaves ``out`` as it was, with no
    half-written file: a storage failure (full, quota, read-only) is a StorageError, one line naming
    ``flag``; anything else is raised as it is."""
    out = Path(out)
    existed = out.is_dir()
    output_dir(out, flag)
    tmp: Path | None = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        yield tmp
        names = sorted(p.name for p in tmp.iterdir())
        for name in [n for n in names if n not in last]:
            _move_into(tmp / name, out / name)
        if prune is not None:
            prune(set(names))
        for name in [n for n in last if n in names]:
            _move_into(tmp / name, out / name)
        fsync_dir(out)
    except Exception as e:
        # Probed before the partial output is removed (which frees the space the write lacked).
        probe = e if isinstance(e, (OSError, RuntimeError)) else RuntimeError(str(e))
        words = storage_problem(probe, out)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp = None
        if not existed:
            with contextlib.suppress(OSError):
                out.rmdir()  # only if still empty
        if words is None:
            raise
        raise StorageError(f"{flag}: {words}; nothing was written to {out}") from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _move_into(src: Path, dst: Path) -> None:
    """Rename ``src`` over ``dst`` (a directory there is replaced whole)."""
    if dst.is_dir() and not dst.is_symlink():
        shutil.rmtree(dst)
    os.replace(src, dst)
