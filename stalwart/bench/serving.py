"""`stalwart bench serving`: a fleet of `stalwart serve` replicas under a trace, one configuration against
another, through the real command and its HTTP API (streamed completions, token-id prompts).

Traces (``--trace``), generated from a seed (every configuration of a repeat gets the same requests; each
repeat a new seed, so no configuration finds the previous repeat's prompts cached):
- ``shared-prefix``: few-shot prompts (``--groups`` shared prefixes of ``--prefix-tokens``, each request the
  prefix plus a question of its own) and multi-turn chats (each turn the conversation so far plus a new
  message; the assistant turns of the history are fixed tokens, not the model's answers), run by
  ``--clients`` closed-loop clients. Configurations: the router's policies (``--policies``).
- ``mixed``: prompts of mixed lengths (mostly short, ``--long-share`` of them long) and outputs of 32-128
  tokens, by ``--clients`` closed-loop clients. Configurations (``--layouts``): ``colocated`` (every replica
  prefills and decodes) and ``P:D`` (P prefill and D decode replicas, serve/disagg.py).
- ``priority``: one replica flooded by ``--clients`` clients sending batch-class requests (priority
  ``--batch-priority``) while one client sends short interactive requests (priority 0) one after another;
  configurations: the interactive client alone (``idle``), under the flood with classes (``classes``) and
  under the same flood with every request at priority 0 (``one-class``).
Every configuration is a server of its own, started once (all before the first repeat), measured in turn
within each repeat. Printed per run: output tokens/s, time to first token and time per output token (p50,
p99 over requests; a request's TPOT is its time from the first token to the last over the tokens after
the first, as `stalwart bench inference` counts it), the prefix-cache hit rate (prompt tokens the replicas served from their cache over prompt tokens
received, from their /metrics), the 1-minute load average; then each repeat's ratios against the first
configuration. Greedy decoding (temperature 0): ``--check`` compares every configuration's output texts
request by request with the first's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from stalwart.bench.inference import pct
from stalwart.config.arguments import ArgumentParser, at_least, listed, one_of

TRACES = ("shared-prefix", "mixed", "priority")


@dataclass
class Req:
    prompt: list[int]
    out: int
    priority: int = 0
    key: str = ""  # names the request across configurations (for --check)


@dataclass
class Stats:
    seconds: float = 0.0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    texts: dict[str, str] = field(default_factory=dict)


def shared_prefix(rng: random.Random, vocab: int, a) -> list[list[Req]]:
    """Sessions (requests that go in order): few-shot requests, one per session, and multi-turn chats."""
    def toks(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    prefixes = [toks(a.prefix_tokens) for _ in range(a.groups)]
    sessions = [[Req(prefixes[g] + toks(32), a.output_tokens, key=f"shot-{g}-{k}")] for g in range(a.groups)
                for k in range(a.per_group)]
    for c in range(a.chats):
        history, turns = prefixes[c % a.groups] + toks(64), []
        for t in range(a.turns):
            turns.append(Req(list(history), a.output_tokens, key=f"chat-{c}-{t}"))
            history += toks(32) + toks(64)  # the assistant's turn, then the next user message
        sessions.append(turns)
    rng.shuffle(sessions)
    return sessions


def mixed(rng: random.Random, vocab: int, a) -> list[list[Req]]:
    reqs = []
    for k in range(a.requests):
        n = rng.randint(a.prefix_tokens // 2, a.prefix_tokens) if rng.random() < a.long_share else rng.randint(16, 128)
        reqs.append([Req([rng.randrange(vocab) for _ in range(n)], rng.randint(32, 128), key=f"m-{k}")])
    return reqs


def priority_flood(rng: random.Random, vocab: int, a) -> tuple[list[list[Req]], list[Req]]:
    flood = [[Req([rng.randrange(vocab) for _ in range(rng.randint(128, a.prefix_tokens))], a.output_tokens * 4,
                  a.batch_priority, f"b-{k}")] for k in range(a.requests)]
    probe = [Req([rng.randrange(vocab) for _ in range(32)], a.output_tokens, 0, f"i-{k}") for k in range(a.probes)]
    return flood, probe


async def one(client, url: str, r: Req, stats: Stats, priority: int | None = None) -> None:
    body = {"prompt": r.prompt, "max_tokens": r.out, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "priority": r.priority if priority is None else priority}
    t0 = time.perf_counter()
    stamps, text = [], ""
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("error"):
                raise RuntimeError(f"stream error: {event['error']}")
            if event.get("usage"):
                stats.tokens += event["usage"]["completion_tokens"]
            for c in event.get("choices") or []:
                stamps.append(time.perf_counter())
                text += c.get("text") or ""
    stats.texts[r.key] = text
    if stamps:  # as `stalwart bench inference` counts them: TPOT per request, its tokens after the first
        stats.ttft.append(stamps[0] - t0)
        if len(stamps) > 1:
            stats.tpot.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))


async def drive(url: str, sessions: list[list[Req]], clients: int, stats: Stats, priority: int | None = None) -> None:
    import httpx

    queue = list(sessions)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        async def worker() -> None:
            while queue:
                for r in queue.pop():
                    await one(client, url, r, stats, priority)

        await asyncio.gather(*(worker() for _ in range(clients)))


async def run_priority(url: str, flood: list[list[Req]], probe: list[Req], clients: int, config: str) -> Stats:
    """The interactive client's requests; under the flood unless ``config`` is idle."""
    stats, flooding = Stats(), Stats()
    done = asyncio.Event()

    async def probing() -> None:
        await asyncio.sleep(0 if config == "idle" else 2.0)  # the flood saturates the replica first
        await drive(url, [[r] for r in reversed(probe)], 1, stats)
        done.set()

    async def flooding_until_done() -> None:
        if config == "idle":
            return
        import httpx

        queue = list(flood)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
            async def worker() -> None:
                while queue and not done.is_set():
                    for r in queue.pop():
                        await one(client, url, r, flooding, None if config == "classes" else 0)

            await asyncio.gather(*(worker() for _ in range(clients)))

    t0 = time.perf_counter()
    await asyncio.gather(probing(), flooding_until_done())
    stats.seconds = time.perf_counter() - t0
    return stats


def metric(text: str, name: str) -> float:
    return sum(float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def replica_urls(url: str) -> list[str]:
    import httpx

    health = httpx.get(url + "/health", timeout=30).json()
    return [r["url"] for r in health["replicas"]] if "replicas" in health else [url]


def cache_counts(urls: list[str]) -> tuple[float, float]:
    """(prompt tokens served from the prefix cache, prompt tokens received) over ``urls``."""
    import httpx

    texts = [httpx.get(u + "/metrics", timeout=30).text for u in urls]
    return (sum(metric(t, "stalwart_serve_prefix_cached_tokens") for t in texts),
            sum(metric(t, "stalwart_serve_prompt_tokens_total") for t in texts))


class Server:
    def __init__(self, args: list[str], tmp: Path, name: str) -> None:
        self.port_file = tmp / f"{name}.port"
        self.log = open(tmp / f"{name}.log", "w")
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        self.proc = subprocess.Popen([sys.executable, "-m", "stalwart", "serve", *args, "--port", "0", "--port-file",
                                      str(self.port_file)], stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.name, self.url = name, ""

    def wait(self, timeout: float = 600.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"stalwart bench serving: the server for {self.name} exited "
                                 f"{self.proc.returncode}; its log: {self.log.name}")
            if self.port_file.is_file():
                self.url = f"http://127.0.0.1:{int(self.port_file.read_text())}"
                try:
                    if httpx.get(self.url + "/health", timeout=10).json().get("status") == "ok":
                        return
                except (httpx.HTTPError, ValueError):
                    pass
            if time.monotonic() > deadline:
                raise SystemExit(f"stalwart bench serving: {self.name} did not serve within {timeout:.0f} s")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(2)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def build_model(flavor: str, seq_len: int, tmp: Path) -> Path:
    """A Hugging Face directory of ``flavor`` with random weights and a byte-level BPE trained on a little of
    Python's standard library (the model's vocabulary is the tokenizer's)."""
    import dataclasses
    import sysconfig

    import torch

    from stalwart.data.tokenizer import EOS, train_bpe
    from stalwart.export.hf import export_hf
    from stalwart.models.flavors import FLAVORS
    from stalwart.models.llama import Transformer

    texts = [p.read_text(errors="replace") for p in sorted(Path(sysconfig.get_paths()["stdlib"], "json").glob("*.py"))]
    tok = train_bpe(texts, 1024)
    args = dataclasses.replace(FLAVORS[flavor], vocab_size=tok.get_vocab_size(), max_seq_len=seq_len, init_std=0.4)
    torch.manual_seed(0)
    state = Transformer(args).state_dict()
    tok.save(str(tmp / "tokenizer.json"))
    out = tmp / f"hf-{flavor}"
    export_hf(state, args, tmp / "tokenizer.json", EOS, tok.token_to_id(EOS), out)
    return out


def configs(a) -> dict[str, list[str]]:
    """Each configuration's `stalwart serve` flags (after the model's)."""
    common = ["--engine.kv_cache_mb", str(a.kv_cache_mb), "--engine.max_batch_tokens", str(a.max_batch_tokens)]
    if a.trace == "shared-prefix":
        balance = ["--layout.balance_abs", str(a.balance_abs)] if a.balance_abs is not None else []
        return {p: [*common, "--replicas", str(a.replicas), "--routing", p, *balance] for p in a.policies}
    if a.trace == "mixed":
        out = {}
        for layout in a.layouts:
            if layout == "colocated":
                out[layout] = [*common, "--replicas", str(a.replicas), "--routing", "least-load"]
            else:
                p, d = layout.split(":")
                out[layout] = [*common, "--prefill-replicas", p, "--decode-replicas", d, "--routing", "least-load"]
        return out
    return {c: common for c in ("idle", "classes", "one-class")}


def layout_item(text: str) -> str:
    if text == "colocated" or re.fullmatch(r"[1-9][0-9]*:[1-9][0-9]*", text):
        return text
    raise argparse.ArgumentTypeError("expected colocated or P:D (prefill:decode replicas), e.g. 1:3")


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="stalwart bench serving", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=one_of(TRACES), default="shared-prefix")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--run", help="serve this run directory (default: a random-weight model of --flavor)")
    src.add_argument("--hf", help="serve this Hugging Face directory")
    p.add_argument("--flavor", type=one_of(["debug", "tiny", "small", "125M"]), default="tiny")
    p.add_argument("--replicas", type=at_least(1), default=4)
    p.add_argument("--policies", type=listed(one_of(["cache-aware", "round-robin", "least-load"])),
                   default="cache-aware,round-robin,least-load")
    p.add_argument("--balance-abs", type=at_least(0), default=None,
                   help="layout.balance_abs of the servers (default: serve's)")
    p.add_argument("--layouts", type=listed(layout_item), default="colocated,1:3,2:2")
    p.add_argument("--repeats", type=at_least(1), default=2)
    p.add_argument("--clients", type=at_least(1), default=16)
    p.add_argument("--groups", type=at_least(1), default=16, help="shared prefixes (shared-prefix)")
    p.add_argument("--per-group", type=at_least(1), default=4, help="few-shot requests per prefix")
    p.add_argument("--chats", type=at_least(0), default=16)
    p.add_argument("--turns", type=at_least(1), default=3)
    p.add_argument("--prefix-tokens", type=at_least(16), default=768, help="shared prefix / longest prompt")
    p.add_argument("--output-tokens", type=at_least(1), default=16)
    p.add_argument("--requests", type=at_least(1), default=48, help="mixed: requests; priority: flood requests")
    p.add_argument("--long-share", type=float, default=0.25, help="mixed: share of long prompts")
    p.add_argument("--probes", type=at_least(1), default=12, help="priority: interactive requests")
    p.add_argument("--batch-priority", type=int, default=10)
    p.add_argument("--kv-cache-mb", type=at_least(1.0, float), default=32.0, help="engine.kv_cache_mb per replica")
    p.add_argument("--max-batch-tokens", type=at_least(64), default=512)
    p.add_argument("--seq-len", type=at_least(64), default=2048)
    p.add_argument("--check", action="store_true", help="every configuration's texts equal the first's")
    a = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="stalwart-bench-serving-"))
    source = ["--run", a.run] if a.run else ["--hf", a.hf or str(build_model(a.flavor, a.seq_len, tmp))]
    vocab = _vocab(source)
    servers = {name: Server([*source, *flags], tmp, name) for name, flags in configs(a).items()}
    try:
        for s in servers.values():
            s.wait()
        warm = [[Req(list(range(n)), 4, key=f"warm-{n}")] for n in (8, 64, 200)]  # first shapes: not timed
        t = time.perf_counter()
        for s in servers.values():
            asyncio.run(drive(s.url, warm, 1, Stats()))
        print(f"# warm-up: {time.perf_counter() - t:.1f} s", flush=True)
        flags = " | ".join(f"{n}: {' '.join(s.proc.args[4:-4])}" for n, s in servers.items())
        print(f"# stalwart bench serving --trace {a.trace}; serve flags per configuration: {flags}")
        print(f"{'rep':>3} {'config':<12} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
              f"{'hit rate':>8} {'reqs':>5}  {'load':>5}   (times in ms; load: 1-minute load average)", flush=True)
        first = next(iter(servers))
        for rep in range(a.repeats):
            rng = random.Random(1000 + rep)
            if a.trace == "priority":
                flood, probe = priority_flood(rng, vocab, a)
            else:
                sessions = (shared_prefix if a.trace == "shared-prefix" else mixed)(rng, vocab, a)
            results = {}
            for name, s in servers.items():
                urls = replica_urls(s.url)
                before = cache_counts(urls)
                load = os.getloadavg()[0]
                if a.trace == "priority":
                    r = asyncio.run(run_priority(s.url, flood, probe, a.clients, name))
                else:
                    r, t0 = Stats(), time.perf_counter()
                    asyncio.run(drive(s.url, sessions, a.clients, r))
                    r.seconds = time.perf_counter() - t0
                after = cache_counts(urls)
                hit = (after[0] - before[0]) / max(1.0, after[1] - before[1])
                results[name] = r
                print(f"{rep:>3} {name:<12} {r.tokens / r.seconds:8.1f} {1e3 * pct(r.ttft, .5):9.1f} "
                      f"{1e3 * pct(r.ttft, .99):9.1f} {1e3 * pct(r.tpot, .5):9.1f} {1e3 * pct(r.tpot, .99):9.1f} "
                      f"{hit:8.1%} {len(r.texts):>5}  {load:5.2f}", flush=True)
            base = results[first]
            for name, r in list(results.items())[1:]:
                print(f"{rep:>3} {first}/{name}: throughput {base.tokens / base.seconds / (r.tokens / r.seconds):.2f}x, "
                      f"TTFT p99 {pct(base.ttft, .99) / pct(r.ttft, .99):.2f}x, "
                      f"TPOT p99 {pct(base.tpot, .99) / pct(r.tpot, .99):.2f}x", flush=True)
                if a.check:
                    same = sum(base.texts.get(k) == v for k, v in r.texts.items())
                    print(f"{rep:>3} {name}: {same} of {len(r.texts)} outputs identical to {first}'s", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    shutil.rmtree(tmp, ignore_errors=True)  # kept (the servers' logs) only when a run failed
    return 0


def _vocab(source: list[str]) -> int:
    from stalwart.infer.load import Source, read_args

    flag, where = source
    return read_args(Source(run=Path(where)) if flag == "--run" else Source(hf=Path(where))).vocab_size
