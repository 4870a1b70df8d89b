"""A command forked from the preloaded interpreter (tests/preloaded_cli.py) is what a fresh
``python -m stalwart`` is to its caller: the same output, exit status and refusals; a background command
takes signals, and its session, like one."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from conftest import REPO, cli_env, popen_cli, run_cli

pytestmark = pytest.mark.e2e

COMMANDS = [
    ["--help"],
    ["train", "--no-such-option", "1"],  # a refusal: one line, exit 2
    ["plan", "--cluster.gpus", "16", "--model.flavor", "llama3-1B"],
    ["goodput", "/no/such/run"],
]


def _fresh(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stalwart", *args], capture_output=True, text=True,
                          env=cli_env(), cwd=REPO, timeout=120)


def test_a_forked_command_prints_and_exits_as_a_fresh_interpreter_does():
    for args in COMMANDS:
        forked, fresh = run_cli(*args, check=False), _fresh(args)
        assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr), args
    assert {run_cli(*a, check=False).returncode for a in COMMANDS} == {0, 2}  # both kinds of ending were seen


def test_a_background_command_takes_signals_in_its_own_session():
    """`rl sandbox --serve` until SIGTERM (exit 0), then until SIGKILL (-9), in a session of its own."""
    import os

    for sig, code in ((signal.SIGTERM, 0), (signal.SIGKILL, -signal.SIGKILL)):
        proc = popen_cli("rl", "sandbox", "--serve", "--service.port", "0", stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            line = proc.stdout.readline()
            assert line.startswith("stalwart rl sandbox: serving on http://127.0.0.1:"), line
            assert proc.poll() is None and os.getsid(proc.pid) == proc.pid
            with pytest.raises(subprocess.TimeoutExpired):
                proc.wait(0.1)
            proc.send_signal(sig)
            assert proc.wait(30) == code
            proc.stdout.read()
        finally:
            proc.kill()
            proc.wait()
