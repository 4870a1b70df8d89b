"""Read a prepared dataset: its index, checksums, tokenizer identity and token streams (positioned reads)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stalwart.data.corpus import DataError
from stalwart.data.prepare import FORMAT, INDEX, TOKENIZER, tokenizer_sha256
from stalwart.data.shards import TokenFile, file_sha256, open_tokens, read_index


def is_prepared(path: str) -> bool:
    """A directory is a prepared dataset when it holds an ``index.json`` of this format."""
    return bool(path) and (Path(path) / INDEX).is_file()


class TokenArray:
    """A split of one source: its shards' tokens as one stream, read by positioned reads.

    ``read`` wraps around the end, so a stream shorter than one sequence still serves sequences.
    """

    def __init__(self, root: Path, shards: list[dict], dtype: np.dtype, first: int = 0, tokens: int = -1) -> None:
        """The stream is tokens [first, first + tokens) of the shards' concatenation (all by default)."""
        self.root, self.shards, self.dtype = root, shards, dtype
        self.ends = np.cumsum([s["tokens"] for s in shards], dtype=np.int64)
        self.first = first
        self.tokens = tokens if tokens >= 0 else int(self.ends[-1]) - first
        self._files: dict[int, TokenFile] = {}

    def _file(self, i: int) -> TokenFile:
        if i not in self._files:
            self._files[i] = open_tokens(self.root / f"{self.shards[i]['name']}.bin", self.dtype,
                                         self.shards[i]["tokens"])
        return self._files[i]

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the stream (modulo its length), as int64."""
        out = np.empty(length, dtype=np.int64)
        filled, pos = 0, start % self.tokens
        while filled < length:
            at = self.first + pos
            i = int(np.searchsorted(self.ends, at, side="right"))
            lo = at - (int(self.ends[i - 1]) if i else 0)
            chunk = self._file(i).read(lo, min(length - filled, self.tokens - pos))
            out[filled:filled + len(chunk)] = chunk
            filled += len(chunk)
            pos = (pos + len(chunk)) % self.tokens
        return out


@dataclass
class Prepared:
    root: Path
    index: dict

    @property
    def names(self) -> list[str]:
        return [s["name"] for s in self.index["sources"]]

    def split(self, split: str) -> list[TokenArray]:
        """One stream per source; a source without validation documents is validated on its last
        training document."""
        dtype = np.dtype(self.index["dtype"])
        out = []
        for src in self.index["sources"]:
            shards = src[split]["shards"] if src[split]["tokens"] else []
            if not shards and split == "val":
                out.append(_last_document(self.root, src["train"]["shards"], dtype))
                continue
            if not shards:
                raise DataError(f"data.path: source '{src['name']}' of {self.root} has no {split} tokens")
            out.append(TokenArray(self.root, shards, dtype))
        return out

    def train_tokens(self) -> list[int]:
        return [s["train"]["tokens"] for s in self.index["sources"]]

    def check_tokenizer(self, tok, where: str) -> None:
        """Refuse a tokenizer other than the one the data was prepared with."""
        have = tokenizer_sha256(tok)
        if have != self.index["tokenizer_sha256"]:
            raise DataError(f"{where}: the tokenizer (sha256 {have[:12]}) differs from the one {self.root} was "
                            f"prepared with (sha256 {self.index['tokenizer_sha256'][:12]}); use "
                            f"{self.root / TOKENIZER} or prepare the data again with this tokenizer")

    def verify(self, full: bool = True) -> None:
        """Every shard present with the size its index says; with ``full``, every checksum too."""
        dtype = np.dtype(self.index["dtype"])
        for src in self.index["sources"]:
            for split in ("train", "val"):
                for shard in src[split]["shards"]:
                    bin_path, idx_path = self.root / f"{shard['name']}.bin", self.root / f"{shard['name']}.idx"
                    open_tokens(bin_path, dtype, shard["tokens"]).close()  # exists, readable, right size
                    read_index(idx_path)
                    if full:
                        for path, key in ((bin_path, "bin_sha256"), (idx_path, "idx_sha256")):
                            if file_sha256(path) != shard[key]:
                                raise DataError(f"data.path: shard {path} fails its checksum (the index records "
                                                f"sha256 {shard[key][:12]}); the file is damaged: prepare the "
                                                "data again")


def _last_document(root: Path, shards: list[dict], dtype: np.dtype) -> TokenArray:
    last = shards[-1]
    _, lengths = read_index(root / f"{last['name']}.idx")
    return TokenArray(root, [last], dtype, first=last["tokens"] - int(lengths[-1]), tokens=int(lengths[-1]))


def open_prepared(path: str | Path) -> Prepared:
    root = Path(path)
    try:
        index = json.loads((root / INDEX).read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"data.path: cannot read the dataset index {root / INDEX} ({e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise DataError(f"data.path: {root / INDEX} is not a dataset index written by `stalwart data prepare`")
    return Prepared(root, index)
