"""Latency classes in the scheduler (pure logic) and through the engine: a better class is admitted
first, runs its prefill in a step of its own class, takes a worse class's sequence slot or cache blocks
(which is recomputed later from its cached blocks), and no class changes anyone's greedy tokens."""

from __future__ import annotations

import dataclasses

import pytest

from stalwart.config.serve import EngineConfig
from stalwart.infer.blocks import BlockPool
from stalwart.infer.engine import Engine
from stalwart.infer.scheduler import Scheduler, Sequence

from test_infer_engine import GREEDY, ByteTokenizer, build, prompts

pytestmark = pytest.mark.unit


def seq(rid: str, n: int, priority: int = 0, room: int = 8) -> Sequence:
    base = 100 * sum(map(ord, rid))  # distinct prompts: nothing shared through the prefix cache
    return Sequence(rid, list(range(base, base + n)), n, n + room, priority=priority)


def step(sched: Scheduler) -> list[tuple[str, int, int]]:
    """One schedule, committed, every sampled sequence given a token: (rid, start, n) per piece."""
    pieces = sched.schedule()
    for p in pieces:
        sched.commit(p)
        if p.sample:
            p.seq.tokens.append(7)
    return [(p.seq.rid, p.start, p.n) for p in pieces]


def test_a_better_class_is_admitted_first_and_prefills_in_a_step_of_its_own():
    sched = Scheduler(BlockPool(64, 4), max_batch_tokens=32, max_seqs=8)
    for name in ("b1", "b2"):
        sched.add(seq(name, 6, priority=5))
    assert step(sched) == [("b1", 0, 6), ("b2", 0, 6)]
    assert step(sched) == [("b1", 6, 1), ("b2", 6, 1)]  # decoding
    sched.add(seq("b3", 6, priority=5))
    sched.add(seq("i", 10, priority=-1))  # arrives after b3, goes before it
    assert [s.rid for s in sched.waiting] == ["i", "b3"]
    # The interactive prompt runs alone: the batch class keeps its blocks and waits this one step.
    assert step(sched) == [("i", 0, 10)]
    assert all(s.blocks for s in sched.running)
    # Then every class decodes and the waiting batch request is admitted, better classes first.
    assert step(sched) == [("i", 10, 1), ("b1", 7, 1), ("b2", 7, 1), ("b3", 0, 6)]


def test_a_better_class_takes_the_slot_of_the_newest_worse_one_which_resumes_from_its_cache():
    sched = Scheduler(BlockPool(64, 4), max_batch_tokens=32, max_seqs=2)
    sched.add(seq("b1", 8, priority=3))
    sched.add(seq("b2", 8, priority=3))
    step(sched)
    step(sched)
    sched.add(seq("i", 5, priority=0))
    assert step(sched) == [("i", 0, 5)]
    b2 = next(s for s in sched.waiting if s.rid == "b2")
    assert b2.preemptions == 1 and [s.rid for s in sched.running] == ["i", "b1"]
    sched.finish(sched.running[0])  # the interactive request ends: b2 comes back, its 2 full blocks cached
    assert step(sched) == [("b1", 9, 1), ("b2", 8, 2)]


def test_a_better_class_takes_the_cache_blocks_of_a_worse_one():
    sched = Scheduler(BlockPool(6, 4), max_batch_tokens=64, max_seqs=8)
    sched.add(seq("b", 20, priority=1, room=4))  # 5 of the 6 blocks
    step(sched)
    sched.add(seq("i", 8, priority=0, room=0))  # needs 2: only one is free
    assert step(sched) == [("i", 0, 8)]
    assert [s.rid for s in sched.waiting] == ["b"] and sched.preempted_total == 1


def test_one_class_schedules_as_before():
    """Every request at the default priority: first come, first served, the newest preempted."""
    sched = Scheduler(BlockPool(64, 4), max_batch_tokens=8, max_seqs=2)
    for name in ("a", "bb", "ccc"):
        sched.add(seq(name, 6))
    assert step(sched) == [("a", 0, 6)]  # chunks end at multiples of the budget: bb's 6 do not fit
    assert step(sched) == [("a", 6, 1), ("bb", 0, 6)]
    assert [s.rid for s in sched.waiting] == ["ccc"]  # max_seqs: no preemption within a class


def test_priorities_change_no_greedy_token():
    """A mixed-class batch (interactive requests arriving while batch ones decode, taking their slots)
    gives every request the tokens it gets alone."""
    batch = prompts(8)
    engine = Engine(build(), ByteTokenizer(), None, EngineConfig(prefix_caching=False))
    alone = []
    for p in batch:  # one at a time
        engine.add("x", p, dataclasses.replace(GREEDY))
        out = []
        while engine.has_work():
            out += [c.token for o in engine.step() for c in o.choices]
        alone.append(out)
    engine = Engine(build(), ByteTokenizer(), None, EngineConfig(max_seqs=4, max_batch_tokens=64))
    got: dict[str, list[int]] = {}
    for i, p in enumerate(batch):
        engine.add(str(i), p, dataclasses.replace(GREEDY), priority=5 if i % 3 else -1)
        for o in engine.step():
            got.setdefault(o.rid, []).extend(c.token for c in o.choices)
    while engine.has_work():
        for o in engine.step():
            got.setdefault(o.rid, []).extend(c.token for c in o.choices)
    assert engine.scheduler.preempted_total > 0  # the classes did preempt
    assert [got[str(i)] for i in range(len(batch))] == alone


def test_priority_through_the_api_its_range_and_per_class_metrics():
    import httpx

    from inproc_server import serve_in_process

    engine = Engine(build(), ByteTokenizer(), None, EngineConfig())
    with serve_in_process(engine) as (url, _):
        for priority in (3, 0):
            r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0,
                                                          "priority": priority}, timeout=60)
            assert r.status_code == 200, r.text
        bad = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "priority": 101}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
        metrics = httpx.get(url + "/metrics", timeout=60).text
        for priority in ("3", "0"):
            assert f'stalwart_serve_time_to_first_token_seconds_count{{model="tiny",priority="{priority}"}} 1.0' in metrics
