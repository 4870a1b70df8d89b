"""Live weights from a training run to servers: the rendezvous on the run's store, both sides of it.

A training run with ``publish.interval`` serves a store on loopback (on its rank 0) and says where in
its run directory (``publish.json``: host, port, trainer ranks, the trainers' timeout). A server that
wants the next weights (a *subscriber*) registers on that store: it sets ``live/<token>/state`` to
``waiting`` and appends its token to ``live/queue``. Every ``publish.interval`` steps trainer rank 0
reads the tokens appended since its last look and *claims* each subscriber still waiting: it writes
the version it will send (the step), then turns ``waiting`` into ``taken`` with one atomic
compare-and-set. The trainer ranks and each claimed subscriber then form a link (a standalone group
under ``live/<token>``: trainer ranks ``0..T-1`` send, the subscriber, group rank ``T``, receives) and
the weights cross it as ``comm.weight_sync`` sends them (each trainer rank its own shards).

A subscriber that waits longer than it was told to gives itself up with the same compare-and-set
(``waiting`` -> ``abandoned``): a claim and a give-up never both win, so a claimed subscriber is always
waited for and a given-up one is never linked. Tensors cross through host memory (gloo), so trainers
and a server may share a GPU, or have none.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch

from stalwart.comm.weight_sync import Link, receive_weights
from stalwart.procs import pid_alive
from stalwart.runtime.device import HOST, LOOPBACK
from stalwart.runtime.group import bound_tcp_store
from stalwart.runtime.standalone import connect_store, standalone_group

QUEUE = "live/queue"
WAITING, TAKEN, ABANDONED = b"waiting", b"taken", b"abandoned"
POLL_S = 0.05


class NotPublishing(RuntimeError):
    """The run names no store that answers: it does not publish, or its training has ended."""


class NothingPublished(TimeoutError):
    """No publish came within the subscriber's timeout; it gave itself up (nothing was installed)."""


@dataclass(frozen=True)
class Address:
    """What ``publish.json`` holds: where the store is, how many trainer ranks send, their timeout."""

    host: str
    port: int
    trainers: int
    timeout_s: float
    pid: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def read(cls, path: Path) -> "Address":
        try:
            fields = json.loads(path.read_text())
            return cls(str(fields["host"]), int(fields["port"]), int(fields["trainers"]), float(fields["timeout_s"]),
                       int(fields["pid"]))
        except FileNotFoundError:
            raise NotPublishing(f"{path.parent} is not publishing weights (no {path.name}: start its training "
                                "with --publish.interval N)") from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise NotPublishing(f"{path} cannot be read ({type(e).__name__}: {e})") from None


def _prefix(token: str) -> str:
    return f"live/{token}"


# ---------------------------------------------------------------------------- the trainers' side
def serve_store(timeout_s: float):
    """Trainer rank 0's store for subscribers, on a free loopback port (``store.port``)."""
    return bound_tcp_store(LOOPBACK, 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)


def claim(store, seen: int, version: int) -> tuple[list[str], int]:
    """Trainer rank 0: the subscribers registered after the first ``seen`` that are still waiting, now
    claimed for ``version``; and how many registrations have been looked at."""
    if not store.check([QUEUE]):
        return [], seen
    tokens = [t for t in store.get(QUEUE).decode().split(",") if t]
    claimed = []
    for token in tokens[seen:]:
        store.set(f"{_prefix(token)}/version", str(version))  # before the claim: a claimed one reads it
        if store.compare_set(f"{_prefix(token)}/state", WAITING.decode(), TAKEN.decode()) == TAKEN:
            claimed.append(token)
    return claimed, len(tokens)


def join_link(store, token: str, rank: int, trainers: int, timeout_s: float) -> Link:
    """Subscriber ``token``'s link, joined as group rank ``rank`` (``trainers`` is the subscriber's)."""
    group = standalone_group(store, _prefix(token), rank, trainers + 1, HOST, timeout_s, timeout_s)
    return Link(group, trainers, rank, HOST)


# ---------------------------------------------------------------------------- a subscriber's side
def connect(address: Address, setup_s: float = 10.0):
    """A client of the run's store; :class:`NotPublishing` at once when nothing listens there."""
    try:
        socket.create_connection((address.host, address.port), timeout=setup_s).close()
    except OSError as e:
        raise NotPublishing(f"nothing answers at {address.host}:{address.port} (training pid {address.pid}: "
                            f"{'running' if pid_alive(address.pid) else 'gone'}; {type(e).__name__})") from None
    return connect_store(address.port, setup_s, address.host)


def register(store) -> str:
    """A new subscriber, waiting on ``store``: its token."""
    token = uuid.uuid4().hex
    store.set(f"{_prefix(token)}/state", WAITING.decode())  # before the token is seen: a claim finds it set
    store.append(QUEUE, token + ",")
    return token


def taken(store, token: str) -> bool:
    return store.get(f"{_prefix(token)}/state") == TAKEN


def give_up(store, token: str) -> bool:
    """Withdraw a waiting subscriber; False when the trainers claimed it first (then they are coming)."""
    return store.compare_set(f"{_prefix(token)}/state", WAITING.decode(), ABANDONED.decode()) == ABANDONED


def receive_next(address: Address, installed: int, timeout_s: float,
                 cancelled: Callable[[], bool] = lambda: False) -> tuple[int, dict[str, torch.Tensor]]:
    """Register on the run's store, wait up to ``timeout_s`` (or until ``cancelled()``) for the next
    publish, and receive it: its version (the trainers' step) and the full state, on the host. Raises
    :class:`NothingPublished` when nothing came in time, ``comm.weight_sync``'s errors when the transfer
    failed or the version is not newer than ``installed``."""
    store = connect(address)
    token = register(store)
    deadline = time.monotonic() + timeout_s
    while not taken(store, token):
        if (cancelled() or time.monotonic() > deadline) and give_up(store, token):
            raise NothingPublished(f"no weights were published within {timeout_s:g} s")
        time.sleep(POLL_S)
    version = int(store.get(f"{_prefix(token)}/version"))
    link = join_link(store, token, address.trainers, address.trainers, address.timeout_s)
    return version, receive_weights(link, version, False, installed)
