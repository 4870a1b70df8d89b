"""Actor meshes whose ranks are gangs: one rank is ``width`` actor processes that work as one (an RL
generator whose engine is tensor-parallel over its processes, member 0 scheduling, the others following).

    mesh = GangMesh.spawn(GeneratorActor, "generator", n=2, spares=1, width=2)
    futures = mesh.call(GeneratorActor.generate, args, ranks=[1])      # to both members of rank 1
    mesh.call(GeneratorActor.setup, PerMember(lambda rank, member: (...)))  # arguments per member

A call goes to every member of a rank; its future answers once every member has (with member 0's
reply) and fails as soon as one member fails. Everything else is :class:`ActorMesh`'s, per rank: a
death of any member is the rank's (``exit_status``), and a rank is killed, replaced and grown whole (a
gang's members share a process group: a survivor is blocked in its collectives and never reused).
``warm`` answers each actor's pid (``ActorMesh``'s contract): a gang keeps every member's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from stalwart.controller.mesh import ActorMesh

POLL_S = 0.02  # a short wait per member while others are pending: a failure anywhere is seen soon


class PerMember:
    """Call arguments that differ per member: ``fn(rank, member) -> tuple``."""

    def __init__(self, fn: Callable[[int, int], tuple]) -> None:
        self.fn = fn


class GangFuture:
    """Every member's future of one call: ``get`` answers member 0's reply once all have answered,
    raises the first member's failure at once, and ``TimeoutError`` past ``timeout``."""

    def __init__(self, futures: list[Any], on_values: Callable[[list[Any]], None] | None = None) -> None:
        self.futures, self.on_values = futures, on_values
        self.values: dict[int, Any] = {}

    def get(self, timeout: float | None = None) -> Any:
        if len(self.futures) == 1 and self.on_values is None:  # a gang of one: its future as it is
            return self.futures[0].get(timeout=timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            for i, fut in enumerate(self.futures):
                if i in self.values:
                    continue
                left = POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic()))
                try:
                    self.values[i] = fut.get(timeout=left)
                except TimeoutError:
                    continue
            if len(self.values) == len(self.futures):
                if self.on_values is not None:
                    self.on_values([self.values[i] for i in range(len(self.futures))])
                return self.values[0]
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{len(self.futures) - len(self.values)} of {len(self.futures)} members still running")


class GangMesh(ActorMesh):
    def __init__(self, actor_cls: type, name: str, n: int, width: int = 1) -> None:
        super().__init__(actor_cls, name, n)
        self.width = width
        self.members: dict[int, list[int]] = {}  # rank -> every member's pid (warm's replies); pids: member 0's

    def _start_rank(self) -> list[Any]:
        return [self._start_one() for _ in range(self.width)]

    def _take_rank(self) -> tuple[list[Any], str]:
        taken = [self._take() for _ in range(self.width)]
        return [h for h, _ in taken], "+".join(sorted({by for _, by in taken}))

    def call(self, endpoint: Any, args: tuple | Callable[[int], tuple] | PerMember = (),
             ranks: list[int] | None = None) -> dict[int, GangFuture]:
        """``ActorMesh.call`` to every member of each rank; ``args`` as there, or :class:`PerMember`."""
        name = self.endpoint_name(endpoint)
        out = {}
        for r in (range(self.n) if ranks is None else ranks):
            futures = []
            for m, handle in enumerate(self.handles[r]):
                a = args.fn(r, m) if isinstance(args, PerMember) else args(r) if callable(args) else args
                futures.append(getattr(handle, name).call_one(*a))
            keep = (lambda pids, r=r: self.members.__setitem__(r, list(pids))) if name == "warm" else None
            out[r] = GangFuture(futures, keep)
        return out

    def _pids(self, rank: int) -> list[int | None]:
        return self.members.get(rank) or [self.pids.get(rank)]

    def exit_status(self, rank: int) -> str | None:
        """How the first member of ``rank`` found dead ended, or None while all run."""
        for pid in self._pids(rank):
            status = self._pid_status(pid)
            if status is not None:
                return status
        return None

    def kill(self, rank: int) -> None:
        for pid in self._pids(rank):
            self._kill_pid(pid)

    def replace(self, rank: int) -> str:
        by = super().replace(rank)
        self.members.pop(rank, None)
        return by

    def shrink(self) -> int:
        rank = super().shrink()
        self.members.pop(rank, None)
        return rank
