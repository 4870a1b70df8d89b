"""Where the text comes from: a list of documents, addressable by index, read lazily.

The bundled default corpus is this Python's own standard library source (real text that exists on
every machine that can run Stalwart). Other sources: text files, directories, globs, JSONL (one
record per line, text in a field) and Parquet (a text column).
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

from stalwart.errors import UserError

TEXT_SUFFIXES = {".txt", ".py", ".md", ".rst", ".c", ".h", ".json", ".toml", ".cfg", ".ini", ".html", ".js"}
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git"}


class DataError(UserError, ValueError):
    """Bad data input (missing path, empty corpus, unreadable file): one line for the user."""


@dataclass(frozen=True)
class DocRef:
    """One document: a whole text file, or record `row` of a JSONL/Parquet file."""

    path: str
    kind: str  # "text" | "jsonl" | "parquet"
    row: int = -1

    @property
    def key(self) -> str:
        return f"{self.path}#{self.row}" if self.row >= 0 else self.path


def default_corpus_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _kind_for(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    if path.suffix == ".jsonl":
        return "jsonl"
    if path.suffix == ".parquet":
        return "parquet"
    return "text"


def _files_under(root: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            p = Path(dirpath) / name
            if p.suffix in TEXT_SUFFIXES or p.suffix in (".jsonl", ".parquet"):
                out.append(p)
    return out


def _expand(path: str) -> list[Path]:
    if path == "":
        root = default_corpus_root()
        return [p for p in _files_under(root) if p.suffix == ".py"]
    if any(ch in path for ch in "*?["):
        matches = sorted(Path(p) for p in glob.glob(path, recursive=True))
        files: list[Path] = []
        for m in matches:
            files.extend(_files_under(m) if m.is_dir() else [m])
        if not matches:
            raise DataError(f"data.path: the glob '{path}' matches no files")
        return files
    p = Path(path)
    if not p.exists():
        raise DataError(f"data.path: '{path}' does not exist (give a file, directory or glob; "
                        "empty = the bundled standard-library corpus)")
    return _files_under(p) if p.is_dir() else [p]


def _rows(path: Path, kind: str, text_field: str) -> int:
    if kind == "jsonl":
        with path.open("rb") as fh:
            return sum(1 for line in fh if line.strip())
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for bad files
        raise DataError(f"data.path: cannot read Parquet file {path}: {e}") from None
    if text_field not in meta.schema_arrow.names:
        raise DataError(f"data.text_field: Parquet file {path} has no column '{text_field}' "
                        f"(columns: {', '.join(meta.schema_arrow.names)})")
    return meta.metadata.num_rows


class Corpus:
    """Documents split deterministically into train and validation by a hash of their key."""

    def __init__(self, path: str, fmt: str = "auto", text_field: str = "text", val_fraction: float = 0.02) -> None:
        self.text_field = text_field
        self.source = path or f"{default_corpus_root()} (Python standard library)"
        docs: list[DocRef] = []
        for f in _expand(path):
            kind = _kind_for(f, fmt)
            if kind == "text":
                docs.append(DocRef(str(f), "text"))
            else:
                docs.extend(DocRef(str(f), kind, r) for r in range(_rows(f, kind, text_field)))
        if not docs:
            raise DataError(f"data.path: no documents found in {self.source}")
        threshold = int(val_fraction * 10_000)
        self.train = [d for d in docs if zlib.crc32(d.key.encode()) % 10_000 >= threshold]
        self.val = [d for d in docs if zlib.crc32(d.key.encode()) % 10_000 < threshold]
        if not self.train:
            raise DataError(f"data.path: every document of {self.source} fell into the validation split; "
                            "lower data.val_fraction or add data")
        if not self.val and val_fraction > 0:
            self.val = self.train[-1:]  # tiny corpora: evaluate on one training document
        self._parquet_cache: dict[str, list[str]] = {}

    def read(self, doc: DocRef) -> str:
        try:
            if doc.kind == "text":
                return Path(doc.path).read_text(encoding="utf-8", errors="replace")
            if doc.kind == "jsonl":
                return self._jsonl_row(doc)
            return self._parquet_rows(doc.path)[doc.row]
        except OSError as e:
            raise DataError(f"cannot read {doc.path}: {e.strerror}") from None

    def _jsonl_row(self, doc: DocRef) -> str:
        # NOTE: linear scan per record keeps memory flat; fine for the sizes CPU runs use. Large JSONL
        # corpora should be pre-tokenized instead.
        with open(doc.path, encoding="utf-8", errors="replace") as fh:
            i = -1
            for line in fh:
                if not line.strip():
                    continue
                i += 1
                if i == doc.row:
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{doc.path}: line {i + 1} is not valid JSON ({e.msg})") from None
                    if not isinstance(rec, dict) or self.text_field not in rec:
                        raise DataError(f"{doc.path}: record {i + 1} has no '{self.text_field}' field "
                                        "(set data.text_field)")
                    return str(rec[self.text_field])
        raise DataError(f"{doc.path}: record {doc.row + 1} is missing (file changed during the run?)")

    def _parquet_rows(self, path: str) -> list[str]:
        if path not in self._parquet_cache:
            import pyarrow.parquet as pq

            self._parquet_cache.clear()  # keep one file's column in memory at a time
            col = pq.read_table(path, columns=[self.text_field]).column(0).to_pylist()
            self._parquet_cache[path] = ["" if t is None else str(t) for t in col]
        return self._parquet_cache[path]

    def sample_text(self, max_bytes: int) -> list[str]:
        """The first `max_bytes` of training text in file order (for tokenizer training)."""
        out, total = [], 0
        for doc in self.train:
            text = self.read(doc)
            out.append(text)
            total += len(text)
            if total >= max_bytes:
                break
        return out
