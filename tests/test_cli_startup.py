"""A bad command line costs a fraction of a second: every command checks its flags and config before it
imports torch (or Monarch, transformers, the web server), so the one-line error and exit 2 come before
the seconds those imports take. One fresh interpreter runs them all through the real entry point."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, cli_env

pytestmark = pytest.mark.e2e

HEAVY = ("torch", "monarch", "transformers", "fastapi", "uvicorn")

# name -> a command line that is wrong before anything runs (a bad flag, a value out of range), and its --help
BAD = {
    "train": ["train", "--nope"],
    "train, bad --nproc-per-node": ["train", "--nproc-per-node", "0"],
    "train, bad config value": ["train", "--training.steps", "many"],
    "train, no such data": ["train", "--data.path", "/nonexistent/stalwart-data"],
    "train, a layout the world cannot hold": ["train", "--nproc-per-node", "2", "--parallelism.tp", "3"],
    "serve": ["serve", "--nope"],
    "serve, no weights": ["serve", "--port", "0"],
    "serve --plan": ["serve", "--plan", "--nope"],
    "generate": ["generate", "--run", "x", "--top-k", "-1"],
    "generate, not a run": ["generate", "--run", "/nonexistent/run"],
    "export": ["export", "--run", "x", "--out", "y", "--max-shard-gb", "0"],
    "export, not a run": ["export", "--run", "/nonexistent/run", "--out", "/nonexistent/out"],
    "report": ["report", "--nope"],
    "rl": ["rl", "--nope"],
    "rl sandbox": ["rl", "sandbox", "--nope"],
    "sandbox run": ["sandbox", "run", "--nope"],
    "sandbox serve": ["sandbox", "serve", "--service.port", "-1"],
    "sandbox": ["sandbox", "nope"],
    "bench": ["bench", "nope"],
    "bench throughput": ["bench", "throughput", "--nope"],
    "bench layouts": ["bench", "layouts", "--nope"],
    "chaos": ["chaos", "--faults", "0"],
    "compare": ["compare", "--nope"],
    "dashboard": ["dashboard", "--nope"],
    "data prepare": ["data", "prepare", "--nope"],
    "data inspect": ["data", "inspect"],
    "diagnose": ["diagnose", "--nope"],
    "doctor": ["doctor", "--nproc", "0"],
    "plan": ["plan", "--nope"],
    "goodput": ["goodput", "--nope"],
    "simulate": ["simulate", "--nope"],
}
HELP = [["train", "--help"], ["serve", "--help"], ["serve", "--plan", "--help"], ["generate", "--help"],
        ["bench", "throughput", "--help"], ["chaos", "--help"], ["compare", "--help"], ["data", "prepare", "--help"]]

# Runs each command line in this one process, in order, and reports its exit status and the heavy
# modules loaded so far (so the first command that loads one is named).
PROBE = """
import contextlib, io, json, sys
from stalwart.cli import main
out = []
for name, argv, want in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    out.append([name, code, want, err.getvalue().strip().splitlines(),
                sorted(m for m in json.loads(sys.argv[2]) if m in sys.modules)])
print(json.dumps(out))
"""


def test_bad_command_lines_and_help_fail_before_any_heavy_import():
    cases = [[name, argv, 2] for name, argv in BAD.items()] + [[" ".join(argv), argv, 0] for argv in HELP]
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(cases), json.dumps(HEAVY)], capture_output=True,
                          text=True, env=cli_env(), cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name, code, want, err, heavy in json.loads(proc.stdout):
        assert code == want, (name, code, err)
        if want == 2:  # the one line that names what to fix
            assert len(err) == 1 and ("error" in err[0] or "unknown" in err[0]), (name, err)
        assert heavy == [], f"`stalwart {name}` imported {', '.join(heavy)} (or a command before it did)"
