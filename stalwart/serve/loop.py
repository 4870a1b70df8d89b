"""The engine's thread: the only thread that touches the engine.

Requests, aborts and weight updates arrive as commands from the HTTP server's event loop and are
applied between engine steps. A weight update is therefore a pause (no step runs while the new
weights are copied in), an update, and a resume; requests in flight keep their place and go on.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from stalwart.infer.engine import Engine, Output
from stalwart.infer.sampling import SamplingParams

Sink = Callable[[Output], None]


@dataclass
class Timing:
    """Per-request latency bookkeeping (monotonic seconds)."""

    arrived: float
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0


class EngineLoop:
    def __init__(self, engine: Engine, link=None, load: Callable[[str], dict] | None = None,
                 on_step: Callable[[list[Output], float], None] | None = None) -> None:
        self.engine = engine
        self.link = link  # infer.group.StepLink on rank 0 of a multi-process replica
        self.load = load  # where -> full state dict, for weight updates
        self.on_step = on_step
        self.commands: queue.Queue = queue.Queue()
        self.sinks: dict[str, Sink] = {}
        self.wake = threading.Event()
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="stalwart-engine", daemon=True)

    def start(self) -> "EngineLoop":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped = True
        self.wake.set()
        self.thread.join(timeout=30)

    # -- called from other threads ---------------------------------------------------------------

    def submit(self, rid: str, prompt: list[int], params: SamplingParams, sink: Sink) -> None:
        self._command(("add", rid, prompt, params, sink))

    def abort(self, rid: str) -> None:
        self._command(("abort", rid))

    def update_weights(self, where: str, version: int) -> Future:
        done: Future = Future()
        self._command(("load", where, version, done))
        return done

    def queued(self) -> int:
        return self.commands.qsize() + len(self.engine.scheduler.waiting)

    def _command(self, cmd: tuple) -> None:
        self.commands.put(cmd)
        self.wake.set()

    # -- the engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self.stopped:
                self._drain()
                if not self.engine.has_work():
                    self.wake.wait(0.5)
                    self.wake.clear()
                    continue
                start = time.monotonic()
                outputs = self.engine.step()
                for out in outputs:
                    self._deliver(out)
                if self.on_step is not None:
                    self.on_step(outputs, time.monotonic() - start)
        finally:
            for rid in list(self.sinks):
                self._deliver(Output(rid, [], "", True, "abort", self.engine.weight_version))
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
                _, rid, prompt, params, sink = cmd
                try:
                    self.engine.add(rid, prompt, params)
                except ValueError as e:
                    sink(Output(rid, [], str(e), True, "error", self.engine.weight_version))
                    continue
                self.sinks[rid] = sink
            elif cmd[0] == "abort":
                out = self.engine.abort(cmd[1])
                if out is not None:
                    self._deliver(out)
            else:
                _, where, version, done = cmd
                try:
                    state = self.load(where)
                    if self.link is not None:
                        self.link.send_load(where, version)
                    self.engine.load_full_state(state, version)
                except Exception as e:  # reported to the caller; the old weights stay
                    done.set_exception(e)
                else:
                    done.set_result(version)

    def _deliver(self, out: Output) -> None:
        sink = self.sinks.get(out.rid)
        if sink is None:
            return
        if out.finished:
            del self.sinks[out.rid]
        sink(out)
