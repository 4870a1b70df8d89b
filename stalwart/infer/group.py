"""One replica over several processes: tensor parallel inside a stage, pipeline stages in a row.

Ranks are laid out as a (pp, tp) grid, rank = stage * tp + tp_rank. Rank 0 (stage 0, tp rank 0) owns
the scheduler and broadcasts each step's batch (token ids, block tables, the rows whose logits it
needs) as one int64 tensor to every rank; each rank rebuilds the batch and runs its part of the
forward. Inside a stage the tensor-parallel all-reduces then match; between stages each tp rank sends
its (replicated) activations to the same tp rank of the next stage, and the last stage's tp rank 0
sends the logits back to rank 0. Weight updates and shutdown travel the same broadcast, so every rank
sees the same sequence of commands. Rank 0 announces a weight update before it reads anything, so
every rank reads the new weights together (reading a run checkpoint is a collective).
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

    def agree(self, ok: bool) -> bool:
        """Whether every rank says ``ok`` (every rank calls this at the same point)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.long)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

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


class PipeLink:
    """This rank's neighbours in the pipeline (global ranks). Activations and logits travel on
    ``device`` (the model's), the step messages above on the host."""

    def __init__(self, rank: int, tp: int, pp: int, device: torch.device) -> None:
        self.device = device
        self.stage, self.tp_rank = divmod(rank, tp)
        self.stages = pp
        self.prev = rank - tp if self.stage > 0 else None
        self.next = rank + tp if self.stage < pp - 1 else None
        self.last_leader = (pp - 1) * tp  # sends the logits to rank 0
        self.rank = rank

    def recv_hidden(self, tokens: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
        h = torch.empty(1, tokens, dim, dtype=dtype, device=self.device)
        dist.recv(h, src=self.prev)
        return h

    def send_hidden(self, h: torch.Tensor) -> None:
        dist.send(h.contiguous(), dst=self.next)

    def exchange_logits(self, logits: torch.Tensor | None, rows: int, vocab: int, dtype: torch.dtype):
        """The last stage's leader sends its logits to rank 0, which receives them; others pass."""
        if self.last_leader == 0:
            return logits
        if self.rank == self.last_leader:
            dist.send(logits.contiguous(), dst=0)
        elif self.rank == 0:
            logits = torch.empty(rows, vocab, dtype=dtype, device=self.device)
            dist.recv(logits, src=self.last_leader)
        return logits


@torch.no_grad()
def follow(engine: Engine, link: StepLink, load) -> None:
    """The loop of a rank other than 0: run each forward rank 0 announces, until it says stop.

    ``load(where)`` returns the full state dict of a weight update (read on every rank, together).
    """
    while True:
        cmd, payload = link.receive()
        if cmd == STEP:
            engine.forward(payload)
        elif cmd == LOAD:
            version, where = payload
            try:
                engine.update_weights(lambda: load(where), version)
            except Exception:  # noqa: BLE001 - rank 0 reports it; every rank kept its old weights
                pass
        else:
            return


def regroup(model, tp_mesh) -> None:
    """Point every tensor-parallel layer of ``model`` (laid out by ``load.layout_model``) at ``tp_mesh``'s
    group: the replica's process group was formed again after one of its processes was started again.
    The weights stay; only the group their collectives run on changes."""
    from stalwart.parallel.tensor import LocalShard

    group = tp_mesh.get_group()
    for module in model.modules():
        if isinstance(module, LocalShard):
            module.group = group
