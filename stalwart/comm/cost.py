"""Alpha-beta-gamma cost model: predict a collective's time from its communication schedule.

Each algorithm is described by its *rounds*: a set of concurrent flows (src, dst, bytes) plus the bytes
each rank reduces. A round takes as long as its slowest flow, where a flow on tier t costs
``alpha_t + share * bytes * beta_t``; ``share`` counts the flows using the same endpoint at once (a
rank for intra-host links, the host's uplink for a ``shared`` tier), so eight ranks of a host sending
across the network at once each get an eighth of the NIC. Then ``+ gamma * reduced_bytes`` and the
software overheads. On one flat tier this reduces to the textbook closed forms, e.g. ring all-reduce
``2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma``.

Schedules mirror the implementations in :mod:`stalwart.comm.algorithms` / ``hierarchical``.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from stalwart.comm.algorithms import _fold_plan, double_tree_parents
from stalwart.comm.topology import HOST, Placement, Topology

Flow = tuple[int, int, float]  # (src global rank, dst global rank, bytes)


@dataclasses.dataclass
class Round:
    flows: list[Flow]
    reduce_bytes: float = 0.0
    repeat: int = 1


@dataclasses.dataclass
class Terms:
    """A predicted time split into the quantities the calibration fits (all in their own units).

    time = sum_t alpha_count[t]*alpha_t + sum_t beta_bytes[t]*beta_t + gamma_bytes*gamma
           + steps*step_overhead + messages*message_overhead + calls*call_overhead
           (+ builtin_steps*builtin_step_overhead for the built-in)
    ``steps`` counts dependent rounds (a wake-up each), ``messages`` the extra messages one rank handles
    in a round beyond the first (a leader collecting from k-1 local ranks handles k-2 extra).
    """

    alpha_count: list[float] = dataclasses.field(default_factory=lambda: [0.0] * 4)
    beta_bytes: list[float] = dataclasses.field(default_factory=lambda: [0.0] * 4)
    gamma_bytes: float = 0.0
    steps: float = 0.0
    messages: float = 0.0
    calls: float = 0.0
    builtin_steps: float = 0.0


# ---------------------------------------------------------------------------------------------
# Schedules
# ---------------------------------------------------------------------------------------------

def _ring(m: list[int], per: float, reduce: bool, rounds: int) -> list[Round]:
    p = len(m)
    if p == 1 or rounds == 0:
        return []
    return [Round([(m[i], m[(i + 1) % p], per) for i in range(p)], per if reduce else 0.0, rounds)]


def _fold(m: list[int], n: float, into: bool, reduce: bool = True) -> list[Round]:
    rem, _ = _fold_plan(len(m))
    if not rem:
        return []
    pairs = [(m[2 * j], m[2 * j + 1]) if into else (m[2 * j + 1], m[2 * j]) for j in range(rem)]
    return [Round([(a, b, n) for a, b in pairs], n if (into and reduce) else 0.0)]


def _active(m: list[int]) -> list[int]:
    return [m[a] for a in _fold_plan(len(m))[1]]


def _rd(m: list[int], n: float) -> list[Round]:
    if len(m) == 1:
        return []
    a, out, mask = _active(m), _fold(m, n, True), 1
    while mask < len(a):
        out.append(Round([(a[i], a[i ^ mask], n) for i in range(len(a))], n))
        mask *= 2
    return out + _fold(m, n, False)


def _halving(a: list[int], n: float) -> list[Round]:
    q, out, mask = len(a), [], len(a) // 2
    while mask >= 1:
        out.append(Round([(a[i], a[i ^ mask], n * mask / q) for i in range(q)], n * mask / q))
        mask //= 2
    return out


def _doubling(a: list[int], n: float) -> list[Round]:
    q, out, mask = len(a), [], 1
    while mask < q:
        out.append(Round([(a[i], a[i ^ mask], n * mask / q) for i in range(q)]))
        mask *= 2
    return out


def _rhd(m: list[int], n: float) -> list[Round]:
    if len(m) == 1:
        return []
    a = _active(m)
    return _fold(m, n, True) + _halving(a, n) + _doubling(a, n) + _fold(m, n, False)


def _dbtree(m: list[int], n: float) -> list[Round]:
    p = len(m)
    if p == 1:
        return []
    trees = double_tree_parents(p)

    def depth(parents: list[int], r: int) -> int:
        d = 0
        while parents[r] >= 0:
            r, d = parents[r], d + 1
        return d

    levels = [[depth(t, r) for r in range(p)] for t in trees]
    top = max(max(lv) for lv in levels)
    up, down = [], []
    for d in range(top, 0, -1):  # both trees' level d at once (they overlap in the implementation)
        flows = [(m[r], m[t[r]], n / 2) for t, lv in zip(trees, levels) for r in range(p) if lv[r] == d]
        up.append(Round(flows, n))  # an interior node reduces two children's halves
        down.insert(0, Round([(b, a, s) for a, b, s in flows]))
    return up + down


def _hier_split(m: list[int], placement: Placement) -> tuple[list[list[int]], list[int]]:
    hosts = list(placement.hosts_of(m).values())
    return hosts, [h[0] for h in hosts]


def _to_leader(hosts: list[list[int]], n: float, reduce: bool) -> list[Round]:
    flows = [(r, h[0], n) for h in hosts for r in h[1:]]
    k = max(len(h) for h in hosts)
    return [Round(flows, n * (k - 1) if reduce else 0.0)] if flows else []


def _from_leader(hosts: list[list[int]], n: float) -> list[Round]:
    flows = [(h[0], r, n) for h in hosts for r in h[1:]]
    return [Round(flows)] if flows else []


def _parallel(schedules: list[list[Round]]) -> list[Round]:
    """Run same-shaped schedules of disjoint teams at once: round i is the union of their round i."""
    out = []
    for rounds in zip(*schedules):
        out.append(Round([f for r in rounds for f in r.flows], max(r.reduce_bytes for r in rounds),
                         rounds[0].repeat))
    return out


def schedule(op: str, algorithm: str, members: list[int], nbytes: float, placement: Placement) -> list[Round]:
    """The rounds of ``algorithm`` for collective ``op`` on ``nbytes`` (the full tensor, all ranks)."""
    m, n, p = members, float(nbytes), len(members)
    if op == "all_reduce":
        if algorithm in ("ring", "builtin"):
            return _ring(m, n / p, True, p - 1) + _ring(m, n / p, False, p - 1)
        if algorithm == "rd":
            return _rd(m, n)
        if algorithm == "rhd":
            return _rhd(m, n)
        if algorithm == "dbtree":
            return _dbtree(m, n)
        if algorithm.startswith("hier2d_"):
            hosts, _ = _hier_split(m, placement)
            if len({len(h) for h in hosts}) == 1:
                k = len(hosts[0])
                intra = [_ring(h, n / k, True, k - 1) for h in hosts]
                cross = [schedule("all_reduce", algorithm[7:], [h[j] for h in hosts], n / k, placement)
                         for j in range(k)]
                gather = [_ring(h, n / k, False, k - 1) for h in hosts]
                return _parallel(intra) + _parallel(cross) + _parallel(gather)
            algorithm = "hier_" + algorithm[7:]
        if algorithm.startswith("hier_"):
            hosts, leaders = _hier_split(m, placement)
            inter = schedule("all_reduce", algorithm[5:], leaders, n, placement)
            return _to_leader(hosts, n, True) + inter + _from_leader(hosts, n)
    elif op in ("reduce_scatter", "all_gather"):
        rs = op == "reduce_scatter"
        if algorithm in ("ring", "builtin"):
            return _ring(m, n / p, rs, p - 1)
        if algorithm in ("halving", "doubling"):
            rem, _ = _fold_plan(p)
            a = _active(m)
            hand = [Round([(m[2 * j + 1], m[2 * j], n / p) if rs else (m[2 * j], m[2 * j + 1], n / p)
                           for j in range(rem)])] if rem else []
            if rs:
                return _fold(m, n, True) + _halving(a, n) + hand
            return hand + _doubling(a, n) + _fold(m, n, False)
        if algorithm == "hier":
            hosts, leaders = _hier_split(m, placement)
            block = n / len(leaders)  # NOTE: equal host sizes assumed for the block size
            inter = _ring(leaders, block, rs, len(leaders) - 1)
            if rs:
                return _to_leader(hosts, n, True) + inter + _from_leader(hosts, n / p)
            return _to_leader(hosts, n / p, False) + inter + _from_leader(hosts, n)
    raise ValueError(f"no cost schedule for {op} algorithm {algorithm!r}")


# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------

def _flow_costs(r: Round, topo: Topology, placement: Placement) -> list[tuple[int, float, float]]:
    """Per flow: (tier, messages serialized at its endpoints, bytes sharing its bottleneck).

    A rank posting or receiving k messages at once handles them one after another (k alphas, k times
    the bytes); flows of different ranks leaving one host over a ``shared`` tier split its uplink
    (bandwidth only: they are handled by different processes in parallel).
    """
    tiers = [placement.tier(s, d) for s, d, _ in r.flows]
    rank_out: Counter = Counter(s for s, _, _ in r.flows)
    rank_in: Counter = Counter(d for _, d, _ in r.flows)
    host_out: Counter = Counter()
    host_in: Counter = Counter()
    for (s, d, _), t in zip(r.flows, tiers):
        if t != HOST and topo.tiers.at(t).shared:
            host_out[placement.host(s)] += 1
            host_in[placement.host(d)] += 1
    out = []
    for (s, d, nb), t in zip(r.flows, tiers):
        msgs = max(rank_out[s], rank_in[d])
        link = msgs
        if t != HOST and topo.tiers.at(t).shared:
            link = max(link, host_out[placement.host(s)], host_in[placement.host(d)])
        out.append((t, float(msgs), nb * link))
    return out


def terms(op: str, algorithm: str, members: list[int], nbytes: float, topo: Topology,
          placement: Placement) -> Terms:
    """Linear terms of the predicted time (the slowest flow of each round, under ``topo``)."""
    out = Terms(calls=0.0 if algorithm == "builtin" else 1.0)
    for r in schedule(op, algorithm, members, nbytes, placement):
        best = None
        flows = _flow_costs(r, topo, placement)
        for t, msgs, shared_bytes in flows:
            tier = topo.tiers.at(t)
            cost = msgs * tier.alpha() + shared_bytes * tier.beta()
            if best is None or cost > best[0]:
                best = (cost, t, msgs, shared_bytes)
        if best is None:
            continue
        _, t, msgs, shared_bytes = best
        out.alpha_count[t] += r.repeat * msgs
        out.beta_bytes[t] += r.repeat * shared_bytes
        out.gamma_bytes += r.repeat * r.reduce_bytes
        if algorithm == "builtin":
            out.builtin_steps += r.repeat
        else:
            out.steps += r.repeat
            out.messages += r.repeat * (max(m for _, m, _ in flows) - 1)
    return out


def efficiency_key(op: str, algorithm: str) -> str:
    """The ``Topology.efficiency`` field for an algorithm: the built-in has one per collective (gloo's
    reduce-scatter and all-gather are different code from its all-reduce); ours share their schedule code."""
    return f"builtin_{op}" if algorithm == "builtin" and op != "all_reduce" else algorithm


def predict(op: str, algorithm: str, members: list[int], nbytes: float, topo: Topology,
            placement: Placement) -> float:
    """Predicted seconds for one call."""
    x = terms(op, algorithm, members, nbytes, topo, placement)
    o = topo.overhead
    byte_part = x.gamma_bytes * topo.gamma() + sum(x.beta_bytes[t] * topo.tiers.at(t).beta() for t in range(4))
    byte_part *= getattr(topo.efficiency, efficiency_key(op, algorithm))
    total = byte_part + sum(x.alpha_count[t] * topo.tiers.at(t).alpha() for t in range(4))
    return total + (x.steps * o.step_us + x.messages * o.message_us + x.calls * o.call_us
                    + x.builtin_steps * o.builtin_step_us) * 1e-6
