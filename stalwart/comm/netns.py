"""Emulated multi-host clusters on one Linux machine: network namespaces joined by shaped, delayed links.

``with NetnsCluster(hosts=2, rate_mbit=1000) as c:`` creates one namespace per "host" (address
10.77.0.<h+1> on interface ``stw0``) plus a switch namespace (a bridge, or a router when a delay line carries the latency); every host's link to
the switch is shaped with ``tc`` (token bucket for bandwidth; ``netem`` delay when the kernel has it).
Ranks on the same host talk over that namespace's loopback, fast and unshaped; ranks on different
hosts cross two shaped veth links. ``run_workers_netns`` runs a gloo job with its ranks placed in
blocks onto the hosts, gloo bound to ``stw0`` (GLOO_SOCKET_IFNAME). Needs root and ``ip``/``tc``
(iproute2); :func:`unavailable_reason` says why not when they are missing. Namespaces are deleted
on exit, also after errors.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

IFNAME = "stw0"
SUBNET = "10.77.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable_reason() -> str | None:
    """None when namespaces can be built here, else a one-line reason (for skips and errors)."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) not installed: apt-get install -y iproute2"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"stwprobe{os.getpid()}"
    r = _ip("netns", "add", name, check=False)
    if r.returncode != 0:
        return f"'ip netns add' is not permitted here: {r.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def _sysctl(ns: str, key: str, value: str) -> None:
    path = "/proc/sys/" + key.replace(".", "/")
    subprocess.run(["ip", "netns", "exec", ns, "sh", "-c", f"echo {value} > {path}"], check=True,
                   capture_output=True, text=True)


def _netem_available() -> bool:
    probe = f"stwnetem{os.getpid()}"
    _ip("netns", "add", probe, check=False)
    try:
        r = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                            "delay", "1ms"], capture_output=True, text=True, check=False)
        return r.returncode == 0
    finally:
        _ip("netns", "del", probe, check=False)


class NetnsCluster:
    """``hosts`` namespaces joined by a switch; inter-host links shaped to ``rate_mbit`` and delayed ``delay_ms``.

    The delay is netem's where the kernel has it; elsewhere the switch routes every packet between two
    hosts through a delay line (:mod:`stalwart.comm.delayline`, a TUN device and a process holding each
    packet ``delay_ms``): ``delay_how`` says which.
    """

    def __init__(self, hosts: int, rate_mbit: float = 1000.0, delay_ms: float = 0.0):
        if not 1 <= hosts <= 200:
            raise ValueError("hosts must be in 1..200")
        self.hosts, self.rate_mbit, self.delay_ms = hosts, rate_mbit, delay_ms
        tag = f"{os.getpid() % 100000}"
        self.switch = f"stw{tag}sw"
        self.names = [f"stw{tag}h{h}" for h in range(hosts)]
        self.delay_applied = False
        self.delay_how = "none"
        self.notes: list[str] = []
        self._line: subprocess.Popen | None = None

    def addr(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def __enter__(self) -> NetnsCluster:
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _shape(self, ns: str, dev: str, netem: bool) -> None:
        """Egress shaping of one link end: netem (delay + rate) when it carries the delay, else tbf (rate)."""
        rate = f"{self.rate_mbit:g}mbit"
        if netem:
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "netem",
                            "delay", f"{self.delay_ms:g}ms", "rate", rate, "limit", "100000"],
                           capture_output=True, text=True, check=True)
            return
        # Burst of ~1 ms at the rate (at least 64 KiB) keeps tbf accurate at high rates.
        burst = max(65536, int(self.rate_mbit * 1e6 / 8 / 1000))
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                        "burst", str(burst), "latency", "50ms"], check=True, capture_output=True, text=True)

    def _build(self) -> None:
        netem = self.delay_ms > 0 and _netem_available()
        routed = self.delay_ms > 0 and not netem
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "set", "lo", "up")
        if routed:
            # The switch is a router: every host port's packets go to the delay line's TUN device
            # (table 100), and what the line writes back is routed to the destination's port (main).
            _sysctl(self.switch, "net.ipv4.ip_forward", "1")
            for key in ("net.ipv4.conf.all.rp_filter", "net.ipv4.conf.default.rp_filter"):
                _sysctl(self.switch, key, "0")
            _ip("-n", self.switch, "tuntap", "add", "dev", "wan0", "mode", "tun")
            _ip("-n", self.switch, "link", "set", "wan0", "up")
            _ip("-n", self.switch, "route", "add", "default", "dev", "wan0", "table", "100")
        else:
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
        for h, ns in enumerate(self.names):
            _ip("netns", "add", ns)
            port = f"p{h}"
            _ip("link", "add", IFNAME, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.switch)
            if routed:
                _sysctl(self.switch, f"net.ipv4.conf.{port}.proxy_arp", "1")
                _sysctl(self.switch, f"net.ipv4.conf.{port}.rp_filter", "0")
                _ip("-n", self.switch, "rule", "add", "iif", port, "lookup", "100")
            else:
                _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            if routed:
                _ip("-n", self.switch, "route", "add", f"{self.addr(h)}/32", "dev", port)
            _ip("-n", ns, "addr", "add", f"{self.addr(h)}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self._shape(ns, IFNAME, netem)  # host -> switch
            self._shape(self.switch, port, netem)  # switch -> host
        if netem:
            self.delay_applied, self.delay_how = True, "netem"
        elif routed:
            self._line = subprocess.Popen(
                ["ip", "netns", "exec", self.switch, sys.executable, "-m", "stalwart.comm.delayline", "wan0",
                 f"{self.delay_ms:g}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            first = self._line.stdout.readline().strip() if self._line.stdout else ""
            if first != "ready":
                raise RuntimeError(f"the delay line did not start: {first or self._line.wait()}")
            self.delay_applied, self.delay_how = True, "delay line (TUN, no netem here)"

    def link_bytes(self, host: int) -> tuple[int, int]:
        """(bytes the host sent onto its link, bytes it received from it), counted by the switch's port."""
        out = []
        for stat in ("rx_bytes", "tx_bytes"):
            r = subprocess.run(["ip", "netns", "exec", self.switch, "cat", f"/sys/class/net/p{host}/statistics/{stat}"],
                               capture_output=True, text=True, check=True)
            out.append(int(r.stdout))
        return out[0], out[1]

    def close(self) -> None:
        if self._line is not None and self._line.poll() is None:
            self._line.terminate()
            try:
                self._line.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._line.kill()
        for ns in [*self.names, self.switch]:
            _ip("netns", "del", ns, check=False)

    def exists(self) -> bool:
        listed = _ip("netns", "list", check=False).stdout
        return any(ns in listed for ns in [*self.names, self.switch])


def run_workers_netns(fn: Callable, cluster: NetnsCluster, ranks_per_host: int, args: tuple = (),
                      timeout_s: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on hosts*ranks_per_host gloo ranks placed in blocks on the hosts."""
    world = cluster.hosts * ranks_per_host
    with tempfile.TemporaryDirectory(prefix="stw-netns-") as tmp:
        job = Path(tmp) / "job.pkl"
        # sys.path travels with the job so that ``fn`` (e.g. in a test module) can be unpickled there.
        job.write_bytes(pickle.dumps((list(sys.path), pickle.dumps((fn, args, world, cluster.addr(0), 29500)))))
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=IFNAME, PYTHONWARNINGS="ignore")
        procs = []
        for r in range(world):
            ns = cluster.names[r // ranks_per_host]
            cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "stalwart.comm.netns", str(job), str(r)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + timeout_s
        try:
            for r, p in enumerate(procs):
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                if p.returncode != 0:
                    raise RuntimeError(f"rank {r} in {cluster.names[r // ranks_per_host]} exited {p.returncode}:\n"
                                       f"{out[-3000:]}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        return [pickle.loads((Path(tmp) / f"result{r}.pkl").read_bytes()) for r in range(world)]


def _worker_main(job: str, rank: int) -> None:
    import torch.distributed as dist

    from stalwart.comm.launch import init_gloo

    path, payload = pickle.loads(Path(job).read_bytes())
    sys.path[:0] = [p for p in path if p not in sys.path]
    fn, args, world, addr, port = pickle.loads(payload)
    init_gloo(rank, world, addr, port)
    try:
        out = fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    Path(job).with_name(f"result{rank}.pkl").write_bytes(pickle.dumps(out))


if __name__ == "__main__":
    _worker_main(sys.argv[1], int(sys.argv[2]))
