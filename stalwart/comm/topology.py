"""The network a job runs on: hosts -> racks (ToR) -> pods (spine) -> cluster, one link tier each.

A :class:`Topology` is a typed config (loaded from ``configs/topology/*.toml``) describing the cost of
a message at each tier. A :class:`Placement` says where every *global* rank sits: its host, rack and
pod. The tier a message between two ranks travels on is the highest level at which they differ.

Nothing here imports ``torch.distributed``, except :func:`detect_placement`, which asks the ranks of
a process group where they are.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path

from stalwart.config import load, option, section, to_toml

# Tier indices, lowest (fastest) first. A message between two ranks uses tier max(level they differ at).
TIERS = ("host", "rack", "pod", "cluster")
HOST, RACK, POD, CLUSTER = range(4)


class Tier:
    """Cost of one link tier in the alpha-beta model: time(n bytes) = latency + n / bandwidth."""

    latency_us: float
    bandwidth_gbps: float
    shared: bool

    def alpha(self) -> float:
        """Seconds per message."""
        return self.latency_us * 1e-6

    def beta(self) -> float:
        """Seconds per byte."""
        return 1.0 / (self.bandwidth_gbps * 1e9)


def _tier_class(name: str, latency_us: float, gbps: float, shared: bool) -> type:
    """A Tier config section with its own defaults (a typical cluster: each tier up is slower)."""
    fields = [
        ("latency_us", float, option("Per-message latency alpha in microseconds (software overhead included).",
                                     latency_us, min=0.0)),
        ("bandwidth_gbps", float, option("Per-link bandwidth in GB/s (1e9 bytes/s), 1/beta.", gbps, min=1e-6)),
        ("shared", bool, option("True when the ranks below share one uplink at this tier (a host NIC), so "
                                "concurrent flows leaving it divide the bandwidth.", shared)),
    ]
    return dataclasses.make_dataclass(name, fields, bases=(Tier,))


HostTier = _tier_class("HostTier", 5.0, 20.0, False)
RackTier = _tier_class("RackTier", 25.0, 12.5, True)
PodTier = _tier_class("PodTier", 40.0, 6.0, True)
ClusterTier = _tier_class("ClusterTier", 80.0, 3.0, True)


@dataclasses.dataclass
class Tiers:
    """One entry per tier; a tier a job never crosses is simply never used."""

    host: HostTier = section(HostTier, "Between ranks on the same host (shared memory, NVLink, loopback).")
    rack: RackTier = section(RackTier, "Between hosts under the same top-of-rack switch.")
    pod: PodTier = section(PodTier, "Between racks under the same spine.")
    cluster: ClusterTier = section(ClusterTier, "Between pods.")

    def at(self, level: int) -> Tier:
        return getattr(self, TIERS[level])


@dataclasses.dataclass
class Overhead:
    """Software costs of this implementation (not of the network); fitted by `stalwart bench collectives`."""

    step_us: float = option("Per dependent communication round of a Python point-to-point algorithm "
                            "(posting and waiting on isend/irecv, waking up), in microseconds.", 50.0, min=0.0)
    message_us: float = option("Per extra message one rank handles in a round (a leader collecting from "
                               "several ranks), in microseconds.", 20.0, min=0.0)
    call_us: float = option("Per call of a Python point-to-point algorithm (setup, buffers), in microseconds.",
                            30.0, min=0.0)
    builtin_step_us: float = option("Per round of the process group's built-in collective (C++), in "
                                    "microseconds.", 5.0, min=0.0)


_EFFICIENCY_NAMES = ("ring", "rd", "rhd", "dbtree", "hier_ring", "hier_rd", "hier2d_ring", "hier2d_rhd",
                     "halving", "doubling", "hier", "builtin", "builtin_reduce_scatter", "builtin_all_gather")
Efficiency = dataclasses.make_dataclass("Efficiency", [
    (name, float, option(f"Per-byte cost of '{name}' relative to its schedule under the tier bandwidths and gamma "
                         "(fitted; like NCCL's per-algorithm bandwidth factors: >1 slower, <1 faster).", 1.0, min=0.0))
    for name in _EFFICIENCY_NAMES])
Efficiency.__doc__ = "Per-algorithm byte-cost factors (the built-in is C++ and pipelined; ours are Python)."


@dataclasses.dataclass
class Topology:
    """A cluster shape and its per-tier costs; ranks are placed on it in blocks (rank // ranks_per_host)."""

    name: str = option("A label for reports.", "unnamed")
    ranks_per_host: int = option("Ranks (processes) per host.", 8, min=1)
    hosts_per_rack: int = option("Hosts under one top-of-rack switch.", 16, min=1)
    racks_per_pod: int = option("Racks under one spine (pod).", 8, min=1)
    gamma_ns_per_byte: float = option("Reduction cost gamma in nanoseconds per byte reduced (CPU or GPU "
                                      "elementwise add).", 0.1, min=0.0)
    tiers: Tiers = section(Tiers, "Latency and bandwidth of each link tier.")
    overhead: Overhead = section(Overhead, "Software overheads of the algorithms (fitted, not hardware).")
    efficiency: Efficiency = section(Efficiency, "Per-algorithm byte-cost factors (fitted, not hardware).")

    def gamma(self) -> float:
        """Seconds per byte reduced."""
        return self.gamma_ns_per_byte * 1e-9

    def place(self, world_size: int) -> Placement:
        """Block placement: consecutive global ranks fill a host, then a rack, then a pod."""
        hosts = [r // self.ranks_per_host for r in range(world_size)]
        return Placement.from_hosts(hosts, self.hosts_per_rack, self.racks_per_pod)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where each global rank sits: ``coords[r] = (host, rack, pod)``."""

    coords: tuple[tuple[int, int, int], ...]

    @staticmethod
    def from_hosts(hosts: list[int], hosts_per_rack: int = 1 << 30, racks_per_pod: int = 1 << 30) -> Placement:
        coords = []
        for h in hosts:
            rack = h // hosts_per_rack
            coords.append((h, rack, rack // racks_per_pod))
        return Placement(tuple(coords))

    @property
    def world_size(self) -> int:
        return len(self.coords)

    def tier(self, a: int, b: int) -> int:
        """Tier index a message between global ranks a and b crosses (HOST when on the same host)."""
        ca, cb = self.coords[a], self.coords[b]
        if ca[2] != cb[2]:
            return CLUSTER
        if ca[1] != cb[1]:
            return POD
        if ca[0] != cb[0]:
            return RACK
        return HOST

    def host(self, r: int) -> int:
        return self.coords[r][0]

    def hosts_of(self, ranks: list[int]) -> dict[int, list[int]]:
        """Host -> members (in the given order), hosts in order of first appearance."""
        out: dict[int, list[int]] = {}
        for r in ranks:
            out.setdefault(self.host(r), []).append(r)
        return out

    def top_tier(self, ranks: list[int]) -> int:
        """The slowest tier spanned by a set of ranks."""
        return max((self.tier(ranks[0], r) for r in ranks[1:]), default=HOST)


def load_topology(path: str | Path, overrides: list[str] | None = None) -> Topology:
    """Read a topology TOML (the file's tables map onto :class:`Topology`)."""
    return load(Topology, path, overrides)


def write_topology(topo: Topology, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(to_toml(topo))


def flat_topology(world_size: int, latency_us: float = 10.0, bandwidth_gbps: float = 5.0,
                  gamma_ns_per_byte: float = 0.1) -> Topology:
    """Every rank on one host: a single tier (what a one-machine run looks like)."""
    t = Topology(name="flat", ranks_per_host=max(1, world_size), gamma_ns_per_byte=gamma_ns_per_byte)
    t.tiers.host = HostTier(latency_us=latency_us, bandwidth_gbps=bandwidth_gbps, shared=False)
    return t


def location_key() -> str:
    """What identifies "a host" for this process: hostname plus network namespace.

    NOTE: ranks in different network namespaces of one machine (the emulation harness) talk over veth
    links, so for communication purposes they are on different hosts.
    """
    try:
        ns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        ns = 0
    return f"{socket.gethostname()}/{ns}"


def detect_placement(group=None, hosts_per_rack: int = 1 << 30) -> Placement:
    """Ask every rank of ``group`` (collectively) where it runs; returns a placement over *global* ranks.

    Ranks outside ``group`` get their own pseudo-host; ranks sharing a location key share a host.
    """
    import torch.distributed as dist

    keys: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(keys, location_key(), group=group)
    members = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    world = dist.get_world_size()
    host_ids: dict[str, int] = {}
    hosts = [-1] * world
    for g, key in zip(members, keys):
        hosts[g] = host_ids.setdefault(str(key), len(host_ids))
    for g in range(world):
        if hosts[g] < 0:
            hosts[g] = len(host_ids) + g
    return Placement.from_hosts(hosts, hosts_per_rack)
