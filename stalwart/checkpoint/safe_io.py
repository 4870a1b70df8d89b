"""Loading DCP checkpoints without unpickling arbitrary objects.

Stock DCP unpickles its ``.metadata`` file with ``pickle.load`` and non-tensor entries (e.g. the
optimizer's ``param_groups``) with ``torch.load(weights_only=False)``: a crafted checkpoint could run
code on load. Stalwart reads both through allow-lists instead: the metadata unpickler accepts only
DCP's own metadata classes and torch dtypes/sizes, and byte entries load with ``weights_only=True``.
"""

from __future__ import annotations

import io
import pickle
import re
import traceback
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint._traverse import set_element


class UnsafeCheckpointError(ValueError):
    """The checkpoint references a Python object outside the allow-list."""


_ALLOWED_MODULES = {"torch.distributed.checkpoint.metadata"}
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "Path"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _ALLOWED_MODULES or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"checkpoint metadata references '{module}.{name}', which is not allowed")


def read_dcp_metadata(stream) -> Metadata:
    try:
        metadata = _MetadataUnpickler(stream).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise UnsafeCheckpointError(f"checkpoint metadata cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError("checkpoint metadata is not a DCP Metadata object")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with ``.metadata`` read through the allow-list, parsed once per reader (it
    grows with tensors x shards: at scale it is large, and DCP asks for it more than once) or taken
    from ``metadata``, parsed by the caller from the same verified file."""

    def __init__(self, path, *args: Any, metadata: Metadata | None = None, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self._parsed: dict[str, Metadata] = {}
        if metadata is not None:
            self._parsed[str(self._get_metadata_path(None))] = metadata
        # Refuse a crafted or damaged .metadata here, before DCP reads it (DCP logs every failed read
        # with a traceback, then retries a rank-local file that does not exist).
        self.read_metadata()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        metadata = self._parsed.get(str(path))
        if metadata is None:
            with self.fs.create_stream(path, "rb") as fh:
                metadata = self._parsed[str(path)] = read_dcp_metadata(fh)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def unpickling_reason(e: BaseException) -> str:
    """One line from a refused ``torch.load(weights_only=True)``: the object it refused, never torch's
    advice to turn the safety off."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    named = [line for line in lines if "GLOBAL" in line or "global" in line]
    plain = [line for line in lines if "weights_only" not in line and "Weights only" not in line]
    return (named or plain or ["a pickled Python object"])[0]


class SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(f"checkpoint entry '{read_item.dest_index.fqn}' is not plain data: "
                                        f"{unpickling_reason(e)}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


_UNSAFE = re.compile(r"(checkpoint (?:metadata|entry) .*?(?:not allowed|not plain data)[^\n]*)|"
                     r"(Weights only load failed[^\n]*)")


def _wrapped(e: BaseException) -> list[BaseException]:
    """The per-rank exceptions DCP wrapped into ``e`` (a ``CheckpointException``), else ``[e]``."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        return [pair[0] if isinstance(pair, tuple) else pair for pair in failures.values()] or [e]
    return [e]


def describe_load_failure(path: Path, e: BaseException) -> str:
    """One line for a failed DCP load; unsafe content (code on load) is named as refused.

    DCP wraps each rank's exception with its traceback, whose source lines may look like the message
    itself: the wrapped exceptions are read first, the text only for what they do not say."""
    inner = _wrapped(e)
    unsafe = next((x for x in inner if isinstance(x, UnsafeCheckpointError)), None)
    if unsafe is not None:
        return f"checkpoint {path}: refused: {unsafe}"
    text = "\n".join("".join(traceback.format_exception_only(type(x), x)) for x in inner)
    m = _UNSAFE.search(text)
    if m and m.group(1):
        return f"checkpoint {path}: refused: {m.group(1).strip()}"
    if m:  # torch's own message goes on to advise turning the safety off: never repeat it
        return (f"checkpoint {path}: refused: a tensor entry holds a pickled Python object, not plain tensor "
                "data (Stalwart never unpickles objects from a checkpoint)")
    msg = text.strip().splitlines()[-1] if text.strip() else type(e).__name__
    return f"checkpoint {path}: cannot be loaded into this model: {msg}"
