"""Which sequences a global batch holds: pure functions of (seed, batch number), no state.

- **Mixture**: sources have weights; by the end of global batch b, source s has served exactly the
  largest-remainder apportionment of b*G sequences (G = global batch), so each batch holds
  round(G*w_s) give or take one and the running totals never drift.
- **Global shuffle**: within a source, epoch e serves its sequences in the order of a seeded
  pseudo-random permutation (a Feistel network over the index bits, cycle-walked into range): any
  position maps to its sequence in O(1) time and memory, whatever the corpus size.
- Within a batch the slots of all sources are shuffled, then data-parallel rank r takes slots
  [r*G/dp, (r+1)*G/dp): the step's data does not depend on the number of ranks, ranks are disjoint.

The loader's position is therefore one integer (batches served), and resuming is exact.
"""

from __future__ import annotations

import functools

import numpy as np

from stalwart.data.corpus import DataError

_M = 0xFFFFFFFFFFFFFFFF
ROUNDS = 6


def parse_mix(text: str, names: list[str]) -> list[float]:
    """``"a:0.7,b:0.3"`` -> weights in the order of ``names`` (normalised; unnamed sources get 0)."""
    weights = dict.fromkeys(names, 0.0)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, raw = part.rpartition(":")
        try:
            w = float(raw)
        except ValueError:
            w = -1.0
        if not sep or name not in weights or not w >= 0 or w == float("inf"):
            raise DataError(f"data.mix: '{part}' is not SOURCE:WEIGHT with a source of this dataset "
                            f"({', '.join(names)}) and a weight >= 0")
        weights[name] = w
    total = sum(weights.values())
    if total <= 0:
        raise DataError(f"data.mix: '{text}' gives no source a positive weight")
    return [weights[n] / total for n in names]


def apportion(total: int, weights: list[float]) -> np.ndarray:
    """Largest-remainder split of ``total`` by ``weights`` (summing to 1); ties go to the earlier source."""
    quota = np.asarray(weights, dtype=np.float64) * total
    base = np.floor(quota).astype(np.int64)
    left = total - int(base.sum())
    order = sorted(range(len(weights)), key=lambda i: (-(quota[i] - base[i]), i))
    if left > 0:
        base[order[:left]] += 1
    elif left < 0:  # weights that sum a hair over 1 in floating point
        base[[i for i in reversed(order) if base[i] > 0][:-left]] -= 1
    return base


def check_weights(weights: list[float], names: list[str], global_batch: int) -> None:
    """A source with a positive weight needs at least one sequence per global batch."""
    for name, w in zip(names, weights):
        if 0 < w * global_batch < 1:
            raise DataError(f"data.mix: source '{name}' has weight {w:.4g}, less than one of the {global_batch} "
                            "sequences of a global batch; raise its weight or training.global_batch")


def _mix64(z: int) -> int:
    """splitmix64's finaliser (64-bit wrapping arithmetic on Python ints)."""
    z = (z + 0x9E3779B97F4A7C15) & _M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
    return z ^ (z >> 31)


def permutation_key(*parts: int) -> int:
    z = 0
    for p in parts:
        z = _mix64(z ^ (p & _M))
    return z


@functools.lru_cache(maxsize=64)
def _round_keys(key: int) -> tuple[int, ...]:
    return tuple(permutation_key(key, r) for r in range(ROUNDS))


def permute(positions, n: int, key: int) -> np.ndarray:
    """The images of ``positions`` (each in [0, n)) under the seeded permutation of [0, n) named by ``key``.
    About a microsecond per position per round: a batch's few thousand positions cost milliseconds."""
    if n <= 1:
        return np.zeros(len(positions), dtype=np.int64)
    half = max(1, ((n - 1).bit_length() + 1) // 2)  # 2*half bits cover n
    mask, keys = (1 << half) - 1, _round_keys(key)

    def image(x: int) -> int:
        while True:  # cycle-walk: a value outside [0, n) is encrypted again until it lands inside
            left, right = x >> half, x & mask
            for k in keys:
                left, right = right, left ^ (_mix64(right ^ k) & mask)
            x = (left << half) | right
            if x < n:
                return x

    return np.fromiter((image(int(x)) for x in positions), dtype=np.int64, count=len(positions))


def batch_plan(b: int, global_batch: int, weights: list[float], n_sequences: list[int],
               seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(source, sequence) for each of the G slots of global batch ``b``, in slot order."""
    before, after = apportion(b * global_batch, weights), apportion((b + 1) * global_batch, weights)
    sources, sequences = [], []
    for s, (lo, hi) in enumerate(zip(before, after)):
        served = np.arange(lo, hi, dtype=np.int64)  # the source's running sequence numbers
        if not len(served):
            continue
        n = n_sequences[s]
        epochs, pos = served // n, served % n
        seqs = np.empty_like(served)
        for e in np.unique(epochs):  # a batch may straddle an epoch boundary
            sel = epochs == e
            seqs[sel] = permute(pos[sel], n, permutation_key(seed, s, int(e)))
        sources.append(np.full(len(served), s, dtype=np.int64))
        sequences.append(seqs)
    src, seq = np.concatenate(sources), np.concatenate(sequences)
    order = np.random.Generator(np.random.PCG64([seed, 104729, b])).permutation(global_batch)
    return src[order], seq[order]


def served_per_source(batches: int, global_batch: int, weights: list[float]) -> np.ndarray:
    """Sequences each source has served after ``batches`` global batches."""
    return apportion(batches * global_batch, weights)
