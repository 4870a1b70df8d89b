"""The snapshot blob: a state dict of tensors and plain values as one checksummed buffer, no pickle.

Format: ``MAGIC | sha256(rest) | u64 header length | header JSON | raw tensor bytes``. The header holds
the state dict's structure with tensors replaced by ``{"__t__": index}`` entries (dtype, shape, byte
offset); plain values are JSON. Loading checks the digest, parses JSON and views the raw bytes (no copy).
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

import torch

from stalwart.errors import UserError

MAGIC = b"STALWART-SNAP-1\n"
_DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                               torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


class SnapshotError(UserError, RuntimeError):
    """A snapshot blob that is corrupt, malformed or does not fit the model."""


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _encode(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors.append(local_tensor(obj).detach())
        return {"__t__": len(tensors) - 1}
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise TypeError("snapshot state dicts must have string keys")
        return {"__d__": {k: _encode(v, tensors) for k, v in obj.items()}}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, tensors) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot snapshot a value of type {type(obj).__name__}")


class BlobLayout:
    """A blob's header and tensor table, computed from the state's structure alone (no tensor bytes)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.tensors: list[torch.Tensor] = []
        skeleton = _encode(state, self.tensors)
        self.table, offset = [], 0
        for t in self.tensors:
            n = t.numel() * t.element_size()
            self.table.append({"dtype": str(t.dtype), "shape": list(t.shape), "offset": offset, "bytes": n})
            offset += n
        self.header = json.dumps({"state": skeleton, "tensors": self.table}).encode()
        self.start = len(MAGIC) + 32 + 8 + len(self.header)
        self.size = self.start + offset

    def fill(self) -> bytearray:
        """The blob with every tensor's bytes copied in (the checksum not yet set)."""
        blob = bytearray(self.size)
        view = memoryview(blob)
        view[:len(MAGIC)] = MAGIC
        view[len(MAGIC) + 32:self.start] = struct.pack("<Q", len(self.header)) + self.header
        for t, meta in zip(self.tensors, self.table):
            if meta["bytes"]:
                raw = t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
                view[self.start + meta["offset"]: self.start + meta["offset"] + meta["bytes"]] = memoryview(raw)
        return blob

    @staticmethod
    def seal(blob: bytearray) -> bytearray:
        view = memoryview(blob)
        view[len(MAGIC):len(MAGIC) + 32] = hashlib.sha256(view[len(MAGIC) + 32:]).digest()
        return blob


def serialize(state: dict[str, Any]) -> bytearray:
    """One blob, built in a single preallocated buffer (no intermediate copies of the tensor data)."""
    return BlobLayout.seal(BlobLayout(state).fill())


def deserialize(blob: bytes | bytearray, what: str = "snapshot") -> dict[str, Any]:
    """Parse a blob (checksum first). Raises SnapshotError naming ``what`` if anything is off."""
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + 40:
        raise SnapshotError(f"{what}: not a Stalwart snapshot")
    digest, body = bytes(blob[len(MAGIC):len(MAGIC) + 32]), memoryview(blob)[len(MAGIC) + 32:]
    if hashlib.sha256(body).digest() != digest:
        raise SnapshotError(f"{what}: fails its checksum (corrupted or truncated)")
    try:
        (hlen,) = struct.unpack("<Q", body[:8])
        header = json.loads(bytes(body[8:8 + hlen]))
        start = len(MAGIC) + 32 + 8 + hlen
        writable = blob if isinstance(blob, bytearray) else bytearray(blob)  # tensors view it, no copy each
        tensors = []
        for meta in header["tensors"]:
            dtype, off, n = _DTYPES[meta["dtype"]], int(meta["offset"]), int(meta["bytes"])
            if off < 0 or n < 0 or start + off + n > len(blob):
                raise ValueError("tensor data out of range")
            t = torch.frombuffer(writable, dtype=torch.uint8, offset=start + off, count=n) if n else \
                torch.empty(0, dtype=torch.uint8)
            tensors.append(t.view(dtype).reshape(meta["shape"]))
        return _decode(header["state"], tensors)
    except (ValueError, KeyError, TypeError, IndexError, RuntimeError, struct.error) as e:
        raise SnapshotError(f"{what}: malformed ({type(e).__name__}: {e})") from None


def _decode(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__t__" in obj:
            return tensors[int(obj["__t__"])]
        if "__tuple__" in obj:
            return tuple(_decode(v, tensors) for v in obj["__tuple__"])
        return {k: _decode(v, tensors) for k, v in obj["__d__"].items()}
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    return obj


def restore_into(target: Any, saved: Any, where: str) -> Any:
    """Copy saved local shards into the live state dict's tensors; plain values replace."""
    if isinstance(target, torch.Tensor):
        local = local_tensor(target)
        if not isinstance(saved, torch.Tensor) or saved.shape != local.shape or saved.dtype != local.dtype:
            raise SnapshotError(f"snapshot entry {where} does not match the model (layout changed?)")
        with torch.no_grad():
            local.copy_(saved)
        return target
    if isinstance(target, dict):
        if not isinstance(saved, dict) or set(saved) != set(target):
            raise SnapshotError(f"snapshot entry {where or 'root'} does not match the model's keys")
        return {k: restore_into(target[k], saved[k], f"{where}.{k}" if where else k) for k in target}
    return saved
