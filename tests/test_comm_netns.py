"""Real multi-host emulation: hosts as network namespaces on a tc-shaped bridge, gloo bound to them.

Skips (with the reason) where namespaces cannot be created; never passes without running.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from stalwart.comm.collectives import ALL_REDUCE, all_reduce
from stalwart.comm.netns import NetnsCluster, run_workers_netns, unavailable_reason
from stalwart.comm.topology import detect_placement

REASON = unavailable_reason()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(REASON is not None, reason=f"netns unavailable: {REASON}")]


def hosts_and_collectives(rank: int, world: int) -> dict:
    placement = detect_placement()  # hostname + network namespace: each namespace is a host
    hosts = [placement.host(r) for r in range(world)]
    x = torch.randint(-4, 5, (1001,), generator=torch.Generator().manual_seed(rank)).float()
    ref = all_reduce(x.clone(), None, "sum", "builtin")
    bad = [a for a in ALL_REDUCE[:-1] if not torch.equal(all_reduce(x.clone(), None, "sum", a, placement), ref)]
    # Time 4 MiB across the shaped link: flat ring vs the two-level algorithm.
    big = torch.ones(1 << 20)
    timings = {}
    for algo in ("ring", "hier2d_ring", "builtin"):
        best = float("inf")
        for _ in range(2):
            dist.barrier()
            t0 = time.perf_counter()
            all_reduce(big, None, "sum", algo, placement)
            best = min(best, time.perf_counter() - t0)
        timings[algo] = best
    return {"hosts": hosts, "bad": bad, "timings": timings}


def test_namespaced_hosts_run_every_algorithm_and_clean_up() -> None:
    with NetnsCluster(hosts=2, rate_mbit=200, delay_ms=0.5) as cluster:
        results = run_workers_netns(hosts_and_collectives, cluster, ranks_per_host=2, timeout_s=240)
        assert cluster.exists()
    assert not cluster.exists()  # namespaces removed
    assert results[0]["hosts"] == [0, 0, 1, 1]  # detected: two ranks in each namespace
    for r in results:
        assert not r["bad"], r["bad"]
    t = results[0]["timings"]
    # 4 MiB over 200 Mbit/s is >= 0.16 s per crossing: the shaping is really in the path...
    assert t["ring"] > 0.1
    # ...and the two-level algorithm sends less across it (1x vs 1.5x the buffer per host uplink).
    assert t["hier2d_ring"] < t["ring"], t


_ECHO = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', 5001)); s.listen()
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range(10):
    c.sendall(c.recv(1))
n, t0 = 0, None
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    n += len(b)
    if t0 is None and n >= 4_000_000:  # past slow start
        t0, n0 = time.perf_counter(), n
print(round((n - n0) * 8 / (time.perf_counter() - t0) / 1e6, 1))
"""
_PING = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], 5001)); s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtt = []
for _ in range(10):
    t = time.perf_counter(); s.sendall(b'p'); s.recv(1); rtt.append(time.perf_counter() - t)
print(' '.join(f'{x * 1000:.2f}' for x in rtt))
s.sendall(b'x' * 20_000_000); s.close()
"""


def test_delay_line_adds_the_latency_it_claims_and_keeps_the_rate() -> None:
    """No netem on these kernels: the switch routes inter-host packets through a TUN delay line."""
    import subprocess
    import sys

    with NetnsCluster(hosts=2, rate_mbit=100, delay_ms=20) as cluster:
        assert cluster.delay_applied, cluster.notes
        before = cluster.link_bytes(0)
        srv = subprocess.Popen(["ip", "netns", "exec", cluster.names[1], sys.executable, "-c", _ECHO],
                               stdout=subprocess.PIPE, text=True)
        time.sleep(0.3)
        ping = subprocess.run(["ip", "netns", "exec", cluster.names[0], sys.executable, "-c", _PING,
                               cluster.addr(1)], capture_output=True, text=True, timeout=60, check=True)
        mbit = float(srv.communicate(timeout=60)[0])
        sent, _ = cluster.link_bytes(0)
    rtt = sorted(float(x) for x in ping.stdout.split())
    median = rtt[len(rtt) // 2]
    # Two one-way delays of 20 ms per round trip, plus a few ms of scheduling on a busy machine.
    assert 40.0 <= median <= 55.0, rtt
    # The token buckets still set the rate under the delay (tbf's burst lets it overshoot a little; the
    # line is a Python process, ~8,600 packets/s at this rate, so a machine loaded past its cores slows it).
    assert 40.0 <= mbit <= 115.0, mbit
    # The switch port counts what crossed the link: the 20 MB plus headers.
    assert 20_000_000 <= sent - before[0] <= 21_500_000, (before, sent)
