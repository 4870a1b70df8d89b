"""Resuming a stream on another replica: the router's internal extension of the API.

A request the router forwards carries the header ``x-stalwart-router`` with a secret the router made
at start-up and gave its replicas (``STALWART_ROUTER_SECRET`` in their environment). A replica that
sees the right secret adds to every stream chunk the field ``x_stalwart``: ``{"job": k, "tokens": [ids],
"finished": bool}`` (k: the position of the prompt's output in the request, ids: the tokens of this
chunk), which the router records and strips before the client sees the chunk.

When a replica dies mid-stream (or its engine fails), the router sends the same body to another replica
with ``x_stalwart_resume``: the stream's ``id`` and ``created``, the weight versions seen so far, and
for each output its tokens so far and whether it finished. That replica recomputes prompt + tokens,
draws each later token with its position's own randomness (``generate.TokenDraws``), advances its
text and structured-output state past them, and streams on under the same id: the client's stream
goes on with exactly the tokens an undisturbed one would have had.

The field is router-only: a request carrying it without the secret is refused (400 naming it), and the
router refuses it from its own clients, so no public client can make a replica skip draws or claim
tokens. Secret rather than "from loopback": replicas listen on loopback, where any local user is too.
"""

from __future__ import annotations

import hmac
import os
import secrets
from dataclasses import dataclass, field

from stalwart.serve.errors import ApiError

HEADER = "x-stalwart-router"
SECRET_ENV = "STALWART_ROUTER_SECRET"
RESUME_FIELD = "x_stalwart_resume"
CHUNK_FIELD = "x_stalwart"


def new_secret() -> str:
    return secrets.token_hex(16)


def replica_secret() -> str | None:
    """The secret this replica's router gave it, if a router started it."""
    return os.environ.get(SECRET_ENV) or None


@dataclass
class Resume:
    """Where a stream stood when its replica was lost."""

    id: str
    created: int
    tokens: list[list[int]]  # per output, in the request's order: the tokens already sent
    finished: list[bool]
    versions: list[int] = field(default_factory=list)
    kv: list[str | None] = field(default_factory=list)  # per output: a prefill replica's hand-off (serve/disagg.py)

    def to_json(self) -> dict:
        return {"id": self.id, "created": self.created, "tokens": self.tokens, "finished": self.finished,
                "versions": self.versions, **({"kv": self.kv} if any(self.kv) else {})}


def from_router(headers, secret: str | None) -> bool:
    """Whether a request comes from this replica's router (it carries the router's secret)."""
    given = headers.get(HEADER)
    return secret is not None and given is not None and hmac.compare_digest(given.encode(), secret.encode())


def resume_of(body: object, routed: bool, outputs: int) -> Resume | None:
    """The resume state in a request body, checked; None when there is none. Raises ApiError (400)."""
    if not isinstance(body, dict) or RESUME_FIELD not in body:
        return None
    if not routed:
        raise ApiError(400, f"{RESUME_FIELD} is internal to stalwart's router and is not accepted from clients",
                       RESUME_FIELD)
    r = body[RESUME_FIELD]
    try:
        resume = Resume(str(r["id"]), int(r["created"]), [[int(t) for t in ts] for ts in r["tokens"]],
                        [bool(f) for f in r["finished"]], [int(v) for v in r.get("versions", [])],
                        [k if isinstance(k, str) else None for k in r.get("kv", [])])
    except (KeyError, TypeError, ValueError) as e:
        raise ApiError(400, f"{RESUME_FIELD} is malformed ({type(e).__name__}: {e})", RESUME_FIELD) from None
    if len(resume.tokens) > outputs or len(resume.finished) != len(resume.tokens):
        raise ApiError(400, f"{RESUME_FIELD} describes {len(resume.tokens)} outputs; the request has {outputs}",
                       RESUME_FIELD)
    missing = outputs - len(resume.tokens)  # outputs the router saw nothing of: they start afresh
    resume.tokens += [[] for _ in range(missing)]
    resume.finished += [False] * missing
    resume.kv = (resume.kv + [None] * outputs)[:outputs]
    return resume


@dataclass
class StreamRecord:
    """What the router has relayed of one stream: enough to resume it elsewhere."""

    id: str | None = None
    created: int = 0
    tokens: dict[int, list[int]] = field(default_factory=dict)
    finished: dict[int, bool] = field(default_factory=dict)
    versions: list[int] = field(default_factory=list)
    outputs: int = 0  # the most outputs any chunk named (job + 1)
    kv: dict[int, str] = field(default_factory=dict)  # outputs a prefill replica handed off: their files

    def take(self, event: dict) -> dict:
        """Record a chunk and return it as the client sees it (without the internal field)."""
        ext = event.pop(CHUNK_FIELD, None)
        if self.id is None and "id" in event:
            self.id, self.created = event["id"], int(event.get("created", 0))
        for v in event.get("weight_versions") or []:
            if v not in self.versions:
                self.versions.append(v)
        if isinstance(ext, dict):
            k = int(ext["job"])
            self.outputs = max(self.outputs, k + 1)
            self.tokens.setdefault(k, []).extend(ext.get("tokens", []))
            self.finished[k] = self.finished.get(k, False) or bool(ext.get("finished"))
            if isinstance(ext.get("kv"), str):  # handed off (serve/disagg.py): not finished for the client
                self.kv[k], self.finished[k] = ext["kv"], False
                for c in event.get("choices") or []:
                    if c.get("finish_reason") == "handoff":
                        c["finish_reason"] = None
        return event

    def handed_off(self) -> list[str]:
        """The hand-off files of this stream's outputs, once; a later resume recomputes."""
        names = list(self.kv.values())
        self.kv.clear()
        return names

    def resume(self) -> Resume:
        n = self.outputs
        return Resume(self.id or "", self.created, [self.tokens.get(k, []) for k in range(n)],
                      [self.finished.get(k, False) for k in range(n)], sorted(self.versions),
                      [self.kv.get(k) for k in range(n)])
