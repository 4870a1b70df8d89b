"""What a store holds and returns: chunks (id, tenant, text, metadata, vector) and search hits.

Chunks arrive as JSON Lines, one object per line::

    {"id": "os.path.join", "tenant": "acme", "text": "...", "meta": {"source": "posixpath.py"},
     "vector": [0.1, ...]}                      # "vector" optional: the index's embedder fills it

``id`` is unique within an index (not only within a tenant); ``tenant`` scopes every read; ``meta`` is
a flat object of string, integer, float or boolean values that queries may filter on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from stalwart.errors import UserError

# Tenants, ids and metadata keys are names, never query text: the store quotes values, and these
# patterns keep every name a plain token.
TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
META_KEY_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
MAX_ID = 512


class IndexError_(UserError):
    """A request the index cannot take: one line naming what to fix (the CLI exits 2)."""


@dataclass
class Chunk:
    id: str
    tenant: str
    text: str
    meta: dict = field(default_factory=dict)
    vector: list[float] | None = None


@dataclass
class Hit:
    id: str
    tenant: str
    text: str
    score: float
    meta: dict = field(default_factory=dict)


def check_tenant(tenant: str, where: str = "tenant") -> str:
    if not isinstance(tenant, str) or not TENANT_RE.fullmatch(tenant):
        raise IndexError_(f"{where} {tenant!r} is not a tenant name: 1-64 letters, digits, '_', '.', '-', "
                          "starting with a letter or digit")
    return tenant


def check_meta(meta: object, where: str) -> dict:
    if not isinstance(meta, dict):
        raise IndexError_(f"{where}: 'meta' must be an object of names to strings, numbers or booleans")
    for k, v in meta.items():
        if not isinstance(k, str) or not META_KEY_RE.fullmatch(k):
            raise IndexError_(f"{where}: metadata key {k!r} must be 1-32 lowercase letters, digits or '_', "
                              "starting with a letter")
        if not isinstance(v, (str, int, float, bool)) or v is None:
            raise IndexError_(f"{where}: metadata {k!r} must be a string, number or boolean")
    return meta


def parse_chunk(line: str, where: str, dim: int | None = None) -> Chunk:
    """One JSON line -> a checked Chunk; a bad line raises one line naming the file:line and the field."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise IndexError_(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise IndexError_(f"{where}: each line must be a JSON object with 'id', 'tenant' and 'text'")
    unknown = set(obj) - {"id", "tenant", "text", "meta", "vector"}
    if unknown:
        raise IndexError_(f"{where}: unknown field(s) {sorted(unknown)}; a chunk has id, tenant, text, meta, vector")
    cid, text = obj.get("id"), obj.get("text")
    if not isinstance(cid, str) or not cid or len(cid) > MAX_ID:
        raise IndexError_(f"{where}: 'id' must be a non-empty string of at most {MAX_ID} characters")
    if not isinstance(text, str):
        raise IndexError_(f"{where}: 'text' must be a string")
    tenant = check_tenant(obj.get("tenant"), f"{where}: 'tenant'")
    meta = check_meta(obj.get("meta", {}), where)
    vec = obj.get("vector")
    if vec is not None:
        if not isinstance(vec, list) or not all(isinstance(x, (int, float)) for x in vec):
            raise IndexError_(f"{where}: 'vector' must be a list of numbers")
        if dim is not None and len(vec) != dim:
            raise IndexError_(f"{where}: 'vector' has {len(vec)} numbers; this index holds {dim}")
    return Chunk(cid, tenant, text, meta, vec)
