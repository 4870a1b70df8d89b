"""A rank of a multi-process replica, forked by its launcher (serve/launcher.py): its place in the group and
how it rejoins the group when another rank is started again.

The launcher serves the group's store and counts attempts there (key ``attempt``): each time it starts a
rank again it gives up the current attempt (``runtime.group.abandon_attempt``) and names the next one.
Every rank forms its process group under the latest attempt's key prefix (``runtime.group.join_attempt``).
A rank that survives a lost one notices either way: its collective fails (the peer's connections closed),
or, when idle, rank 0's watcher sees the attempt change. It then leaves the broken group, joins the new
attempt beside the restarted rank, and points its tensor-parallel layers at the new group
(``infer.group.regroup``). Its weights, KV cache and (on rank 0) the requests in flight stay in memory;
rank 0 has every running sequence recomputed, since the new rank's cache is empty.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass

import torch

from stalwart.infer.load import Loaded

ATTEMPT = "attempt"  # the store key naming the attempt every rank forms its group under
NOTICE_S = 5.0  # how long a rank whose collective failed waits for the launcher to name a new attempt
SETUP_S = 120.0  # how long the members of one attempt wait for each other to arrive
WATCH_S = 0.05  # how often rank 0 looks for a new attempt
IDLE_TIMEOUT_S = 30 * 24 * 3600.0  # a follower rank waits this long for rank 0's next step


@dataclass
class GroupPlace:
    """What the launcher gives each rank it forks."""

    rank: int
    world: int
    store_port: int
    loaded: Loaded | None  # the weights the launcher read once (None: this rank reads them)
    version: int  # the weight version of ``loaded``
    sock: socket.socket | None = None  # rank 0's: the HTTP socket the launcher holds and answers on meanwhile
    serving_fd: int | None = None  # rank 0's: a pipe to the launcher's keeper, told once rank 0 accepts connections


class GroupHealer:
    """This rank's membership of its replica's group, attempt after attempt."""

    def __init__(self, place: GroupPlace, device: torch.device, shape: tuple[int, int]) -> None:
        from stalwart.runtime.standalone import connect_store

        self.place, self.device, self.shape = place, device, shape
        self.store = connect_store(place.store_port, SETUP_S)
        self.attempt = -1
        self.tp_mesh = None
        self.notice_s = NOTICE_S
        self._newer = threading.Event()  # rank 0's watcher saw a newer attempt than this rank's
        self._lock = threading.Lock()  # the store client is shared with the watcher thread

    def latest(self) -> int:
        with self._lock:
            return int(self.store.get(ATTEMPT))

    def join(self):
        """Form the group under the latest attempt (a later one if it is given up while waiting); the
        tensor-parallel mesh (None without tensor parallelism)."""
        from stalwart.runtime.group import device_mesh, join_attempt

        while True:
            attempt = self.latest()
            try:
                join_attempt(self.place.rank, self.place.world, self.place.store_port, attempt, self.device,
                             IDLE_TIMEOUT_S, SETUP_S)
            except RuntimeError:  # given up for a later attempt while this rank waited
                if self.latest() > attempt:
                    continue
                raise
            self.attempt = attempt
            mesh = device_mesh(self.device, self.shape, ("pp", "tp"))
            self.tp_mesh = mesh["tp"] if self.shape[1] > 1 else None
            return self.tp_mesh

    def broken(self, wait_s: float = 0.0) -> bool:
        """Whether the launcher has named a newer attempt (a rank was started again). Without ``wait_s``,
        as rank 0's watcher last saw it (no store round trip: rank 0 asks before every step); else asked of
        the store, waiting up to ``wait_s``: a collective that just failed may precede the launcher's notice."""
        if wait_s <= 0:
            if not self._newer.is_set():
                return False
            if self.latest() > self.attempt:
                return True
            self._newer.clear()  # seen before this rank joined the attempt it is in
            return False
        deadline = time.monotonic() + wait_s
        while self.latest() <= self.attempt:
            if time.monotonic() >= deadline:
                return False
            time.sleep(WATCH_S)
        return True

    def ready(self, model) -> None:
        """Wait until every rank of the group has its model ready (a rank started again builds its own
        while the others wait here); rejoin a newer attempt if a rank is lost meanwhile."""
        import torch.distributed as dist

        while True:
            try:
                dist.all_reduce(torch.ones(1, device=self.device))
                return
            except RuntimeError:
                if not self.broken(self.notice_s):
                    raise
                self._join_again(model)

    def rejoin(self, model) -> None:
        """Leave the broken group, join the newest attempt (``model``'s tensor-parallel layers pointed at its
        group), and wait until every rank is ready."""
        self._join_again(model)
        self.ready(model)

    def _join_again(self, model) -> None:
        from stalwart.infer.group import regroup

        self.join()
        if self.tp_mesh is not None:
            regroup(model, self.tp_mesh)

    def announce_serving(self, pid: int) -> None:
        """Rank 0 accepts connections: the launcher's keeper stops answering on its socket."""
        if self.place.serving_fd is not None:
            os.write(self.place.serving_fd, f"serving {pid}\n".encode())

    def watch(self, wake: threading.Event, stopped) -> None:
        """Rank 0: note a newer attempt as soon as one is named and set ``wake`` (its engine thread may be
        idle), from a thread of its own, until ``stopped()``."""

        def run() -> None:
            while not stopped():
                try:
                    if self.latest() > self.attempt >= 0:
                        self._newer.set()
                        wake.set()
                except Exception:  # noqa: BLE001 - the launcher is gone: this process ends with it
                    return
                time.sleep(WATCH_S)

        threading.Thread(target=run, name="stalwart-attempts", daemon=True).start()

