"""Live weights through the real CLI: `stalwart serve` takes the weights of a `stalwart train` run that is
still training (two FSDP ranks, each sending its own shards), in memory, with no checkpoint read. The
served greedy tokens then equal `stalwart generate` from the checkpoint saved at the same step; a live
update from a run that publishes nothing within the timeout answers 504 naming ``timeout`` and the
server keeps its weights; a run that does not publish at all is a 400 naming ``source``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import REPO, TINY_RUN, cli_env, run_cli
from test_serve_e2e import Server

pytestmark = pytest.mark.e2e

PROMPTS = ["def ", "import json\n", "class Foo("]


def start_train(run: Path, log: Path, *extra: str) -> subprocess.Popen:
    """`stalwart train` in a session of its own (so the test can stop its workers with it)."""
    return subprocess.Popen([sys.executable, "-m", "stalwart", "train", "--run.dir", str(run), *TINY_RUN,
                             "--model.init_std", "0.4", "--sample.max_new_tokens", "0", *extra],
                            env=cli_env(), cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_for(what: str, ready, proc: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"{what}: training exited {proc.returncode}\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def live(server: Server, run: Path, **fields) -> httpx.Response:
    return httpx.post(server.url + "/v1/weights", json={"source": str(run), "live": True, **fields}, timeout=180)


def logprobs(server: Server) -> list[float]:
    r = server.client.completions.create(model=None, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=1)
    return r.choices[0].logprobs.token_logprobs


def test_live_weights_from_a_running_train(tmp_path):
    run, idle = tmp_path / "live", tmp_path / "idle"
    trainer = start_train(run, tmp_path / "live.log", "--training.steps", "100000", "--publish.interval", "2",
                          "--checkpoint.interval", "2", "--checkpoint.keep_last", "0",
                          "--launch.nproc_per_node", "2")
    # A run that publishes, but not within any test's patience.
    quiet = start_train(idle, tmp_path / "idle.log", "--training.steps", "100000", "--publish.interval", "100000",
                        "--launch.nproc_per_node", "1")
    server = None
    try:
        wait_for("a first checkpoint", lambda: (run / "checkpoints" / "latest").is_file(), trainer,
                 tmp_path / "live.log")
        server = Server(tmp_path, "--run", str(run))
        before, old = server.greedy(PROMPTS), logprobs(server)

        r = live(server, run)
        assert r.status_code == 200, r.text
        version = r.json()["weight_version"]
        assert version > 0 and version % 2 == 0 and r.json()["live"] is True
        assert httpx.get(server.url + "/health").json()["weight_version"] == version
        served = server.greedy(PROMPTS)
        assert logprobs(server) != old  # trained weights, not the checkpoint the server started from
        step = run / "checkpoints" / f"step-{version}"
        wait_for(f"checkpoint step-{version}", step.is_dir, trainer, tmp_path / "live.log")
        assert served == [generate_from(run, step, p) for p in PROMPTS], before

        # Nothing published within the timeout: 504 naming the field, and the weights served stay.
        wait_for("the idle run's store", (idle / "publish.json").is_file, quiet, tmp_path / "idle.log")
        r = live(server, idle, timeout=2)
        assert r.status_code == 504 and r.json()["error"]["param"] == "timeout", r.text
        assert "within timeout = 2 s" in r.json()["error"]["message"]
        assert httpx.get(server.url + "/health").json()["weight_version"] == version
        assert server.greedy(PROMPTS) == served
        # A directory that publishes nothing at all; a live update is one process's only.
        r = live(server, step)
        assert r.status_code == 400 and r.json()["error"]["param"] == "source" and "publish.json" in r.text, r.text
        r = live(server, run, version=version + 10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "version", r.text
        # A second live update: a later step, and the trainer recorded each send.
        r = live(server, run)
        assert r.status_code == 200 and r.json()["weight_version"] > version, r.text
        # The trainer records a publish once every send returned, which can be after the server has
        # installed the weights and answered.
        def published() -> list[dict]:
            return [e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines())
                    if e["event"] == "weights_published"]

        deadline = time.monotonic() + 60
        while len(published()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        sends = published()
        assert len(sends) >= 2 and all(e["failed"] == [] and e["subscribers"] == 1 for e in sends)
        print(f"live updates: trainer-side seconds {[round(e['seconds'], 3) for e in sends]}, "
              f"server-side seconds (wait included) {r.json()['seconds']}")
    finally:
        if server is not None:
            assert server.stop() == 0, server.output()
        for proc in (trainer, quiet):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)


def generate_from(run: Path, checkpoint: Path, prompt: str) -> str:
    out = run_cli("generate", "--run", str(run), "--checkpoint", str(checkpoint), "--prompt", prompt,
                  "--max-new-tokens", "8", "--temperature", "0").stdout
    return out[len(prompt):].rstrip("\n")
