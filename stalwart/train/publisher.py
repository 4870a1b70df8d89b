"""Live weights for running servers: the trainer's side of ``POST /v1/weights {"live": true}``.

With ``publish.interval`` = N, rank 0 serves a store on loopback for the run's subscribers (servers
that asked for the next weights) and writes where it is to ``<run>/publish.json``
(``comm/live.py`` has the rendezvous). Every N steps, after the checkpointer, rank 0 claims the
subscribers that are waiting and tells the other ranks which (one small broadcast over the default
group, so every rank agrees); each rank then joins a link with each of them and sends its own pieces
of the weights (``comm.weight_sync.send_weights``: DTensor shards as they are, plain tensors from rank
0) as version = the step. No subscriber: that broadcast is all a publish step costs; publishing off:
nothing at all (no store, no file, no collective).

A subscriber that fails (gone, too slow) costs at most ``publish.timeout_s`` and fails alone: the
ranks record it and train on. The trainer ranks and the servers must share one host (loopback).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any, Callable

import torch.distributed as dist
from torch import nn

from stalwart.atomic import write_text_atomic
from stalwart.comm.live import Address, claim, join_link, serve_store
from stalwart.comm.weight_sync import send_weights
from stalwart.config.job import PublishConfig
from stalwart.errors import UserError
from stalwart.paths import RunPaths
from stalwart.runtime.device import LOOPBACK
from stalwart.runtime.env import DistEnv
from stalwart.runtime.standalone import connect_store
from stalwart.train.init import canonical_name


class WeightPublisher:
    """Sends the weights to the run's subscribers every ``publish.interval`` steps (see the module)."""

    def __init__(self, cfg: PublishConfig, paths: RunPaths, env: DistEnv, model: nn.Module,
                 events: Callable[..., None], say: Callable[[str], None],
                 phase: Callable[[str], Any] = lambda _name: contextlib.nullcontext()) -> None:
        self.cfg, self.paths, self.env, self.model = cfg, paths, env, model
        self.events, self.say, self.phase = events, say, phase
        self.store = None  # rank 0: the store it serves; other ranks: a client, once there is a subscriber
        self.seen = 0  # registrations rank 0 has looked at
        self.port = 0
        if not cfg.interval:
            return
        if env.world_size != env.local_world_size:
            raise UserError(f"publish.interval: live weights need every trainer rank on the servers' host (this job "
                            f"has {env.world_size} ranks, {env.local_world_size} on this host)")
        if env.is_main:
            self.store = serve_store(cfg.timeout_s)
            self.port = self.store.port
            address = Address(LOOPBACK, self.port, env.world_size, cfg.timeout_s, os.getpid())
            write_text_atomic(paths.publish, address.to_json())

    def __enter__(self) -> "WeightPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Rank 0: the run no longer publishes (its file goes, unless a newer session wrote its own)."""
        if self.env.is_main and self.cfg.interval:
            with contextlib.suppress(OSError, ValueError):
                if Address.read(self.paths.publish).pid == os.getpid():
                    self.paths.publish.unlink()
        self.store = None

    def due(self, step: int) -> bool:
        return bool(self.cfg.interval) and step % self.cfg.interval == 0

    def maybe_publish(self, step: int) -> None:
        """After step ``step``: on a publish step, every rank learns from rank 0 whom to send to, and sends."""
        if not self.due(step):
            return
        decision: list = [None]
        if self.env.is_main:
            tokens, self.seen = claim(self.store, self.seen, step)
            decision[0] = (tokens, self.port)
        if self.env.is_distributed:
            dist.broadcast_object_list(decision, src=0)
        tokens, port = decision[0]
        if tokens:
            with self.phase("publish"):
                self._send(tokens, port, step)

    def _send(self, tokens: list[str], port: int, step: int) -> None:
        t0 = time.perf_counter()
        rank, cfg = self.env.rank, self.cfg
        if self.store is None:
            self.store = connect_store(port, cfg.timeout_s)
        links, failed = [], {}
        for token in tokens:
            try:
                links.append((token, join_link(self.store, token, rank, self.env.world_size, cfg.timeout_s)))
            except Exception as e:  # noqa: BLE001 - a subscriber gone before its link formed fails alone
                failed[token] = f"{type(e).__name__}: {e}"
        if links:
            state = {canonical_name(k): v for k, v in self.model.state_dict().items()}
            try:
                errors = send_weights([link for _, link in links], state, rank, step, False,
                                      max(1, int(cfg.bucket_mb * 2**20)))
            except Exception as e:  # noqa: BLE001 - the subscribers' transfers fail; training goes on
                errors = {i: f"{type(e).__name__}: {e}" for i in range(len(links))}
            failed.update((links[i][0], error) for i, error in errors.items())
        del links  # the links' groups close: a subscriber still receiving fails at once
        seconds = time.perf_counter() - t0
        if self.env.is_main:
            self.events("weights_published", step=step, subscribers=len(tokens), failed=sorted(failed.values()),
                        seconds=seconds)
            self.say(f"step {step}: weights sent to {len(tokens) - len(failed)} of {len(tokens)} server(s) in "
                     f"{seconds:.2f} s" + (f" (failed: {'; '.join(sorted(failed.values()))})" if failed else ""))
        elif failed:
            print(f"stalwart train: rank {rank}: sending the weights of step {step} failed for {len(failed)} "
                  f"server(s): {'; '.join(sorted(failed.values()))}", file=sys.stderr, flush=True)
