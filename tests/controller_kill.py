"""Killing a controller from a test: start `stalwart ...` in the background, wait until its journal shows
a chosen moment, SIGKILL the controller process alone, and check that none of its descendants (the
actor processes) outlives it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from conftest import popen_cli

from stalwart.metrics.records import read_jsonl
from stalwart.paths import RunPaths
from stalwart.procs import descendants, pid_alive


def journal(run_dir: Path) -> list[dict]:
    """The entries of a run's controller journal (a torn last line skipped)."""
    return read_jsonl(RunPaths(run_dir).journal)


def start(*args: str) -> subprocess.Popen:
    return popen_cli(*args, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def kill_when(proc: subprocess.Popen, run_dir: Path, moment: Callable[[list[dict]], bool],
              timeout_s: float = 300.0, poll_s: float = 0.02) -> list[dict]:
    """SIGKILL ``proc`` (the controller alone) once ``moment(journal entries)`` holds; then wait until
    every process it had started is gone (an orphan fails the test). Returns the journal at the kill."""
    deadline = time.monotonic() + timeout_s
    while True:
        entries = journal(run_dir)
        if moment(entries):
            break
        if proc.poll() is not None:
            raise AssertionError(f"the controller ended (exit {proc.returncode}) before the moment to kill it:\n"
                                 f"{proc.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the moment to kill the controller did not come in {timeout_s:g} s")
        time.sleep(poll_s)
    children = descendants(proc.pid)
    assert children, "the controller had started no actor process"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
    deadline = time.monotonic() + 30
    while (left := {p for p in children if pid_alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"actor processes {sorted(left)} outlived their killed controller"
    return entries


def has(entries: list[dict], cmd: str, step: int) -> bool:
    """The journal holds ``cmd`` for ``step`` in its newest session."""
    start = max((i for i, e in enumerate(entries) if e["cmd"] == "session"), default=0)
    return any(e["cmd"] == cmd and e.get("step") == step for e in entries[start:])
