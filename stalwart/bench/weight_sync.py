"""`stalwart bench weight-sync`: one RL weight sync, trainer ranks -> generators, by RL's path against the
path it replaced, interleaved.

- ``direct``: RL's path (``rl/weights.py``): each trainer rank sends its own FSDP shards over each
  generator's weight link, in buckets; the controller sends versions and reads small replies.
- ``via-controller``: the path it replaced, kept here as the baseline: trainer rank 0 gathers the full
  state dict (``get_state_dict(full_state_dict=True, cpu_offload=True)``), converts it to numpy and
  returns it to the controller, which sends it to every generator, which converts it back to torch and
  installs it.

The actors are RL's own (``PolicyTrainerActor``, ``GeneratorActor``) with the baseline's endpoints
added, driven by RL's services, so ``direct`` is exactly what ``stalwart rl`` runs. Every sync prints
one line: seconds, peak RSS of the controller and of trainer rank 0 during it (``VmHWM`` after a reset
through ``/proc/self/clear_refs``), and the bytes through the controller (arguments and replies of every
call it makes, counted where it sends and receives them). After each sync the generators' weights are
checked against the trainers' (a float64 sum over every tensor)."""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from monarch.actor import endpoint

from stalwart.config.arguments import ArgumentParser, at_least, one_of, positive
from stalwart.controller.gang import GangMesh, PerMember
from stalwart.controller.mesh import ActorMesh
from stalwart.rl.generator import GeneratorActor
from stalwart.rl.trainer import PolicyTrainerActor

PATHS = ("via-controller", "direct")


def reset_peak() -> None:
    """Start this process's peak-RSS count afresh (Linux: ``clear_refs`` 5 resets ``VmHWM``)."""
    Path("/proc/self/clear_refs").write_text("5")


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_mb() -> float:
    return _status_mb("VmHWM")


def memory_mark(reset: bool) -> tuple[float, float]:
    """(peak RSS since the last reset, RSS now), MiB; then a reset when asked."""
    mark = (peak_mb(), _status_mb("VmRSS"))
    if reset:
        reset_peak()
    return mark


def payload_bytes(obj: Any) -> int:
    """Bytes a message carries: array and tensor data by size, anything else as pickled."""
    import torch

    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(payload_bytes(k) + payload_bytes(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return sum(payload_bytes(v) for v in obj)
    return len(pickle.dumps(obj))


class CountingMesh(ActorMesh):
    """An actor mesh that counts the bytes of every call's arguments and every reply at the controller."""

    bytes = 0

    def call(self, endpoint, args=(), ranks=None):
        for r in (range(self.n) if ranks is None else ranks):
            CountingMesh.bytes += payload_bytes(args.fn(r, 0) if isinstance(args, PerMember) else
                                                args(r) if callable(args) else args)
        return super().call(endpoint, args, ranks)

    def wait(self, futures, timeout_s, what=""):
        replies = super().wait(futures, timeout_s, what)
        CountingMesh.bytes += payload_bytes(replies)
        return replies


class CountingGang(CountingMesh, GangMesh):
    """The generators' mesh (a gang of one process per generator), counted."""


class BenchTrainer(PolicyTrainerActor):
    @endpoint
    def gather_numpy(self) -> dict[str, Any]:
        """The replaced path: the full model state on rank 0, as numpy ({} on the others; a collective)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        sd, _ = get_state_dict(self.core.model, [], options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        out = {k: v.detach().cpu().numpy().copy() for k, v in sd.items()} if self.rank == 0 else {}
        return {"weights": out, "step": self.done}

    @endpoint
    def advance(self) -> tuple[int, float]:
        """The next version: every weight moves by a small step (so each sync carries new values); the
        version and the float64 sum of the whole model after it."""
        import torch
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        from stalwart.comm.weight_sync import owned_pieces
        from stalwart.runtime.device import HOST

        self.done += 1
        total = torch.zeros((), dtype=torch.float64)
        with torch.no_grad():
            for p in self.core.model.parameters():
                (p._local_tensor if isinstance(p, DTensor) else p).add_(1e-3)
            for piece in owned_pieces(self.core.model.state_dict(), self.rank):
                total += piece.local.double().sum().to(HOST)
        if dist.is_initialized():
            dist.all_reduce(total)
        return self.done, float(total)

    @endpoint
    def memory(self, reset: bool) -> tuple[float, float]:
        return memory_mark(reset)


class BenchGenerator(GeneratorActor):
    @endpoint
    def load_numpy(self, weights: dict[str, np.ndarray], version: int) -> dict[str, float]:
        """The replaced path's install: numpy back to torch, then into the engine."""
        import torch

        t0 = time.perf_counter()
        self.engine.load_full_state({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in weights.items()},
                                    version)
        return {"load_s": time.perf_counter() - t0}

    @endpoint
    def digest(self) -> float:
        return float(sum(t.double().sum() for t in self.engine.model.state_dict().values() if t.is_floating_point()))

    @endpoint
    def memory(self, reset: bool) -> tuple[float, float]:
        return memory_mark(reset)


def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, models

    from stalwart.data.tokenizer import EOS

    return Tokenizer(models.WordLevel({"x": 0, EOS: 1}, unk_token="x")).to_str()


def main(argv: list[str]) -> int:
    from stalwart.config.controller import ControllerConfig
    from stalwart.config.job import ModelConfig, ParallelismConfig
    from stalwart.config.rl import GRPOConfig, RLConfig, WorkersConfig
    from stalwart.config.serve import EngineConfig
    from stalwart.controller.mesh import configure_monarch
    from stalwart.models.flavors import FLAVORS, resolve_args
    from stalwart.rl.pools import Pool
    from stalwart.rl.services import Generators, Timeouts, Trainers
    from stalwart.rl.weights import WeightSync
    from stalwart.runtime.device import check_device
    from stalwart.runtime.group import abandon_attempt, controller_store
    from stalwart.runtime.standalone import abandon

    p = ArgumentParser(prog="stalwart bench weight-sync", description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", type=one_of(FLAVORS), default="125M", help=f"model shape ({', '.join(FLAVORS)})")
    p.add_argument("--dim", type=at_least(0), default=0, help="override the flavor's hidden size (0 = keep)")
    p.add_argument("--layers", type=at_least(0), default=0, help="override the flavor's layer count (0 = keep)")
    p.add_argument("--trainers", type=at_least(1), default=2, help="trainer ranks (FSDP-sharded)")
    p.add_argument("--generators", type=at_least(1), default=1, help="generators")
    p.add_argument("--bucket-mb", type=positive, default=GRPOConfig.weight_sync_bucket_mb, help="weight sync bucket, MiB")
    p.add_argument("--repeats", type=at_least(1), default=3, help="syncs per path, interleaved")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--json", default="", help="also write every sync's row to this file")
    args = p.parse_args(argv)
    if args.json and Path(args.json).is_dir():
        p.error(f"--json: {args.json} is a directory")
    kind = check_device(args.device, 1, "--device")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    configure_monarch(0.5)

    model = ModelConfig(flavor=args.flavor, dim=args.dim, n_layers=args.layers)
    cfg = RLConfig(model=model, parallelism=ParallelismConfig(data_parallel="shard"),
                   workers=WorkersConfig(trainers=args.trainers, generators=args.generators, device=args.device),
                   rl=GRPOConfig(weight_sync_bucket_mb=args.bucket_mb, prompts_per_step=args.trainers),
                   engine=EngineConfig(kv_cache_mb=1, max_seqs=8, max_batch_tokens=64),
                   controller=ControllerConfig(supervision_poll_s=0.5))
    margs = resolve_args(model, FLAVORS[args.flavor].vocab_size, 32)
    store = controller_store(args.trainers, 600.0)
    timeouts = Timeouts(600.0, 600.0, 600.0)
    snapshots = tempfile.mkdtemp(prefix="stalwart-bench-sync-", dir="/dev/shm")  # the trainers keep none here
    tmesh = CountingMesh.spawn(BenchTrainer, "trainer", args.trainers)
    gmesh = CountingGang.spawn(BenchGenerator, "generator", args.generators)
    try:
        for mesh in (tmesh, gmesh):
            mesh.report_grace_s = 0.75
            mesh.pids.update(mesh.call_all(mesh.actor_cls.warm, (), 600.0))
        trainers = Trainers(tmesh, cfg, store.port, snapshots, timeouts, lambda a: abandon_attempt(store, a))
        trainers.join()
        info = trainers.build("rl", margs, 32, 1, 1)
        pool = Pool(gmesh, "generator", 600.0, lambda *a, **k: None, lambda g: None)
        generators = Generators(pool, {}, (margs, _tokenizer_json(), cfg.engine, {"max_tokens": 1, "temperature": 1.0,
                                                                                  "top_k": 0}, False, 32, 1,
                                           args.device, None), store.port, timeouts)  # no episode: single-turn
        weights = WeightSync(trainers, generators, lambda *a, **k: None, lambda prefix: abandon(store, prefix), "")
        pool.restore = weights.bring_up
        generators.setup()
        params = info["params"]
        t0 = time.perf_counter()
        weights.settle(weights.publish(0))
        print(f"stalwart bench weight-sync: {args.flavor} (dim {margs.dim}, {margs.n_layers} layers), {params / 1e6:.1f}M "
              f"parameters = {params * 4 / 2**30:.2f} GiB float32; {args.trainers} FSDP trainer ranks -> "
              f"{args.generators} generator(s) on {kind}, {args.bucket_mb:g} MiB buckets; links and version 0 "
              f"in {time.perf_counter() - t0:.1f} s", flush=True)
        rows = []
        for rep in range(args.repeats):
            for path in PATHS:
                rows.append(_one(path, rep, trainers, generators, weights, args.trainers))
                print(json.dumps(rows[-1]), flush=True)
        _table(rows)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    finally:
        for mesh in (tmesh, gmesh):
            mesh.stop()
        shutil.rmtree(snapshots, ignore_errors=True)
    return 0


def _one(path: str, rep: int, trainers, generators, weights, n_trainers: int) -> dict[str, Any]:
    """One sync of the next version by ``path``; its row."""
    version, total = trainers.mesh.call_all(BenchTrainer.advance, (), 600.0)[0]
    trainer_start = trainers.mesh.call_all(BenchTrainer.memory, (True,), 600.0)[0][1]
    generators.mesh.call_all(BenchGenerator.memory, (True,), 600.0)
    controller_start = memory_mark(True)[1]
    CountingMesh.bytes = 0
    t0 = time.perf_counter()
    if path == "direct":
        weights.settle(weights.publish(version))
    else:
        held = trainers.mesh.call_all(BenchTrainer.gather_numpy, (), 600.0)[0]["weights"]
        generators.mesh.call_all(BenchGenerator.load_numpy, (held, version), 600.0)
        del held
        weights.version = version  # the generators now hold it (the next direct sync must be newer)
    seconds = time.perf_counter() - t0
    through = CountingMesh.bytes
    controller = peak_mb()
    trainer0 = trainers.mesh.call_all(BenchTrainer.memory, (False,), 600.0)[0][0]
    generator0 = generators.mesh.call_all(BenchGenerator.memory, (False,), 600.0)[0][0]
    got = generators.mesh.call_all(BenchGenerator.digest, (), 600.0)
    same = all(math.isclose(v, total, rel_tol=1e-9, abs_tol=1e-6) for v in got.values())
    if not same:
        raise RuntimeError(f"{path}: the generators' weights {got} differ from the trainers' ({total})")
    return {"path": path, "repeat": rep, "version": version, "seconds": round(seconds, 3),
            "controller_peak_mb": round(controller), "controller_rise_mb": round(controller - controller_start),
            "trainer0_peak_mb": round(trainer0), "trainer0_rise_mb": round(trainer0 - trainer_start),
            "generator0_peak_mb": round(generator0), "controller_bytes": through, "weights_match": same,
            "trainers": n_trainers}


def _table(rows: list[dict[str, Any]]) -> None:
    print("\n| path | s per sync | controller peak RSS MiB (rise during the sync) | trainer 0 peak RSS MiB (rise) "
          "| generator peak RSS MiB | bytes through the controller |\n|---|---|---|---|---|---|")
    for path in PATHS:
        mine = [r for r in rows if r["path"] == path]
        cell = lambda fmt: " / ".join(fmt.format(**r) for r in mine)  # noqa: E731
        print(f"| {path} | {cell('{seconds:.2f}')} | {cell('{controller_peak_mb} (+{controller_rise_mb})')} | "
              f"{cell('{trainer0_peak_mb} (+{trainer0_rise_mb})')} | {cell('{generator0_peak_mb}')} | "
              f"{cell('{controller_bytes:,}')} |")
