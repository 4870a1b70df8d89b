"""Verifying a checkpoint against its manifest in the same pass that reads it for loading.

``verify_checkpoint`` checks the manifest, every file's size and SHA-256. The large shard files are
read once, with direct I/O, hashing each chunk while the next is read (two files at a time); their
bytes are kept (``VerifiedFiles``) so that the load that follows reads them from memory
(``MemoryFileSystemReader``) instead of from the disk a second time. The bytes loaded are therefore
exactly the bytes whose checksums were checked, even if the files change afterwards.
"""

from __future__ import annotations

import io
import json
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem

from stalwart.checkpoint.direct_io import read_verified
from stalwart.checkpoint.safe_io import SafeFileSystemReader
from stalwart.checkpoint.writer import TRAINER_STATE, sha256_file
from stalwart.errors import PeerUserError, UserError

MANIFEST = "manifest.json"
READERS = 2  # files read and hashed at once (one core each)


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be used; the message names the checkpoint and the bad file."""


class PeerCheckpointError(CheckpointError, PeerUserError):
    """Another rank could not use the checkpoint (this one could)."""


@dataclass
class VerifiedFiles:
    """A verified checkpoint: its manifest and the verified bytes of its shard files."""

    path: Path
    manifest: dict[str, Any]
    data: dict[str, memoryview] = field(default_factory=dict)


def _entries(path: Path) -> tuple[dict[str, Any], list[tuple[str, int, str]]]:
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is missing (incomplete or not a checkpoint)")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        entries = sorted((str(name), int(meta["bytes"]), str(meta["sha256"])) for name, meta in files.items())
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


def verify_checkpoint(path: Path, keep: bool = False) -> VerifiedFiles:
    """Check the manifest and every file's size and checksum; raise CheckpointError naming the bad file.
    ``keep``: hold the shard files' verified bytes for a load from memory."""
    path = Path(path)
    manifest, entries = _entries(path)
    shards = [(n, s) for n, _, s in entries if n.endswith(".distcp")]
    small = [(n, s) for n, _, s in entries if not n.endswith(".distcp")]
    out = VerifiedFiles(path, manifest)
    for name, sha in small:
        if sha256_file(path / name) != sha:
            raise CheckpointError(f"checkpoint {path}: file {name} fails its checksum (corrupted)")
    with ThreadPoolExecutor(max_workers=READERS, thread_name_prefix="verify") as pool:
        reads = {name: pool.submit(read_verified, path / name) for name, _ in shards}
        for name, sha in shards:
            try:
                data, digest = reads[name].result()
            except OSError as e:
                raise CheckpointError(f"checkpoint {path}: file {name} cannot be read ({e})") from None
            if digest != sha:
                raise CheckpointError(f"checkpoint {path}: file {name} fails its checksum (corrupted)")
            if keep:
                out.data[name] = data
            else:
                data.release()
    return out


class _MemoryStream(io.RawIOBase):
    """A read-only, seekable file over verified bytes (no copy until a reader asks for bytes)."""

    def __init__(self, data: memoryview) -> None:
        self._data, self._pos = data, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._data)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buf) -> int:
        n = max(0, min(len(buf), len(self._data) - self._pos))
        memoryview(buf).cast("B")[:n] = self._data[self._pos:self._pos + n]
        self._pos += n
        return n


class _MemoryFileSystem(FileSystem):
    def __init__(self, files: VerifiedFiles) -> None:
        super().__init__()
        self._files = files

    @contextmanager
    def create_stream(self, path, mode: str):
        p = Path(path)
        if mode == "rb" and p.parent == self._files.path and p.name in self._files.data:
            with io.BufferedReader(_MemoryStream(self._files.data[p.name]), buffer_size=1 << 16) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as stream:
            yield stream


class MemoryFileSystemReader(SafeFileSystemReader):
    """The safe DCP reader, serving shard files from their verified bytes."""

    def __init__(self, files: VerifiedFiles) -> None:
        super().__init__(str(files.path))
        self.fs = _MemoryFileSystem(files)
