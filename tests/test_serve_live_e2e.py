"""Live weights through the real CLI: `stalwart serve` (a router over one replica, `--layout.router`)
takes the weights of a `stalwart train` run that is still training (two FSDP ranks, each sending its own
shards), in memory, with no checkpoint read. The served greedy tokens then equal `stalwart generate` from
the checkpoint saved at the same step; killed mid-stream, the replica is started again with those live
weights (its snapshot), and the stream resumes on it token for token; a live
update from a run that publishes nothing within the timeout answers 504 naming ``timeout`` and the
server keeps its weights; a run that does not publish at all is a 400 naming ``source``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from conftest import TINY_RUN, popen_cli, run_cli
from test_serve_e2e import Server, replica_ranks

pytestmark = pytest.mark.e2e

PROMPTS = ["def ", "import json\n", "class Foo("]


def start_train(run: Path, log: Path, *extra: str) -> subprocess.Popen:
    """`stalwart train` in a session of its own (so the test can stop its workers with it)."""
    return popen_cli("train", "--run.dir", str(run), *TINY_RUN,
                             "--model.init_std", "0.4", "--sample.max_new_tokens", "0", *extra,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT,
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
    # (context 256, trained on 32-token pieces: room for a stream long enough to be cut mid-way.) Both runs
    # train for as long as the test lasts; each step is stretched with sleeps (an injected slow rank), so
    # they do not take the cores from the server under test with thousands of steps and checkpoints.
    trainer = start_train(run, tmp_path / "live.log", "--training.steps", "100000", "--publish.interval", "2",
                          "--checkpoint.interval", "2", "--checkpoint.keep_last", "0",
                          "--launch.nproc_per_node", "2", "--model.max_seq_len", "256",
                          "--fault.inject", "slow:rank=0,factor=8,steps=1-100000")
    # A run that publishes, but not within any test's patience.
    quiet = start_train(idle, tmp_path / "idle.log", "--training.steps", "100000", "--publish.interval", "100000",
                        "--launch.nproc_per_node", "1", "--fault.inject", "slow:rank=0,factor=30,steps=1-100000")
    server = None
    try:
        wait_for("a first checkpoint", lambda: (run / "checkpoints" / "latest").is_file(), trainer,
                 tmp_path / "live.log")
        server = Server(tmp_path, "--run", str(run), "--layout.router", "true")
        before, old = server.greedy(PROMPTS), logprobs(server)

        r = live(server, run)
        assert r.status_code == 200, r.text
        version = r.json()["weight_version"]
        assert version > 0 and version % 2 == 0 and r.json()["live"] is True
        assert served_version(server) == version
        served = server.greedy(PROMPTS)
        assert logprobs(server) != old  # trained weights, not the checkpoint the server started from
        step = run / "checkpoints" / f"step-{version}"
        wait_for(f"checkpoint step-{version}", step.is_dir, trainer, tmp_path / "live.log")
        # (`stalwart generate` prints its text and a newline; the comparison drops trailing newlines alike)
        assert [t.rstrip("\n") for t in served] == [generate_from(run, step, p) for p in PROMPTS], before

        # kill -9 of the replica's process mid-stream: its launcher starts it again with the live weights
        # (the snapshot on disk: the launcher holds the checkpoint it started from), the stream resumes.
        body = {"prompt": PROMPTS[1], "max_tokens": 200, "temperature": 1.0, "seed": 5, "ignore_eos": True,
                "stream": True}
        undisturbed = stream(server, body)
        assert len(undisturbed) > 50 and stream(server, body, kill_after=1) == undisturbed
        deadline = time.monotonic() + 120
        while (health := httpx.get(server.url + "/health", timeout=30).json())["status"] != "ok":
            assert time.monotonic() < deadline, (health, server.output()[-3000:])
            time.sleep(0.5)
        assert "replica process rank 0 was killed by SIGKILL; starting it again" in server.output()
        assert served_version(server) == version
        assert server.greedy(PROMPTS) == served and "started again with the weights last applied" in server.output()

        # Nothing published within the timeout: 504 naming the field, and the weights served stay.
        wait_for("the idle run's store", (idle / "publish.json").is_file, quiet, tmp_path / "idle.log")
        r = live(server, idle, timeout=2)
        assert r.status_code == 504 and r.json()["error"]["param"] == "timeout", r.text
        assert "within timeout = 2 s" in r.json()["error"]["message"]
        assert served_version(server) == version
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


def served_version(server: Server) -> int:
    """The weight version the router's one replica serves."""
    replica = httpx.get(server.url + "/health", timeout=30).json()["replicas"][0]["url"]
    return httpx.get(replica + "/health", timeout=30).json()["weight_version"]


def stream(server: Server, body: dict, kill_after: int | None = None) -> str:
    """A streamed completion's text; with ``kill_after``, kill -9 the replica after that many chunks."""
    text, chunks = "", 0
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=240) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                text += "".join(c["text"] for c in event["choices"])
                chunks += 1
                if chunks == kill_after:
                    replica = replica_ranks(server.proc.pid)
                    os.kill(replica[0], signal.SIGKILL)
    return text


def generate_from(run: Path, checkpoint: Path, prompt: str) -> str:
    out = run_cli("generate", "--run", str(run), "--checkpoint", str(checkpoint), "--prompt", prompt,
                  "--max-new-tokens", "8", "--temperature", "0").stdout
    return out[len(prompt):].rstrip("\n")
