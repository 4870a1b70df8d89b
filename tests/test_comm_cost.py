"""Cost model closed forms, selector choices, topology files (pure logic, no processes)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from stalwart.comm.cost import predict
from stalwart.comm.selector import CommConfig, Selector
from stalwart.comm.topology import (
    CLUSTER,
    HOST,
    POD,
    RACK,
    Topology,
    flat_topology,
    load_topology,
    write_topology,
)
from stalwart.config import ConfigError, help_text, load, undocumented_fields

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
ALPHA, GBPS, GAMMA_NS = 20.0, 2.0, 0.5  # microseconds, GB/s, ns/byte


def _flat(p: int) -> Topology:
    t = flat_topology(p, ALPHA, GBPS, GAMMA_NS)
    t.overhead.step_us = t.overhead.call_us = t.overhead.builtin_step_us = t.overhead.message_us = 0.0
    return t


@pytest.mark.parametrize("p", [2, 3, 4, 7, 8, 16])
@pytest.mark.parametrize("n", [1024.0, 3.0e6])
def test_closed_forms_on_one_tier(p: int, n: float) -> None:
    topo, a, b, g = _flat(p), ALPHA * 1e-6, 1 / (GBPS * 1e9), GAMMA_NS * 1e-9
    m, pl = list(range(p)), topo.place(p)
    ring = 2 * (p - 1) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g
    assert predict("all_reduce", "ring", m, n, topo, pl) == pytest.approx(ring)
    assert predict("reduce_scatter", "ring", m, n, topo, pl) == pytest.approx((p - 1) * (a + n / p * b + n / p * g))
    assert predict("all_gather", "ring", m, n, topo, pl) == pytest.approx((p - 1) * (a + n / p * b))
    if p & (p - 1) == 0:  # powers of two: the textbook forms
        lg = math.log2(p)
        assert predict("all_reduce", "rd", m, n, topo, pl) == pytest.approx(lg * (a + n * b + n * g))
        rhd = 2 * lg * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g
        assert predict("all_reduce", "rhd", m, n, topo, pl) == pytest.approx(rhd)
        assert predict("all_gather", "doubling", m, n, topo, pl) == pytest.approx(lg * a + (p - 1) / p * n * b)
    else:  # one extra fold in and out of the power of two below
        q = 1 << (p.bit_length() - 1)
        rd = math.log2(q) * (a + n * b + n * g) + 2 * (a + n * b) + n * g
        assert predict("all_reduce", "rd", m, n, topo, pl) == pytest.approx(rd)


def test_shared_uplink_divides_bandwidth() -> None:
    """Four ranks of a host exchanging across hosts at once each get a quarter of the NIC."""
    topo = Topology(ranks_per_host=4, hosts_per_rack=2, gamma_ns_per_byte=0.0)
    topo.overhead.step_us = topo.overhead.call_us = topo.overhead.message_us = 0.0
    pl, n = topo.place(8), 1e6
    rack = topo.tiers.rack
    # Recursive doubling over 8 = 2 hosts x 4: masks 1, 2 stay in the host; mask 4 crosses with 4 flows.
    host = topo.tiers.host
    expect = 2 * (host.alpha() + n * host.beta()) + rack.alpha() + 4 * n * rack.beta()
    assert predict("all_reduce", "rd", list(range(8)), n, topo, pl) == pytest.approx(expect)
    assert (pl.tier(0, 3), pl.tier(0, 4), topo.place(64).tier(0, 8 * 4), topo.place(2048).tier(0, 2047)) == (
        HOST, RACK, POD, CLUSTER)


def test_selector_flat_small_vs_large() -> None:
    topo = _flat(8)
    sel = Selector(topo)
    m = list(range(8))
    assert sel.choose("all_reduce", 1024, m) == "rd"
    assert sel.choose("all_reduce", 256 << 20, m) in ("ring", "rhd")
    assert sel.choose("reduce_scatter", 256 << 20, m) in ("ring", "halving")
    # Non-power-of-two: rd pays two extra full-size folds, still best when latency dominates.
    assert sel.choose("all_reduce", 64, list(range(6))) == "rd"


def test_selector_two_tier_prefers_hierarchical() -> None:
    topo = load_topology(REPO / "configs/topology/two_tier.toml")
    sel = Selector(topo)
    world = 16
    m = list(range(world))
    for size in [64 << 10, 1 << 20, 64 << 20]:
        choice = sel.choose("all_reduce", size, m, world)
        assert choice.startswith("hier"), (size, choice, sel.predictions("all_reduce", size, m, world))
    # Leader-based reduce-scatter / all-gather win in the middle (fewer slow steps than ring, less slow
    # traffic than halving/doubling); at 64 MiB the leader's intra-host fan-in makes ring better.
    assert sel.choose("reduce_scatter", 1 << 20, m, world) == "hier"
    assert sel.choose("all_gather", 1 << 20, m, world) == "hier"
    # ...but not on a single host, where there is no slow tier to save.
    assert not sel.choose("all_reduce", 64 << 20, m[:4], world).startswith("hier")


def test_selector_fixed_and_cache() -> None:
    sel = Selector(_flat(4), fixed={"all_reduce": "dbtree"})
    m = [0, 1, 2, 3]
    assert sel.choose("all_reduce", 10, m) == "dbtree"
    assert sel.choose("all_reduce", 256 << 20, m) == "dbtree"  # fixed at every size, whatever the model says
    # An op that is not fixed is the cost model's cheapest algorithm...
    pred = sel.predictions("all_gather", 10, m)
    choice = sel.choose("all_gather", 10, m)
    assert choice == min(pred, key=pred.__getitem__), pred
    # ...and is cached: asking again does not predict again.
    sel.predictions = lambda *a, **k: pytest.fail("a cached choice was predicted again")
    assert sel.choose("all_gather", 10, m) == choice


def test_shipped_topologies_parse_and_round_trip(tmp_path: Path) -> None:
    files = sorted((REPO / "configs/topology").glob("*.toml"))
    assert len(files) >= 2
    for f in files:
        topo = load_topology(f)
        write_topology(topo, tmp_path / f.name)
        assert load_topology(tmp_path / f.name) == topo
    assert not undocumented_fields(Topology) and not undocumented_fields(CommConfig)
    assert "bandwidth_gbps" in help_text(Topology)
    with pytest.raises(ConfigError, match="did you mean"):
        load_topology(files[0], ["--tiers.rack.bandwith_gbps", "3"])
    with pytest.raises(ConfigError):
        load(CommConfig, None, ["--algorithm", "fastest"])
