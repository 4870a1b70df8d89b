"""The islands planner (stalwart/planner/islands.py): link arithmetic, the schedule's stalls, bytes, and
the gloo exchanges measured on the emulated cluster's shaped, delayed link."""

from __future__ import annotations

import math

import pytest

from stalwart.planner import islands as isl

pytestmark = pytest.mark.unit

DEBUG_PARAMS = 131_392          # the debug model (dim 64, 2 layers, vocab 512, tied embeddings)
LINK = isl.Link(100.0, 50.0)


def test_payload_bytes_match_what_the_islands_send():
    """The planner's byte count is the size of the quantizer's payload (parallel/islands.py) for every
    layout and odd size."""
    import torch

    from stalwart.parallel.islands import quantize

    for n in (1, 7, 255, 256, 257, 1000, 131_392):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n))
        for how in isl.QUANTIZE:
            for block in (8, 256):
                assert isl.payload_bytes(n, how, block) == quantize(x, how, block).numel(), (n, how, block)


def test_latency_terms_and_bandwidth():
    # A tiny all-gather of 2 islands is one round trip (the recv-ready notice, then the data); k - 1 steps.
    assert isl.all_gather_s(16, 2, LINK, 100.0)[0] == pytest.approx(0.1, abs=1e-3)
    assert isl.all_gather_s(16, 4, LINK, 100.0)[0] == pytest.approx(0.3, abs=3e-3)
    # A tiny all-reduce: reduce-scatter then all-gather, two round trips.
    assert isl.all_reduce_s(4096, 2, LINK, 100.0)[0] == pytest.approx(0.2, abs=2e-3)
    # A large all-gather on a warm connection is latency + bytes / bandwidth.
    big = 40e6
    t = isl.all_gather_s(big, 2, LINK, 1e6)[0]
    assert t == pytest.approx(0.1 + big / LINK.bytes_per_s, rel=0.01)
    # gloo's ring keeps two 1 MiB segments in flight: on a long fat link it cannot fill the pipe.
    fat = isl.Link(10_000.0, 40.0)
    assert isl.all_reduce_s(1e9, 2, fat, 1e9)[0] > 5 * 2 * 1e9 / fat.bytes_per_s


def test_slow_start_costs_round_trips_on_a_fresh_connection():
    fresh, w = isl.transfer_s(1e6, LINK, 10.0)
    warm, _ = isl.transfer_s(1e6, LINK, w)
    # 10 segments doubling past 691 (1 MB) take 6 round trips that the warm connection fills with bytes.
    assert 6 * LINK.rtt_s - 1e6 / LINK.bytes_per_s <= fresh - warm <= 6 * LINK.rtt_s
    assert w * isl.MSS >= 1e6


def test_schedules_stall_as_the_algorithms_wait():
    common = dict(model_params=DEBUG_PARAMS, step_compute_s=0.05, islands=2, procs_per_island=1, link_mbit=100.0,
                  latency_ms=50.0)
    sync = isl.predict(algorithm="sync", **common)
    d50 = isl.predict(algorithm="diloco", inner_steps=50, **common)
    d100 = isl.predict(algorithm="diloco", inner_steps=100, **common)
    # Synchronous: every step waits the counters' round trip and a two-phase all-reduce.
    assert sync.step_s == pytest.approx(0.05 + sync.exchange_s, rel=1e-6)
    assert sync.payload_bytes_per_step == 4 * DEBUG_PARAMS
    # DiLoCo: the same exchange once per H steps, blocking.
    assert d50.step_s == pytest.approx(0.05 + d50.exchange_s / 50, rel=1e-6)
    assert d100.payload_bytes_per_step == pytest.approx(4 * DEBUG_PARAMS / 100)
    assert sync.utilisation < d50.utilisation < d100.utilisation < 1
    # Streaming: a fragment every H / P steps, hidden behind tau steps when they are long enough.
    slow = isl.predict(algorithm="streaming", inner_steps=100, fragments=4, overlap=1, quantize="int4", **common)
    assert slow.stall_s_per_step == pytest.approx((slow.exchange_s - 0.05) / 25, rel=1e-6)
    hidden = isl.predict(algorithm="streaming", inner_steps=100, fragments=4, overlap=5, quantize="int4", **common)
    assert hidden.utilisation == pytest.approx(1.0) and hidden.step_s == pytest.approx(0.05)
    assert hidden.payload_bytes_per_step == pytest.approx(
        sum(isl.payload_bytes(DEBUG_PARAMS // 4, "int4", 256) for _ in range(4)) / 100)
    # On the link, framing and notices included: sync sends >= 100x what streaming int4 sends.
    assert sync.link_bytes_per_step / hidden.link_bytes_per_step > 100
    assert 1.0 < sync.link_bytes_per_step / sync.payload_bytes_per_step < 1.1


def test_a_finite_run_pays_slow_start_and_the_final_sync():
    common = dict(model_params=DEBUG_PARAMS, step_compute_s=0.05, islands=2, procs_per_island=1, link_mbit=100.0,
                  latency_ms=50.0, algorithm="streaming", inner_steps=100, fragments=4, overlap=1, quantize="int4")
    steady = isl.predict(**common)
    run = isl.predict(steps=200, **common)
    assert run.run_s == pytest.approx(run.step_s * 200)
    assert run.run_s > steady.step_s * 200 + 4 * 0.2  # + the final sync of 4 fragments, blocking


def test_cubic_restarts_slow_start_after_idle_bbr_does_not():
    common = dict(model_params=2_000_000, step_compute_s=0.05, islands=2, procs_per_island=1, link_mbit=100.0,
                  latency_ms=50.0, algorithm="diloco", inner_steps=50)
    bbr = isl.predict(congestion="bbr", **common)
    cubic = isl.predict(congestion="cubic", **common)
    assert cubic.exchange_s > bbr.exchange_s + 3 * LINK.rtt_s


def test_fragment_sizes_and_procs():
    common = dict(model_params=DEBUG_PARAMS, step_compute_s=0.05, islands=2, link_mbit=100.0, latency_ms=50.0,
                  algorithm="streaming", inner_steps=100, fragments=2, overlap=1, quantize="none")
    even = isl.predict(procs_per_island=1, **common)
    skewed = isl.predict(procs_per_island=1, fragment_params=[82_048, 49_344], **common)
    assert skewed.exchange_s > even.exchange_s
    shared = isl.predict(procs_per_island=4, island_gbit=0.1, **common)
    assert shared.step_s > even.step_s  # the island's broadcast of each result is not overlapped


@pytest.mark.parametrize("bad, words", [
    (dict(islands=1), "islands must be at least 2"),
    (dict(link_mbit=0.0), "link_mbit"),
    (dict(latency_ms=math.nan), "latency_ms"),
    (dict(step_compute_s=-1.0), "step_compute_s"),
    (dict(algorithm="gossip"), "algorithm must be one of"),
    (dict(quantize="int2"), "quantize must be one of"),
    (dict(inner_steps=50, fragments=4), "multiple of fragments"),
    (dict(overlap=25), "overlap (25) must be below"),
    (dict(fragment_params=[1, 2, 3, 4]), "fragment_params"),
    (dict(model_params=0), "model_params"),
    (dict(steps=-1), "steps"),
])
def test_bad_arguments_are_one_line(bad, words):
    args = dict(model_params=1000, step_compute_s=0.05, islands=2, procs_per_island=1, link_mbit=100.0,
                latency_ms=50.0, algorithm="streaming", inner_steps=100, fragments=4, overlap=1, quantize="int4")
    args.update(bad)
    with pytest.raises(ValueError) as e:
        isl.predict(**args)
    assert words in str(e.value) and "\n" not in str(e.value)


# gloo exchanges on the emulated cluster (stalwart/comm/netns.py: 100 Mbit/s token buckets, a 50 ms TUN
# delay line each way), every island's rank 0 on its own host; each exchange preceded by the counters'
# all-gather, repeated on one process group 0.05-1 s apart as a run's syncs are. Median seconds of the
# settled repeats (after the second), measured 2026-12 at load average 14-25 on 2 cores.
MEASURED = [  # (islands, collective, bytes, seconds)
    (2, "counters", 16, 0.101),
    (2, "all_reduce", 525_568, 0.279),      # the debug model's gradient, float32
    (2, "all_reduce", 328_192, 0.305),
    (2, "all_gather", 68_640, 0.161),       # the debug model, int4
    (2, "all_gather", 17_160, 0.133),       # a quarter of it, int4
    (2, "all_gather", 4_194_304, 0.463),
    (2, "all_reduce", 8_388_608, 1.137),
    (4, "counters", 16, 0.306),
    (4, "all_reduce", 525_568, 0.768),
    (4, "all_gather", 68_640, 0.379),
    (4, "all_gather", 17_160, 0.347),
]


@pytest.mark.parametrize("k, what, nbytes, seconds", MEASURED, ids=[f"{m[0]}x{m[1]}-{m[2]}" for m in MEASURED])
def test_measured_exchanges_on_the_emulated_link(k, what, nbytes, seconds):
    fn = {"counters": isl.all_gather_s, "all_gather": isl.all_gather_s, "all_reduce": isl.all_reduce_s}[what]
    predicted = fn(nbytes, k, LINK, 2 * LINK.bdp_bytes / isl.MSS)[0]
    assert abs(predicted / seconds - 1) <= 0.20, (predicted, seconds)
