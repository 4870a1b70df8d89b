"""File I/O at the disk's speed: large aligned ``O_DIRECT`` writes and reads with SHA-256 computed in passing.

Writing: :class:`HashingWriteStream` is a write-only file object. ``write`` hashes the bytes (hashlib
releases the GIL) and copies them into page-aligned chunk buffers; a dedicated I/O thread writes each
full chunk with ``pwrite`` on an ``O_DIRECT`` descriptor while the caller fills the next one. The page
cache is bypassed (no second copy, no dirty-page writeback throttling) and no file is ever re-read to
checksum it. ``close`` writes the padded tail, truncates to the true length and fsyncs.

Reading: :func:`read_verified` reads a whole file into one page-aligned buffer with ``O_DIRECT`` in
chunks on an I/O thread while the caller hashes the chunks already read, so verification costs no
extra pass over the disk. The returned buffer is what the checkpoint is then loaded from.

Filesystems without ``O_DIRECT`` (tmpfs, some network mounts) fall back to ordinary buffered I/O with
the same interface.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import queue
import threading
from pathlib import Path

CHUNK = 16 << 20  # bytes per I/O request: large enough to reach the device's streaming bandwidth
ALIGN = 4096  # O_DIRECT offset/length/address alignment (page size covers every common block size)
_DIRECT = getattr(os, "O_DIRECT", 0)


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _open(path: Path, flags: int, direct: bool) -> tuple[int, bool]:
    """(fd, whether O_DIRECT is on): O_DIRECT where the filesystem supports it, else buffered."""
    if direct and _DIRECT:
        try:
            return os.open(path, flags | _DIRECT, 0o644), True
        except OSError:  # EINVAL on tmpfs and friends: buffered I/O below
            pass
    return os.open(path, flags, 0o644), False


class HashingWriteStream:
    """Write-only binary stream: SHA-256 while writing, chunked aligned writes on an I/O thread.

    ``on_close(name, sha256_hex, size)`` is called once the file is durable.
    """

    def __init__(self, path: Path, on_close=None, direct: bool = True, chunk: int = CHUNK) -> None:
        self.path = Path(path)
        self._fd, self.direct = _open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, direct)
        self._chunk = chunk
        self._sha = hashlib.sha256()
        self._on_close = on_close
        self._free: queue.Queue = queue.Queue()
        for _ in range(3):  # one being filled, one being written, one spare
            self._free.put(mmap.mmap(-1, chunk))
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._buf = self._free.get()
        self._fill = 0  # bytes in the current buffer
        self._flushed = 0  # file offset of the current buffer
        self._closed = False
        self._io = threading.Thread(target=self._writer, name=f"write-{self.path.name}", daemon=True)
        self._io.start()

    # ------------------------------------------------------------------ I/O thread
    def _writer(self) -> None:
        while (job := self._jobs.get()) is not None:
            buf, n, offset = job
            try:
                if self._error is None:
                    view = memoryview(buf)[:n]
                    done = 0
                    while done < n:
                        done += os.pwrite(self._fd, view[done:], offset + done)
                    view.release()
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                self._error = e
            self._free.put(buf)

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def _submit(self, padded: int) -> None:
        self._jobs.put((self._buf, padded, self._flushed))
        self._flushed += self._fill
        self._fill = 0

    # ------------------------------------------------------------------ file object
    def write(self, data) -> int:
        self._check()
        view = memoryview(data).cast("B")
        n = len(view)
        self._sha.update(view)
        pos = 0
        while pos < n:
            take = min(self._chunk - self._fill, n - pos)
            self._buf[self._fill:self._fill + take] = view[pos:pos + take]
            self._fill += take
            pos += take
            if self._fill == self._chunk:
                self._submit(self._chunk)
                self._buf = self._free.get()
                self._check()
        view.release()
        return n

    def tell(self) -> int:
        return self._flushed + self._fill

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readable(self) -> bool:
        return False

    def flush(self) -> None:
        pass

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Write the tail, wait for the I/O thread, trim the padding, fsync. Idempotent."""
        if self._closed:
            return
        self._closed = True
        size = self.tell()
        try:
            if self._fill:
                # O_DIRECT writes whole aligned blocks: pad the tail, trim the file afterwards.
                padded = _round_up(self._fill) if self.direct else self._fill
                self._buf[self._fill:padded] = bytes(padded - self._fill)
                self._submit(padded)
            self._jobs.put(None)
            self._io.join()
            self._check()
            os.ftruncate(self._fd, size)
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
        if self._on_close is not None:
            self._on_close(self.path.name, self._sha.hexdigest(), size)

    def abort(self) -> None:
        """Stop after an error elsewhere: no fsync, no digest."""
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
            self._io.join()
            os.close(self._fd)

    def __enter__(self) -> HashingWriteStream:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def read_verified(path: Path, direct: bool = True, chunk: int = CHUNK) -> tuple[memoryview, str]:
    """(the file's bytes, their SHA-256 hex): one pass, reading chunk k+1 while hashing chunk k."""
    path = Path(path)
    size = path.stat().st_size
    buf = mmap.mmap(-1, max(_round_up(size), ALIGN))  # page-aligned, as O_DIRECT needs
    fd, is_direct = _open(path, os.O_RDONLY, direct)
    ready: queue.Queue = queue.Queue()
    error: list[BaseException] = []

    def reader() -> None:
        view = memoryview(buf)
        try:
            for start in range(0, size, chunk):
                end = min(start + chunk, size)
                want = _round_up(end) - start if is_direct else end - start
                got = 0
                while got < end - start:
                    n = os.preadv(fd, [view[start + got:start + want]], start + got)
                    if n == 0:
                        raise OSError(f"{path}: file shrank while reading ({start + got} of {size} bytes)")
                    got += n
                ready.put((start, end))
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            error.append(e)
        finally:
            view.release()
            ready.put(None)

    sha = hashlib.sha256()
    thread = threading.Thread(target=reader, name=f"read-{path.name}", daemon=True)
    thread.start()
    try:
        view = memoryview(buf)
        while (span := ready.get()) is not None:
            sha.update(view[span[0]:span[1]])
        thread.join()
    finally:
        os.close(fd)
    if error:
        raise error[0]
    return view[:size], sha.hexdigest()
