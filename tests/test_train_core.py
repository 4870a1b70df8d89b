"""The reusable training core without the pre-training loop: batches and a loss the caller supplies,
gates on the optimizer, and save/restore through the same checkpointer, bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from stalwart.config.job import (CheckpointConfig, CommConfig, OptimizerConfig, ParallelismConfig, SchedulerConfig,
                                 TrainingConfig)
from stalwart.data.loader import Batch
from stalwart.ft.gate import Decision
from stalwart.models.flavors import TransformerArgs
from stalwart.paths import RunPaths
from stalwart.train.checkpointer import Checkpointer
from stalwart.train.core import CoreSpec, TrainCore
from stalwart.runtime.env import DistEnv

pytestmark = pytest.mark.unit

ARGS = TransformerArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden=64, max_seq_len=16,
                       tie_embeddings=True)
ENV = DistEnv(0, 1, 0, 1, torch.device("cpu"))


def build() -> TrainCore:
    spec = CoreSpec(ARGS, ParallelismConfig(), CommConfig(), OptimizerConfig(lr=1e-2), SchedulerConfig(warmup_steps=1),
                    TrainingConfig(steps=10, global_batch=2, micro_batch=2), seq_len=16, accum_steps=1)
    return TrainCore.build(spec, ENV)


def batch(i: int) -> list[Batch]:
    x = torch.randint(0, ARGS.vocab_size, (2, 17), generator=torch.Generator().manual_seed(i))
    return [Batch(x[:, :-1], x[:, 1:])]


def weighted_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A caller's own objective (here: token log-likelihood weighted by position, as a policy-gradient
    loss weights tokens by their advantage)."""
    logp = F.log_softmax(logits.float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (batch, seq)
    weights = torch.linspace(0.1, 1.0, targets.shape[1])
    return -(logp * weights).mean()


class Stateful:
    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def params(core: TrainCore) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in core.model.state_dict().items()}


def test_supplied_loss_is_the_one_trained_on():
    a, b = build(), build()
    assert all(torch.equal(x, y) for x, y in zip(params(a).values(), params(b).values()))  # same seeded init
    ra = a.train_step(batch(0))
    rb = b.train_step(batch(0), loss_fn=weighted_loss)
    with torch.no_grad():
        expected = weighted_loss(build().model(batch(0)[0].inputs), batch(0)[0].targets)
    assert rb["loss"] == pytest.approx(float(expected), rel=1e-6) and ra["loss"] != rb["loss"]
    assert any(not torch.equal(x, y) for x, y in zip(params(a).values(), params(b).values()))
    assert a.state.step == b.state.step == 1 and a.state.tokens_seen == 32


def test_a_gate_decides_whether_the_update_is_applied():
    core = build()
    seen = []

    def gate(outcome):
        seen.append((outcome.step, outcome.grad_norm > 0, outcome.compute_s > 0))
        return Decision(commit=outcome.step != 2)

    core.opt.gates.append(gate)
    core.train_step(batch(0))
    before = params(core)
    record = core.train_step(batch(1))
    assert record.get("skipped") is True and all(torch.equal(before[k], v) for k, v in params(core).items())
    assert not core.train_step(batch(2)).get("skipped")
    assert seen == [(1, True, True), (2, True, True), (3, True, True)]


def test_checkpointer_round_trip_resumes_bit_for_bit(tmp_path):
    paths = RunPaths(tmp_path / "run")
    cfg = CheckpointConfig(async_save=False)
    straight = build()
    losses = [straight.train_step(batch(i), loss_fn=weighted_loss)["loss"] for i in range(5)]

    first, data = build(), Stateful()
    ckpt = Checkpointer(cfg, paths, ENV, first, {"data": data}, lambda *a, **k: None, describe={})
    for i in range(3):
        first.train_step(batch(i), loss_fn=weighted_loss)
        data.position = i + 1
    assert ckpt.save(block=True) == paths.checkpoint(3)

    second, data2 = build(), Stateful()
    Checkpointer(cfg, paths, ENV, second, {"data": data2}, lambda *a, **k: None, describe={}).restore()
    assert (second.state.step, second.state.tokens_seen, data2.position) == (3, 3 * 32, 3)
    assert second.schedule.state_dict() == first.schedule.state_dict()
    resumed = [second.train_step(batch(i), loss_fn=weighted_loss)["loss"] for i in range(3, 5)]
    assert resumed == losses[3:]
    assert all(torch.equal(v, params(straight)[k]) for k, v in params(second).items())
    assert dataclasses.asdict(ARGS) == ckpt.trainer_state()["model_args"]
