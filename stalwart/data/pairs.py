"""Query/document pairs mined from Python sources, and the pairs dataset an embeddings model trains on.

Mining: every function or method with a docstring gives a pair: the query is the docstring's first
paragraph (what a user would ask for), the document is the function's code with the docstring removed
(what retrieval should find). Pairs whose query or document occurs more than once are dropped (they
cannot be told apart). Whole modules are held out, by a hash of their name, so the held-out queries
ask for code the model never saw.

The dataset is a prepared dataset (``prepared.py`` reads it like any other) whose every sequence is
one pair of ``seq_len`` tokens: the query's tokens, the end token, padding with the end token to
``seq_len / 2``, then the same for the document. ``index.json`` says so (``"pairs": {"half": N}``); the
loader then hands each micro-batch over as rows query, document, query, document, ... with each row's
text mask as its targets.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from stalwart.atomic import write_json_atomic, write_text_atomic
from stalwart.data.corpus import DataError
from stalwart.data.prepare import FORMAT, INDEX, TOKENIZER, tokenizer_sha256
from stalwart.data.shards import token_dtype, write_shard

SKIP_DIRS = {"site-packages", "__pycache__"}  # test suites are code and docstrings too
PAIRS_PER_SHARD = 20000


@dataclass(frozen=True)
class Pair:
    id: str        # module:qualified.name
    module: str
    query: str
    document: str


def _first_paragraph(doc: str) -> str:
    para = re.split(r"\n\s*\n", doc.strip(), maxsplit=1)[0]
    return " ".join(para.split())


def _functions(tree: ast.Module):
    """(qualified name, node) of every function and method, nested ones included."""
    todo = [("", n) for n in tree.body]
    while todo:
        prefix, node = todo.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                yield name, node
            todo += [(f"{name}.", n) for n in node.body]


def _code_without_docstring(lines: list[str], node) -> str:
    doc = node.body[0]
    keep = [line for i, line in enumerate(lines[node.lineno - 1:node.end_lineno], start=node.lineno)
            if not doc.lineno <= i <= doc.end_lineno]
    start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
    head = lines[start - 1:node.lineno - 1]
    return textwrap.dedent("\n".join(head + keep)).strip()


def name_words(qualname: str) -> str:
    """``HTTPConnection._send_output`` -> ``http connection send output``: an identifier as the words a
    query would use."""
    parts = re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+", qualname)
    return " ".join(p.lower() for p in parts)


def mine_file(path: Path, module: str, min_words: int = 4, kind: str = "docstring") -> list[Pair]:
    """``kind`` 'docstring': the docstring's first paragraph asks for the function (functions with one);
    'name': the words of its qualified name ask for it (every function with a body of two statements
    or more: many more pairs, with the lexical link from words to identifiers a docstring has too)."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []
    lines, out = source.splitlines(), []
    for name, node in _functions(tree):
        doc = ast.get_docstring(node)
        if kind == "name":
            body = node.body[1:] if doc else node.body
            query = name_words(name)
            if len(body) >= 2 and len(query.split()) >= 2:
                code = _code_without_docstring(lines, node) if doc else _code(lines, node)
                out.append(Pair(f"{module}:{name}#name", module, query, code))
            continue
        if not doc or len(node.body) < 2:
            continue
        query = _first_paragraph(doc)
        if len(query.split()) < min_words:
            continue
        out.append(Pair(f"{module}:{name}", module, query, _code_without_docstring(lines, node)))
    return out


def _code(lines: list[str], node) -> str:
    start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
    return textwrap.dedent("\n".join(lines[start - 1:node.end_lineno])).strip()


def mine(root: Path, kind: str = "docstring") -> list[Pair]:
    """Every unambiguous pair of the ``.py`` files under ``root``, in path order."""
    pairs: list[Pair] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_DIRS & set(rel.parts[:-1]):
            continue
        module = ".".join(rel.with_suffix("").parts)
        pairs += mine_file(path, module, kind=kind)
    queries: dict[str, int] = {}
    docs: dict[str, int] = {}
    for p in pairs:
        queries[p.query] = queries.get(p.query, 0) + 1
        docs[p.document] = docs.get(p.document, 0) + 1
    return [p for p in pairs if queries[p.query] == 1 and docs[p.document] == 1]


def held_out(module: str, percent: int) -> bool:
    top = module.split(".")[0]  # a package is held out whole: its modules share code and words
    return int(hashlib.sha256(top.encode()).hexdigest()[:8], 16) % 100 < percent


def split(pairs: list[Pair], percent: int) -> tuple[list[Pair], list[Pair]]:
    train = [p for p in pairs if not held_out(p.module, percent)]
    return train, [p for p in pairs if held_out(p.module, percent)]


def encode_text(tok, text: str, half: int, end: int) -> list[int]:
    """A text as a row of at most ``half`` tokens: its first ``half - 1`` tokens and the end token (the
    embedder encodes queries and chunks the same way)."""
    return tok.encode(text).ids[:half - 1] + [end]


def text_mask(tokens: torch.Tensor, end: int) -> torch.Tensor:
    """(texts, seq) token ids, each text ending at its first ``end`` token and padded with ``end`` after
    it -> 1 up to and including the first ``end``, 0 after (the mask ``models.embedding.pool`` takes)."""
    is_end = (tokens == end).to(torch.int64)
    return ((is_end.cumsum(dim=1) - is_end) == 0).to(torch.int64)


def pair_rows(seqs: torch.Tensor, half: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, >= 2 * half) pair records -> (2n, half) rows query, document, query, ... and their masks."""
    rows = seqs[:, :2 * half].reshape(-1, half).contiguous()
    return rows, text_mask(rows, end)


def _record(tok, pair: Pair, half: int, end: int) -> np.ndarray:
    row = np.full(2 * half, end, dtype=np.int64)
    q, d = encode_text(tok, pair.query, half, end), encode_text(tok, pair.document, half, end)
    row[:len(q)], row[half:half + len(d)] = q, d
    return row


def write_jsonl(pairs: list[Pair], path: Path) -> None:
    write_text_atomic(path, "".join(json.dumps(asdict(p)) + "\n" for p in pairs))


def read_jsonl(path: Path) -> list[Pair]:
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            out.append(Pair(**json.loads(line)))
        except (ValueError, TypeError):
            raise DataError(f"{path}:{n}: not a pair (a JSON object with id, module, query, document)") from None
    return out


def write_dataset(sources: dict[str, tuple[list[Pair], list[Pair]]], out: Path, tok, end: int, seq_len: int) -> dict:
    """The pairs dataset: per source (name -> (training pairs, held-out pairs)) shards of fixed-width
    records, the tokenizer, and ``index.json`` last."""
    if seq_len % 2 or seq_len < 16:
        raise DataError(f"--seq-len must be an even number of at least 16 (got {seq_len})")
    half, dtype = seq_len // 2, token_dtype(tok.get_vocab_size())
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / TOKENIZER, tok.to_str(pretty=True))
    out_sources = []
    for source, (train, val) in sources.items():
        splits = {}
        for name, pairs in (("train", train), ("val", val)):
            shards = []
            for k in range(0, len(pairs), PAIRS_PER_SHARD):
                records = [_record(tok, p, half, end) for p in pairs[k:k + PAIRS_PER_SHARD]]
                shards.append(write_shard(out / f"{source}.{name}.{k // PAIRS_PER_SHARD:05d}", records, dtype))
            splits[name] = {"documents": sum(s["documents"] for s in shards),
                            "tokens": sum(s["tokens"] for s in shards), "shards": shards}
        out_sources.append({"name": source, "path": "", **splits})
    index = {"format": FORMAT, "tokenizer_sha256": tokenizer_sha256(tok), "vocab_size": tok.get_vocab_size(),
             "eos_id": end, "dtype": dtype.name, "pairs": {"half": half}, "sources": out_sources}
    write_json_atomic(out / INDEX, index)
    return index
