"""`stalwart serve` through the real CLI, spoken to with OpenAI's own client: greedy output equals
`stalwart generate`; tensor parallel, pipeline parallel (from the exported Hugging Face directory) and
replicas equal one process; streaming chat, weight updates that
drop nothing (over one process and over tensor- and pipeline-parallel groups), bad input answered with a
4xx while the server keeps serving, a killed replica the router routes around, quiet shutdown.
The API's finer points run against an in-process server in test_serve_app.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from conftest import TINY_RUN, popen_cli, run_cli

openai = pytest.importorskip("openai")

PROMPTS = ["def ", "import json\n", "class Foo(object):\n    def __init__(self", "    return", "x = [1, 2]\nfor",
           "\"\"\"", "if __name__ == '__main__':\n", "try:\n    import"]


def train(run: Path, seed: int) -> None:
    # lr 0 keeps the (wide) initial weights: greedy choices far from ties, outputs that differ.
    run_cli("train", "--run.dir", str(run), *TINY_RUN, "--training.steps", "2", "--optimizer.lr", "0",
            "--model.init_std", "0.4", "--model.max_seq_len", "160", "--run.seed", str(seed),
            "--sample.max_new_tokens", "0", "--launch.nproc_per_node", "1")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("serve")
    train(root / "a", 0)
    train(root / "b", 1)
    return root / "a", root / "b"


class Server:
    def __init__(self, tmp: Path, *args: str) -> None:
        self.port_file = tmp / f"port-{time.monotonic_ns()}"
        self.log = open(tmp / f"server-{self.port_file.name}.log", "a+")  # this server's output only
        self.proc = popen_cli("serve", *args, "--port", "0",
                                      "--port-file", str(self.port_file),
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.wait_serving()

    def wait_serving(self) -> None:
        """Wait for the port file (written once serving; again by a group started again)."""
        deadline = time.monotonic() + 240
        while not self.port_file.is_file():
            assert self.proc.poll() is None, f"server exited {self.proc.returncode}: {self.output()}"
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        self.url = f"http://127.0.0.1:{int(self.port_file.read_text())}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def greedy(self, prompts: list[str], max_tokens: int = 8) -> list[str]:
        r = self.client.completions.create(model=None, prompt=prompts, max_tokens=max_tokens, temperature=0)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    def stop(self, sig: int = signal.SIGINT, everyone: bool = False) -> int:
        """Signal the command (as a Ctrl-C at its terminal does), or ``everyone``: every process of the
        server at once (as a service manager stopping its cgroup does); its exit status."""
        for pid in process_tree(self.proc.pid) if everyone else [self.proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return self.proc.wait(timeout=60)

    def listening(self) -> list[str]:
        """The addresses (host:port) every process of the server listens on (TCP, from /proc)."""
        inodes = set()
        for pid in process_tree(self.proc.pid):
            with contextlib.suppress(OSError):
                for fd in Path(f"/proc/{pid}/fd").iterdir():
                    with contextlib.suppress(OSError):
                        target = os.readlink(fd)
                        if target.startswith("socket:["):
                            inodes.add(target[8:-1])
        found = []
        for table, size in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # state LISTEN, a socket of ours
                    addr, port = fields[1].split(":")
                    raw = bytes.fromhex(addr)
                    # /proc shows the address as 32-bit words in host (little-endian) order.
                    host = socket.inet_ntop(socket.AF_INET if size == 4 else socket.AF_INET6,
                                            b"".join(raw[i:i + 4][::-1] for i in range(0, size, 4)))
                    found.append(f"{host}:{int(port, 16)}")
        return found

    def update(self, source: Path, **fields) -> dict:
        r = httpx.post(self.url + "/v1/weights", json={"source": str(source), **fields}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()


def _parents() -> dict[int, int]:
    """Every process's parent (Linux /proc)."""
    parents = {}
    for p in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            if p.name.isdigit():
                parents[int(p.name)] = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
    return parents


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux /proc)."""
    parents = _parents()
    tree = [pid]
    for p in tree:
        tree += [child for child, parent in parents.items() if parent == p]
    return tree


def replica_ranks(pid: int) -> list[int]:
    """The replica processes under ``pid``: each one-process replica a router started (``python -m
    stalwart.serve.replica``), and each rank of a multi-process one (a fork of its launcher, ``python -m
    stalwart.serve.launcher``)."""
    tree, parents = process_tree(pid), _parents()
    lines = {}
    for p in tree:
        with contextlib.suppress(OSError):
            lines[p] = Path(f"/proc/{p}/cmdline").read_bytes()
    launchers = {p for p, line in lines.items() if b"stalwart.serve.launcher" in line}
    return sorted(p for p, line in lines.items() if b"stalwart.serve.replica" in line or parents.get(p) in launchers
                  and Path(f"/proc/{p}/comm").read_text().strip() != "stalwart-keeper")


def rank_pid(server: Server, rank: int) -> int:
    """The process of rank ``rank`` of the server's replica (its launcher names each rank's process)."""
    for pid in process_tree(server.proc.pid):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() == f"stalwart-rank{rank}":
                return pid
    raise AssertionError(f"no rank {rank} under {server.proc.pid}")


def kill_and_watch(server: Server, rank: int, timeout: float = 120) -> list[tuple]:
    """kill -9 rank ``rank``, then poll ``/health`` until it is 200 again after the kill was noticed: every
    other answer, as (status, Retry-After), or the connection error's name."""
    os.kill(rank_pid(server, rank), signal.SIGKILL)
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(server.url + "/health", timeout=30)
        except httpx.HTTPError as e:
            seen.append(type(e).__name__)
            continue
        if r.status_code == 200 and seen:
            return seen
        if r.status_code != 200:
            seen.append((r.status_code, r.headers.get("retry-after")))
        time.sleep(0.01)
    raise AssertionError(f"not serving {timeout:.0f} s after rank {rank} was killed: {seen[-3:]}")


def greedy_at_once(server: Server, prompts: list[str]) -> list[str | None]:
    """Each prompt's greedy text, every prompt sent at the same time on a thread of its own."""
    results: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, server.greedy([prompts[i]])[0]))
               for i in range(len(prompts))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    return [results.get(i) for i in range(len(prompts))]


# Prompt scoring (echo with logprobs) and several choices, as lm-evaluation-harness and samplers send them.
SCORED = {"prompt": PROMPTS[:3], "max_tokens": 2, "echo": True, "logprobs": 2, "temperature": 0, "n": 2}


def scored(server: Server) -> tuple[list[str], list[list[float | None]]]:
    """The texts and per-token log-probabilities (the prompt's, then the output's) of one echo request."""
    r = httpx.post(server.url + "/v1/completions", json=SCORED, timeout=120)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    return [c["text"] for c in choices], [c["logprobs"]["token_logprobs"] for c in choices]


def same_scores(got: tuple[list[str], list[list]], want: tuple[list[str], list[list]]) -> bool:
    """Equal texts, log-probabilities within 1e-5 (tensor parallel sums in another order)."""
    flat = [(x, y) for g, w in zip(got[1], want[1]) for x, y in zip(g, w, strict=True)]
    return got[0] == want[0] and all(x is y is None or abs(x - y) < 1e-5 for x, y in flat)


def generate(run: Path, prompt: str, n: int) -> str:
    out = run_cli("generate", "--run", str(run), "--prompt", prompt, "--max-new-tokens", str(n),
                  "--temperature", "0").stdout
    return out[len(prompt):].rstrip("\n")


@pytest.mark.e2e
def test_serve_one_process(runs, tmp_path):
    a, b = runs
    server = Server(tmp_path, "--run", str(a))
    try:
        c = server.client
        # Greedy completions of a batch equal `stalwart generate`, and each alone.
        batch = server.greedy(PROMPTS)
        assert batch == [server.greedy([p])[0] for p in PROMPTS]
        assert len(set(batch)) > 4
        assert batch[0] == generate(a, PROMPTS[0], 8)
        # Log-probabilities on request; OpenAI's chat stream through OpenAI's client.
        r = c.completions.create(model="a", prompt="def ", max_tokens=4, temperature=0, logprobs=2)
        assert len(r.choices[0].logprobs.token_logprobs) == 4 and r.usage.completion_tokens == 4
        chunks = list(c.chat.completions.create(model="a", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=6, stream=True, seed=3))
        assert chunks[-1].choices[0].finish_reason == "length"
        assert sum(1 for ch in chunks if ch.choices[0].delta.content is not None) == 6
        # Bad input: a clear 4xx each, and the server goes on.
        with pytest.raises(openai.BadRequestError, match="the model's context of 160"):
            c.completions.create(model="a", prompt="x " * 200, max_tokens=10)
        # A seed torch cannot take is refused by name; the engine goes on serving.
        for seed in (99999999999999999999999, -9223372036854775809):
            with pytest.raises(openai.BadRequestError, match=r"seed must be an integer in \[-2\*\*63") as e:
                c.completions.create(model="a", prompt="def ", max_tokens=3, seed=seed)
            assert e.value.body["param"] == "seed"
        assert server.greedy([PROMPTS[0]]) == batch[:1]
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            c.completions.create(model="gpt-4", prompt="x")
        with pytest.raises(openai.BadRequestError, match="temperature"):
            c.completions.create(model="a", prompt="x", temperature=9)
        r = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        # A client that leaves mid-stream: its request is cancelled.
        with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                          json={"prompt": "def ", "max_tokens": 120, "stream": True, "ignore_eos": True}) as s:
            next(s.iter_lines())
        # A weight update while streams are in flight: every stream finishes, the versions say what made it.
        # Two clients keep a 150-token stream running each until the update has returned, so one spans it
        # whatever the update costs on a loaded machine (one stream alone could end before the load landed).
        runs: list[list[dict]] = []
        updated = threading.Event()

        def stream_until_updated():
            while not updated.is_set():
                seen: list[dict] = []
                runs.append(seen)
                with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                                  json={"prompt": "def ", "max_tokens": 150, "stream": True, "temperature": 0,
                                        "ignore_eos": True}) as s:
                    seen.extend(json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {"))

        clients = [threading.Thread(target=stream_until_updated) for _ in range(2)]
        for t in clients:
            t.start()
            deadline = time.monotonic() + 30
            while not (runs and runs[-1]) and time.monotonic() < deadline:
                time.sleep(0.01)
        r = httpx.post(server.url + "/v1/weights", json={"source": str(b), "version": 7}, timeout=60)
        updated.set()
        assert r.status_code == 200, r.text
        for t in clients:
            t.join(60)
        for seen in runs:  # one event per token: none lost across the update
            assert len(seen) == 150 and seen[-1]["choices"][0]["finish_reason"] == "length"
        spans = [(seen[0]["weight_versions"], seen[-1]["weight_versions"]) for seen in runs]
        assert ([0], [7]) in spans, spans
        assert all(first <= last for first, last in spans), spans
        assert httpx.get(server.url + "/health").json()["weight_version"] == 7
        assert server.greedy([PROMPTS[0]]) == [generate(b, PROMPTS[0], 8)]
        bad = httpx.post(server.url + "/v1/weights", json={"source": str(tmp_path)}, timeout=60)
        assert bad.status_code == 400 and "neither a run directory" in bad.text
        # Versions are positive and only go forward; unset, the next one.
        for version, status in ((-7, 400), (7, 409), (3, 409)):
            r = httpx.post(server.url + "/v1/weights", json={"source": str(a), "version": version}, timeout=60)
            assert r.status_code == status and r.json()["error"]["param"] == "version", r.text
        assert server.update(a)["weight_version"] == 8
        r = c.completions.create(model="a", prompt=PROMPTS[0], max_tokens=8, temperature=0)
        assert r.choices[0].text == batch[0] and r.system_fingerprint == "stalwart-weights-v8"
        metrics = httpx.get(server.url + "/metrics").text
        assert 'stalwart_serve_requests_total{model="a",outcome="cancelled"} 1.0' in metrics
        assert "stalwart_serve_time_to_first_token_seconds_count" in metrics
    finally:
        assert server.stop() == 0, server.output()


@pytest.mark.e2e
def test_tensor_parallel_pipeline_and_replicas_equal_one_process(runs, tmp_path):
    a, b = runs
    prompts = [p * k for k in (1, 3) for p in PROMPTS] * 2  # 32 requests, mixed lengths
    one = Server(tmp_path, "--run", str(a))
    try:
        expected = one.greedy(prompts)
        expected_scores = scored(one)
        one.update(b)
        expected_b = one.greedy(prompts)  # what the weights of run b say
        assert expected_b != expected
    finally:
        assert one.stop() == 0
    run_cli("export", "--run", str(a), "--format", "hf", "--out", str(tmp_path / "hf"))
    bad = wrong_shape_copy(tmp_path / "hf", tmp_path / "hf-bad")
    tp = Server(tmp_path, "--run", str(a), "--tp", "2")
    try:
        # Every socket the group listens on is on loopback (the HTTP one follows --host, 127.0.0.1 here):
        # the launcher's rendezvous store, the group's store, gloo's connections.
        listening = tp.listening()
        assert len(listening) >= 4 and all(a.startswith("127.0.0.1:") for a in listening), listening
        assert tp.greedy(prompts) == expected
        assert tp.greedy(prompts[:1]) == expected[:1] and tp.greedy(prompts[:4]) == expected[:4]
        assert same_scores(scored(tp), expected_scores)
        # Weight updates over both processes: from a run directory, then from one of a run's checkpoints.
        assert tp.update(b)["weight_version"] == 1
        assert tp.greedy(prompts) == expected_b
        checkpoint = next((a / "checkpoints").glob("step-*"))
        assert tp.update(checkpoint)["weight_version"] == 2
        r = tp.client.completions.create(model=None, prompt=prompts[:4], max_tokens=8, temperature=0)
        assert [c.text for c in r.choices] == expected[:4] and r.system_fingerprint == "stalwart-weights-v2"
        # Weights of the wrong shape: refused by every rank alike (400 naming the tensor), all keep serving.
        r = httpx.post(tp.url + "/v1/weights", json={"source": str(bad)}, timeout=120)
        assert r.status_code == 400 and "has shape" in r.json()["error"]["message"], r.text
        assert tp.greedy(prompts[:4]) == expected[:4]
        assert httpx.get(tp.url + "/health").json() == {"status": "ok", "model": "a", "weight_version": 2}
        quiet = len(tp.output().splitlines())
        # kill -9 of rank 1 with 32 requests in flight: its launcher starts it alone again (with the weights
        # last applied, version 2, read from disk: the launcher holds version 0); rank 0 rejoins its group,
        # keeps answering (/health 503 with Retry-After meanwhile) and recomputes the requests in flight:
        # none fails. Then rank 0: its launcher answers on the port meanwhile.
        checkpoint_weights = tp.greedy(prompts[:4])
        for rank in (1, 0):
            pending = threading.Thread(target=lambda: results.append(tp.greedy(prompts)))
            results: list = []
            pending.start()
            time.sleep(0.5)
            seen = kill_and_watch(tp, rank)
            pending.join(120)
            assert rank == 0 or results == [expected], (rank, seen)  # rank 0's loss drops its connections
            # Every answer meanwhile was a 503 with Retry-After (rank 0, or for rank 0 its launcher), never a
            # refused connection.
            assert seen and all(s == (503, "1") for s in seen), (rank, seen)
            assert tp.greedy(prompts[:4]) == checkpoint_weights
        assert httpx.get(tp.url + "/health").json() == {"status": "ok", "model": "a", "weight_version": 2}
        healing = tp.output().splitlines()[quiet:]
        assert [line for line in healing if "starting it again" in line] == [
            f"stalwart serve: replica process rank {r} was killed by SIGKILL; starting it again (the other ranks "
            "keep their state)" for r in (1, 0)], healing
    finally:
        # SIGINT to every process of the group at once stops it quietly, as one process: the start line
        # and "stopped", exit status 0 (no launcher or rank traceback, no warning from a rank).
        assert tp.stop(signal.SIGINT, everyone=True) == 0, tp.output()
        lines = tp.output().splitlines()
        assert "tp=2" in lines[0] and lines[-1] == "stalwart serve: stopped", tp.output()
        assert "Traceback" not in tp.output() and "arning" not in tp.output(), tp.output()
    # The exported Hugging Face directory, pipeline-split over two processes.
    pp = Server(tmp_path, "--hf", str(tmp_path / "hf"), "--pp", "2")
    try:
        assert pp.greedy(prompts) == expected
        assert same_scores(scored(pp), expected_scores)
        assert pp.update(b)["weight_version"] == 1
        assert pp.greedy(prompts[:8]) == expected_b[:8]
        # kill -9 of the last stage: its launcher starts that rank alone again, with the weights the
        # replica last applied (run b, version 1, read from disk: the launcher holds version 0), while
        # rank 0 keeps serving /health (503 with Retry-After until the group is whole again).
        first = rank_pid(pp, 0)
        os.kill(rank_pid(pp, 1), signal.SIGKILL)
        assert pp.greedy(prompts[:8]) == expected_b[:8]  # queued meanwhile, then served
        assert httpx.get(pp.url + "/health").json()["weight_version"] == 1
        assert "replica process rank 1 was killed by SIGKILL; starting it again" in pp.output()
        assert "rank 1 started again with the weights last applied (version 1, " in pp.output()
        assert rank_pid(pp, 0) == first  # rank 0 was not started again
    finally:
        # SIGTERM to the command: the group stops in order, quietly.
        assert pp.stop(signal.SIGTERM) == 0, pp.output()
        assert pp.output().splitlines()[-1] == "stalwart serve: stopped", pp.output()
        assert "Traceback" not in pp.output(), pp.output()
    routed = Server(tmp_path, "--run", str(a), "--replicas", "2")
    try:
        assert greedy_at_once(routed, prompts[:8]) == expected[:8]
        health = httpx.get(routed.url + "/health").json()
        assert health["status"] == "ok" and all(r["served"] > 0 for r in health["replicas"])
        replicas = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _has_parent(p, routed.proc.pid)]
        assert len(replicas) == 2
        # kill -9 of one replica: every request goes to the other, none fails.
        dead = replicas.pop()
        subprocess.run(["kill", "-9", dead.name], check=True)
        assert greedy_at_once(routed, prompts[:10]) == expected[:10]
        health = httpx.get(routed.url + "/health").json()
        assert health["status"] == "degraded" and sorted(r["ok"] for r in health["replicas"]) == [False, True]
        # kill -9 of the launcher leaves no replica behind.
        routed.proc.kill()
        routed.proc.wait()
        deadline = time.monotonic() + 20
        while any((p / "cmdline").exists() for p in replicas) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any((p / "cmdline").exists() for p in replicas)
    finally:
        if routed.proc.poll() is None:
            assert routed.stop() == 0, routed.output()


def wrong_shape_copy(hf: Path, out: Path) -> Path:
    """A copy of the Hugging Face directory ``hf`` whose last layer's MLP is one row short."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(hf, out)
    weights = out / "model.safetensors"
    tensors = load_file(weights)
    name = max(k for k in tensors if k.endswith("mlp.down_proj.weight"))
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, weights, metadata={"format": "pt"})
    return out


def _has_parent(proc: Path, pid: int) -> bool:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid
    except (OSError, ValueError, IndexError):
        return False


@pytest.mark.e2e
def test_bad_command_lines_exit_2_with_one_line(runs, tmp_path):
    a, _ = runs
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cases = {("--run", str(tmp_path / "missing")): "--run: ",
                 ("--run", str(a), "--tp", "3"): "--tp 3 must divide",
                 ("--hf", str(tmp_path)): "--hf: ",
                 ("--run", str(a), "--engine.block_sise", "4"): "did you mean 'engine.block_size'",
                 ("--run", str(a), "--port", str(busy.getsockname()[1])): "server.port: cannot listen",
                 ("--run", str(a), "--host", "999.1.1.1"): "server.host: cannot listen on 999.1.1.1",
                 ("--run", str(a), "--engine.kv_cache_mb", "nan"): "engine.kv_cache_mb: expected a finite number"}
        for args, message in cases.items():
            r = run_cli("serve", *args, check=False, timeout=120)
            assert r.returncode == 2 and message in r.stderr, (args, r.stderr)
            assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.e2e
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: --device cuda is no error here")
def test_a_device_this_machine_lacks_is_one_line(runs):
    """`serve` (checked before any process starts, one process or a group) and `generate` refuse a
    device the machine lacks in one line naming the setting, exit 2."""
    a, _ = runs
    cases = {("serve", "--run", str(a), "--device", "cuda"): "--device cuda: ",
             ("serve", "--run", str(a), "--tp", "2", "--device", "cuda"): "--device cuda: ",
             ("serve", "--run", str(a), "--engine.device", "cuda"): "engine.device cuda: ",
             ("generate", "--run", str(a), "--device", "cuda"): "--device cuda: "}
    for args, message in cases.items():
        r = run_cli(*args, check=False, timeout=120)
        assert r.returncode == 2 and message in r.stderr and r.stdout == "", (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
