"""A small API over Monarch actor meshes: spawn a mesh of actor processes, call an endpoint on all of
them or a slice, get one future per actor back, wait with a bound, and replace one actor.

    mesh = ActorMesh.spawn(TrainerActor, "trainer", n=2, spares=1)
    futures = mesh.call(TrainerActor.join, lambda r: (cfg, r, 2, port, 0))   # per-rank arguments
    replies = mesh.wait(futures, timeout_s=60)          # {rank: value}, or ActorsFailed
    mesh.call(TrainerActor.step, args, ranks=[1])       # a slice
    mesh.replace(1)                                     # a spare (or a new process) for rank 1

An endpoint is named by its reference on the actor class (``TrainerActor.step``: what Monarch's
``@endpoint`` leaves on the class), never by a string: a rename or a type checker follows it, and an
endpoint of another actor class is refused where it is passed (:meth:`ActorMesh.endpoint_name`), not
answered by a remote ``AttributeError``.

Every call is sent to each actor separately (a slice of one), so every reply and every failure is
known by rank. A failure is reported, never lost: an endpoint that raised (its traceback), a process
that died (Monarch's supervision event, with the signal), and a command still running past the bound
(a hang) all end ``wait`` with :class:`ActorsFailed`. Monarch's supervision is polled every
``poll_s`` (``HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY``; its default of about 10 s would leave a
killed actor's call waiting that long).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stalwart.controller.recovery import Failure, classify_error, signal_text
from stalwart.errors import UserError

if TYPE_CHECKING:
    from monarch.actor import Endpoint


def configure_monarch(poll_s: float) -> None:
    """How often actor processes are polled for deaths. Monarch reads it when it is first imported:
    call this before anything imports ``monarch``."""
    os.environ["HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY"] = f"{max(1, int(poll_s * 1000))}ms"


def endpoint_name(actor_cls: type, endpoint: Any) -> str:
    """The attribute name under which ``actor_cls`` (or a base class) holds ``endpoint``, which must be
    a Monarch ``@endpoint`` (on the class, ``@endpoint`` leaves an ``EndpointProperty``: its ``__get__``
    returns the object itself, so ``SomeActor.step`` is that very object and identity finds it)."""
    # NOTE: EndpointProperty is not exported by monarch.actor (pinned at 0.7.0); imported here, late,
    # because Monarch must not be imported before configure_monarch.
    from monarch._src.actor.endpoint import EndpointProperty

    for klass in actor_cls.__mro__:
        for name, value in vars(klass).items():
            if value is endpoint and isinstance(value, EndpointProperty):
                return name
    method = getattr(endpoint, "_method", endpoint)  # another class's endpoint: name its method
    what = getattr(method, "__qualname__", None) or repr(endpoint)
    raise TypeError(f"{what} is not an endpoint of {actor_cls.__name__}: pass one of its own, "
                    f"{actor_cls.__name__}.<endpoint>")


class ActorsFailed(Exception):
    """One or more actors failed; ``failures`` names each, ``replies`` holds the actors that answered,
    ``pending`` the futures of those still running."""

    def __init__(self, failures: list[Failure], replies: dict[int, Any], pending: dict[int, Any]) -> None:
        self.failures, self.replies, self.pending = failures, replies, pending
        super().__init__("; ".join(f.describe() for f in failures))


class ActorMesh:
    def __init__(self, actor_cls: type, name: str, n: int) -> None:
        self.actor_cls, self.name, self.n = actor_cls, name, n
        self.spares: list[tuple[Any, Any]] = []  # (actor, its warm-up future): started, imports done
        self._procs: list[Any] = []           # proc meshes (the first holds all ranks; replacements one each)
        self.handles: list[Any] = [None] * n  # rank -> a mesh of one actor
        self.pids: dict[int, int] = {}
        self.report_grace_s = 1.0  # a vanished process's call waits this long for Monarch's own report
        self.deaths: list[tuple[float, str]] = []  # (time, Monarch's report) of supervision events
        self._lock = threading.Lock()

    @classmethod
    def spawn(cls, actor_cls: type, name: str, n: int, spares: int = 0, **kwargs: Any) -> "ActorMesh":
        """``n`` actors, plus ``spares`` started ones that take a failed actor's place (the actor class
        needs a ``warm`` endpoint that does its imports and answers its pid); ``kwargs`` go to the class
        (``controller/gang.py``'s width)."""
        import monarch.actor as monarch_actor

        mesh = cls(actor_cls, name, n, **kwargs)
        # An actor's death arrives here as well as at its pending calls: keep it, never exit the controller.
        monarch_actor.unhandled_fault_hook = mesh._on_fault
        # NOTE: one proc mesh per actor. Monarch 0.7.0 reports only the first process death of a proc
        # mesh: a call to a second member that dies later never fails (docs/controller.md has the
        # reproducer). Alone in its mesh, every actor's death is its mesh's first.
        mesh.handles = [mesh._start_rank() for _ in range(n)]
        for _ in range(spares):
            spare = mesh._start_one()
            mesh.spares.append((spare, spare.warm.call_one()))
        return mesh

    def _on_fault(self, failure: Any) -> None:
        with self._lock:
            self.deaths.append((time.time(), str(failure)))

    # ------------------------------------------------------------------ calls
    def endpoint_name(self, endpoint: "Endpoint[..., Any]") -> str:
        """The name of ``endpoint``, an ``@endpoint`` of this mesh's actor class taken from the class
        (``TrainerActor.step``); a ``TypeError`` when it is anything else: another actor's endpoint, a
        method that is no endpoint, a string."""
        return endpoint_name(self.actor_cls, endpoint)

    def call(self, endpoint: "Endpoint[..., Any]", args: tuple | Callable[[int], tuple] = (),
             ranks: list[int] | None = None) -> dict[int, Any]:
        """Send ``endpoint`` (``ActorClass.method``) to each rank in ``ranks`` (all by default); ``args``
        is one tuple for all, or a function of the rank. Returns {rank: future}."""
        name = self.endpoint_name(endpoint)
        out = {}
        for r in (range(self.n) if ranks is None else ranks):
            a = args(r) if callable(args) else args
            out[r] = getattr(self.handles[r], name).call_one(*a)
        return out

    def wait(self, futures: dict[int, Any], timeout_s: float, what: str = "") -> dict[int, Any]:
        """Every future's value, or :class:`ActorsFailed` as soon as one actor raised or died (the
        actors blocked in a collective with it are left pending), or naming each actor still running
        ``timeout_s`` after the call (a hang)."""
        deadline = time.monotonic() + timeout_s
        replies: dict[int, Any] = {}
        failures: list[Failure] = []
        gone: dict[int, float] = {}  # rank -> when its process was first seen dead
        pending = dict(futures)
        while pending and not any(f.root for f in failures):
            for r, fut in list(pending.items()):
                try:  # a short wait per future while others are pending: a failure anywhere is seen soon
                    replies[r] = fut.get(timeout=max(0.0, min(0.05 if len(pending) > 1 else 1.0,
                                                              deadline - time.monotonic())))
                except TimeoutError:
                    continue
                except Exception as e:  # noqa: BLE001 - every remote failure is reported by rank
                    if isinstance(getattr(e, "exception", None), UserError):
                        raise e.exception from None  # a config or data mistake: the user's one line
                    failures.append(classify_error(r, e, time.time(), what))
                del pending[r]
            for r in list(pending):  # a death Monarch has not reported (yet, or ever): see it ourselves,
                ended = self.exit_status(r)  # then give Monarch's report (it names the signal) a moment
                if ended is not None and time.time() - gone.setdefault(r, time.time()) > self.report_grace_s:
                    failures.append(Failure(r, "killed", ended, time.time(), gone[r]))
                    del pending[r]
            if pending and time.monotonic() >= deadline:
                now = time.time()
                failures += [Failure(r, "hang", f"{what or 'command'} still running after {timeout_s:g} s", now,
                                     now - timeout_s) for r in sorted(pending)]
                break
        if failures:
            raise ActorsFailed(failures, replies, pending)
        return replies

    def call_all(self, endpoint: "Endpoint[..., Any]", args: tuple | Callable[[int], tuple] = (),
                 timeout_s: float = 600.0, ranks: list[int] | None = None) -> dict[int, Any]:
        """:meth:`call`, then :meth:`wait` for every reply."""
        return self.wait(self.call(endpoint, args, ranks), timeout_s, self.endpoint_name(endpoint))

    # ------------------------------------------------------------------ membership
    def alive(self, rank: int) -> bool:
        return self.exit_status(rank) is None

    def exit_status(self, rank: int) -> str | None:
        """None while rank's process runs (or its pid is not known yet); else how it ended, as far as
        /proc tells: the actors are this process's children, so a dead one is a zombie until reaped,
        and a zombie's stat carries its wait status."""
        return self._pid_status(self.pids.get(rank))

    @staticmethod
    def _pid_status(pid: int | None) -> str | None:
        if not pid:
            return None
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
        except OSError:
            return f"process {pid} is gone (reaped; Monarch reported no cause)"
        if fields[0] not in ("Z", "X"):
            return None
        status = int(fields[-1]) if len(fields) >= 50 else 0  # exit_code, the last field (Linux >= 3.5)
        return signal_text(status & 0x7F) if status & 0x7F else f"process {pid} exited with code {status >> 8}"

    def kill(self, rank: int) -> None:
        """SIGKILL rank's process (a hung or failed actor is not trusted to stop by itself)."""
        self._kill_pid(self.pids.get(rank))

    @staticmethod
    def _kill_pid(pid: int | None) -> None:
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _start_one(self) -> Any:
        from monarch.actor import this_host

        procs = this_host().spawn_procs(per_host={"procs": 1})
        self._procs.append(procs)
        return procs.spawn(self.name, self.actor_cls)

    def _start_rank(self) -> Any:
        """What one rank is: one actor here (a gang of them in ``controller/gang.py``)."""
        return self._start_one()

    def _take(self) -> tuple[Any, str]:
        """A started spare (a new spare is then started in its place), else a fresh actor; and which."""
        if self.spares:
            handle, _ = self.spares.pop(0)
            fresh = self._start_one()
            self.spares.append((fresh, fresh.warm.call_one()))
            return handle, "spare"
        return self._start_one(), "new"

    def _take_rank(self) -> tuple[Any, str]:
        return self._take()

    def replace(self, rank: int) -> str:
        """Another actor for ``rank`` (the old one is killed first): a started spare when there is one,
        else a fresh process. Returns which."""
        self.kill(rank)
        self.pids.pop(rank, None)
        self.handles[rank], by = self._take_rank()
        return by

    def grow(self) -> int:
        """One more actor (a started spare when there is one); returns its rank."""
        self.handles.append(self._take_rank()[0])
        self.n += 1
        return self.n - 1

    def shrink(self) -> int:
        """Stop the last actor (SIGKILL: it holds nothing the run still needs); returns its rank."""
        rank = self.n - 1
        self.kill(rank)
        self.pids.pop(rank, None)
        self.handles.pop()
        self.n -= 1
        return rank

    def replace_all(self) -> list[str]:
        return [self.replace(r) for r in range(self.n)]

    def stop(self) -> None:
        for procs in self._procs:
            try:
                procs.stop().get(timeout=30)
            except Exception:  # noqa: BLE001 - a mesh with a dead member may refuse a clean stop
                pass
        for r in range(self.n):
            self.kill(r)
