"""A cheap, bit-exact fingerprint of the whole training state, taken at the metrics cadence.

What it covers: every parameter, every optimizer state tensor (AdamW's moments and step counters),
every rank's RNG state and the data position. Each tensor is summed as 64-bit words on its own
device, never converted (``word_sums.py``: sums of disjoint pieces add up to the whole tensor's, and
any single changed bit changes the sum); nothing is copied to the host but one small vector. A
changed bit changes the tensor's sum and the fingerprint; the sums are combined with BLAKE2 in a fixed order (sorted names).

Layout: a rank sums its local shard of each tensor. Integer sums of disjoint shards add up to the
sum of the whole tensor, so the per-tensor values (and the ``params`` / ``optim`` digests) are the
same whether a tensor is replicated (DDP: one copy counted), sharded (FSDP, tensor parallel) or held
by one process: those two components do not depend on the number of processes or the layout. A
piece is identified by the tensor's name and the global offset of its shard; replicas hold the same
piece, which is counted once and summed by one of them (in turn: N replicas each do 1/N of the
work). The ``rng`` component digests the distinct per-rank RNG states and ``data`` the distinct data
positions: the loader's position is the global one (batches served, and what defines the batches:
``data/loader.py``), the same on every rank, so ``data`` is a digest of the global data position and
does not depend on how many ranks read it (an elastic resume onto fewer ranks compares identical); a
rank whose position differed from the others' would add a second one and change it.
Once every rank's list of pieces is known (from the first fingerprint on, until the optimizer's state
appears or the layout changes), a fingerprint costs one fixed-size int64 ``all_gather``.

Sampling (``metrics.fingerprint_sample`` = k, default 4): the parameters are split into k bins of
about equal size (``assign_bins``: largest first into the lightest bin, from every parameter's name
and whole size, so the same bins on every rank and layout), each with its optimizer state, and a
fingerprint at step ``s`` sums bin ``(s // log_interval) % k``, so it reads about 1/k of the state. A
bit changed anywhere is caught by the first fingerprint whose bin holds it, at most k logged steps
later; a diverging step changes every parameter (each gets a gradient), so it is caught at once. The
run's last step also sums every tensor, as ``fingerprint_full``. RNG and data are digested every time.

The record carries ``fingerprint`` (the sampled state, 16 hex digits), ``fingerprint_parts``
(``params``, ``optim``, ``rng``, ``data``), ``fingerprint_s`` (what taking it cost) and
``fingerprint_wait_s`` (of that, the time in the exchange, waiting for the slowest rank included); rank 0 also
appends the per-tensor sums to ``<run>/fingerprints.jsonl`` (a ``names`` line whenever the list of names changes, then one
``{"step", "sums"}`` line per fingerprinted step, null where a tensor was not summed) so that ``stalwart compare --tensors`` can name the
first tensor that differs.

NOTE: a sum cannot tell two swapped elements apart, or two changes that cancel exactly; it tells
every single changed bit, which is what a diverging run produces.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stalwart.runtime.device import HOST
from stalwart.train.word_sums import MASK, piece_of, piece_sums

PARTS = ("params", "optim", "rng", "data")


def local_pieces(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list[tuple[str, str, torch.Tensor]]:
    """``(name, offset key, local tensor)`` for this rank's piece of every parameter (``params/NAME``) and
    optimizer state tensor (``optim/NAME/KEY``), in a fixed order; ``word_sums.piece_sum`` sums one."""
    out: list[tuple[str, str, torch.Tensor]] = []
    names = {}
    for name, p in model.named_parameters():
        names[id(p)] = name
        out.append((f"params/{name}", piece_of(p)[1], p))
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                for key, value in sorted(optimizer.state.get(p, {}).items()):
                    if isinstance(value, torch.Tensor):
                        out.append((f"optim/{names.get(id(p), '?')}/{key}", piece_of(value)[1], value))
    return out


def assign_owners(keys: dict[int, list[tuple[str, str]]],
                  cost: Callable[[tuple[str, str]], tuple[int, int]] | None = None) -> dict[int, list[int]]:
    """Which rank sums which of its pieces: a piece several ranks hold (a replica) is summed by one of
    them, so replicated state costs each of N replicas about 1/N of the work. ``cost(key)`` gives a
    piece's (bin, weight): within each bin, the heaviest pieces first, each goes to the holder with the
    least weight in that bin so far (so each sampled fingerprint's work is shared out too; by default
    every piece weighs 1 in one bin). Returns, per rank, the indices into its own key list. Pure and the
    same on every rank (it sees the same ``keys``)."""
    holders: dict[tuple[str, str], list[int]] = {}
    for r in sorted(keys):
        for k in keys[r]:
            holders.setdefault(k, []).append(r)
    where = {r: {k: i for i, k in enumerate(keys[r])} for r in keys}
    costs = {k: cost(k) if cost is not None else (0, 1) for k in holders}
    load: dict[tuple[int, int], int] = {}
    owned: dict[int, list[int]] = {r: [] for r in keys}
    for k in sorted(holders, key=lambda k: (costs[k][0], -costs[k][1], k)):
        b, w = costs[k]
        owner = min(holders[k], key=lambda r: (load.get((b, r), 0), r))
        load[(b, owner)] = load.get((b, owner), 0) + w
        owned[owner].append(where[owner][k])
    return {r: sorted(v) for r, v in owned.items()}


def param_of(name: str) -> str:
    """The parameter a piece's name belongs to: ``params/NAME`` and ``optim/NAME/KEY`` -> NAME."""
    return name[7:] if name.startswith("params/") else name[6:].rsplit("/", 1)[0]


def param_sizes(model: torch.nn.Module) -> dict[str, int]:
    """Every parameter this rank holds a piece of: name -> the whole tensor's element count."""
    return {name: p.numel() for name, p in model.named_parameters()}  # a DTensor's numel is the whole's


def assign_bins(sizes: dict[str, int], k: int) -> dict[str, int]:
    """Which of ``k`` bins each parameter (with its optimizer state) falls in: largest first, each into
    the lightest bin so far (ties: the lowest), so each bin holds about 1/k of the state. Pure, and the
    same on every rank and layout: it sees every parameter's name and whole size."""
    load, out = [0] * max(1, k), {}
    for name, n in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        b = min(range(len(load)), key=lambda i: (load[i], i))
        out[name], load[b] = b, load[b] + n
    return out


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
    modulo 2**64; RNG states and data positions count once each, so no component depends on the number
    of ranks. Pure: unit-tested without processes."""
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
        "data": _digest(sorted({c["data"] for c in ranks})),
    }
    return sums, parts


def _signed(value: int) -> int:
    """A 64-bit unsigned value as the int64 that has its bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


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
                 tensors_file: Path | None, is_main: bool, sample: int = 1) -> None:
        self.model, self.optimizer, self.data_state = model, optimizer, data_state
        self.every, self.end = max(1, every), end
        self.sample = max(1, sample)  # each fingerprint sums one bin of this many, in turn
        self.is_main = is_main
        self.tensors_file = tensors_file
        self._names: list[str] | None = None
        self._sent_keys: list | None = None   # this rank's piece names and offsets, as last sent
        self._keys: dict[int, list] = {}      # every rank's, as last received
        self._owned: dict[int, list[int]] | None = None  # per rank, the indices of the pieces it sums
        self._bins: dict[str, int] = {}       # parameter name -> its bin (assign_bins)
        self._selected: dict = {}             # chosen bins -> per rank, the owned indices in them
        self.seconds = 0.0  # time spent fingerprinting in this session (the overhead figure)
        self.wait_s = 0.0   # of the last fingerprint, the time in its collective

    def bins_at(self, step: int) -> frozenset[int] | None:
        """The bins a fingerprint at ``step`` sums (None: every tensor): one of ``sample`` in turn, by step."""
        return None if self.sample == 1 else frozenset({(step // self.every) % self.sample})

    def take(self, chosen: frozenset[int] | None = None, full: bool = False
             ) -> tuple[str, dict[str, str], dict[str, int], str | None]:
        """(fingerprint, components, per-tensor sums, whole-state fingerprint or None) of the current
        state (collective). ``chosen``: the bins summed (None: all); ``full``: every tensor is summed,
        the sums are all of them and the fourth value digests them all, the first two still ``chosen``'s.

        Once every rank's pieces are known, a rank sums only the pieces it owns (``assign_owners``) in
        the chosen bins and sends their sums with its RNG and data digests in one fixed-size int64
        ``all_gather``, with a flag saying its list of pieces changed (the optimizer's state appears
        after the first step); if any rank raised it, every rank sends its names, offsets, sizes and
        all its sums as objects instead (and the bins are drawn again from every rank's names)."""
        pieces = local_pieces(self.model, self.optimizer)
        keys = [(n, o) for n, o, _ in pieces]
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        rank = dist.get_rank() if world > 1 else 0
        digests = [rng_digest(), _digest([json.dumps(self.data_state(), sort_keys=True, default=str)])]
        gathered = None
        if self._owned is not None:
            gathered = self._gather_owned(pieces, keys != self._sent_keys, digests, world, rank,
                                          None if full else chosen)
        if gathered is None:  # the first time, or some rank's pieces changed: names and every sum
            mine = (keys, piece_sums([t for _, _, t in pieces]).cpu().tolist(), *digests, param_sizes(self.model))
            objects: list = [mine]
            if world > 1:
                objects = [None] * world
                t0 = time.perf_counter()
                dist.all_gather_object(objects, mine)
                self.wait_s = time.perf_counter() - t0
            gathered, sizes = [], {}
            for r, (rank_keys, rank_values, rng, data, rank_sizes) in enumerate(objects):
                self._keys[r] = rank_keys
                sizes.update(rank_sizes)
                gathered.append((rank_keys, rank_values, rng, data))
            self._bins = assign_bins(sizes, self.sample)
            self._owned = assign_owners(self._keys, lambda k: (  # AdamW's step counters weigh 1
                self._bins.get(param_of(k[0]), 0), 1 if k[0].endswith("/step") else sizes.get(param_of(k[0]), 1)))
            self._selected = {}
        self._sent_keys = keys

        def contributions(bins: frozenset[int] | None) -> list[dict[str, Any]]:
            return [{"pieces": [(n, o, v) for (n, o), v in zip(held, values)
                                if bins is None or self._bins.get(param_of(n), 0) in bins],
                     "rng": rng, "data": data} for held, values, rng, data in gathered]

        sums, parts = combine(contributions(chosen))
        whole_state = None
        if full:  # every tensor's sum goes to the per-tensor file
            sums, all_parts = combine(contributions(None))
            whole_state = whole(all_parts)
        return whole(parts), parts, sums, whole_state

    def _gather_owned(self, pieces, changed: bool, digests: list[str], world: int, rank: int,
                      chosen: frozenset[int] | None) -> list | None:
        """Every rank's (held keys, sums of its owned pieces in the ``chosen`` bins, rng, data) through
        one int64 all_gather, or None (on every rank) when some rank's pieces changed."""
        selected = self._selected.get(chosen)
        if selected is None:  # per rank, the indices it sums for these bins: the same on every rank
            selected = self._selected[chosen] = {
                r: [i for i in owned if chosen is None or self._bins.get(param_of(self._keys[r][i][0]), 0) in chosen]
                for r, owned in self._owned.items()}
        width = max(len(v) for v in selected.values())
        device = pieces[0][2].device if pieces else HOST
        head = [int(changed)] + [_signed(int(d, 16)) for d in digests]
        sums = piece_sums([pieces[i][2] for i in selected[rank]]) if not changed else None
        packed = torch.zeros(len(head) + width, dtype=torch.int64, device=device)
        packed[:len(head)] = torch.tensor(head, dtype=torch.int64)
        if sums is not None and len(sums):
            packed[len(head):len(head) + len(sums)] = sums
        rows = [packed]
        if world > 1:
            rows = [torch.empty_like(packed) for _ in range(world)]
            t0 = time.perf_counter()
            dist.all_gather(rows, packed)
            self.wait_s = time.perf_counter() - t0
        table = torch.stack(rows).cpu().tolist()
        if any(row[0] for row in table):
            return None
        out = []
        for r, row in enumerate(table):
            mine = selected[r]
            out.append(([self._keys[r][i] for i in mine], row[len(head):len(head) + len(mine)],
                         f"{row[1] & MASK:016x}", f"{row[2] & MASK:016x}"))
        return out

    def maybe_stamp(self, step: int, record: dict[str, Any]) -> None:
        """At a fingerprinted step, add ``fingerprint`` and ``fingerprint_parts`` to ``record`` (at the
        last step also ``fingerprint_full``, the whole state's)."""
        if step % self.every and step != self.end:
            return
        t0, self.wait_s = time.perf_counter(), 0.0
        fp, parts, sums, whole_state = self.take(self.bins_at(step), full=step == self.end)
        record["fingerprint"], record["fingerprint_parts"] = fp, parts
        if whole_state is not None and self.sample > 1:
            record["fingerprint_full"] = whole_state
        if self.is_main and self.tensors_file is not None:
            self._append(step, sums)
        spent = time.perf_counter() - t0
        record["fingerprint_s"] = spent  # its cost, against the record's step_time_s
        if self.wait_s:  # of which in the exchange: the gather's latency plus waiting for the slowest rank
            record["fingerprint_wait_s"] = self.wait_s
        self.seconds += spent

    def _append(self, step: int, sums: dict[str, int]) -> None:
        from stalwart.atomic import storage_errors

        lines = []
        names = sorted({n for keys in self._keys.values() for n, _ in keys} | set(sums))
        if names != self._names:
            lines.append(json.dumps({"names": names}))
            self._names = names
        # null: a tensor this step's fingerprint did not sum (metrics.fingerprint_sample)
        lines.append(json.dumps({"step": step, "sums": [f"{sums[n]:016x}" if n in sums else None for n in names]}))
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
            out[int(rec["step"])] = {n: int(v, 16) for n, v in zip(names, rec["sums"]) if v is not None}
    return out
