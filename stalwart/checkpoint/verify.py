"""Verifying a checkpoint against its manifest in the same pass that reads it for loading.

``verify_checkpoint`` checks the manifest, every file's size and checksum (XXH3-128, or SHA-256 in
manifests written before; ``direct_io``). The large shard files are read once, one after another
with direct I/O, each hashed as it arrives. For a load (``keep=True``) the manifest, the sizes and the
small files are checked at once and the shard files keep streaming into a bounded ring of memory
(``VerifiedFiles``, ``read_stream.ReadArena``): the load that follows reads them from there
(``MemoryFileSystemReader``), record by record as they arrive, so it runs beside the disk instead of
after it and holds a few hundred MB however large the checkpoint, and ``VerifiedFiles.check`` compares every
digest before the loaded state is accepted (``loader.load_verified``). The bytes loaded are exactly
the bytes whose checksums were checked, even if the files change afterwards; a checkpoint that fails
is refused by name and ``resume = auto`` falls back past it at load (``CheckpointManager.load_resume``).
With several ranks (``share``) each shard file is checked whole by one rank, the one that wrote it;
another rank that needs records from it (replicated entries, a new layout) reads just those, and the
ranks agree on the outcome before any of them accepts the state.
"""

from __future__ import annotations

import io
import json
import pickle
import re
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.futures import Future

from stalwart.checkpoint.direct_io import ALIGN, HASHES, file_digest
from stalwart.checkpoint.read_stream import READ_ARENA, ReadArena, StreamingRead, units_for_records, units_from_cuts
from stalwart.checkpoint.records import RecordError, tensor_from_record
from stalwart.checkpoint.safe_io import (SafeFileSystemReader, UnsafeCheckpointError, read_dcp_metadata,
                                         unpickling_reason)
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
    into memory: ``reads`` maps a file name to its read and the digest the manifest expects.
    ``pending``: shard files left to other ranks to verify (``verify_checkpoint(share=...)``); the
    records this rank's load needs from one are read here too (:meth:`stream`)."""

    path: Path
    manifest: dict[str, Any]
    reads: dict[str, tuple[StreamingRead, str | None]] = field(default_factory=dict)  # None: a part, unchecked
    pending: dict[str, tuple[str, str]] = field(default_factory=dict)
    arena: ReadArena | None = None
    cuts: dict[str, list[int]] = field(default_factory=dict)  # where each shard file's records start and end
    metadata: Metadata | None = None  # DCP's, parsed once (the load's reader takes it)

    def stream(self, name: str, offsets) -> StreamingRead:
        """A read of the records at ``offsets`` in shard file ``name``, which another rank checks
        whole, started now (after the reads already going): just the spans holding them, unhashed."""
        if name not in self.reads:
            self.pending.pop(name)
            previous = next(reversed(self.reads.values()))[0] if self.reads else None
            try:
                size = (self.path / name).stat().st_size
                units, only = units_for_records(size, self.cuts.get(name, ()), offsets)
                read = StreamingRead(self.path / name, after=previous, arena=self.arena, units=units, only=only)
            except OSError as e:
                raise CheckpointError(f"checkpoint {self.path}: file {name} cannot be read ({e})") from None
            self.reads[name] = (read, None)
        return self.reads[name][0]

    def check(self) -> None:
        """Wait for every shard file read here; raise CheckpointError naming the first that cannot be
        read or fails its checksum."""
        for name, (read, want) in list(self.reads.items()):
            try:
                digest = read.result()
            except OSError as e:
                raise CheckpointError(f"checkpoint {self.path}: file {name} cannot be read ({e})") from None
            if want is not None and digest != want:
                raise CheckpointError(f"checkpoint {self.path}: file {name} fails its checksum (corrupted)")

    def release(self) -> None:
        """Stop any read still going and drop its memory (unmapping takes a while: done beside the caller)."""
        reads, self.reads = self.reads, {}
        for read, _ in reads.values():
            read.cancel()
        threading.Thread(target=reads.clear, name="free-verified", daemon=True).start()


def shard_owner(name: str, world: int) -> int:
    """The rank that verifies shard file ``name`` when ranks share the work: the rank that wrote it
    (``__<rank>_<i>.distcp``), modulo the current world size; rank 0 for any other name."""
    m = re.match(r"__(\d+)_", name)
    return int(m.group(1)) % world if m else 0


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


def verify_checkpoint(path: Path, keep: bool = False, rank: int | None = None,
                      share: tuple[int, int] | None = None) -> VerifiedFiles:
    """Check the manifest and every file's size and checksum; raise CheckpointError naming the bad file.
    ``keep``: return once the manifest, sizes and small files are checked, with the shard files
    streaming into memory for a load, whose ``check()`` compares their digests. ``rank``: read that
    rank's own shard files first (the ones its load needs first). ``share = (rank, world)`` (with
    ``keep``): stream only the shard files this rank owns (:func:`shard_owner`); the others are read
    here only for the records the load needs from them (``VerifiedFiles.stream``). Every file is still
    checked whole by one rank, so the caller must agree on the outcome across ranks
    (``CheckpointManager.load_resume``): ``world`` ranks read the checkpoint about once between them
    instead of ``world`` times each."""
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
    out.metadata = _read_metadata(path) if keep else None
    cuts = _record_bounds(out.metadata)
    units = {name: units_from_cuts((path / name).stat().st_size, cuts.get(name, ())) for name, _ in shards}
    largest = max((e - s for spans in units.values() for s, e in spans), default=0)
    out.arena, out.cuts = ReadArena(max(READ_ARENA, largest + 2 * ALIGN)), cuts
    if keep and share is not None and share[1] > 1:
        out.pending = {n: s for n, s in shards if shard_owner(n, share[1]) != share[0]}
        shards = [(n, s) for n, s in shards if n not in out.pending]
    previous = None
    for name, (algorithm, want) in shards:
        try:
            previous = StreamingRead(path / name, algorithm, after=previous, arena=out.arena, units=units[name])
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


def _read_metadata(path: Path) -> Metadata | None:
    """The DCP metadata (already checked against the manifest); None if unreadable: the load refuses
    it by name before it reads a record."""
    try:
        with (path / ".metadata").open("rb") as fh:
            return read_dcp_metadata(fh)
    except (OSError, UnsafeCheckpointError):
        return None


def _record_bounds(metadata: Metadata | None) -> dict[str, list[int]]:
    """Where each shard file's records start and end, so that every record is read whole into one span
    of memory."""
    cuts: dict[str, list[int]] = defaultdict(list)
    for info in ((metadata.storage_data if metadata else None) or {}).values():
        cuts[info.relative_path] += [info.offset, info.offset + info.length]
    return cuts


class MemoryFileSystemReader(SafeFileSystemReader):
    """The safe DCP reader, serving records from the streaming reads of ``VerifiedFiles`` in the order
    they arrive (files in ``reads`` order, each from its first byte to its last). A tensor record is
    loaded as soon as its bytes are in memory: read in place (``records.tensor_from_record``) and copied
    once into its target; a bytes entry goes to the planner's safe ``load_bytes``."""

    def __init__(self, files: VerifiedFiles) -> None:
        super().__init__(str(files.path), metadata=files.metadata)
        self._files = files
        self._files_path = files.path
        self.in_place = 0  # tensor records read in place

    def read_data(self, plan, planner):
        elsewhere: dict[str, list[int]] = defaultdict(list)  # records in files another rank checks
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if info.relative_path in self._files.pending:
                elsewhere[info.relative_path].append(info.offset)
        for name in sorted(elsewhere):
            self._files.stream(name, elsewhere[name])
        self._reads = {name: read for name, (read, _) in self._files.reads.items()}
        self._order = {name: i for i, name in enumerate(self._reads)}

        def position(item):
            info = self.storage_data[item.storage_index]
            return self._order.get(info.relative_path, len(self._order)), info.offset

        names, passed = list(self._reads), 0
        for item in sorted(plan.items, key=position):
            info = self.storage_data[item.storage_index]
            fqn, read = item.storage_index.fqn, self._reads.get(info.relative_path)
            if read is None:
                raise CheckpointError(f"checkpoint {self._files_path}: entry '{fqn}' is in file "
                                      f"{info.relative_path}, which the manifest does not list")
            for name in names[passed:self._order[info.relative_path]]:  # files this rank is done with
                self._reads[name].consume(self._reads[name].size)
            passed = self._order[info.relative_path]
            read.consume(info.offset)
            try:
                record = read.view(info.offset, info.length)
            except ValueError as e:
                raise CheckpointError(f"checkpoint {self._files_path}: file {info.relative_path}: entry "
                                      f"'{fqn}': {e}") from None
            self._load(item, info, record, planner)
        for read in self._reads.values():
            read.consume(read.size)
        done: Future = Future()
        done.set_result(None)
        return done

    def _load(self, item, info, record: memoryview, planner) -> None:
        fqn = item.storage_index.fqn
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors:  # written through DCP storage extensions (Stalwart's own writer uses none)
            transforms = getattr(self, "transforms", None)
            if transforms is None:
                raise CheckpointError(f"checkpoint {self._files_path}: entry '{fqn}' uses DCP storage "
                                      f"transforms {list(descriptors)}, which this torch cannot read")
            record = memoryview(bytearray(
                transforms.transform_load_stream(item, descriptors, io.BytesIO(bytes(record))).read(-1)))
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(bytes(record)))
            return
        try:
            tensor = tensor_from_record(record)
        except RecordError as e:
            raise CheckpointError(f"checkpoint {self._files_path}: file {info.relative_path}: entry "
                                  f"'{fqn}' is not a tensor record ({e})") from None
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(f"checkpoint entry '{fqn}' is not plain data: {unpickling_reason(e)}") from None
        tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CheckpointError(f"checkpoint {self._files_path}: entry '{fqn}' has shape "
                                  f"{tuple(tensor.size())}, this model wants {tuple(target.size())}")
        target.copy_(tensor)
        planner.commit_tensor(item, target)
        self.in_place += 1
