"""Where the text comes from: a list of documents, addressable by index, read lazily.

The bundled default corpus is this Python's own standard library source (real text that exists on
every machine that can run Stalwart). Other sources: text files, directories, globs, JSONL (one
record per line, text in a field) and Parquet (a text column).
"""

from __future__ import annotations

import glob
import json
import os
import sys
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stalwart.errors import UserError

TEXT_SUFFIXES = {".txt", ".py", ".md", ".rst", ".c", ".h", ".json", ".toml", ".cfg", ".ini", ".html", ".js"}
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git"}
# Data files no data.format reads: refused by name rather than skipped or decoded as text.
BINARY_SUFFIXES = {".arrow", ".npy", ".npz", ".bin", ".pt", ".pth", ".safetensors", ".pkl", ".pickle", ".h5"}
_BINARY_MAGIC = (b"\x93NUMPY", b"ARROW1", b"PK\x03\x04", b"\x80\x02", b"\x80\x04", b"\x89HDF")


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
    if path.suffix == ".arrow":
        return "arrow"
    return "text"


def _refuse_binary(paths: list[Path], where: str) -> None:
    if paths:
        names = ", ".join(str(p) for p in paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
        raise DataError(f"data.path: {where} holds binary data files no data.format reads ({names}); convert them "
                        "to text, JSONL or Parquet, or point data.path at the text files only")


def _arrow_files(root: Path) -> list[Path]:
    """The Arrow files of a `datasets.Dataset.save_to_disk` directory, in the order its state lists them."""
    try:
        state = json.loads((root / "state.json").read_text())
        files = [root / f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"data.path: {root}/state.json is not a readable `datasets` state file ({e})") from None
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        raise DataError(f"data.path: the Hugging Face dataset at {root} lacks its Arrow files "
                        f"({', '.join(missing[:3]) or 'none listed'})")
    return files


def _files_under(root: Path, skip_binary: bool = False) -> list[Path]:
    if (root / "dataset_dict.json").is_file():  # a DatasetDict: its train split
        if not (root / "train" / "state.json").is_file():
            raise DataError(f"data.path: the Hugging Face DatasetDict at {root} has no 'train' split; point "
                            "data.path at the split directory to read")
        root = root / "train"
    if (root / "state.json").is_file() and (root / "dataset_info.json").is_file():
        return _arrow_files(root)
    out, binary, other = [], [], []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            p = Path(dirpath) / name
            if p.suffix in TEXT_SUFFIXES or p.suffix in (".jsonl", ".parquet"):
                out.append(p)
            elif p.suffix in BINARY_SUFFIXES:
                binary.append(p)
            elif not name.startswith("."):
                other.append(p)
    if not skip_binary:
        _refuse_binary(binary, str(root))
        _warn_skipped(other, root)
    return out


def _warn_skipped(paths: list[Path], root: Path) -> None:
    """A file in a data directory that no data.format reads is left out, and said so (once per directory)."""
    if not paths or str(root) in _WARNED:
        return
    _WARNED.add(str(root))
    names = ", ".join(f"{p.relative_to(root)}{' (binary)' if looks_binary(p) else ''}" for p in paths[:3])
    more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
    print(f"warning: data.path: {root}: skipped {len(paths)} file(s) of a type no data.format reads ({names}{more}); "
          f"read are {', '.join(sorted(TEXT_SUFFIXES | {'.jsonl', '.parquet'}))}", file=sys.stderr, flush=True)


_WARNED: set[str] = set()  # directories already warned about in this process (the launcher's check, then rank 0)


def looks_binary(path: Path) -> bool:
    """A NUL byte or a known binary format's magic in the first 8 KiB (text never has either)."""
    try:
        with path.open("rb") as fh:
            head = fh.read(8192)
    except OSError:
        return False
    return b"\x00" in head or head.startswith(_BINARY_MAGIC)


def decode_utf8(data: bytes, replace: bool, where: str) -> tuple[str, int]:
    """(text, invalid bytes replaced by U+FFFD). Strict: a DataError naming the file and byte offset."""
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError as e:
        if not replace:
            raise DataError(f"{where} is not valid UTF-8 (byte {e.start}: {data[e.start:e.start + 4]!r}); convert "
                            "it, or set data.decode_errors = replace to substitute U+FFFD (counted)") from None
    out, bad, rest = [], 0, data
    while True:
        try:
            out.append(rest.decode("utf-8"))
            return "".join(out), bad
        except UnicodeDecodeError as e:
            out += [rest[:e.start].decode("utf-8"), "\ufffd"]
            bad += e.end - e.start
            rest = rest[e.end:]


def _expand(path: str) -> list[Path]:
    if path == "":
        root = default_corpus_root()
        return [p for p in _files_under(root, skip_binary=True) if p.suffix == ".py"]
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


def _first_mb(files: list[Path], max_mb: float) -> list[Path]:
    """The first of ``files`` whose sizes add up to ``max_mb`` megabytes (the one that crosses it
    included, so at least one)."""
    out, total = [], 0
    for f in files:
        if out and total >= max_mb * 1e6:
            break
        out.append(f)
        total += f.stat().st_size
    return out


def _check_files(files: list[Path], fmt: str) -> None:
    """A file given by name or glob is read as what its name says; binary content is refused (Arrow
    files only inside a `datasets` directory, whose state.json says what they hold)."""
    _refuse_binary([f for f in files if f.suffix in BINARY_SUFFIXES and not _in_hf_dir(f)], "it")
    _refuse_binary([f for f in files if _kind_for(f, fmt) == "text" and looks_binary(f)], "it")


def _in_hf_dir(path: Path) -> bool:
    return path.suffix == ".arrow" and (path.parent / "state.json").is_file()


def jsonl_offsets(path: Path) -> np.ndarray:
    """Byte offset of every non-blank line: one sequential read, then random access by seek."""
    offsets, pos = [], 0
    with path.open("rb") as fh:
        for line in fh:
            if line.strip():
                offsets.append(pos)
            pos += len(line)
    return np.asarray(offsets, dtype=np.int64)


def read_arrow_column(path: Path, field: str):
    """A `datasets` Arrow file's text column, memory-mapped (no copy of the file into memory)."""
    import pyarrow as pa

    try:
        source = pa.memory_map(str(path))
        try:
            table = pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            table = pa.ipc.open_file(source).read_all()
    except Exception as e:  # pyarrow raises several types for bad files
        raise DataError(f"data.path: cannot read Arrow file {path}: {e}") from None
    if field not in table.schema.names:
        raise DataError(f"data.text_field: the dataset file {path} has no column '{field}' "
                        f"(columns: {', '.join(table.schema.names)})")
    return table.column(field)


def _rows(path: Path, kind: str, text_field: str) -> int:
    if kind == "arrow":
        return len(read_arrow_column(path, text_field))
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

    def __init__(self, path: str, fmt: str = "auto", text_field: str = "text", val_fraction: float = 0.02,
                 decode_errors: str = "auto", max_mb: float = 0.0) -> None:
        """``max_mb``: only the first files (in path order) up to that many megabytes, at least one; 0 = all."""
        self.text_field = text_field
        self.source = path or f"{default_corpus_root()} (Python standard library)"
        # The bundled corpus has a few files in legacy encodings on purpose (the stdlib's own encoding
        # tests): 'auto' replaces there and is strict for the user's data.
        self.replace = decode_errors == "replace" or (decode_errors == "auto" and not path)
        self.warn_replaced = decode_errors == "replace"
        self.replaced: dict[str, int] = {}  # file -> invalid bytes replaced so far
        docs: list[DocRef] = []
        files = _first_mb(_expand(path), max_mb) if max_mb > 0 else _expand(path)
        if path:
            _check_files(files, fmt)
        self._jsonl: dict[str, np.ndarray] = {}  # file -> byte offset of each record
        self._row_groups: dict[str, np.ndarray] = {}  # Parquet file -> first row of each row group
        self._cache: tuple[str, int, list[str] | object] | None = None  # (file, first row, rows)
        self._rows_of: dict[str, int] = {}
        for f in files:
            kind = _kind_for(f, fmt)
            if kind == "text":
                docs.append(DocRef(str(f), "text"))
                continue
            if kind == "jsonl":
                self._jsonl[str(f)] = jsonl_offsets(f)
                n = len(self._jsonl[str(f)])
            else:
                n = self._rows_of[str(f)] = _rows(f, kind, text_field)
            if kind == "parquet":
                import pyarrow.parquet as pq

                meta = pq.ParquetFile(f).metadata
                self._row_groups[str(f)] = np.cumsum([0] + [meta.row_group(i).num_rows
                                                            for i in range(meta.num_row_groups)])
            docs.extend(DocRef(str(f), kind, r) for r in range(n))
        if not docs:
            raise DataError(f"data.path: no documents found in {self.source}")
        threshold = int(val_fraction * 10_000)
        self.train = [d for d in docs if zlib.crc32(d.key.encode()) % 10_000 >= threshold]
        self.val = [d for d in docs if zlib.crc32(d.key.encode()) % 10_000 < threshold]
        # A tiny corpus can hash wholly to one side (one file lands in validation 2% of the time, by its
        # path): it trains on everything and evaluates on one training document rather than failing.
        if not self.train:
            self.train, self.val = self.val, []
        if not self.val and val_fraction > 0:
            self.val = self.train[-1:]

    def read(self, doc: DocRef) -> str:
        try:
            if doc.kind == "text":
                return self._decode(Path(doc.path).read_bytes(), doc.path)
            if doc.kind == "jsonl":
                return self._jsonl_row(doc)
            if doc.kind == "parquet":
                return self._parquet_row(doc)
            return self._arrow_row(doc)
        except OSError as e:
            raise DataError(f"cannot read {doc.path}: {e.strerror}") from None

    def _jsonl_row(self, doc: DocRef) -> str:
        """One record by its byte offset (found by the one sequential scan at construction)."""
        with open(doc.path, "rb") as fh:
            fh.seek(int(self._jsonl[doc.path][doc.row]))
            raw = fh.readline()
        where = f"{doc.path} record {doc.row + 1}"
        if not raw.strip():
            raise DataError(f"{where} is missing (file changed during the run?)")
        try:
            rec = json.loads(self._decode(raw, doc.path, where))
        except json.JSONDecodeError as e:
            raise DataError(f"{where} is not valid JSON ({e.msg})") from None
        if not isinstance(rec, dict) or self.text_field not in rec:
            raise DataError(f"{where} has no '{self.text_field}' field (set data.text_field)")
        return str(rec[self.text_field])

    def _parquet_row(self, doc: DocRef) -> str:
        """Rows come one row group at a time (the one holding the row is kept until another is read)."""
        starts = self._row_groups[doc.path]
        group = int(np.searchsorted(starts, doc.row, side="right")) - 1
        if self._cache is None or self._cache[:2] != (doc.path, int(starts[group])):
            import pyarrow.parquet as pq

            col = pq.ParquetFile(doc.path).read_row_group(group, columns=[self.text_field]).column(0)
            self._cache = (doc.path, int(starts[group]), ["" if t is None else str(t) for t in col.to_pylist()])
        return self._cache[2][doc.row - self._cache[1]]

    def _arrow_row(self, doc: DocRef) -> str:
        """A `datasets` Arrow file is memory-mapped; one row is read without copying the rest."""
        if self._cache is None or self._cache[:2] != (doc.path, 0):
            self._cache = (doc.path, 0, read_arrow_column(Path(doc.path), self.text_field))
        value = self._cache[2][doc.row].as_py()
        return "" if value is None else str(value)

    def _decode(self, data: bytes, path: str, where: str = "") -> str:
        text, bad = decode_utf8(data, self.replace, where or path)
        if bad and path not in self.replaced and self.warn_replaced:  # once per file
            print(f"warning: data: {where or path} is not valid UTF-8: {bad} byte(s) replaced by U+FFFD "
                  "(data.decode_errors = replace)", file=sys.stderr, flush=True)
        if bad:
            self.replaced[path] = self.replaced.get(path, 0) + bad
        return text

    def size_hint(self, doc: DocRef) -> int:
        """Bytes of text a document holds, known without reading it (estimated for columnar files)."""
        if doc.kind == "text":
            return os.path.getsize(doc.path)
        if doc.kind == "jsonl":
            offsets = self._jsonl[doc.path]
            end = offsets[doc.row + 1] if doc.row + 1 < len(offsets) else os.path.getsize(doc.path)
            return int(end - offsets[doc.row])
        return max(1, os.path.getsize(doc.path) // max(1, self._rows_of[doc.path]))

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
