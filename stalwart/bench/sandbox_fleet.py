"""`stalwart bench sandbox --fleet K --flood-s S --kill-at T`: a fleet of sandbox services under a flood.

K `stalwart sandbox serve` processes run on emulated hosts (``comm/netns.py``: a network namespace each,
joined by a switch), and a flood client on a host of its own keeps ``--flood-threads`` batches of
``--batch`` programs in flight for S seconds through the reward workers' ``SandboxClient`` (per-host
limits, 429s, fail-over, health checks: ``sandbox/client.py``). T seconds into the flood the first
service is killed with SIGKILL (its sandboxes die with it); with ``--restart-at R`` it is started again
R seconds into the flood and must be health-checked back in.

The programs are a fixed set of distinct jobs of mixed verdicts (every code-task family's reference, a
wrong one, a crashing one, one right on some cases only), each scored first by a local ``Sandbox`` under
the services' limits: every verdict of the flood must equal that local one (the reward RL would get).
Each batch is a slice of an endless numbering of those jobs, so each program of the flood is known by
its number. Reported: programs/s per second of the flood, p50/p99 latency of a batch, programs *lost*
(sent, never given a verdict), *doubled* (given more verdicts than one), verdicts *unequal* to the
local ones, the programs the client sent again after a service died (*resent*, from the requests on the
wire), and *recovery*: the seconds from the kill to the end of the first ``--window-s`` window (starting
after the kill) whose programs/s reach (K-1)/K of the median before the kill (what the services left could carry on hosts of their own;
here they share the machine's cores, so the rate usually comes back whole).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

PORT = 8077


def workload(n: int, cases: int) -> list[tuple[str, list]]:
    """``n`` distinct (program, cases) jobs: per code-task instance its reference, a wrong program, one
    that crashes and one right only on inputs of even length, in turn."""
    from stalwart.rl.tasks import FAMILIES, Instance
    from stalwart.sandbox.local import Case

    jobs = []
    for i in range(n):
        fam = FAMILIES[(i // 4) % len(FAMILIES)]
        inst = Instance(fam.name, fam.params[(i // (4 * len(FAMILIES))) % len(fam.params)])
        ref = inst.solution
        source = [ref, "print(input()[::-1] + 'x')", "raise ValueError('no answer')\n" + ref,
                  "import io, sys\ndata = sys.stdin.read()\nsys.stdin = io.StringIO(data)\n"
                  "if len(data.strip()) % 2:\n    print('odd')\nelse:\n" + "".join(
                      "    " + line + "\n" for line in ref.splitlines())][i % 4]
        jobs.append((source, [Case(c.input, c.output) for c in inst.cases(cases, seed=i)]))
    return jobs


class Wire:
    """An httpx transport that records every request it carries: (host, sent, answered, status or the
    error's name, the program ids of a batch), for the resent count and each host's traffic."""

    def __init__(self, inner) -> None:
        self.inner, self.log, self._lock = inner, [], threading.Lock()

    def handle_request(self, request):
        ids = []
        if request.method == "POST":
            try:
                ids = [p.get("id") for p in json.loads(request.content).get("programs", [])]
            except (ValueError, AttributeError):
                ids = []
        t0 = time.monotonic()
        try:
            resp = self.inner.handle_request(request)
            resp.read()
            outcome: object = resp.status_code
        except Exception as e:
            outcome = type(e).__name__
            raise
        finally:
            with self._lock:
                self.log.append((request.url.host, t0, time.monotonic(), outcome, ids))
        return resp

    def close(self) -> None:
        self.inner.close()


def flood(urls: list[str], seconds: float, threads: int, batch: int, jobs: int, cases: int) -> dict:
    """Keep ``threads`` batches in flight for ``seconds`` (the client's side, in its own namespace):
    every batch's numbers, start, end and verdicts (or its error), and the requests on the wire."""
    import httpx

    from stalwart.sandbox.client import SandboxClient, transport

    work = workload(jobs, cases)
    wire = Wire(transport(urls, 8))
    client = SandboxClient(urls, retry_s=60.0, http=httpx.Client(transport=wire, timeout=httpx.Timeout(60.0, connect=5.0)))
    seq, lock, batches = [0], threading.Lock(), []
    sys.stdin.readline()  # the services listen
    start = time.monotonic()
    print(json.dumps({"flooding": start}), flush=True)
    end = start + seconds

    def worker() -> None:
        while time.monotonic() < end:
            with lock:
                first, seq[0] = seq[0], seq[0] + batch
            part = [work[(first + k) % jobs] for k in range(batch)]
            t0 = time.monotonic()
            try:
                got = [[v.reward, v.passed, v.total, v.reason] for v in client.score_many(part)]
            except Exception as e:  # noqa: BLE001 - a batch the fleet never scored: its programs are lost
                got = f"{type(e).__name__}: {e}"[:300]
            batches.append((first, batch, t0, time.monotonic(), got))

    pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return {"start": start, "seconds": seconds, "batches": batches, "wire": wire.log}


def summarize(run: dict, expected: list[list], kill_at: float | None, hosts: list[str], window: float = 1.0,
              restart_at: float | None = None) -> dict:
    """The flood table from a flood's record: per-second programs/s, latency, lost/doubled/unequal, resent,
    recovery after the kill, and when a restarted host took requests again. Pure logic."""
    start, seconds = run["start"], run["seconds"]
    counts: dict[int, int] = {}
    unequal, lost, latency, done = 0, 0, [], []
    for first, n, t0, t1, got in run["batches"]:
        if isinstance(got, str):
            lost += n
            continue
        latency.append(t1 - t0)
        done.append((t1 - start, len(got)))
        for k, verdict in enumerate(got):
            counts[first + k] = counts.get(first + k, 0) + 1
            unequal += verdict != expected[(first + k) % len(expected)]
        lost += max(0, n - len(got))
    sent_to: dict[str, set] = {}
    for host, _, _, _, ids in run["wire"]:
        for i in ids:
            sent_to.setdefault(i, set()).add(host)

    def rate(a: float, b: float) -> float:
        return sum(n for t, n in done if a <= t < b) / (b - a)

    total_s = max([seconds, *(t for t, _ in done)])
    per_second = [round(rate(s, s + 1.0), 1) for s in range(int(total_s + 0.999))]
    out = {"programs": sum(n for _, n, *_ in run["batches"]), "scored": sum(counts.values()), "lost": lost,
           "doubled": sum(c - 1 for c in counts.values() if c > 1), "unequal": unequal,
           "resent": sum(len(h) > 1 for h in sent_to.values()), "batches": len(run["batches"]),
           "programs_per_s": round(sum(n for _, n in done) / total_s, 2),
           "latency_p50_s": round(_quantile(latency, 0.5), 3), "latency_p99_s": round(_quantile(latency, 0.99), 3),
           "per_second": per_second}
    if kill_at is not None:
        before = [rate(s, s + window) for s in _steps(min(2.0, kill_at / 2), kill_at - window)]
        base = statistics.median(before) if before else 0.0
        bar = base * (len(hosts) - 1) / len(hosts)
        flooding = _steps(kill_at, seconds - window)  # not the drain after the flood: no batch starts then
        after = [s for s in flooding if rate(s, s + window) >= bar]
        out.update(rate_before_kill=round(base, 1), recovered_at=round(bar, 1),
                   recovery_s=round(after[0] + window - kill_at, 1) if after else None,
                   lowest_after_kill=round(min((rate(s, s + window) for s in flooding), default=0.0), 1))
    if restart_at is not None:
        back = [t0 - start for host, t0, _, status, _ in run["wire"]
                if host == hosts[0] and status == 200 and t0 - start >= restart_at]
        out["restarted_host_back_after_s"] = round(min(back) - restart_at, 1) if back else None
    return out


def _steps(a: float, b: float, step: float = 0.1) -> list[float]:
    return [a + k * step for k in range(max(0, int((b - a) / step) + 1))]


def _quantile(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def _serve(cluster, host: int, service_args: list[str], env: dict) -> subprocess.Popen:
    """`stalwart sandbox serve` on emulated host ``host``, its first line read (it listens)."""
    cmd = ["ip", "netns", "exec", cluster.names[host], sys.executable, "-m", "stalwart", "sandbox", "serve",
           "--service.host", cluster.addr(host), "--service.port", str(PORT), *service_args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()
    if "serving on" not in line:
        proc.kill()
        raise RuntimeError(f"the sandbox service on host {host} did not start: {line}{proc.stdout.read()[-2000:]}")
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep its pipe drained
    return proc


def fleet(cfg, services: int, flood_s: float, kill_at: float | None, restart_at: float | None, threads: int,
          batch: int, jobs: int, cases: int, window: float = 1.0) -> dict:
    """Start the fleet and the flood, kill (and restart) the first service on time: the flood's table."""
    from stalwart.comm.netns import NetnsCluster
    from stalwart.sandbox.local import Sandbox

    expected: list[list] = []

    def score_locally() -> None:  # while the services start
        local = Sandbox(cfg)
        expected.extend([v.reward, v.passed, v.total, v.reason] for v in local.score_many(workload(jobs, cases)))
        local.close()

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                        os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    limits = [f"--sandbox.{k}={getattr(cfg, k)}" for k in ("wall_seconds", "cpu_seconds", "memory_mb", "processes",
                                                            "file_size_mb", "open_files", "max_sandboxes",
                                                            "memory_reserve_mb")]
    started: list[subprocess.Popen] = []  # every service process, the restarted one too
    by_host: dict[int, subprocess.Popen] = {}
    events: dict[str, float] = {}
    client = None

    def serve(h: int) -> None:
        by_host[h] = _serve(cluster, h, limits, env)
        started.append(by_host[h])

    with NetnsCluster(hosts=services + 1) as cluster:
        try:
            urls = [f"http://{cluster.addr(h)}:{PORT}" for h in range(services)]
            args = json.dumps({"urls": urls, "seconds": flood_s, "threads": threads, "batch": batch, "jobs": jobs,
                               "cases": cases})
            # The client starts with the services (its imports meanwhile) and floods once told to.
            client = subprocess.Popen(["ip", "netns", "exec", cluster.names[services], sys.executable, "-m",
                                       "stalwart.bench.sandbox_fleet", args], env=env, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
            starting = [threading.Thread(target=serve, args=(h,)) for h in range(services)]
            starting.append(threading.Thread(target=score_locally))
            for t in starting:
                t.start()
            for t in starting:
                t.join()
            if len(by_host) != services or len(expected) != jobs:
                raise RuntimeError("a sandbox service did not start, or the local scoring failed (see above)")
            client.stdin.write("go\n")
            client.stdin.close()
            client.stdin = None  # communicate() below reads only
            start = json.loads(client.stdout.readline())["flooding"]
            if kill_at is not None:
                time.sleep(max(0.0, start + kill_at - time.monotonic()))
                os.kill(by_host[0].pid, signal.SIGKILL)
                events["killed_at"] = time.monotonic() - start
                by_host[0].wait()
            if restart_at is not None:
                time.sleep(max(0.0, start + restart_at - time.monotonic()))
                events["restarted_at"] = time.monotonic() - start
                serve(0)
                events["restarted_listening_at"] = time.monotonic() - start
            out, _ = client.communicate(timeout=flood_s + 180)
            if client.returncode != 0:
                raise RuntimeError(f"the flood client exited {client.returncode}")
            run = json.loads(out)
        finally:
            for p in [*started, *([client] if client else [])]:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in [*started, *([client] if client else [])]:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    hosts = [u.split("//")[1].split(":")[0] for u in urls]
    summary = summarize(run, expected, events.get("killed_at"), hosts, window, events.get("restarted_at"))
    per_host = {h: sum(1 for host, _, _, status, _ in run["wire"] if host == h and status == 200) for h in hosts}
    return {"measure": "fleet", "services": services, "flood_s": flood_s, "threads": threads, "batch": batch,
            "cases": cases, **{k: round(v, 2) for k, v in events.items()}, **summary,
            "batches_answered_per_host": per_host}


def main() -> int:
    """The flood client, in its own namespace: ``python -m stalwart.bench.sandbox_fleet '<json>'``."""
    a = json.loads(sys.argv[1])
    print(json.dumps(flood(a["urls"], a["seconds"], a["threads"], a["batch"], a["jobs"], a["cases"])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
