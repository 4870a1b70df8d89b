"""A DCP tensor record, read in place: the tensor a ``torch.save`` record holds, as a view of the bytes.

DCP writes each tensor chunk with ``torch.save`` (a small uncompressed zip: a pickle describing the tensor
and its storage bytes, 64-byte aligned). ``torch.load`` on such a record copies the storage out of the
read buffer and parses the zip through a Python file object; the restore then copies the result into the
model a second time. :func:`tensor_from_record` instead finds the storage inside the record and wraps it
with ``torch.frombuffer``, so the only copy is the one into the model. The pickle goes through torch's
weights-only unpickler, the one ``torch.load(weights_only=True)`` uses: a record holding anything but a
plain tensor is refused, never run.
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
import zipfile

import torch
from torch._weights_only_unpickler import Unpickler

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., file name length, extra field length


class RecordError(ValueError):
    """A record that is not a plain tensor saved by ``torch.save``."""


class _ViewFile(io.RawIOBase):
    """A seekable read-only file over a memoryview; zipfile reads only the directory and headers."""

    def __init__(self, view: memoryview) -> None:
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buf) -> int:
        n = max(0, min(len(buf), len(self._view) - self._pos))
        memoryview(buf).cast("B")[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n


def _data_offset(view: memoryview, info: zipfile.ZipInfo) -> int:
    signature, name_len, extra_len = _LOCAL_HEADER.unpack_from(view, info.header_offset)
    if signature != b"PK\x03\x04":
        raise RecordError(f"no zip local header for {info.filename}")
    return info.header_offset + _LOCAL_HEADER.size + name_len + extra_len


def _entry(view: memoryview, info: zipfile.ZipInfo) -> bytes:
    """A small entry's bytes. Not ``ZipFile.read``: Stalwart saves without zip CRCs (the manifest's
    checksum covers the file), and zipfile would refuse the zero CRC."""
    start = _data_offset(view, info)
    return bytes(view[start:start + info.file_size])


def tensor_from_record(view: memoryview) -> torch.Tensor:
    """The tensor in ``view`` (one ``torch.save`` record), sharing its memory: copy it before the buffer
    goes. ``view`` must be writable (``torch.frombuffer`` would warn on a read-only one). Raises
    :class:`RecordError` for bytes that are not a well-formed tensor record, ``pickle.UnpicklingError``
    for a pickle the weights-only unpickler refuses or one holding anything but a plain tensor."""
    try:
        archive = zipfile.ZipFile(_ViewFile(view))
        infos = {info.filename.split("/", 1)[-1]: info for info in archive.infolist()}
        pkl = infos["data.pkl"]
        byteorder = _entry(view, infos["byteorder"]) if "byteorder" in infos else b"little"
        payload = _entry(view, pkl)
    except (zipfile.BadZipFile, KeyError, struct.error) as e:
        raise RecordError(f"not a torch.save record ({type(e).__name__}: {e})") from None
    if byteorder.decode() != sys.byteorder:
        raise RecordError(f"saved {byteorder.decode()}-endian on a {sys.byteorder}-endian machine")

    def persistent_load(saved_id):
        kind, storage_type, key, _location, nbytes_or_numel = saved_id
        if kind != "storage":
            raise RecordError(f"unexpected persistent id {kind!r}")
        info = infos.get(f"data/{key}")
        if info is None or info.compress_type != zipfile.ZIP_STORED:
            raise RecordError(f"storage {key} is missing or compressed")
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        start, nbytes = _data_offset(view, info), info.file_size
        raw = (torch.frombuffer(view, dtype=torch.uint8, count=nbytes, offset=start) if nbytes
               else torch.empty(0, dtype=torch.uint8))
        return torch.storage.TypedStorage(wrap_storage=raw.untyped_storage(), dtype=dtype, _internal=True)

    unpickler = Unpickler(io.BytesIO(payload), encoding="utf-8")
    unpickler.persistent_load = persistent_load
    try:
        tensor = unpickler.load()
    except RuntimeError as e:  # e.g. sizes and strides that reach past the storage
        raise RecordError(f"the tensor does not fit its storage ({e})") from None
    if type(tensor) is not torch.Tensor:
        raise pickle.UnpicklingError(f"the record holds a {type(tensor).__name__}, not a tensor")
    return tensor
