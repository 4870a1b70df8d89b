"""Prefill and decode on separate replicas (``stalwart serve --prefill-replicas P --decode-replicas D``).

The router sends a new streamed request to a prefill replica with ``x_stalwart_prefill`` (router only,
like the resume extension: serve/resume.py). That replica computes the prompt, samples the first token,
streams it, and hands the request off (``finish_reason`` ``handoff``, for the router only): its keys and
values (infer/handoff.py) go into a file in a directory in shared memory that `stalwart serve` made
for its replicas (``STALWART_KV_DIR``; safetensors, never a pickle), named in the chunk's ``x_stalwart``
field. The router relays the token, then resumes the stream on a decode replica exactly as it resumes a
stream whose replica died (serve/resume.py: the tokens so far, the same id), adding the file's name; the
decode replica reads the file (and removes it), takes the keys and values into its cache and decodes on
from the first token. A decode replica that cannot use them (gone, another shape, a full cache)
recomputes the prompt instead: slower, never wrong. So the migration that survives a killed replica is
the hand-off, and a replica killed on either side loses no request: a prefill replica lost before the
hand-off is a stream with nothing sent yet (sent again as it came), a decode replica lost mid-stream is
a stream resumed on another decode replica (a prefill replica if none is left: every replica can do
both). Requests that do not stream go to the decode replicas whole (nothing to hand off mid-answer).
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from stalwart.serve.errors import ApiError

PREFILL_FIELD = "x_stalwart_prefill"
KV_DIR_ENV = "STALWART_KV_DIR"
_NAME = re.compile(r"^[0-9a-f]{32}\.kv$")


def kv_dir() -> Path | None:
    """Where this replica's `stalwart serve` has prefill replicas leave keys and values, if anywhere."""
    where = os.environ.get(KV_DIR_ENV)
    return Path(where) if where else None


def make_kv_dir(tmp: Path) -> Path:
    """A private directory for hand-offs: in shared memory (/dev/shm) when the host has it, else ``tmp``."""
    import tempfile

    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="stalwart-kv-", dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else tmp))


def handoff_of(body: object, routed: bool, streams: bool) -> bool:
    """Whether a request asks to be handed off after its first token. Raises ApiError (400)."""
    if not isinstance(body, dict) or PREFILL_FIELD not in body:
        return False
    if not routed:
        raise ApiError(400, f"{PREFILL_FIELD} is internal to stalwart's router and is not accepted from clients",
                       PREFILL_FIELD)
    if not streams or kv_dir() is None:
        raise ApiError(400, f"{PREFILL_FIELD} needs a stream and a replica started with prefill/decode replicas",
                       PREFILL_FIELD)
    return body[PREFILL_FIELD] is True


def write_kv(kv) -> str:
    """Leave a handed-off request's keys and values for its decode replica: the file's name."""
    from safetensors.torch import save_file

    where = kv_dir()
    name = f"{secrets.token_hex(16)}.kv"
    tmp = where / f".{name}.tmp"
    save_file({"kv": kv.contiguous()}, str(tmp))
    os.replace(tmp, where / name)
    return name


def read_kv(name: object):
    """The keys and values a prefill replica left under ``name`` (the file is removed), or None when
    there are none to read (a name that is not one of ours, a file gone or unreadable): recompute."""
    where = kv_dir()
    if where is None or not isinstance(name, str) or not _NAME.match(name):
        return None
    path = where / name
    try:
        from safetensors.torch import load_file

        return load_file(str(path))["kv"]
    except Exception:  # noqa: BLE001 - missing or damaged: the decode replica recomputes the prompt
        return None
    finally:
        path.unlink(missing_ok=True)


def discard(where: Path | None, names: list[str]) -> None:
    """Remove hand-off files nobody took (the router, once a decode replica answered or none could)."""
    for name in names:
        if where is not None and isinstance(name, str) and _NAME.match(name):
            (where / name).unlink(missing_ok=True)


class Roles:
    """Which replicas prefill and which decode: the first ``prefill`` of ``n`` prefill. Without
    disaggregation (``prefill`` = 0) every replica does both."""

    def __init__(self, n: int, prefill: int = 0) -> None:
        self.disaggregated = prefill > 0
        self.prefill = list(range(prefill))
        self.decode = list(range(prefill, n)) if prefill else list(range(n))

    def first(self, streams: bool) -> tuple[list[int], list[int]]:
        """(replicas to try first, then) for a new request: a stream's prompt on a prefill replica."""
        if self.disaggregated and streams:
            return self.prefill, self.decode
        return self.decode, self.prefill

    def name(self, i: int) -> str:
        return "prefill" if i in self.prefill else "decode" if self.disaggregated else "both"
