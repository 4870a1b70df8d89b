"""Token shards in Megatron-LM's ``.bin``/``.idx`` layout (``MMapIndexedDataset``, index version 1).

``NAME.bin`` is the tokens of every document back to back (little-endian uint16, or int32 for
vocabularies of 65,500 and more), each document ending with the end-of-text token. ``NAME.idx`` is:

    b"MMIDIDX\\x00\\x00" | version <Q = 1 | dtype code <B | sequences <Q | documents <Q
    | lengths int32[sequences] | byte pointers int64[sequences] | document index int64[documents]

with one sequence per document, so the document index is ``0, 1, ..., n``. Megatron-LM, NeMo and
the tools built on them read these files as they are; ``numpy.memmap`` reads the ``.bin`` directly.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import numpy as np

from stalwart.atomic import write_bytes_atomic
from stalwart.data.corpus import DataError

HEADER = b"MMIDIDX\x00\x00"
DTYPE_CODES = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


def token_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice: uint16 when every id fits with room to spare, else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_shard(prefix: Path, docs: list[np.ndarray], dtype: np.dtype) -> dict:
    """Write ``prefix.bin``/``prefix.idx`` (each atomically: complete or absent) and return
    the shard's entry for the dataset index: documents, tokens and both files' sha256."""
    lengths = np.array([len(d) for d in docs], dtype=np.int32)
    pointers = np.zeros(len(docs), dtype=np.int64)
    if len(docs) > 1:
        pointers[1:] = np.cumsum(lengths[:-1].astype(np.int64)) * dtype.itemsize
    bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    tokens = np.concatenate(docs).astype(dtype) if docs else np.zeros(0, dtype=dtype)
    header = (HEADER + struct.pack("<Q", 1) + struct.pack("<B", DTYPE_CODES[dtype])
              + struct.pack("<Q", len(docs)) + struct.pack("<Q", len(docs) + 1))
    write_bytes_atomic(bin_path, tokens.tobytes())
    write_bytes_atomic(idx_path, header + lengths.tobytes() + pointers.tobytes()
                       + np.arange(len(docs) + 1, dtype=np.int64).tobytes())
    return {"name": prefix.name, "documents": len(docs), "tokens": int(lengths.sum(dtype=np.int64)),
            "bin_sha256": file_sha256(bin_path), "idx_sha256": file_sha256(idx_path)}


def read_index(idx_path: Path) -> tuple[np.dtype, np.ndarray]:
    """(token dtype, document lengths) of one ``.idx`` file; refuses anything else by name."""
    try:
        raw = idx_path.read_bytes()
    except OSError as e:
        raise DataError(f"data.path: cannot read shard index {idx_path}: {e.strerror}") from None
    head = len(HEADER) + 8 + 1 + 8 + 8
    if len(raw) < head or not raw.startswith(HEADER):
        raise DataError(f"data.path: {idx_path} is not a Megatron .idx shard index (bad header); "
                        "prepare the data again with `stalwart data prepare`")
    version, code = struct.unpack_from("<QB", raw, len(HEADER))
    n_seq, n_doc = struct.unpack_from("<QQ", raw, len(HEADER) + 9)
    if version != 1 or code not in CODE_DTYPES or len(raw) < head + n_seq * 12 + n_doc * 8:
        raise DataError(f"data.path: {idx_path} is a shard index this reader does not understand "
                        f"(version {version}, dtype code {code}) or is truncated")
    lengths = np.frombuffer(raw, dtype=np.int32, count=n_seq, offset=head)
    return CODE_DTYPES[code], lengths


class TokenFile:
    """A shard's tokens, read by positioned reads (``os.pread``): only the bytes asked for enter the process.

    A memory map would do the same reads, but every page it touches (and the kernel maps up to 16
    cached neighbours per fault) counts toward the process's resident memory, which then grows with
    the corpus a long run has visited. The file stays in the OS page cache, shared by all ranks.
    """

    def __init__(self, path: Path, dtype: np.dtype, tokens: int) -> None:
        self.path, self.dtype, self.tokens = path, dtype, tokens
        self._fd = -1
        try:
            self._fd = os.open(path, os.O_RDONLY)
            size = os.fstat(self._fd).st_size
        except OSError as e:
            raise DataError(f"data.path: cannot read shard {path}: {e.strerror}") from None
        if size != tokens * dtype.itemsize:
            self.close()
            raise DataError(f"data.path: shard {path} holds {size} bytes, its index says {tokens} tokens "
                            f"({tokens * dtype.itemsize} bytes); the shard is damaged: prepare the data again")

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count), clipped to the shard."""
        count = max(0, min(count, self.tokens - start))
        raw = os.pread(self._fd, count * self.dtype.itemsize, start * self.dtype.itemsize)
        return np.frombuffer(raw, dtype=self.dtype)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()


def open_tokens(bin_path: Path, dtype: np.dtype, tokens: int) -> TokenFile:
    """A shard's token file, checked to be readable and of the size its index says."""
    return TokenFile(bin_path, dtype, tokens)
