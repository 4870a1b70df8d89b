"""A cheap, bit-exact fingerprint of the whole training state, taken at the metrics cadence.

What it covers: every parameter, every optimizer state tensor (AdamW's moments and step counters),
every rank's RNG state and the data position. Each tensor is read as integers (its bytes viewed as
int32 words, or int16 / uint8 for narrower types, never converted) and summed modulo 2**32 on its own
device: one vectorised pass over memory (an int32 sum that wraps runs at the speed of a float sum; one
widened to int64 is ~50x slower on CPU), nothing copied to the host but one small vector. Any single
changed bit changes its word by +-2**k, k < 32, so it changes the tensor's sum and the fingerprint;
the sums are combined with BLAKE2 in a fixed order (sorted names).

Layout: a rank sums its local shard of each tensor. Integer sums of disjoint shards add up to the
sum of the whole tensor, so the per-tensor values (and the ``params`` / ``optim`` digests) are the
same whether a tensor is replicated (DDP: one copy counted), sharded (FSDP, tensor parallel) or held
by one process: those two components do not depend on the number of processes or the layout. A
piece is identified by the tensor's name and the global offset of its shard; replicas hold the same
piece, which is counted once and summed by one of them (in turn: N replicas each do 1/N of the
work). The ``rng`` component digests the distinct per-rank RNG states and ``data`` the per-rank data
positions in rank order: both depend on the number of data-parallel ranks (each has its own position).

The record carries ``fingerprint`` (the whole state, 16 hex digits), ``fingerprint_parts``
(``params``, ``optim``, ``rng``, ``data``) and ``fingerprint_s`` (what taking it cost); rank 0 also
appends the per-tensor sums to ``<run>/fingerprints.jsonl`` (a ``names`` line whenever the list of names changes, then one
``{"step", "sums"}`` line per fingerprinted step) so that ``stalwart compare --tensors`` can name the
first tensor that differs. One ``all_gather_object`` per fingerprinted step.

NOTE: a sum cannot tell two swapped elements apart, or two changes that cancel exactly; it tells
every single changed bit, which is what a diverging run produces.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

_INT_VIEW = {8: torch.int32, 4: torch.int32, 2: torch.int16, 1: torch.uint8}  # 8 bytes: two int32 words
MASK = (1 << 32) - 1
PARTS = ("params", "optim", "rng", "data")


_OFFSETS: dict[tuple, str] = {}  # (shape, mesh, placements) -> offset key: the same for every step


def _local(t: torch.Tensor) -> tuple[torch.Tensor, str]:
    """This rank's piece of ``t`` and the piece's global offset, as a key ("0,0" for a plain tensor)."""
    if hasattr(t, "to_local"):  # a DTensor: the shard and where it sits in the whole tensor
        layout = (tuple(t.shape), id(t.device_mesh), tuple(t.placements))
        offset = _OFFSETS.get(layout)
        if offset is None:
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            _, at = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            offset = _OFFSETS[layout] = ",".join(str(int(o)) for o in at)
        return t.to_local(), offset
    return t, ",".join("0" * t.dim())


def int_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum, modulo 2**32, of ``t``'s bytes read as integers (int32 words; int16 / uint8 for narrower
    element types), as an int32 0-d tensor on its device. Position-independent, so the sums of disjoint
    shards add up to the whole tensor's."""
    t = t.detach()
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.int32, device=t.device)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    flat = t.contiguous().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    view = _INT_VIEW[flat.element_size()]
    ints = flat if flat.dtype == view else flat.view(view)
    return ints.sum(dtype=torch.int32)


def local_pieces(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list[tuple[str, str, torch.Tensor]]:
    """``(name, offset key, local tensor)`` for this rank's piece of every parameter (``params/NAME``) and
    optimizer state tensor (``optim/NAME/KEY``), in a fixed order."""
    out: list[tuple[str, str, torch.Tensor]] = []
    names = {}
    for name, p in model.named_parameters():
        names[id(p)] = name
        local, offset = _local(p)
        out.append((f"params/{name}", offset, local))
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                for key, value in sorted(optimizer.state.get(p, {}).items()):
                    if isinstance(value, torch.Tensor):
                        local, offset = _local(value)
                        out.append((f"optim/{names.get(id(p), '?')}/{key}", offset, local))
    return out


def assign_owners(keys: dict[int, list[tuple[str, str]]]) -> dict[int, list[int]]:
    """Which rank sums which of its pieces: a piece several ranks hold (a replica) is summed by one of
    them, in turn, so replicated state costs each of N replicas 1/N of the work. Returns, per rank, the
    indices into its own key list. Pure and the same on every rank (it sees the same ``keys``)."""
    holders: dict[tuple[str, str], list[int]] = {}
    for r in sorted(keys):
        for k in keys[r]:
            holders.setdefault(k, []).append(r)
    where = {r: {k: i for i, k in enumerate(keys[r])} for r in keys}
    owned: dict[int, list[int]] = {r: [] for r in keys}
    for n, (k, ranks) in enumerate(holders.items()):
        owner = ranks[n % len(ranks)]
        owned[owner].append(where[owner][k])
    return {r: sorted(v) for r, v in owned.items()}


def _digest(items) -> str:
    h = hashlib.blake2b(digest_size=8)
    for item in items:
        h.update(str(item).encode())
        h.update(b"\0")
    return h.hexdigest()


def combine(ranks: list[dict[str, Any]]) -> tuple[dict[str, int], dict[str, str]]:
    """Per-tensor sums and component digests from every rank's contribution, in rank order.

    Each contribution is ``{"pieces": [(name, offset, sum)], "rng": str, "data": str}``. A piece seen
    on several ranks (a replica) counts once; a tensor's value is the sum of its distinct pieces,
    modulo 2**32. Pure: unit-tested without processes."""
    seen: dict[tuple[str, str], int] = {}
    for contribution in ranks:
        for name, offset, value in contribution["pieces"]:
            seen.setdefault((name, offset), int(value))
    sums: dict[str, int] = {}
    for (name, _), value in seen.items():
        sums[name] = (sums.get(name, 0) + value) & MASK
    sums = dict(sorted(sums.items()))
    parts = {
        "params": _digest(f"{k}={v}" for k, v in sums.items() if k.startswith("params/")),
        "optim": _digest(f"{k}={v}" for k, v in sums.items() if k.startswith("optim/")),
        "rng": _digest(sorted({c["rng"] for c in ranks})),
        "data": _digest(c["data"] for c in ranks),
    }
    return sums, parts


def whole(parts: dict[str, str]) -> str:
    """The fingerprint of the whole state from its components."""
    return _digest(parts[k] for k in PARTS)


def rng_digest() -> str:
    """This rank's RNG states (host, and the accelerator's when one is in use), digested."""
    from stalwart.checkpoint.loader import rng_state

    return _digest(f"{k}={v}" for k, v in sorted(rng_state().items()))


class Fingerprinter:
    """Stamps a step's record with the state fingerprint at the metrics cadence (``every`` steps and the
    last step), collectively: every rank calls ``maybe_stamp`` after each step."""

    def __init__(self, model: torch.nn.Module, optimizer, data_state: Callable[[], dict], every: int, end: int,
                 tensors_file: Path | None, is_main: bool) -> None:
        self.model, self.optimizer, self.data_state = model, optimizer, data_state
        self.every, self.end = max(1, every), end
        self.is_main = is_main
        self.tensors_file = tensors_file
        self._names: list[str] | None = None
        self._sent_keys: list | None = None   # this rank's piece names and offsets, as last sent
        self._keys: dict[int, list] = {}      # every rank's, as last received
        self._owned: dict[int, list[int]] | None = None  # per rank, the indices of the pieces it sums
        self.seconds = 0.0  # time spent fingerprinting in this session (the overhead figure)

    def take(self) -> tuple[str, dict[str, str], dict[str, int]]:
        """(fingerprint, components, per-tensor sums) of the current state (collective).

        A rank sends its pieces' names and offsets (and every piece's sum) only when they changed since
        its last send (the optimizer's state appears after the first step); otherwise just the sums of
        the pieces it owns (``assign_owners``)."""
        pieces = local_pieces(self.model, self.optimizer)
        keys = [(n, o) for n, o, _ in pieces]
        full = keys != self._sent_keys or self._owned is None
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        mine_idx = range(len(pieces)) if full else self._owned[rank]
        sums = [int_sum(pieces[i][2]) for i in mine_idx]
        values = torch.stack(sums).cpu().tolist() if sums else []
        mine = (keys if full else None, values, rng_digest(),
                json.dumps(self.data_state(), sort_keys=True, default=str))
        self._sent_keys = keys
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        ranks, any_keys = [], False
        for r, (rank_keys, rank_values, rng, data) in enumerate(gathered):
            if rank_keys is not None:
                self._keys[r], any_keys = rank_keys, True
                held = rank_keys
            else:
                held = [self._keys[r][i] for i in self._owned[r]]
            ranks.append({"pieces": [(n, o, v) for (n, o), v in zip(held, rank_values)], "rng": rng, "data": data})
        if any_keys:
            self._owned = assign_owners(self._keys)
        sums, parts = combine(ranks)
        return whole(parts), parts, sums

    def maybe_stamp(self, step: int, record: dict[str, Any]) -> None:
        """At a fingerprinted step, add ``fingerprint`` and ``fingerprint_parts`` to ``record``."""
        if step % self.every and step != self.end:
            return
        import time

        t0 = time.perf_counter()
        fp, parts, sums = self.take()
        record["fingerprint"], record["fingerprint_parts"] = fp, parts
        if self.is_main and self.tensors_file is not None:
            self._append(step, sums)
        spent = time.perf_counter() - t0
        record["fingerprint_s"] = spent  # its cost, against the record's step_time_s
        self.seconds += spent

    def _append(self, step: int, sums: dict[str, int]) -> None:
        from stalwart.atomic import storage_errors

        lines = []
        names = list(sums)
        if names != self._names:
            lines.append(json.dumps({"names": names}))
            self._names = names
        lines.append(json.dumps({"step": step, "sums": [f"{v:08x}" for v in sums.values()]}))
        with storage_errors(self.tensors_file):
            with self.tensors_file.open("a", encoding="utf-8") as fh:
                fh.write("\n".join(lines) + "\n")


def read_tensor_sums(path: Path) -> dict[int, dict[str, int]]:
    """``fingerprints.jsonl`` as ``{step: {name: sum}}``; a step written twice (a resumed run) keeps the later."""
    out: dict[int, dict[str, int]] = {}
    names: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn last line of a killed run
        if "names" in rec:
            names = rec["names"]
        elif "step" in rec and len(rec.get("sums", [])) == len(names):
            out[int(rec["step"])] = {n: int(v, 16) for n, v in zip(names, rec["sums"])}
    return out
