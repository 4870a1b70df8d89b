"""Whatever ends a training session, every handler, patch and thread it installed is undone.

Runs the real Trainer in this process over a one-rank gloo group (so the flight recorder patches
torch.distributed), with fault injection and chaos on (so the SIGUSR2 handler is installed), and ends
the session with an injected exception at step 2.
"""

from __future__ import annotations

import json
import signal
import sys
import threading

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from conftest import TINY_RUN
from stalwart.config import load
from stalwart.config.job import JobConfig
from stalwart.ft.inject import InjectedFault
from stalwart.runtime.env import DistEnv
from stalwart.train.trainer import Trainer

pytestmark = pytest.mark.unit

HANDLED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
THREADS = ("stalwart-heartbeat", "stalwart-flight-watchdog")


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield DistEnv(0, 1, 0, 1, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def before() -> dict:
    return {"all_reduce": dist.all_reduce, "c10d.all_reduce": c10d.all_reduce, "barrier": dist.barrier,
            "excepthook": sys.excepthook, **{f"signal {s.name}": signal.getsignal(s) for s in HANDLED}}


def test_an_exception_undoes_every_patch_handler_and_thread(tmp_path, one_rank_group):
    run = tmp_path / "run"
    cfg = load(JobConfig, None, [*TINY_RUN, "--run.dir", str(run), "--training.steps", "5",
                                 "--fault.inject", "exception:rank=0,step=2", "--fault.chaos_mtbf_s", "1000",
                                 "--observe.hang_timeout_s", "60"])
    saved = before()
    trainer = Trainer(cfg, one_rank_group)
    seen_inside = {}

    def spy(step, loss):  # a backward hook: look at the process while the session is running
        seen_inside.update(before(), threads={t.name for t in threading.enumerate()})
        return loss

    trainer.core.backward_hooks.append(spy)
    with pytest.raises(InjectedFault, match="exception:rank=0,step=2"):
        trainer.train()
    # While training, the session had patched and installed them all ...
    assert seen_inside["all_reduce"] is not saved["all_reduce"]
    assert seen_inside["excepthook"] is not saved["excepthook"]
    assert all(seen_inside[f"signal {s.name}"] is not saved[f"signal {s.name}"] for s in HANDLED)
    assert set(THREADS) <= seen_inside["threads"]
    # ... and the exception undid every one of them.
    assert before() == saved
    alive = {t.name for t in threading.enumerate()}
    assert not alive & set(THREADS), alive
    dump = json.loads((run / "flight" / "rank-0.json").read_text())
    assert dump["reason"].startswith("exception InjectedFault")
    beat = json.loads((run / "ft" / "heartbeat" / "rank-0.json").read_text())
    assert beat["phase"] == "failed" and beat["step"] == 1
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(x)] == [1]
