"""Checkpoint I/O at disk speed: hashing direct-I/O streams, verified single-pass reads, parallel shard
files, loading the earlier on-disk layout, and snapshots taken off the loop."""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict

from stalwart.checkpoint import safe_io, verify, writer
from stalwart.checkpoint.direct_io import HashingWriteStream
from stalwart.checkpoint.read_stream import ReadArena, StreamingRead, read_digest, units_for_records, units_from_cuts
from stalwart.checkpoint.inspect import digest
from stalwart.checkpoint.loader import rng_state
from stalwart.checkpoint.snapshot import SnapshotStore
from stalwart.checkpoint.verify import CheckpointError, verify_checkpoint
from test_checkpoint_unit import manager, tiny, train_step

pytestmark = pytest.mark.unit


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("where", ["disk", "shm"])
def test_hashing_stream_and_verified_read_round_trip_exact_bytes(tmp_path, where):
    base = tmp_path if where == "disk" else Path("/dev/shm")  # tmpfs: no O_DIRECT, buffered fallback
    if not base.is_dir():
        pytest.skip("no /dev/shm")
    seen = {}
    chunk = 8192
    for n in (0, 1, 4096, 3 * chunk + 123):
        data = os.urandom(n)
        path = base / f"stalwart-io-test-{os.getpid()}-{n}.bin"
        try:
            with HashingWriteStream(path, on_close=lambda name, sha, size: seen.update({name: (sha, size)}),
                                    chunk=chunk) as s:
                for i in range(0, n, 5000):  # writes that straddle chunk boundaries
                    s.write(data[i:i + 5000])
                assert s.tell() == n
            assert path.read_bytes() == data
            assert seen[path.name] == (xxhash.xxh3_128(data).hexdigest(), n)
            assert read_digest(path, chunk=chunk) == xxhash.xxh3_128(data).hexdigest()
            assert read_digest(path, chunk=chunk, algorithm="sha256") == hashlib.sha256(data).hexdigest()
            # Records of odd sizes, read whole through an arena smaller than the file: every byte as
            # written, each record in one piece, the memory reused as the consumer moves on.
            cuts = list(range(0, n, 3001)) + [n]
            read = StreamingRead(path, chunk=chunk, arena=ReadArena(3 * chunk),
                                 units=units_from_cuts(n, cuts, target=chunk))
            for a, b in zip(cuts, cuts[1:]):
                read.consume(a)
                assert bytes(read.view(a, b - a)) == data[a:b]
            assert read.result() == xxhash.xxh3_128(data).hexdigest()
        finally:
            path.unlink(missing_ok=True)


def test_large_shards_are_written_by_parallel_writers_and_load_back(tmp_path, monkeypatch):
    monkeypatch.setattr(writer, "PARALLEL_FROM", 1)
    model, opt = tiny()
    train_step(model, opt, 1)
    m = manager(tmp_path, async_save=False)
    path = m.save(1, model, opt, {"tokens_seen": 1})
    manifest = json.loads((path / "manifest.json").read_text())["files"]
    shards = sorted(n for n in manifest if n.endswith(".distcp"))
    assert shards == ["__0_0.distcp", "__0_1.distcp"]
    for name in shards:  # hashed while writing == hashed from the file
        assert manifest[name] == {"xxh3_128": xxhash.xxh3_128((path / name).read_bytes()).hexdigest(),
                                  "bytes": (path / name).stat().st_size}
    before = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})
    fresh, fresh_opt = tiny(seed=4)
    train_step(fresh, fresh_opt, 9)
    parsed = []  # .metadata grows with tensors x shards: the restore parses it once (verify and DCP share it)
    real = verify.read_dcp_metadata
    monkeypatch.setattr(verify, "read_dcp_metadata", lambda fh: parsed.append(1) or real(fh))
    monkeypatch.setattr(safe_io, "read_dcp_metadata", lambda fh: parsed.append(1) or real(fh))
    m.load(path, fresh, fresh_opt)
    assert _same({"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}, before)
    assert len(parsed) == 1


def test_checkpoint_in_the_earlier_layout_still_loads(tmp_path):
    """Stock DCP writer (one file per rank, zip CRCs, page cache) + a manifest: what earlier versions wrote."""
    model, opt = tiny()
    train_step(model, opt, 1)
    path = tmp_path / "step-1"
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, storage_writer=FileSystemWriter(str(path), single_file_per_rank=True),
             no_dist=True)
    (path / "trainer_state.json").write_text(json.dumps({"step": 1, "tokens_seen": 1}))
    (path / "rng-rank0.json").write_text(json.dumps(rng_state()))
    files = {f.name: {"sha256": hashlib.sha256(f.read_bytes()).hexdigest(), "bytes": f.stat().st_size}
             for f in path.iterdir()}
    (path / "manifest.json").write_text(json.dumps({"step": 1, "files": files, "world_size": 1}))
    new = manager(tmp_path / "new", async_save=True)
    new.save(1, model, opt, {"tokens_seen": 1})
    new.wait()
    fresh, fresh_opt = tiny(seed=7)
    train_step(fresh, fresh_opt, 5)
    assert manager(tmp_path).resolve_resume() == path
    loaded = manager(tmp_path).load(path, fresh, fresh_opt)
    assert loaded.step == 1
    assert _same({"model": fresh.state_dict(), "optim": fresh_opt.state_dict()},
                 {"model": model.state_dict(), "optim": opt.state_dict()})
    assert digest(path, "model.") == digest(tmp_path / "new" / "step-1", "model.")
    shard = path / "__0_0.distcp"  # the earlier manifest's SHA-256 still catches a flipped byte
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(data)
    with pytest.raises(CheckpointError, match="__0_0.distcp fails its checksum"):
        verify_checkpoint(path)


def test_snapshot_is_staged_off_the_loop_and_holds_the_state_of_its_step(tmp_path):
    model, opt = tiny()
    train_step(model, opt, 1)
    before = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})
    store = SnapshotStore(tmp_path / "job", 0, 1)
    store.save_async(1, model, opt, {"tokens_seen": 1})
    train_step(model, opt, 2)  # its optimizer step waits for the copy, then mutates the weights
    size = store.wait()
    assert size == store.memory_bytes and store.last_stall_s >= 0
    assert store.newest_complete_step() == 1
    fresh, fresh_opt = tiny(seed=3)
    train_step(fresh, fresh_opt, 7)
    assert store.load(1, fresh, fresh_opt) == {"step": 1, "tokens_seen": 1}
    assert _same({"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}, before)
    assert not _same(before["model"], model.state_dict())  # the later step did change the live weights


def test_read_arena_hands_out_disjoint_spans_and_reuses_them_in_order():
    import random

    arena = ReadArena(64 * 4096)
    rng = random.Random(0)
    live: list[tuple[int, int]] = []
    high = 0
    for _ in range(2000):
        n = rng.choice([1, 4096, 5000, 20 * 4096, 64 * 4096])
        while True:  # what a reader does: wait (here: give back the oldest) until the span fits
            at = arena.alloc(n, stop=lambda: True) if live else arena.alloc(n, stop=lambda: False)
            if at is not None:
                break
            arena.free(live.pop(0)[0])
        span = (at, at + -(-n // 4096) * 4096)
        assert span[1] <= arena.size and at % 4096 == 0
        assert all(span[1] <= s or e <= span[0] for s, e in live), (span, live)
        live.append(span)
        high = max(high, span[1])
        if rng.random() < 0.5:
            arena.free(live.pop(0)[0])
    assert high == arena.size  # the whole ring was used
    with pytest.raises(ValueError, match="does not fit"):
        arena.alloc(arena.size + 1, stop=lambda: False)


def test_files_sharing_a_small_arena_stream_through_it_and_an_unread_one_does_not_stall_them(tmp_path):
    """Three files through an arena of two chunks: the consumer skips the middle file (this rank
    loads nothing from it), gives each record back as it moves on, and every digest still comes out."""
    chunk = 8192
    data = [os.urandom(n) for n in (5 * chunk + 17, 3 * chunk, 4 * chunk - 5)]
    paths = []
    for i, d in enumerate(data):
        paths.append(tmp_path / f"f{i}.bin")
        paths[-1].write_bytes(d)
    arena, previous, reads = ReadArena(2 * chunk), None, []
    for p, d in zip(paths, data):
        previous = StreamingRead(p, chunk=chunk, arena=arena, after=previous,
                                 units=units_from_cuts(len(d), range(0, len(d), 1000), target=chunk))
        reads.append(previous)
    for i in (0, 2):
        if i == 2:  # done with the first file, and nothing wanted from the second
            reads[0].consume(reads[0].size)
            reads[1].consume(reads[1].size)
        for a in range(0, len(data[i]), 1000):
            reads[i].consume(a)
            assert bytes(reads[i].view(a, min(1000, len(data[i]) - a))) == data[i][a:a + 1000]
    assert [r.result() for r in reads] == [xxhash.xxh3_128(d).hexdigest() for d in data]


def test_a_read_of_a_few_records_reads_about_their_bytes(tmp_path):
    """A rank that needs three small records of another rank's 4 MiB file reads their pages, not the
    spans around them: the neighbours close together share a unit, the far one has its own."""
    size, record = 4 << 20, 3000
    data = os.urandom(size)
    path = tmp_path / "shard.distcp"
    path.write_bytes(data)
    cuts = [c for a in range(0, size - record, 64 << 10) for c in (a, a + record)] + [size]
    wanted = [64 << 10, 128 << 10, 3 << 20]
    units, only = units_for_records(size, cuts, wanted, gap=100 << 10)
    assert units[0][0] == 0 and units[-1][1] == size and all(a[1] == b[0] for a, b in zip(units, units[1:]))
    assert sorted(units[u] for u in only) == [(64 << 10, (128 << 10) + record), (3 << 20, (3 << 20) + record)]
    read = StreamingRead(path, arena=ReadArena(1 << 20), units=units, only=only)
    for a in wanted:
        read.consume(a)
        assert bytes(read.view(a, record)) == data[a:a + record]
    assert read.result() is None  # a part of a file has no digest
    fetched = read.bytes_to_read
    assert fetched <= 2 * ((64 << 10) + 2 * 4096 + record), fetched  # pages of the two units, not 4 MiB
    # One record larger than the target keeps a unit of its own; nothing wanted: nothing to read.
    units, only = units_for_records(size, [0, size], [0], target=1 << 20)
    assert units == [(0, size)] and only == {0}
    assert units_for_records(size, cuts, []) == ([(0, size)], set())
