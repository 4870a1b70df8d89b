"""Weights from trainer ranks to generators over a process group of their own, in buckets, versioned.

Trainers that train a policy and generators that sample from it hold the same model in different
layouts: a trainer rank holds its shards (FSDP's ``Shard(0)`` DTensors, or the whole model when
replicated), a generator the full tensors. A *link* is a standalone group (``runtime.standalone``)
between the ``T`` trainer ranks (group ranks ``0..T-1``) and one generator (group rank ``T``); every
trainer rank sends the pieces it owns straight to the generator, and the generator assembles the full
tensors. Nothing is gathered on one rank and nothing passes through the controller, which only names
the version.

What a trainer rank owns: the local tensor of each DTensor (``_local_tensor``) with its global
offsets, unless it is a replica (a ``Replicate`` mesh dimension where this rank's coordinate is not 0,
or a DTensor on a slice of the trainers' mesh that other slices hold too, as the ep-sharded experts
are held by every tp rank: only the slice with trainer rank 0 sends);
plain tensors (a replicated layout, or buffers beside FSDP's shards) are owned by trainer rank 0.

One sync, per link, per sender: a header (magic, version, reference flag, manifest size, buckets, bytes),
then the manifest (JSON: every chunk's tensor name, dtype, global shape, offsets, local shape, its
byte range in the local tensor and its place in a bucket), then the buckets: flat byte tensors of at
most ``bucket_bytes`` (a tensor larger than a bucket is split across several). A sender keeps at most
two buckets in memory. The receiver allocates the full tensors, copies each chunk in (straight into
the full tensor when the shard is a contiguous block of it, as a ``Shard(0)`` shard is), checks that
every element arrived exactly once, and only then hands the state over: a failed sync installs
nothing. A sync whose version is not newer than the installed one (or not the one expected) is
received to the end (so the sender finishes normally) and refused.

A generator of several processes (its engine tensor-parallel) is several receivers on one link, group
ranks ``T..``: when the link forms, each tells the senders what it takes (:class:`Want`, from
:func:`boxes_of`: the block of each full tensor its shard is, or the full tensors), and each sender
sends each receiver the parts of its own pieces inside that receiver's blocks (:func:`clip`), placed
relative to the block; the receiver assembles its shards as it would full tensors.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from stalwart.runtime.device import synchronize

MAGIC = 0x57_53_59_4E  # "WSYN"
HEADER = 6  # int64 fields: magic, version, reference, manifest bytes, buckets, payload bytes
TAG = 0


class WeightSyncError(RuntimeError):
    """A sync that cannot be installed: refused, incomplete, or inconsistent."""


class OutOfOrder(WeightSyncError):
    """A sync whose version is not newer than the installed weights (or not the one expected)."""


@dataclass(frozen=True)
class Want:
    """What one receiver takes of a policy sync: ``boxes`` (tensor name -> (offsets, shape): the block of
    the full tensor it holds, a tensor-parallel rank's shard) or None for the full tensors; ``reference``:
    whether it takes the frozen reference's syncs too (always the full tensors: a plain copy)."""

    boxes: dict[str, tuple[list[int], list[int]]] | None = None
    reference: bool = True

    @property
    def key(self) -> str:
        return json.dumps([self.boxes, self.reference], sort_keys=True)


@dataclass
class Link:
    """One generator's group: trainer ranks ``0..senders-1`` send, group ranks ``senders..`` receive
    (one per process of the generator). ``wants`` (on a sender: receiver rank -> :class:`Want`, as
    :func:`exchange_wants` told it) defaults to one receiver, rank ``senders``, taking the full tensors."""

    group: object            # a standalone ProcessGroup (runtime.standalone.standalone_group)
    senders: int
    rank: int                # this process's rank in the group
    device: torch.device
    wants: dict[int, Want] | None = None

    def targets(self) -> dict[int, Want]:
        return self.wants if self.wants is not None else {self.senders: Want()}


@dataclass(frozen=True)
class Piece:
    """The part of one tensor a trainer rank owns: ``local`` is the block of the full tensor of
    ``shape`` that starts at ``offsets``."""

    name: str
    local: torch.Tensor
    shape: tuple[int, ...]
    offsets: tuple[int, ...]


def owned_pieces(state: Mapping[str, torch.Tensor], rank: int) -> list[Piece]:
    """The pieces of ``state`` (a model's state dict on trainer rank ``rank``) this rank sends."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = []
    for name, t in state.items():
        if isinstance(t, DTensor):
            mesh, placements = t.device_mesh, t.placements
            coord = mesh.get_coordinate()
            if coord is None or any(isinstance(p, Replicate) and c != 0 for p, c in zip(placements, coord)):
                continue  # another rank sends this replica
            if int(mesh.mesh.min()) != 0:
                continue  # a copy of a mesh slice (ep-sharded experts under tp): the slice holding rank 0 sends
            local_shape, offsets = compute_local_shape_and_global_offset(t.shape, mesh, placements)
            local = t._local_tensor
            if tuple(local.shape) != tuple(local_shape):  # a padded shard: the real rows come first
                local = local[tuple(slice(0, n) for n in local_shape)]
            out.append(Piece(name, local.detach(), tuple(t.shape), tuple(offsets)))
        elif rank == 0:
            out.append(Piece(name, t.detach(), tuple(t.shape), (0,) * t.dim()))
    return out


def boxes_of(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[list[int], list[int]]]:
    """The block of each full tensor this process holds (offsets, shape): a DTensor's local shard, a
    plain tensor whole (a receiver's :class:`Want` for its tensor-parallel shards)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    for name, t in state.items():
        if isinstance(t, DTensor):
            shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            out[name] = (list(offsets), list(shape))
        else:
            out[name] = ([0] * t.dim(), list(t.shape))
    return out


def clip(pieces: list[Piece], boxes: dict[str, tuple[list[int], list[int]]] | None) -> list[Piece]:
    """The parts of ``pieces`` inside a receiver's ``boxes``, each placed in its box (the box is the
    receiver's "full" tensor: its shape, offsets from the box's corner); all of them when None."""
    if boxes is None:
        return pieces
    out = []
    for p in pieces:
        if p.name not in boxes:
            continue
        at, size = boxes[p.name]
        lo = [max(o, a) for o, a in zip(p.offsets, at)]
        hi = [min(o + n, a + m) for o, n, a, m in zip(p.offsets, p.local.shape, at, size)]
        if any(h <= lo_ for lo_, h in zip(lo, hi)):
            continue  # no element of this piece is in the box
        local = p.local[tuple(slice(lo_ - o, h - o) for lo_, h, o in zip(lo, hi, p.offsets))]
        out.append(Piece(p.name, local, tuple(size), tuple(lo_ - a for lo_, a in zip(lo, at))))
    return out


def exchange_wants(link: Link, want: Want | None, receivers: int) -> None:
    """Every receiver tells every sender what it takes (called once a link is formed, by all its
    members: a receiver passes its ``want``, a sender None and learns ``link.wants``)."""
    device, group = link.device, link.group
    if want is not None:
        raw = torch.frombuffer(bytearray(want.key.encode()), dtype=torch.uint8).to(device)
        size = torch.tensor([raw.numel()], dtype=torch.int64, device=device)
        for t in (size, raw):
            for w in [group.send([t], s, TAG) for s in range(link.senders)]:
                w.wait()
        return
    ranks = range(link.senders, link.senders + receivers)
    sizes = {r: torch.zeros(1, dtype=torch.int64, device=device) for r in ranks}
    for w in [group.recv([t], r, TAG) for r, t in sizes.items()]:
        w.wait()
    raws = {r: torch.empty(int(t.item()), dtype=torch.uint8, device=device) for r, t in sizes.items()}
    for w in [group.recv([t], r, TAG) for r, t in raws.items()]:
        w.wait()
    link.wants = {}
    for r, t in raws.items():
        boxes, reference = json.loads(bytes(t.cpu().numpy()))
        link.wants[r] = Want(None if boxes is None else {k: (v[0], v[1]) for k, v in boxes.items()}, reference)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's elements as one flat byte tensor (a copy only when it is not contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightSyncError(f"unknown dtype {name!r} in a weight manifest")
    return dtype


def plan_buckets(pieces: list[Piece], bucket_bytes: int) -> tuple[dict, list[list[tuple[int, int, int, int]]]]:
    """The manifest and, per bucket, its chunks as (piece index, start in the piece, end, start in the
    bucket). Chunks fill buckets in order; a piece larger than the room left is split."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive (got {bucket_bytes})")
    tensors, chunks, buckets, sizes = [], [], [[]], [0]
    for i, p in enumerate(pieces):
        nbytes = p.local.numel() * p.local.element_size()
        tensors.append([p.name, str(p.local.dtype), list(p.shape), list(p.offsets), list(p.local.shape)])
        lo = 0
        while lo < nbytes:
            if sizes[-1] == bucket_bytes:
                buckets.append([])
                sizes.append(0)
            hi = min(nbytes, lo + bucket_bytes - sizes[-1])
            chunks.append([i, lo, hi, len(buckets) - 1, sizes[-1]])
            buckets[-1].append((i, lo, hi, sizes[-1]))
            sizes[-1] += hi - lo
            lo = hi
    if sizes[-1] == 0:
        buckets.pop()
        sizes.pop()
    return {"tensors": tensors, "chunks": chunks, "buckets": sizes}, buckets


def _post(links: list[Link], targets: list[tuple[int, int]], tensor: torch.Tensor,
          errors: dict[int, str]) -> list[tuple[int, object]]:
    """Start sending ``tensor`` to every target (link index, receiver rank) whose link has not failed;
    a link that refuses fails alone."""
    works = []
    for i, dst in targets:
        if i in errors:
            continue
        try:
            works.append((i, links[i].group.send([tensor], dst, TAG)))
        except Exception as e:  # noqa: BLE001 - a connection already closed by a lost generator
            errors[i] = f"{type(e).__name__}: {e}"
    return works


def _wait_live(works: Iterable[tuple[int, object]], errors: dict[int, str]) -> None:
    for i, w in works:
        if i in errors:
            continue
        try:
            w.wait()
        except Exception as e:  # noqa: BLE001 - a lost generator fails its own link, not the others
            errors[i] = f"{type(e).__name__}: {e}"


def send_weights(links: list[Link], state: Mapping[str, torch.Tensor], rank: int, version: int,
                 reference: bool, bucket_bytes: int) -> dict[int, str]:
    """Send this trainer rank's pieces of ``state`` as ``version`` over every link (to every receiver of
    every generator: to each what its :class:`Want` takes; a reference sync only to those that take
    it). Receivers that want the same (the same tensor-parallel rank of every generator) get the same
    buckets. Returns the links that failed (index -> error); the others received everything."""
    if not links:
        raise ValueError("send_weights needs at least one link")
    pieces = owned_pieces(state, rank)
    plans: dict[str, tuple[Want, list[tuple[int, int]]]] = {}
    for i, link in enumerate(links):
        for dst, want in link.targets().items():
            if reference and not want.reference:
                continue
            want = Want() if reference else want
            plans.setdefault(want.key, (want, []))[1].append((i, dst))
    errors: dict[int, str] = {}
    for want, targets in plans.values():
        _send(links, targets, clip(pieces, want.boxes), version, reference, bucket_bytes, errors)
    synchronize(links[0].device)
    return errors


def _send(links: list[Link], targets: list[tuple[int, int]], pieces: list[Piece], version: int, reference: bool,
          bucket_bytes: int, errors: dict[int, str]) -> None:
    """One sync's header, manifest and buckets of ``pieces`` to every target (link index, receiver rank)."""
    manifest, buckets = plan_buckets(pieces, bucket_bytes)
    device = links[0].device
    raw = json.dumps(manifest, separators=(",", ":")).encode()
    header = torch.tensor([MAGIC, version, int(reference), len(raw), len(buckets), sum(manifest["buckets"])],
                          dtype=torch.int64, device=device)
    text = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
    _wait_live(_post(links, targets, header, errors), errors)
    _wait_live(_post(links, targets, text, errors), errors)
    current, flat = -1, None  # one piece's bytes at a time (a copy only if it is not contiguous)
    inflight: deque[list] = deque()
    for b, chunks in enumerate(buckets):
        buf = torch.empty(manifest["buckets"][b], dtype=torch.uint8, device=device)
        for i, lo, hi, start in chunks:
            if i != current:
                current, flat = i, _bytes(pieces[i].local)
            buf[start:start + hi - lo].copy_(flat[lo:hi])
        inflight.append(_post(links, targets, buf, errors))
        if len(inflight) > 1:  # two buckets in flight: the next is packed while this one is sent
            _wait_live(inflight.popleft(), errors)
    while inflight:
        _wait_live(inflight.popleft(), errors)


class _Assembly:
    """Full tensors filled from the chunks of every sender's manifest."""

    def __init__(self, manifests: list[dict], device: torch.device) -> None:
        self.full: dict[str, torch.Tensor] = {}
        self.covered: dict[str, int] = {}
        self.staging: dict[tuple[int, int], torch.Tensor] = {}  # non-contiguous pieces, by (sender, piece)
        self.left: dict[tuple[int, int], int] = {}
        for s, m in enumerate(manifests):
            for i, (name, dtype, shape, offsets, local_shape) in enumerate(m["tensors"]):
                dt = _dtype(dtype)
                have = self.full.get(name)
                if have is None:
                    self.full[name] = torch.empty(shape, dtype=dt, device=device)
                    self.covered[name] = 0
                elif list(have.shape) != shape or have.dtype != dt:
                    raise WeightSyncError(f"senders disagree on {name!r}: {list(have.shape)} {have.dtype} and "
                                          f"{shape} {dtype}")
                self.left[(s, i)] = math.prod(local_shape) * dt.itemsize
                if math.prod(local_shape) == 0:
                    continue
                if not self._contiguous(shape, offsets, local_shape):
                    self.staging[(s, i)] = torch.empty(local_shape, dtype=dt, device=device)
        self.manifests = manifests

    @staticmethod
    def _contiguous(shape: list[int], offsets: list[int], local_shape: list[int]) -> bool:
        return not shape or (list(local_shape[1:]) == list(shape[1:]) and not any(offsets[1:]))

    def put(self, sender: int, chunk: list[int], bucket: torch.Tensor) -> None:
        i, lo, hi, _, start = chunk
        name, _, shape, offsets, local_shape = self.manifests[sender]["tensors"][i]
        data = bucket[start:start + hi - lo]
        key = (sender, i)
        target = self.staging.get(key)
        if target is None:  # a contiguous block of the full tensor: write in place
            full = self.full[name]
            base = (offsets[0] * math.prod(shape[1:]) if shape else 0) * full.element_size()
            _bytes_view(full)[base + lo:base + hi].copy_(data)
        else:
            _bytes_view(target)[lo:hi].copy_(data)
        self.left[key] -= hi - lo
        if self.left[key] == 0:
            self._done(name, offsets, local_shape, target)

    def _done(self, name: str, offsets: list[int], local_shape: list[int], staged: torch.Tensor | None) -> None:
        if staged is not None:
            self.full[name][tuple(slice(o, o + n) for o, n in zip(offsets, local_shape))].copy_(staged)
        self.covered[name] += math.prod(local_shape)

    def finish(self) -> dict[str, torch.Tensor]:
        for (s, i), n in self.left.items():
            if n:
                raise WeightSyncError(f"sender {s} left {n} bytes of {self.manifests[s]['tensors'][i][0]!r} unsent")
        for name, t in self.full.items():
            if self.covered[name] != t.numel():
                raise WeightSyncError(f"{name!r}: {self.covered[name]} of {t.numel()} elements arrived (the "
                                      "senders' pieces must cover the tensor exactly once)")
        return self.full


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """A flat byte view of a contiguous tensor (writes go to the tensor)."""
    return t.view(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def receive_weights(link: Link, version: int, reference: bool, installed: int,
                    into: torch.device | None = None) -> dict[str, torch.Tensor]:
    """The full state every sender of ``link`` sends as ``version``, on ``into`` (default: the link's
    device). Refused (:class:`OutOfOrder`, after the whole sync is received, so the senders finish)
    unless the senders announce ``version``, it is newer than ``installed`` (the generator's current
    version; a reference sync is exempt) and the reference flag matches."""
    device, group = link.device, link.group
    heads = [torch.zeros(HEADER, dtype=torch.int64, device=device) for _ in range(link.senders)]
    for w in [group.recv([h], s, TAG) for s, h in enumerate(heads)]:
        w.wait()
    fields = [h.tolist() for h in heads]
    if any(f[0] != MAGIC for f in fields):
        raise WeightSyncError("a weight sync began without its header: the link is out of step")
    texts = [torch.empty(f[3], dtype=torch.uint8, device=device) for f in fields]
    for w in [group.recv([t], s, TAG) for s, t in enumerate(texts)]:
        w.wait()
    manifests = [json.loads(bytes(t.cpu().numpy())) for t in texts]
    problem = None
    announced = {f[1] for f in fields}
    if announced != {version}:
        problem = f"the trainers sent version {sorted(announced)}, this generator expected {version}"
    elif {bool(f[2]) for f in fields} != {reference}:
        problem = f"a {'reference' if not reference else 'policy'} sync arrived where the other was expected"
    elif not reference and version <= installed:
        problem = f"version {version} is not newer than the installed version {installed}"
    assembly = None if problem else _Assembly(manifests, into or device)
    by_bucket: list[dict[int, list]] = [{} for _ in manifests]
    for s, m in enumerate(manifests):
        for chunk in m["chunks"]:
            by_bucket[s].setdefault(chunk[3], []).append(chunk)

    def post(b: int) -> tuple[dict[int, torch.Tensor], list]:
        bufs = {s: torch.empty(manifests[s]["buckets"][b], dtype=torch.uint8, device=device)
                for s, f in enumerate(fields) if b < f[4]}
        return bufs, [group.recv([buf], s, TAG) for s, buf in bufs.items()]

    n = max((f[4] for f in fields), default=0)
    following = post(0) if n else None
    for b in range(n):  # bucket b + 1 is on its way while bucket b is unpacked
        bufs, works = following
        for w in works:
            w.wait()
        following = post(b + 1) if b + 1 < n else None
        if assembly is not None:
            for s, buf in bufs.items():
                for chunk in by_bucket[s].get(b, []):
                    assembly.put(s, chunk, buf)
    if problem:
        raise OutOfOrder(problem)
    state = assembly.finish()
    synchronize(into or device)
    return state
