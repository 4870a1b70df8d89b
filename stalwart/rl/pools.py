"""The generator and reward meshes as pools of workers that lose nothing when a worker dies.

Work is dealt out in pieces (a generator gets whole groups, a reward worker a chunk of programs), each
piece remembered until its answer arrives. When a worker fails (killed, crashed, or still running past
its bound), the controller names it in ``events.jsonl``, kills it, puts a spare (or a new process) in
its place, brings the newcomer to the pool's current state (its setup and the current weights), and
sends it the same piece again. A group's responses are seeded by its identity and the engine's output
does not depend on its batch, so a group generated again is the same group; a program scored again
gets the same verdict. No piece is lost or answered twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stalwart.controller.mesh import ActorMesh, ActorsFailed


@dataclass
class Pending:
    """Pieces sent and not yet answered: rank -> (future, piece)."""
    endpoint: Any  # the actor class's endpoint (``GeneratorActor.generate``)
    pieces: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    sent_at: float = 0.0
    incarnations: dict[int, int] = field(default_factory=dict)  # the worker of each rank it went to


class Pool:
    def __init__(self, mesh: ActorMesh, kind: str, timeout_s: float, events: Callable[..., None],
                 restore: Callable[[int], None]) -> None:
        self.mesh, self.kind, self.timeout_s, self.events = mesh, kind, timeout_s, events
        self.restore = restore          # brings a replaced rank to the pool's current state
        self.replacements = 0
        self.busy_s = [0.0] * mesh.n    # seconds each worker reported working
        self.incarnation = [0] * mesh.n  # how many times each rank's worker was replaced (or moved)

    @property
    def n(self) -> int:
        return self.mesh.n

    def send(self, endpoint: Any, pieces: dict[int, Any], args: Callable[[Any], tuple]) -> Pending:
        """Send ``pieces[rank]`` (turned into the endpoint's arguments by ``args``) to each rank."""
        p = Pending(endpoint, sent_at=time.time())
        for rank, piece in pieces.items():
            fut = self.mesh.call(endpoint, args(piece), ranks=[rank])[rank]
            p.pieces[rank] = (fut, (piece, args))
            p.incarnations[rank] = self.incarnation[rank]
        return p

    def collect(self, pending: Pending) -> dict[int, Any]:
        """Every piece's answer by rank; a failed worker is replaced and its piece sent again."""
        out: dict[int, Any] = {}
        todo = dict(pending.pieces)
        while todo:
            rank, (fut, (piece, args)) = next(iter(todo.items()))
            if pending.incarnations.get(rank, self.incarnation[rank]) != self.incarnation[rank]:
                # its worker was replaced since (another call saw it fail): the piece goes to the new one
                pending.incarnations[rank] = self.incarnation[rank]
                todo[rank] = (self.mesh.call(pending.endpoint, args(piece), ranks=[rank])[rank], (piece, args))
                continue
            try:
                out[rank] = self.mesh.wait({rank: fut}, self.timeout_s,
                                           f"{self.kind} {self.mesh.endpoint_name(pending.endpoint)}")[rank]
                del todo[rank]
            except ActorsFailed as e:
                self.replace(rank, e, pending.endpoint)
                pending.incarnations[rank] = self.incarnation[rank]
                todo[rank] = (self.mesh.call(pending.endpoint, args(piece), ranks=[rank])[rank], (piece, args))
        return out

    def call_all(self, endpoint: Any, args: tuple | Callable[[int], tuple]) -> dict[int, Any]:
        """The same command on every worker (setup, a weight load), each failure repaired by ``restore``,
        which repeats what a newcomer lacks (so the command is not sent to it twice)."""
        pending = {r: self.mesh.call(endpoint, args, ranks=[r])[r] for r in range(self.n)}
        out: dict[int, Any] = {}
        for rank, fut in pending.items():
            try:
                out[rank] = self.mesh.wait({rank: fut}, self.timeout_s,
                                           f"{self.kind} {self.mesh.endpoint_name(endpoint)}")[rank]
            except ActorsFailed as e:
                self.replace(rank, e, endpoint)
                out[rank] = None
        return out

    def replace(self, rank: int, err: ActorsFailed, endpoint: Any) -> None:
        """Name ``rank``'s failure, put a spare or a new process in its place and bring it to the
        pool's current state."""
        for f in err.failures:
            self.events("rl_worker_failure", mesh=self.kind, endpoint=self.mesh.endpoint_name(endpoint),
                        **f.as_event())
        by = self.mesh.replace(rank)
        self.replacements += 1
        self.incarnation[rank] += 1
        self._warm(rank)
        self.restore(rank)
        self.events("rl_worker_replaced", mesh=self.kind, rank=rank, by=by, pid=self.mesh.pids[rank])

    def _warm(self, rank: int) -> None:
        reply = self.mesh.wait(self.mesh.call(self.mesh.actor_cls.warm, (), ranks=[rank]), self.timeout_s,
                               f"{self.kind} warm")
        self.mesh.pids[rank] = reply[rank]

    def grow(self) -> int:
        """One more worker, brought to the pool's current state; its rank."""
        rank = self.mesh.grow()
        self.busy_s.append(0.0)
        self.incarnation.append(0)
        self._warm(rank)
        self.restore(rank)
        return rank

    def shrink(self) -> None:
        """Stop the last worker."""
        self.mesh.shrink()
        self.busy_s.pop()
        self.incarnation.pop()


def deal(items: list[Any], n: int) -> dict[int, list[Any]]:
    """Round-robin: item i to worker i % n (only workers that get something)."""
    out: dict[int, list[Any]] = {}
    for i, item in enumerate(items):
        out.setdefault(i % n, []).append(item)
    return out
