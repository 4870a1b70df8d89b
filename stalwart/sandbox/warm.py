"""Warm sandboxes: started ahead of need, each serving one request after another.

A sandbox's fixed cost (bubblewrap's namespaces and mounts, the interpreter, the runner's imports; about
30 ms of CPU) is paid before a request arrives, on the pool's own starter thread, so a request finds a
runner already waiting (``runner.py``: PID 1 keeps a program runner forked ahead for the next
request's first program, and forks one per later program; each forks a child per case). A sandbox serves at most ``sandbox.reuse`` requests, and only while every one of them
ended cleanly (its frames well formed, its runner's ``done`` line read); any other end retires it.

The pool also admits: a new sandbox starts only while fewer than ``sandbox.max_sandboxes`` are alive
(0: no count limit) and the host has more than ``sandbox.memory_reserve_mb`` of memory available
(``MemAvailable``); past either, ``SandboxFull`` says which, and nothing is started. Every process of a
sandbox runs with ``oom_score_adj`` 1000 (``choom``), so if memory runs out anyway the kernel's OOM
killer takes a sandboxed program first, never the service or another process of the host.

NOTE: every sandbox is started on the starter thread, which lives as long as the pool: bubblewrap's
``--die-with-parent`` fires when the *thread* that started it ends, and a caller's thread (a pool
worker) may end while its sandbox waits idle for the next request.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from stalwart.sandbox.verdicts import SandboxError


class SandboxFull(SandboxError):
    """No sandbox can start now: the configured count or the host's memory says no (retry later)."""


def mem_available_mb() -> float:
    """The host's MemAvailable (/proc/meminfo), MiB; infinity where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return float("inf")


@dataclass(eq=False)
class WarmSandbox:
    """One started sandbox: its process (stdin: requests, stdout: frames) and its stderr file."""
    proc: subprocess.Popen
    stderr: object  # an unnamed file
    served: int = 0
    _closed: bool = field(default=False, repr=False)

    @property
    def alive(self) -> bool:
        return not self._closed and self.proc.poll() is None

    def stderr_tail(self, limit: int) -> str:
        try:
            size = os.fstat(self.stderr.fileno()).st_size
            return os.pread(self.stderr.fileno(), min(size, limit), max(0, size - limit)).decode(errors="replace")
        except (OSError, ValueError):
            return ""

    def close(self) -> None:
        """Kill its whole process group (bubblewrap and everything inside) and reap it."""
        if self._closed:
            return
        self._closed = True
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.stderr):
            try:
                f.close()
            except OSError:
                pass


class WarmPool:
    """Sandboxes started ahead: ``take`` one (idle, or started now), ``give_back`` it after a request."""

    def __init__(self, launch: Callable[[], tuple[list[str], dict[str, str], tuple[int, ...], Callable[[], None]]],
                 keep: int, reuse: int, max_sandboxes: int, reserve_mb: float) -> None:
        self._launch = launch  # -> (command, environment, descriptors to pass, what closes them after the start)
        self.keep, self.reuse, self.max_sandboxes, self.reserve_mb = keep, reuse, max_sandboxes, reserve_mb
        self._idle: list[WarmSandbox] = []
        self._busy = 0
        self._starting = 0
        self.started = 0  # sandboxes started so far
        self._wanted: list[tuple[threading.Event, list]] = []  # callers waiting for a sandbox started for them
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._starter, name="sandbox-starter", daemon=True)
        self._thread.start()

    @property
    def live(self) -> int:
        return len(self._idle) + self._busy + self._starting

    def admit(self) -> None:
        """Raise SandboxFull unless one more sandbox may start now (the lock held)."""
        if self.max_sandboxes and self.live >= self.max_sandboxes:
            raise SandboxFull(f"{self.live} sandboxes are alive, sandbox.max_sandboxes allows "
                              f"{self.max_sandboxes}; retry when one ends")
        free = mem_available_mb()
        if free < self.reserve_mb:
            raise SandboxFull(f"the host has {free:.0f} MiB of memory available, under sandbox.memory_reserve_mb "
                              f"({self.reserve_mb:g}); no sandbox starts until more is free")

    def take(self) -> WarmSandbox:
        """An idle warm sandbox, or one started now on the starter thread (SandboxFull if none may)."""
        with self._cond:
            while self._idle:
                box = self._idle.pop()
                if box.alive:
                    self._busy += 1
                    self._cond.notify_all()  # the starter refills
                    return box
                box.close()
            self.admit()
            done, got = threading.Event(), []
            self._starting += 1
            self._wanted.append((done, got))
            self._cond.notify_all()
        done.wait()
        with self._cond:
            self._starting -= 1
            if isinstance(got[0], BaseException):
                raise got[0]
            self._busy += 1
            return got[0]

    def give_back(self, box: WarmSandbox, reusable: bool) -> None:
        box.served += 1
        keep = reusable and box.alive and box.served < self.reuse
        with self._cond:
            self._busy -= 1
            if keep and not self._closed and len(self._idle) < max(self.keep, 1):
                self._idle.append(box)
                self._cond.notify_all()
                return
            self._cond.notify_all()
        box.close()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for box in idle:
            box.close()

    def _start(self) -> WarmSandbox:
        argv, env, fds, after = self._launch()
        err = tempfile.TemporaryFile(prefix="stalwart-sandbox-stderr-")
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                    env=env, start_new_session=True, pass_fds=fds)
        except OSError as e:
            err.close()
            raise SandboxError(f"cannot start a sandbox: {e}") from None
        finally:
            after()
        self.started += 1
        return WarmSandbox(proc, err)

    def _starter(self) -> None:
        """Start what callers wait for first, then keep ``keep`` idle sandboxes ahead."""
        while True:
            with self._cond:
                while not self._closed and not self._wanted and not self._refill_due():
                    self._cond.wait()
                if self._closed:
                    for done, got in self._wanted:
                        got.append(SandboxError("the sandbox pool is closed"))
                        done.set()
                    self._wanted.clear()
                    return
                waiter = self._wanted.pop(0) if self._wanted else None
                if waiter is None:
                    try:
                        self.admit()
                    except SandboxFull:
                        self._cond.wait(0.5)  # memory or the count may free up; look again soon
                        continue
                    self._starting += 1
            try:
                box: WarmSandbox | BaseException = self._start()
            except BaseException as e:  # noqa: BLE001 - handed to the caller that waits for it
                box = e
            with self._cond:
                if waiter is not None:
                    waiter[1].append(box)
                    waiter[0].set()
                    continue
                self._starting -= 1
                if isinstance(box, WarmSandbox):
                    self._idle.append(box)
                self._cond.notify_all()
                if isinstance(box, BaseException):
                    self._cond.wait(1.0)  # a start that failed: no busy loop

    def _refill_due(self) -> bool:
        """Fewer than ``keep`` sandboxes idle, starting or busy (a busy one comes back warm)."""
        return self.live < self.keep
