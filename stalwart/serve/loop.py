"""The engine's thread: the only thread that touches the engine.

Requests, aborts and weight updates arrive as commands from the HTTP server's event loop and are
applied between engine steps. A weight update is therefore a pause (no step runs while the new
weights are copied in), an update, and a resume; requests in flight keep their place and go on.
A live update (the next weights a training run publishes, ``comm/live.py``) is waited for and
received on a thread of its own while the engine goes on; only its install is such a pause.

The prompts of one HTTP request are submitted together and start together or not at all. If the
engine thread ever fails it prints why, every request waiting on it gets a 500, later ones are
refused, and ``failure`` says why (``/health`` reports it): nothing waits on a thread that is gone.
A thread that is alive but stuck (a step or a weight load that does not end: a hung collective, a rank
stopped) is reported by ``problem()`` once it overruns its limit, so ``/health`` turns to 503 and a
router restarts the replica. In a multi-process replica whose launcher starts a lost rank again
(serve/heal.py), the thread instead rejoins the group and goes on; ``recovering()`` says so meanwhile,
and the requests in flight are recomputed, not failed.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Union

from stalwart.comm.live import Address, receive_next
from stalwart.comm.weight_sync import OutOfOrder
from stalwart.errors import UserError
from stalwart.infer.engine import Engine
from stalwart.infer.outputs import Output, RequestError
from stalwart.infer.load import source_from
from stalwart.infer.sampling import SamplingError, SamplingParams
from stalwart.paths import RunPaths


@dataclass
class Failure:
    """A request the engine did not take or could not finish: the HTTP error it gets."""

    status: int
    message: str
    param: str | None = None
    kind: str = "invalid_request_error"


Sink = Callable[[Union[Output, Failure]], None]


@dataclass
class Submission:
    rid: str
    prompt: list[int]
    params: SamplingParams
    sink: Sink
    follows: str | None = None  # an earlier submission of the same request with the same prompt (``n``)
    emitted: list[int] = ()  # tokens a resumed request produced already, on another replica (serve/resume.py)
    priority: int = 0  # latency class: lower runs first (infer/scheduler.py)
    handoff: bool = False  # a prefill replica's: ends after the first token, handed off (serve/disagg.py)
    kv: object = None  # a decode replica's: the handed-off keys and values (infer/handoff.py)


class EngineUnavailable(RuntimeError):
    """The engine thread takes no more commands (it failed, or the server is stopping)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class WeightVersionError(UserError):
    """A weight update whose version is not newer than the version served."""


@dataclass
class Timing:
    """Per-request latency bookkeeping (monotonic seconds)."""

    arrived: float
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0


# How long one step, or one command such as a weight load, may take before the engine counts as stuck.
# NOTE: generous for a step (a step is bounded by engine.max_batch_tokens; seconds even on 2 CPU cores);
# a load reads a whole checkpoint.
STEP_LIMIT_S = 20.0
LOAD_LIMIT_S = 900.0


class EngineLoop:
    def __init__(self, engine: Engine, link=None, load: Callable[[str], dict] | None = None,
                 on_step: Callable[[list[Output], float], None] | None = None,
                 on_weights: Callable[[int, str | None, dict | None], None] | None = None, healer=None) -> None:
        """``on_weights(version, where, state)``: after each weight update applied, from ``where`` (a path
        read by ``load``) or as a live ``state``; on the engine thread, before the update is answered.
        ``healer``: rank 0's ``serve.heal.GroupHealer`` in a replica whose launcher restarts lost ranks."""
        self.engine = engine
        self.link = link  # infer.group.StepLink on rank 0 of a multi-process replica
        self.load = load  # where -> full state dict, for weight updates
        self.on_step = on_step
        self.on_weights = on_weights
        self.commands: queue.Queue = queue.Queue()
        self.sinks: dict[str, Sink] = {}
        self.wake = threading.Event()
        self.stopped = False
        self.failure: str | None = None  # why the engine thread died, if it did
        # Orders commands against the thread's last look at the queue: once ``_closed`` is set under
        # it, no command can arrive that nobody answers.
        self._lock = threading.Lock()
        self._closed: EngineUnavailable | None = None
        self._pending = 0  # requests submitted, not yet in the scheduler
        self.step_limit_s, self.load_limit_s = STEP_LIMIT_S, LOAD_LIMIT_S
        self._busy: tuple[str, float, float] | None = None  # (what, since, limit) while a step or command runs
        self.healer = healer
        self._recovering: str | None = None  # why the engine waits for its group to be formed again
        self.thread = threading.Thread(target=self._run, name="stalwart-engine", daemon=True)

    def start(self) -> "EngineLoop":
        self.thread.start()
        if self.healer is not None:
            self.healer.watch(self.wake, lambda: self.stopped)
        return self

    def stop(self) -> None:
        self.stopped = True
        self.wake.set()
        self.thread.join(timeout=30)

    # -- called from other threads ---------------------------------------------------------------

    def submit(self, requests: list[Submission]) -> None:
        """Queue requests that start together or not at all. Raises EngineUnavailable."""
        with self._lock:
            if self._closed is not None:
                raise self._closed
            self._pending += len(requests)
            self.commands.put(("add", requests))
        self.wake.set()

    def abort(self, rid: str) -> None:
        self.commands.put(("abort", rid))
        self.wake.set()

    def update_weights(self, where: str, version: int | None) -> Future:
        """Load new weights between two steps; the future gives the version (default: the served one + 1)."""
        done: Future = Future()
        with self._lock:
            if self._closed is not None:
                raise self._closed
            self.commands.put(("load", where, version, done))
        self.wake.set()
        return done

    def update_live(self, run_dir: str, timeout_s: float, cancelled: threading.Event) -> Future:
        """The next weights the training run in ``run_dir`` publishes: waited for (up to ``timeout_s``, or
        until ``cancelled``) and received on a thread of its own, then installed between two steps; the
        future gives the version (the trainers' step). One process only: the other ranks of a replica
        would not receive them."""
        done: Future = Future()
        if self.link is not None:
            raise UserError("live updates need a one-process replica (this one has several processes: "
                            "layout.tp = layout.pp = 1)")
        with self._lock:
            if self._closed is not None:
                raise self._closed
        threading.Thread(target=self._receive_live, args=(run_dir, timeout_s, cancelled, done),
                         name="stalwart-live-weights", daemon=True).start()
        return done

    def _receive_live(self, run_dir: str, timeout_s: float, cancelled: threading.Event, done: Future) -> None:
        try:
            address = Address.read(RunPaths(run_dir).publish)
            version, state = receive_next(address, self.engine.weight_version, timeout_s, cancelled.is_set)
            with self._lock:
                if self._closed is not None:
                    raise self._closed
                self.commands.put(("install", state, version, done))
            self.wake.set()
        except OutOfOrder as e:
            done.set_exception(WeightVersionError(str(e)))
        except BaseException as e:  # noqa: BLE001 - reported to the caller; the served weights stay
            done.set_exception(e)

    def problem(self) -> str | None:
        """Why this replica cannot serve now (the engine thread failed, or one step or command has run
        past its limit), or None when it is alive and stepping."""
        if self.failure is not None:
            return f"the engine stopped ({self.failure})"
        if not self.thread.is_alive() and not self.stopped:
            return "the engine thread is not running"
        busy = self._busy
        if busy is not None and time.monotonic() - busy[1] > busy[2]:
            return (f"the engine is stuck: one {busy[0]} has run for {time.monotonic() - busy[1]:.0f} s (limit "
                    f"{busy[2]:g} s)")
        return None

    def recovering(self) -> str | None:
        """Why this replica waits before serving again (a process of it is being started again), or None."""
        return self._recovering

    @contextlib.contextmanager
    def _running(self, what: str, limit_s: float):
        self._busy = (what, time.monotonic(), limit_s)
        try:
            yield
        finally:
            self._busy = None

    def queued(self) -> int:
        """Requests waiting: submitted, or in the scheduler's queue."""
        return self._pending + len(self.engine.scheduler.waiting)

    # -- the engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        closed = EngineUnavailable("the server is shutting down", 503)
        try:
            while not self.stopped:
                if self.healer is not None and self.healer.broken():
                    self._recover()
                self._drain()
                if not self.engine.has_work():
                    self.wake.wait(0.5)
                    self.wake.clear()
                    continue
                start = time.monotonic()
                try:
                    with self._running("step", self.step_limit_s):
                        outputs = self.engine.step()
                except RuntimeError:  # a collective failed: a lost rank, if the launcher names a new attempt
                    if self.healer is None or not self.healer.broken(self.healer.notice_s):
                        raise
                    self._recover()
                    continue
                for out in outputs:
                    self._deliver(out)
                if self.on_step is not None:
                    self.on_step(outputs, time.monotonic() - start)
        except BaseException as e:  # noqa: BLE001 - a dead engine must say so, not leave requests waiting
            self.failure = f"{type(e).__name__}: {e}"
            print(f"stalwart serve: the engine stopped ({self.failure}); every request fails until a restart",
                  file=sys.stderr, flush=True)
            traceback.print_exc()
            closed = EngineUnavailable(f"the engine stopped ({self.failure}); the server must be restarted", 500)
        finally:
            self._close(closed)

    def _recover(self) -> None:
        """Rejoin the replica's group beside a rank started again; the sequences in flight are recomputed
        (the new rank's cache is empty) and go on."""
        self._recovering = "a process of this replica is being started again"
        t0 = time.monotonic()
        try:
            self.healer.rejoin(self.engine.model)
            self.engine.recompute_all()
        finally:
            self._recovering = None
        print(f"stalwart serve: the replica's group is whole again ({time.monotonic() - t0:.1f} s); serving",
              file=sys.stderr, flush=True)

    def _close(self, closed: EngineUnavailable) -> None:
        """Take no more commands; answer every request in flight and every command left."""
        with self._lock:
            self._closed = closed
        if self.failure is None:
            ends = {rid: Output(rid, [], "", True, "abort", self.engine.weight_version) for rid in self.sinks}
        else:
            ends = {rid: Failure(500, str(closed), None, "server_error") for rid in self.sinks}
        while True:
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                ends.update((r.rid, Failure(closed.status, str(closed), None, "server_error")) for r in cmd[1])
                self.sinks.update((r.rid, r.sink) for r in cmd[1])
            elif cmd[0] in ("load", "install"):
                cmd[3].set_exception(closed)
        for rid, end in ends.items():
            with contextlib.suppress(RuntimeError):  # the server's event loop may be gone already
                self.sinks.pop(rid)(end)
        if self.link is not None:
            try:
                self.link.send_stop()
            except RuntimeError:  # the other ranks are already gone (their launcher stopped them)
                pass

    def _drain(self) -> None:
        while True:
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                self._add(cmd[1])
            elif cmd[0] == "abort":
                out = self.engine.abort(cmd[1])
                if out is not None:
                    self._deliver(out)
            elif cmd[0] == "install":
                with self._running("weight update", self.load_limit_s):
                    self._install(*cmd[1:])
            else:
                with self._running("weight update", self.load_limit_s):
                    self._load(*cmd[1:])

    def _add(self, requests: list[Submission]) -> None:
        added: list[str] = []
        try:
            for r in requests:
                self.engine.add(r.rid, r.prompt, r.params, r.follows, r.emitted, r.priority, r.handoff, r.kv)
                added.append(r.rid)
        except Exception as e:  # noqa: BLE001 - the request is refused; the engine is as it was
            for rid in added:
                self.engine.abort(rid)
            if isinstance(e, (RequestError, SamplingError)):
                failure = Failure(400, str(e), e.param)
            else:
                failure = Failure(500, f"the engine could not take the request ({type(e).__name__}: {e})", None,
                                  "server_error")
            for r in requests:
                r.sink(failure)
        else:
            self.sinks.update((r.rid, r.sink) for r in requests)
        finally:
            with self._lock:
                self._pending -= len(requests)

    def _load(self, where: str, version: int | None, done: Future) -> None:
        def apply(v: int) -> None:
            source_from(where)  # a path that names no weights fails here, before the other ranks hear of it
            if self.link is not None:  # first: the other ranks read the weights together with this one
                self.link.send_load(where, v)
            self.engine.update_weights(lambda: self.load(where), v)

        self._update(version, done, apply, where)

    def _install(self, state: dict, version: int, done: Future) -> None:
        self._update(version, done, lambda v: self.engine.update_weights(lambda: state, v), state=state)

    def _update(self, version: int | None, done: Future, apply: Callable[[int], None], where: str | None = None,
                state: dict | None = None) -> None:
        """Apply a weight update as ``version`` (default: the served one + 1), only if newer."""
        current = self.engine.weight_version
        version = current + 1 if version is None else version
        if version <= current:
            done.set_exception(WeightVersionError(f"version {version} is not newer than the weights served "
                                                  f"(version {current})"))
            return
        try:
            apply(version)
        except Exception as e:  # noqa: BLE001 - reported to the caller; the old weights stay
            done.set_exception(e)
        else:
            if self.on_weights is not None:
                self.on_weights(version, where, state)
            done.set_result(version)

    def _deliver(self, out: Output) -> None:
        sink = self.sinks.get(out.rid)
        if sink is None:
            return
        if out.finished:
            del self.sinks[out.rid]
        sink(out)
