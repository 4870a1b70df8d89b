"""`stalwart bench sandbox --startup K | --concurrent N`: a sandbox's fixed costs, and how many fit at once.

``--startup K`` times K programs one after another, each alone in a request, from the request (the
call to ``Sandbox.run``) to the program's first line (it prints ``time.monotonic()``: the sandbox
shares the host's monotonic clock), with sandboxes started ahead (warm) and with one started per
request (cold, ``sandbox.warm 0 --sandbox.reuse 1``); and the memory an idle warm sandbox holds
(proportional set size of its processes, and the host's MemAvailable before and after).

``--concurrent N`` starts N programs at once, each in a sandbox of its own, each touching 1 MiB and
sleeping until a common deadline (``--hold`` seconds after the first request): the programs alive at
the deadline are those that started before it, and all of them were alive together. It reports how
many ran, how many the pool refused (``SandboxFull``: the configured ``sandbox.max_sandboxes`` or
``sandbox.memory_reserve_mb``, a clean refusal, never a start), the memory per running sandbox, and
the kernel's OOM kills during the run (/proc/vmstat ``oom_kill``), which must be 0.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time

FIRST_LINE = "print(__import__('time').monotonic())"
HOLD = """import time
deadline = float(input())
x = bytearray(1 << 20)
x[::4096] = b'1' * 256
print(time.monotonic(), flush=True)
time.sleep(max(0.0, deadline - time.monotonic()))
print('ok')
"""


def load() -> dict:
    """The machine's load while measuring (/proc/loadavg: 1, 5, 15 minutes)."""
    with open("/proc/loadavg") as f:
        return {"loadavg": " ".join(f.read().split()[:3])}


def oom_kills() -> int:
    try:
        with open("/proc/vmstat") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("oom_kill ")), 0)
    except OSError:
        return 0


def _tree_pss_mb(roots: list[int]) -> tuple[float, int]:
    """Proportional set size of the processes under ``roots`` (themselves included), MiB, and their count."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    total, count, todo = 0, 0, list(roots)
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
            count += 1
        except (OSError, StopIteration, ValueError):
            continue
    return total / 1024, count


def _sandbox_pids(sandbox) -> list[int]:
    pool = sandbox.pool
    with pool._cond:
        return [b.proc.pid for b in pool._idle]


def startup(cfg, runs: int) -> list[dict]:
    """Start-up to the first line, warm and cold, interleaved; then an idle warm sandbox's memory."""
    from dataclasses import replace

    from stalwart.sandbox.local import Sandbox
    from stalwart.sandbox.warm import mem_available_mb

    sandboxes = {"warm": Sandbox(replace(cfg, warm=max(cfg.warm, 1))), "cold": Sandbox(replace(cfg, warm=0, reuse=1))}
    time.sleep(1.0)  # the warm pool starts its first sandboxes
    starts: dict[str, list[float]] = {k: [] for k in sandboxes}
    for _ in range(runs):
        for name, sandbox in sandboxes.items():
            t0 = time.monotonic()
            run = sandbox.run(FIRST_LINE, "")
            starts[name].append((float(run.stdout) - t0) * 1000)
            time.sleep(0.05)  # the warm pool's next sandbox is ready (reuse keeps the same one)
    rows = [{"measure": "startup_ms", "mode": name, "runs": runs, "median": round(statistics.median(v), 2),
             "p90": round(sorted(v)[int(0.9 * (len(v) - 1))], 2), "min": round(min(v), 2), **load()}
            for name, v in starts.items()]
    for sandbox in sandboxes.values():
        sandbox.close()
    idle = Sandbox(replace(cfg, warm=20, reuse=64))
    before = mem_available_mb()
    deadline = time.monotonic() + 60
    while len(_sandbox_pids(idle)) < 20 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)
    pids = _sandbox_pids(idle)
    pss, procs = _tree_pss_mb(pids)
    rows.append({"measure": "idle_memory_mb", "sandboxes": len(pids), "pss_per_sandbox": round(pss / len(pids), 2),
                 "processes_per_sandbox": round(procs / len(pids), 1),
                 "mem_available_drop_per_sandbox": round((before - mem_available_mb()) / len(pids), 2), **load()})
    idle.close()
    return rows


def concurrent(cfg, n: int, hold_s: float) -> dict:
    """N programs at once, each in its own sandbox, alive together until a common deadline."""
    from dataclasses import replace

    from stalwart.sandbox.local import Sandbox
    from stalwart.sandbox.warm import SandboxFull, mem_available_mb

    sandbox = Sandbox(replace(cfg, warm=0, reuse=1, wall_seconds=hold_s + 120.0))
    oom_before, mem_before = oom_kills(), mem_available_mb()
    t0 = time.monotonic()
    deadline = t0 + hold_s
    results: list[tuple[str, object]] = [("", None)] * n
    sample: dict = {}

    def one(i: int) -> None:
        try:
            results[i] = ("run", sandbox.run(HOLD, f"{deadline!r}\n"))
        except SandboxFull as e:
            results[i] = ("refused", str(e))

    def measure() -> None:  # just before the deadline: every program started by then is alive
        time.sleep(max(0.0, deadline - 2.0 - time.monotonic()))
        with sandbox.pool._cond:
            sample["sandboxes_alive"] = sandbox.pool._busy
        pids = [p for p in _busy_pids(sandbox)]
        sample["pss_mb"], sample["processes"] = _tree_pss_mb(pids)
        sample["mem_available_mb"] = mem_available_mb()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    watcher = threading.Thread(target=measure, daemon=True)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    watcher.join()
    sandbox.close()
    ran = [r for kind, r in results if kind == "run"]
    alive = [r for r in ran if r.returncode == 0 and r.stdout.split()[-1:] == ["ok"]
             and float(r.stdout.split()[0]) < deadline]
    refused = [r for kind, r in results if kind == "refused"]
    failed = [r for r in ran if r not in alive]
    alive_n = max(1, sample.get("sandboxes_alive", 0))
    return {"measure": "concurrent", "requested": n, "hold_s": hold_s, "alive_together": len(alive),
            "refused": len(refused), "first_refusal": refused[0] if refused else "",
            "failed": len(failed), "first_failure": (failed[0].failure or failed[0].stdout[-200:]) if failed else "",
            "sandboxes_alive_at_sample": sample.get("sandboxes_alive"),
            "pss_per_running_sandbox_mb": round(sample.get("pss_mb", 0) / alive_n, 2),
            "mem_available_drop_per_running_sandbox_mb": round((mem_before - sample.get("mem_available_mb", mem_before))
                                                               / alive_n, 2),
            "mem_available_at_sample_mb": round(sample.get("mem_available_mb", 0)),
            "oom_kills": oom_kills() - oom_before, "seconds": round(time.monotonic() - t0, 1), **load()}


def _busy_pids(sandbox) -> list[int]:
    """The sandbox processes (bubblewrap's) of every sandbox this process started and has not reaped."""
    mine = os.getpid()
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == mine and open(f"/proc/{entry.name}/comm").read().strip() == "bwrap":
                    out.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return out


def main(args, cfg) -> int:
    if args.startup:
        for row in startup(cfg, args.startup):
            print(json.dumps(row), flush=True)
    if args.concurrent:
        print(json.dumps(concurrent(cfg, args.concurrent, args.hold)), flush=True)
    return 0
