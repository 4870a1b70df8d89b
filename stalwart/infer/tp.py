"""Tensor-parallel inference: rank 0 schedules, every rank runs the same forward on its shard.

Rank 0 broadcasts each step's batch (token ids, block tables, the rows whose logits it needs) as one
int64 tensor over the process group; the other ranks rebuild the batch and run the forward, whose
all-reduces then match rank 0's. Weight updates and shutdown travel the same way, so every rank sees
the same sequence of commands.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from stalwart.infer.engine import Batch, Engine

STOP, STEP, LOAD = 0, 1, 2


class StepLink:
    def __init__(self, group=None, src: int = 0) -> None:
        self.group = group
        self.src = src

    def _broadcast(self, ints: list[int] | None) -> list[int]:
        size = torch.tensor([len(ints) if ints is not None else 0], dtype=torch.long)
        dist.broadcast(size, self.src, group=self.group)
        data = torch.tensor(ints, dtype=torch.long) if ints is not None else torch.empty(int(size), dtype=torch.long)
        dist.broadcast(data, self.src, group=self.group)
        return data.tolist()

    def send_step(self, batch: Batch) -> None:
        msg = [STEP, len(batch.tokens), len(batch.spans), len(batch.rows), *batch.tokens, *batch.rows]
        for q_start, q_len, ctx, blocks in batch.spans:
            msg += [q_start, q_len, ctx, len(blocks), *blocks]
        self._broadcast(msg)

    def send_load(self, where: str, version: int) -> None:
        self._broadcast([LOAD, version, *where.encode()])

    def send_stop(self) -> None:
        self._broadcast([STOP])

    def receive(self) -> tuple[int, object]:
        msg = self._broadcast(None)
        if msg[0] == STEP:
            n_tok, n_spans, n_rows = msg[1:4]
            tokens = msg[4:4 + n_tok]
            rows = msg[4 + n_tok:4 + n_tok + n_rows]
            i, spans, positions = 4 + n_tok + n_rows, [], []
            for _ in range(n_spans):
                q_start, q_len, ctx, nb = msg[i:i + 4]
                spans.append((q_start, q_len, ctx, msg[i + 4:i + 4 + nb]))
                positions += range(ctx - q_len, ctx)
                i += 4 + nb
            return STEP, Batch(tokens, positions, spans, rows)
        if msg[0] == LOAD:
            return LOAD, (msg[1], bytes(msg[2:]).decode())
        return STOP, None


@torch.no_grad()
def follow(engine: Engine, link: StepLink, load) -> None:
    """The loop of a rank other than 0: run each forward rank 0 announces, until it says stop.

    ``load(where)`` returns the full state dict of a weight update (read on every rank).
    """
    while True:
        cmd, payload = link.receive()
        if cmd == STEP:
            engine.forward(payload)
        elif cmd == LOAD:
            version, where = payload
            engine.load_full_state(load(where), version)
        else:
            return
