"""Live weight publishing in one process: when the trainer publishes, whom it claims (a subscriber that
gave up is never linked; one claimed cannot give up), and a whole round trip from a WeightPublisher to
``comm.live.receive_next`` over a real loopback store and gloo link (trainer and subscriber on two
threads). Through the real CLI, with a server and a multi-rank trainer: test_serve_live_e2e.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from stalwart.comm.live import (
    Address,
    NothingPublished,
    NotPublishing,
    claim,
    give_up,
    receive_next,
    register,
    serve_store,
    taken,
)
from stalwart.config.core import ConfigError
from stalwart.config.job import JobConfig, ParallelismConfig, PublishConfig
from stalwart.paths import RunPaths
from stalwart.runtime.env import DistEnv
from stalwart.train.publisher import WeightPublisher

pytestmark = pytest.mark.unit


def publisher(tmp_path, interval: int, model: nn.Module | None = None) -> WeightPublisher:
    events: list = []
    p = WeightPublisher(PublishConfig(interval=interval, timeout_s=20), RunPaths(tmp_path), DistEnv.single(),
                        model or nn.Linear(3, 2), lambda name, **f: events.append((name, f)), lambda _m: None)
    p.recorded = events
    return p


def test_off_publishes_nothing_and_writes_nothing(tmp_path):
    p = publisher(tmp_path, 0)
    assert not any(p.due(s) for s in range(1, 20))
    p.maybe_publish(2)
    assert p.store is None and not RunPaths(tmp_path).publish.exists()


def test_due_every_interval_steps(tmp_path):
    with publisher(tmp_path, 3) as p:
        assert [s for s in range(1, 10) if p.due(s)] == [3, 6, 9]
        assert Address.read(RunPaths(tmp_path).publish).trainers == 1
    assert not RunPaths(tmp_path).publish.exists()  # closed: the run no longer publishes


def test_claims_only_waiting_subscribers_once():
    store = serve_store(10)
    assert claim(store, 0, 2) == ([], 0)  # nobody registered yet
    a, b = register(store), register(store)
    assert give_up(store, b)  # b left before the trainers looked
    assert claim(store, 0, 4) == ([a], 2)
    assert taken(store, a) and int(store.get(f"live/{a}/version")) == 4
    assert not give_up(store, a)  # claimed first: a cannot give up, the trainers are coming
    assert claim(store, 2, 6) == ([], 2)
    c = register(store)
    assert claim(store, 2, 6) == ([c], 3)


def test_pipeline_parallel_cannot_publish():
    with pytest.raises(ConfigError, match=r"publish.interval: .*pipeline-parallel"):
        JobConfig(publish=PublishConfig(interval=2), parallelism=ParallelismConfig(pp=2))


def test_round_trip_and_timeout(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 5))
    p = publisher(tmp_path, 2, model)
    address = Address.read(RunPaths(tmp_path).publish)
    # Nobody publishes within the timeout: the subscriber gives up, and is never claimed afterwards.
    with pytest.raises(NothingPublished):
        receive_next(address, 0, 0.3)
    assert claim(p.store, p.seen, 2) == ([], 1)
    p.seen = 1
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(result=receive_next(address, 0, 30)))
    t.start()
    step = 0
    while t.is_alive() and step < 10_000:
        step += 1
        p.maybe_publish(step)  # the trainer goes on stepping while the subscriber registers
        time.sleep(0.01)
    t.join(30)
    version, state = got["result"]
    assert version % 2 == 0 and version <= step
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert p.recorded[-1][0] == "weights_published" and p.recorded[-1][1]["failed"] == []
    # Closed: the file is gone, and a subscriber holding the old address hears nothing answers.
    p.close()
    with pytest.raises(NotPublishing, match="no publish.json"):
        Address.read(RunPaths(tmp_path).publish)
    with pytest.raises(NotPublishing, match="nothing answers"):
        receive_next(address, version, 1)


def test_a_multi_process_replica_refuses_live_updates():
    from stalwart.errors import UserError
    from stalwart.serve.loop import EngineLoop

    loop = EngineLoop(engine=None, link=object())  # rank 0 of a tensor/pipeline-parallel replica
    with pytest.raises(UserError, match="one-process replica"):
        loop.update_live("runs/x", 1.0, threading.Event())
