"""Read a whole checkpoint into plain tensors on one process (no model needed).

Used by export, by `stalwart generate`-style tools and by tests that compare training states.
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from stalwart.checkpoint.safe_io import SafeFileSystemReader, SafeLoadPlanner


def load_flat(path: str | Path, prefix: str = "") -> dict[str, Any]:
    """Every entry (tensors and plain values) whose flattened key starts with ``prefix``."""
    reader = SafeFileSystemReader(str(path))
    metadata = reader.read_metadata()
    state: dict[str, Any] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if not key.startswith(prefix):
            continue
        if isinstance(meta, TensorStorageMetadata):
            state[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
        elif isinstance(meta, BytesStorageMetadata):
            state[key] = None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        planner = SafeLoadPlanner(flatten_state_dict=False)
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=planner, no_dist=True)
    # Plain values land in the planner's own (copied) dict.
    return {k: planner.state_dict.get(k, v) for k, v in state.items()}


def digest(path: str | Path, prefix: str = "") -> str:
    """SHA-256 over the sorted tensors of a checkpoint: equal digests mean bit-identical state."""
    h = hashlib.sha256()
    for key, value in sorted(load_flat(path, prefix).items()):
        h.update(key.encode())
        if isinstance(value, torch.Tensor):
            h.update(value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(value).encode())
    return h.hexdigest()
