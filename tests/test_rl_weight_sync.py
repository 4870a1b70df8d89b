"""Weight sync between real processes: two FSDP-sharded trainer ranks send their own shards (never a
gathered model) to two generators over standalone gloo groups, in many small buckets; every generator
assembles exactly the full state, versions are enforced, a replicated layout sends from rank 0 only, and
a lost generator fails only its own link."""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

import pytest
import torch

from stalwart.comm.weight_sync import (
    Link,
    OutOfOrder,
    Piece,
    owned_pieces,
    plan_buckets,
    receive_weights,
    send_weights,
)
from stalwart.models.flavors import TransformerArgs

TRAINERS, GENERATORS = 2, 2
ARGS = TransformerArgs(dim=24, n_layers=2, n_heads=2, n_kv_heads=2, vocab_size=37, ffn_hidden=40, max_seq_len=16)
BUCKET = 1000  # bytes: the 21 KB model crosses in about 11 buckets per rank, tensors split between them


def _model(seed: int):
    from stalwart.models.llama import Transformer

    torch.manual_seed(seed)
    return Transformer(ARGS)


def _links(store, me: int | None, device, timeout_s: float, attempt: int = 0) -> dict[int, Link]:
    """Trainer rank ``me`` joins every generator's link; a generator (me None) is told its own below."""
    from stalwart.runtime.standalone import standalone_group

    return {g: Link(standalone_group(store, f"wsync-{g}-{attempt}", me, TRAINERS + 1, device, timeout_s, 60.0),
                    TRAINERS, me, device) for g in range(GENERATORS)}


def _process(index: int, port: int, out: str) -> None:
    from stalwart.runtime.device import HOST
    from stalwart.runtime.standalone import connect_store, standalone_group

    torch.set_num_threads(1)
    try:
        store = connect_store(port, 60.0)
        if index < TRAINERS:
            _trainer(index, port, store, HOST, out)
        else:
            g = index - TRAINERS
            link = Link(standalone_group(store, f"wsync-{g}-0", TRAINERS, TRAINERS + 1, HOST, 20.0, 60.0), TRAINERS,
                        TRAINERS, HOST)
            _generator(g, link, out)
    except BaseException:  # noqa: BLE001 - the parent reads the file
        Path(out, f"error-{index}").write_text(traceback.format_exc())
        raise


def _trainer(rank: int, port: int, store, device, out: str) -> None:
    from stalwart.parallel.fsdp import apply_fsdp
    from stalwart.runtime.group import device_mesh, join_attempt, leave

    join_attempt(rank, TRAINERS, port, 0, device, 60.0, 60.0)
    model = _model(0)
    apply_fsdp(model, device_mesh(device, (TRAINERS,), ("dp_shard",)), torch.float32, True)
    sd = model.state_dict()
    sent, whole = sum(p.local.numel() for p in owned_pieces(sd, rank)), sum(t.numel() for t in sd.values())
    assert 0.4 * whole < sent < 0.6 * whole, (sent, whole)  # its own shards: about half, never the model
    links = _links(store, rank, device, 20.0)
    order = list(links.values())
    errors = []
    errors.append(send_weights(order, sd, rank, 1, False, BUCKET))      # version 1
    errors.append(send_weights(order, sd, rank, 1, False, BUCKET))      # version 1 again: refused, sent all
    errors.append(send_weights(order, sd, rank, 0, True, BUCKET))       # the reference
    replicated = _model(1).state_dict()                                  # a replicated layout: rank 0 sends
    errors.append(send_weights(order, replicated, rank, 2, False, BUCKET))
    errors.append(send_weights(order, sd, rank, 3, False, BUCKET))      # generator 1 has left
    Path(out, f"trainer-{rank}.txt").write_text(repr([sorted(e) for e in errors]))
    leave()


def _generator(g: int, link: Link, out: str) -> None:
    got = receive_weights(link, 1, False, installed=-1)
    torch.save(got, Path(out, f"gen-{g}-v1.pt"))
    try:
        receive_weights(link, 1, False, installed=1)
        refused = "no"
    except OutOfOrder as e:
        refused = str(e)
    Path(out, f"gen-{g}-refused.txt").write_text(refused)
    torch.save(receive_weights(link, 0, True, installed=1), Path(out, f"gen-{g}-ref.pt"))
    torch.save(receive_weights(link, 2, False, installed=1), Path(out, f"gen-{g}-v2.pt"))
    if g == 1:
        os._exit(0)  # leaves without receiving version 3: the trainers' link to it fails, not the other
    torch.save(receive_weights(link, 3, False, installed=2), Path(out, f"gen-{g}-v3.pt"))


@pytest.mark.multiproc
def test_sharded_trainers_send_their_shards_and_every_generator_gets_the_full_state(tmp_path):
    import torch.multiprocessing as mp

    from stalwart.runtime.group import controller_store

    store = controller_store(TRAINERS + GENERATORS, 60.0)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_process, args=(i, store.port, str(tmp_path))) for i in range(TRAINERS + GENERATORS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    errors = {f.name: f.read_text() for f in tmp_path.glob("error-*")}
    assert not errors, errors
    assert [p.exitcode for p in procs] == [0] * len(procs)

    want, want2 = _model(0).state_dict(), _model(1).state_dict()
    for g in range(GENERATORS):
        for tag, ref in (("v1", want), ("ref", want), ("v2", want2)) + ((("v3", want),) if g == 0 else ()):
            got = torch.load(tmp_path / f"gen-{g}-{tag}.pt")
            assert got.keys() == ref.keys(), (g, tag)
            for k in ref:
                assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), (g, tag, k)
        assert "not newer than the installed version 1" in (tmp_path / f"gen-{g}-refused.txt").read_text()
    for r in range(TRAINERS):
        errs = eval((tmp_path / f"trainer-{r}.txt").read_text())
        assert errs[:4] == [[], [], [], []], errs  # a refused sync still completes on the sender
        assert errs[4] == [1], errs                # only the link to the generator that left


@pytest.mark.unit
def test_buckets_split_large_tensors_and_cover_every_byte():
    pieces = [Piece("a", torch.arange(10, dtype=torch.float32), (10,), (0,)),
              Piece("b", torch.zeros(3, 2, dtype=torch.float64), (6, 2), (3, 0)),
              Piece("c", torch.ones((), dtype=torch.int64), (), ())]
    manifest, buckets = plan_buckets(pieces, 16)
    assert all(0 < size <= 16 for size in manifest["buckets"])
    assert sum(manifest["buckets"]) == 40 + 48 + 8
    per_piece = {}
    for i, lo, hi, _b, _start in manifest["chunks"]:
        per_piece.setdefault(i, []).append((lo, hi))
    assert {i: (spans[0][0], spans[-1][1]) for i, spans in per_piece.items()} == {0: (0, 40), 1: (0, 48), 2: (0, 8)}
    assert all(a[1] == b[0] for spans in per_piece.values() for a, b in zip(spans, spans[1:]))
    assert len(buckets) == len(manifest["buckets"])
    with pytest.raises(ValueError):
        plan_buckets(pieces, 0)


@pytest.mark.e2e
def test_weight_sync_bench_compares_both_paths_and_the_direct_one_skips_the_controller(tmp_path):
    from conftest import run_cli

    out = tmp_path / "rows.json"
    p = run_cli("bench", "weight-sync", "--flavor", "debug", "--repeats", "1", "--json", str(out), timeout=300)
    rows = {r["path"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"via-controller", "direct"} and all(r["weights_match"] for r in rows.values())
    weights_bytes = rows["via-controller"]["controller_bytes"]
    assert weights_bytes > 2 * 4 * 100_000  # the debug model's weights, in and out of the controller
    assert rows["direct"]["controller_bytes"] < 2048 and rows["direct"]["seconds"] > 0, p.stdout
    assert "| direct |" in p.stdout
    bad = run_cli("bench", "weight-sync", "--repeats", "0", check=False)
    assert bad.returncode == 2 and "--repeats" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.unit
def test_a_tensor_parallel_receiver_gets_exactly_its_shard_from_row_sharded_senders():
    """Two FSDP-like senders (row halves) and receivers that take column or row blocks (a tensor-parallel
    generator's shards): each receiver assembles exactly its block, every element once; a receiver that
    takes the full tensors (``boxes`` None) gets them whole."""
    from stalwart.comm.weight_sync import _Assembly, clip

    full = {"w": torch.arange(48, dtype=torch.float32).reshape(6, 8), "b": torch.arange(8, dtype=torch.float32),
            "s": torch.tensor(3.0)}
    senders = [[Piece("w", full["w"][:3], (6, 8), (0, 0)), Piece("b", full["b"], (8,), (0,)),
                Piece("s", full["s"], (), ())],
               [Piece("w", full["w"][3:], (6, 8), (3, 0))]]
    for boxes, want in (({"w": ([0, 4], [6, 4]), "b": ([0], [8]), "s": ([], [])},     # rowwise: columns 4..7
                         {"w": full["w"][:, 4:], "b": full["b"], "s": full["s"]}),
                        ({"w": ([2, 0], [2, 8]), "b": ([4], [4]), "s": ([], [])},     # a row block across both
                         {"w": full["w"][2:4], "b": full["b"][4:], "s": full["s"]}),
                        (None, full)):
        parts = [clip(pieces, boxes) for pieces in senders]
        plans = [plan_buckets(p, 20) for p in parts]
        assembly = _Assembly([m for m, _ in plans], torch.device("cpu"))
        for s, (manifest, buckets) in enumerate(plans):
            for b, chunks in enumerate(buckets):
                buf = torch.empty(manifest["buckets"][b], dtype=torch.uint8)
                for i, lo, hi, start in chunks:
                    buf[start:start + hi - lo] = parts[s][i].local.contiguous().reshape(-1).view(torch.uint8)[lo:hi]
                for chunk in [c for c in manifest["chunks"] if c[3] == b]:
                    assembly.put(s, chunk, buf)
        got = assembly.finish()
        assert got.keys() == want.keys(), boxes
        assert all(torch.equal(got[k], want[k]) for k in want), boxes
