"""Verifying a checkpoint against its manifest in the same pass that reads it for loading.

``verify_checkpoint`` checks the manifest, every file's size and checksum (XXH3-128, or SHA-256 in
manifests written before; ``direct_io``). The large shard files are read once, one after another
with direct I/O, each hashed as it arrives. For a load (``keep=True``) the manifest, the sizes and the
small files are checked at once and the shard files keep streaming into memory (``VerifiedFiles``):
the load that follows reads them from there (``MemoryFileSystemReader``), record by record as they
arrive, so it runs beside the disk instead of after it, and ``VerifiedFiles.check`` compares every
digest before the loaded state is accepted (``loader.load_verified``). The bytes loaded are exactly
the bytes whose checksums were checked, even if the files change afterwards; a checkpoint that fails
is refused by name and ``resume = auto`` falls back past it at load (``CheckpointManager.load_resume``).
"""

from __future__ import annotations

import dataclasses
import io
import json
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystem

from stalwart.checkpoint.direct_io import HASHES, StreamingRead, file_digest
from stalwart.checkpoint.safe_io import SafeFileSystemReader
from stalwart.checkpoint.writer import TRAINER_STATE
from stalwart.errors import PeerUserError, UserError

MANIFEST = "manifest.json"


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be used; the message names the checkpoint and the bad file."""


class PeerCheckpointError(CheckpointError, PeerUserError):
    """Another rank could not use the checkpoint (this one could)."""


@dataclass
class VerifiedFiles:
    """A checkpoint whose manifest, sizes and small files are checked, with its shard files streaming
    into memory: ``reads`` maps a file name to its read and the digest the manifest expects."""

    path: Path
    manifest: dict[str, Any]
    reads: dict[str, tuple[StreamingRead, str]] = field(default_factory=dict)

    def check(self) -> None:
        """Wait for every shard file; raise CheckpointError naming the first that cannot be read or
        fails its checksum."""
        for name, (read, want) in self.reads.items():
            try:
                _, digest = read.result()
            except OSError as e:
                raise CheckpointError(f"checkpoint {self.path}: file {name} cannot be read ({e})") from None
            if digest != want:
                raise CheckpointError(f"checkpoint {self.path}: file {name} fails its checksum (corrupted)")

    def release(self) -> None:
        """Stop any read still going and drop the buffers (unmapping a large one takes a while: done
        beside the caller)."""
        reads, self.reads = self.reads, {}
        for read, _ in reads.values():
            read.cancel()
        threading.Thread(target=reads.clear, name="free-verified", daemon=True).start()


def _checksum(meta: dict[str, Any]) -> tuple[str, str]:
    """(algorithm, hex digest) of a manifest entry: the first algorithm of ``HASHES`` it carries."""
    for algorithm in HASHES:
        if algorithm in meta:
            return algorithm, str(meta[algorithm])
    raise KeyError(f"no checksum (one of {', '.join(HASHES)})")


def _entries(path: Path) -> tuple[dict[str, Any], list[tuple[str, int, tuple[str, str]]]]:
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is missing (incomplete or not a checkpoint)")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        entries = sorted((str(name), int(meta["bytes"]), _checksum(meta)) for name, meta in files.items())
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is corrupt ({type(e).__name__}: {e})") from None
    names = {name for name, _, _ in entries}
    for required in (".metadata", TRAINER_STATE):
        if required not in names:
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} does not list {required} (corrupt manifest)")
    for name, size, _ in entries:
        f = path / name
        if "/" in name or name.startswith(".."):
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} names a file outside it: {name}")
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path}: file {name} is missing")
        if f.stat().st_size != size:
            raise CheckpointError(f"checkpoint {path}: file {name} has {f.stat().st_size} bytes, "
                                  f"expected {size} (truncated?)")
    return manifest, entries


def verify_checkpoint(path: Path, keep: bool = False, rank: int | None = None) -> VerifiedFiles:
    """Check the manifest and every file's size and checksum; raise CheckpointError naming the bad file.
    ``keep``: return once the manifest, sizes and small files are checked, with the shard files
    streaming into memory for a load, whose ``check()`` compares their digests. ``rank``: read that
    rank's own shard files first (the ones its load needs first)."""
    path = Path(path)
    manifest, entries = _entries(path)
    shards = [(n, s) for n, _, s in entries if n.endswith(".distcp")]
    small = [(n, s) for n, _, s in entries if not n.endswith(".distcp")]
    out = VerifiedFiles(path, manifest)
    for name, (algorithm, want) in small:
        if file_digest(path / name, algorithm) != want:
            raise CheckpointError(f"checkpoint {path}: file {name} fails its checksum (corrupted)")
    if rank is not None:
        shards.sort(key=lambda e: not e[0].startswith(f"__{rank}_"))  # stable: by name within each group
    previous = None
    for name, (algorithm, want) in shards:
        try:
            previous = StreamingRead(path / name, algorithm, after=previous)
        except OSError as e:
            out.release()  # the reads already started stop
            raise CheckpointError(f"checkpoint {path}: file {name} cannot be read ({e})") from None
        out.reads[name] = (previous, want)
    if not keep:
        try:
            out.check()
        finally:
            out.release()
    return out


class _MemoryStream(io.RawIOBase):
    """A read-only, seekable file over a streaming read's bytes (no copy until a reader asks for bytes;
    a read waits until those bytes have arrived)."""

    def __init__(self, read: StreamingRead) -> None:
        self._source, self._pos = read, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._source.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buf) -> int:
        n = max(0, min(len(buf), self._source.size - self._pos))
        data = self._source.wait_for(self._pos + n)
        if n >= 1 << 20:  # torch's copy releases the GIL and uses the intra-op threads
            torch.frombuffer(buf, dtype=torch.uint8, count=n).copy_(
                torch.frombuffer(data, dtype=torch.uint8, count=n, offset=self._pos))
        else:
            memoryview(buf).cast("B")[:n] = data[self._pos:self._pos + n]
        self._pos += n
        return n


class _MemoryFileSystem(FileSystem):
    def __init__(self, files: VerifiedFiles) -> None:
        super().__init__()
        self._files = files

    @contextmanager
    def create_stream(self, path, mode: str):
        p = Path(path)
        if mode == "rb" and p.parent == self._files.path and p.name in self._files.reads:
            with io.BufferedReader(_MemoryStream(self._files.reads[p.name][0]), buffer_size=1 << 16) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as stream:
            yield stream


class MemoryFileSystemReader(SafeFileSystemReader):
    """The safe DCP reader, serving shard files from their streaming reads, in the order they are read:
    files in ``VerifiedFiles.reads`` order, each from its first byte to its last (DCP itself asks for
    a file's records in the order of the load plan)."""

    def __init__(self, files: VerifiedFiles) -> None:
        super().__init__(str(files.path))
        self.fs = _MemoryFileSystem(files)
        self._order = {name: i for i, name in enumerate(files.reads)}

    def read_data(self, plan, planner):
        def position(item):
            info = self.storage_data[item.storage_index]
            return self._order.get(info.relative_path, len(self._order)), info.offset

        return super().read_data(dataclasses.replace(plan, items=sorted(plan.items, key=position)), planner)
