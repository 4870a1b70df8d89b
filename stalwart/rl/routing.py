"""Routing replay as data: the experts a mixture-of-experts generator chose, shipped with its samples.

The generator's engine records, for every position a response's sequence fed through the model (the
prompt and all response tokens but the last), the top-k experts of every sparse layer, in the order the
layer chose them (``infer.engine``: ``Output.routing``). One response's record is a (positions, sparse
layers, k) array of a compact integer type (int8 up to 127 experts, else int16; ``models.moe.route_dtype``).
The trainer packs a group's records into the rows' shape (``pack``: -1 where nothing is replayed, the
padding) and its forward replays them (``models.moe.Routing``), so it routes every token exactly as the
sampler did. A pending group persisted with the loop's state keeps its records (``to_json``/``from_json``:
the raw bytes in base64, with dtype and shape).

Pure logic: numpy only.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

DTYPES = ("int8", "int16")


def pack(records: list[np.ndarray], length: int) -> np.ndarray:
    """One group's records as (responses, length, sparse layers, k), the rows' positions: a response's
    positions 0.. hold its record, the rest -1 (padding: routed as usual, never trained on)."""
    first = records[0]
    out = np.full((len(records), length, *first.shape[1:]), -1, dtype=first.dtype)
    for i, rec in enumerate(records):
        if rec.shape[0] > length:
            raise ValueError(f"a routing record of {rec.shape[0]} positions exceeds the row length {length}")
        out[i, :rec.shape[0]] = rec
    return out


def to_json(records: list[np.ndarray] | None) -> list[dict[str, Any]] | None:
    """A group's records as JSON values (compact: the bytes themselves, base64)."""
    if records is None:
        return None
    return [{"dtype": str(r.dtype), "shape": list(r.shape), "data": base64.b64encode(r.tobytes()).decode()}
            for r in records]


def from_json(values: list[dict[str, Any]] | None) -> list[np.ndarray] | None:
    """:func:`to_json` read back."""
    if values is None:
        return None
    out = []
    for v in values:
        if v["dtype"] not in DTYPES:
            raise ValueError(f"a routing record of type {v['dtype']!r}; expected one of {', '.join(DTYPES)}")
        out.append(np.frombuffer(base64.b64decode(v["data"]), dtype=v["dtype"]).reshape(v["shape"]).copy())
    return out
