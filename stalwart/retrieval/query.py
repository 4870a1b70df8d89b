"""What a query may ask, as a where clause no request can widen, and reciprocal rank fusion.

Metadata filters are not SQL from the user: a filter is a dict of metadata key -> value (equality) or
``{"in": [values]}``. Keys never become identifiers; every (key, value) pair becomes one *tag*, the string
``key=<value as JSON>`` (``source="a.py"``, ``year=2020``, ``draft=false``), and rows carry the tags of
their metadata in a ``list<string>`` column with a label-list index. A filter is then membership of
quoted literals in that column, ANDed after the tenant clause, so a crafted key or value can only fail to
match: it can never reach the ``tenant`` column, change the clause's shape, or reach another tenant's rows.
Literals are produced by one function, :func:`sql_literal`, which refuses control characters and doubles
quotes (standard SQL: a backslash is an ordinary character there).
"""

from __future__ import annotations

import json
import math

from stalwart.retrieval.records import META_KEY_RE, IndexError_, check_tenant

MAX_IN = 256        # values in one {"in": [...]} filter
MAX_FILTERS = 16    # keys in one filter
RRF_K = 60          # reciprocal rank fusion's constant (Cormack et al.; LanceDB's RRFReranker default)


def sql_literal(value: str, what: str = "value") -> str:
    """``value`` as a single-quoted SQL string literal; control characters are refused (one line)."""
    if not isinstance(value, str):
        raise IndexError_(f"{what} must be a string")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise IndexError_(f"{what} {value[:40]!r} holds a control character")
    return "'" + value.replace("'", "''") + "'"


def _canonical(value: object, where: str) -> str:
    """A metadata value's tag form: JSON, ASCII-only, with an integral float written as the integer
    (1.0 and 1 match each other; "1" does not match 1, nor true 1)."""
    if isinstance(value, bool) or isinstance(value, (int, str)):
        return json.dumps(value, ensure_ascii=True)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise IndexError_(f"{where}: metadata values must be finite numbers")
        return json.dumps(int(value) if value.is_integer() and abs(value) < 2**53 else value)
    raise IndexError_(f"{where}: a metadata value must be a string, number or boolean, not {type(value).__name__}")


def tag(key: str, value: object, where: str = "filter") -> str:
    if not isinstance(key, str) or not META_KEY_RE.fullmatch(key):
        raise IndexError_(f"{where}: metadata key {str(key)[:40]!r} must be 1-32 lowercase letters, digits or '_', "
                          "starting with a letter")
    return f"{key}={_canonical(value, where)}"


def meta_tags(meta: dict) -> list[str]:
    """The tags a row with this metadata carries (one per key)."""
    return sorted(tag(k, v, "meta") for k, v in meta.items())


def filter_tags(filters: dict | None) -> list[list[str]]:
    """A checked filter -> one list of acceptable tags per key (a row must carry one tag of every list)."""
    if filters is None:
        return []
    if not isinstance(filters, dict):
        raise IndexError_("a filter must be an object of metadata keys to values")
    if len(filters) > MAX_FILTERS:
        raise IndexError_(f"a filter may name at most {MAX_FILTERS} keys")
    out = []
    for key, value in filters.items():
        if isinstance(value, dict):
            if set(value) != {"in"} or not isinstance(value["in"], list) or not 0 < len(value["in"]) <= MAX_IN:
                raise IndexError_(f"filter {str(key)[:40]!r}: an object value must be {{\"in\": [1-{MAX_IN} values]}}")
            out.append(sorted({tag(key, v, f"filter {key!r}") for v in value["in"]}))
        else:
            out.append([tag(key, value, f"filter {str(key)[:40]!r}")])
    return out


def tenant_clause(tenant: str) -> str:
    return f"tenant = {sql_literal(check_tenant(tenant))}"


def where_clause(tenant: str, filters: dict | None = None) -> str:
    """The where clause of every read: the tenant first, then one membership test per filter key."""
    parts = [tenant_clause(tenant)]
    for tags in filter_tags(filters):
        if len(tags) == 1:
            parts.append(f"array_has(tags, {sql_literal(tags[0])})")
        else:
            parts.append(f"array_has_any(tags, [{', '.join(sql_literal(t) for t in tags)}])")
    return " AND ".join(parts)


def ids_clause(tenant: str, ids: list[str]) -> str:
    """This tenant's rows among ``ids`` (deletes, lookups)."""
    return f"{tenant_clause(tenant)} AND id IN ({', '.join(sql_literal(i, 'id') for i in ids)})"


def any_tenant_ids_clause(ids: list[str]) -> str:
    """Rows with these ids, whatever their tenant: only for the ingest's own check of what is committed."""
    return f"id IN ({', '.join(sql_literal(i, 'id') for i in ids)})"


def parse_filter_args(items: list[str]) -> dict:
    """``--filter key=value`` flags -> a filter. The value is JSON when it parses as a JSON string, number,
    boolean or list (a list means "any of"), else the text itself: ``year=2020`` is the number,
    ``year='"2020"'`` the string, ``source=a.py`` the string ``a.py``, ``lang=["py","rs"]`` either."""
    out: dict = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise IndexError_(f"--filter {item[:40]!r}: expected KEY=VALUE")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        if isinstance(value, dict) or value is None:
            raise IndexError_(f"--filter {key[:40]!r}: the value must be a string, number, boolean or a list of them")
        if key in out:
            raise IndexError_(f"--filter {key[:40]!r} given twice; give the values as a list: {key}=[a, b]")
        out[key] = {"in": value} if isinstance(value, list) else value
    filter_tags(out)  # checked now: one line naming the bad key or value
    return out


def rrf(rankings: list[list[str]], k: int, c: int = RRF_K) -> list[tuple[str, float]]:
    """Reciprocal rank fusion: each id scores sum(1 / (c + rank)) over the rankings it appears in (rank from
    1); the top ``k`` by score, ties broken by the id (a deterministic order)."""
    score: dict[str, float] = {}
    for ranking in rankings:
        for rank, cid in enumerate(ranking, start=1):
            score[cid] = score.get(cid, 0.0) + 1.0 / (c + rank)
    return sorted(score.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
