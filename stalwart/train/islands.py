"""Islands: jobs that train on their own and meet only in an outer sync (``parallelism.islands``).

Each island is a job of its own (its processes, process group, supervisor and run directory:
island 0 in the run directory, island ``i`` in ``groups/<i>``), launched like the replica groups of
``fault.group_recovery`` (``launch/groups.py``). Between islands only the outer sync crosses: rank
0 of every island joins one gloo process group (built from the launcher's store, under a key that
names every island's start attempt, so a restarted island and the survivors build a new one), and
the other ranks of an island get the result by a broadcast on the island's own group.

What crosses is chosen by ``islands.algorithm`` (the math: ``parallel/islands.py``): DiLoCo's
outer gradient of the whole model every ``H`` steps; Streaming DiLoCo's, one fragment at a time,
sent by a thread while the next ``tau`` inner steps run; or, for ``sync``, every step's gradients.

**State.** The outer state of every parameter (``outer_anchor``, ``outer_momentum``; with a
quantized link ``outer_residual``; with overlap ``outer_pending``, the outer gradient in flight) is
kept in the optimizer's per-parameter state, so every checkpoint and memory snapshot holds it
beside the inner AdamW moments; the sync counter and the sync in flight are this component's
``state_dict``. A resumed island sends what it sent before, so the run is the same bit for bit.

**A lost island.** Its supervisor restarts it alone; it restores its own newest snapshot or
checkpoint and trains its inner steps again. The others wait at their next sync (a collective that
failed is retried on a new group once the lost island's attempt changed). Before every exchange
the islands compare their sync counters: an island one sync behind (it died after the others
finished a sync it had not recorded) receives that sync's result, the new anchor and momentum of its
fragment, from the first island ahead, which is what it would have computed. An island further
behind cannot be caught up this way: the run stops with a message (whole-job fallback: restart
every island from a checkpoint).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from stalwart.parallel.islands import Schedule, Sync, average, dequantize, fragments_of, nesterov, quantize

ANCHOR, MOMENTUM, RESIDUAL, PENDING = "outer_anchor", "outer_momentum", "outer_residual", "outer_pending"


def _local(t: torch.Tensor) -> torch.Tensor:
    """A parameter's (or its state's) tensor on this rank: every rank of an island holds it whole."""
    return t.to_local() if hasattr(t, "to_local") else t


def _broadcast(pg, tensor: torch.Tensor, root: int) -> None:
    # The cross-island group is not in torch.distributed's group map: its collectives are called on it
    # directly (through torch.distributed's functions, gloo failed a 0.5 MB all-reduce with EFAULT here).
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    pg.broadcast([tensor], opts).wait()


class IslandLost(RuntimeError):
    """The islands cannot meet: one is too far behind, or none came back within the timeout."""


class CrossLink:
    """Rank 0 of every island: the process group between islands, rebuilt after a lost island."""

    def __init__(self, store, island: int, islands: int, timeout_s: float, waiting) -> None:
        self.store, self.island, self.k, self.timeout_s = store, island, islands, timeout_s
        self.waiting = waiting
        self.attempt = store.add(f"isl/att/{island}", 1)
        self.pg = None
        self.tag = ""
        self.rebuilds = 0
        self.failed = lambda error: None  # told when a collective between islands failed

    def _attempts(self) -> str:
        keys = [f"isl/att/{i}" for i in range(self.k)]
        self.store.wait(keys, timedelta(seconds=self.timeout_s))
        return "-".join(v.decode() for v in self.store.multi_get(keys))

    def group(self):
        if self.pg is None:
            self.tag = self._attempts()
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore(f"isl/pg/{self.tag}", self.store), self.island, self.k,
                                            timedelta(seconds=self.timeout_s))
        return self.pg

    def broken(self) -> None:
        """A collective failed: wait until some island's attempt changed (it restarted), then rebuild."""
        old, self.pg = self.tag, None
        deadline = time.monotonic() + self.timeout_s
        while self._attempts() == old:
            if time.monotonic() > deadline:
                raise IslandLost(f"island {self.island}: no lost island came back within {self.timeout_s:g} s "
                                 "(islands.sync_timeout_s)")
            time.sleep(0.2)
        self.rebuilds += 1

    def run(self, work):
        """``work(pg)`` until it completes on a group whose members are all alive."""
        self.waiting(True)
        try:
            while True:
                try:
                    return work(self.group())
                except (RuntimeError, dist.DistBackendError) as e:
                    if isinstance(e, IslandLost):
                        raise
                    self.failed(e)
                    self.broken()
        finally:
            self.waiting(False)


class Islands:
    """One island's side of the outer sync. ``cfg``: the ``islands`` section; ``island``/``islands``:
    this island and how many; ``store``: the launcher's store (a client); ``core``: the training core."""

    def __init__(self, cfg, island: int, islands: int, env, core, store, n_layers: int, events, say,
                 snapshot_every: int = 0, waiting=lambda waiting: None) -> None:
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        self.cfg, self.island, self.k, self.env, self.core = cfg, island, islands, env, core
        self.events, self.say = events, say
        self.schedule = Schedule(cfg.algorithm, cfg.inner_steps, cfg.fragments, cfg.overlap_steps)
        named = [(n, p) for n, p in core.model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        frag = fragments_of([n for n, _ in named], n_layers, self.schedule.p)
        self.fragments = [[p for p, f in zip(self.params, frag) if f == i] for i in range(self.schedule.p)]
        if not all(self.fragments):
            from stalwart.errors import UserError

            raise UserError(f"islands.fragments = {self.schedule.p}: the model's {n_layers} layers do not fill as many "
                            f"fragments; use --islands.fragments {min(n_layers, self.schedule.p)} or fewer")
        self.link = CrossLink(store, island, islands, cfg.sync_timeout_s, waiting) if env.rank == 0 else None
        self.syncs = 0          # outer syncs applied
        # The results of the last `keep` syncs, for an island restored behind them: it can be behind by the
        # syncs of two snapshot intervals (a snapshot still being written when it died) and the one in flight.
        every = max(1, self.schedule.every)
        self.keep = max(2, -(-2 * snapshot_every // every) + 2)
        self.kept: dict[int, tuple[int, torch.Tensor]] = {}
        self.last_fragment = -1  # the fragment of the last one
        self.inflight: Sync | None = None
        self._thread: tuple[threading.Thread, dict] | None = None
        self.sent_bytes = 0
        self.wait_s = 0.0
        if cfg.algorithm == "sync":
            core.backward_hooks.append(self._sync_gradients)
            return
        # The outer state lives in the optimizer's per-parameter state (AdamW's is made first, as a load does).
        _init_optim_state(core.optimizer)
        for p in self.params:
            st = core.optimizer.state[p]
            st[ANCHOR] = p.detach().clone()
            st[MOMENTUM] = torch.zeros_like(p)
            if cfg.quantize in ("int8", "int4"):
                st[RESIDUAL] = torch.zeros_like(p)
            if self.schedule.tau:
                st[PENDING] = torch.zeros_like(p)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"syncs": self.syncs, "last_fragment": self.last_fragment,
                "inflight": self.inflight.__dict__ if self.inflight else None}

    def load_state_dict(self, state: dict) -> None:
        self.syncs, self.last_fragment = int(state["syncs"]), int(state["last_fragment"])
        self.inflight = Sync(**state["inflight"]) if state.get("inflight") else None
        if self.inflight is not None:  # resend what was in flight when the state was saved
            self._start(self.inflight, self._flat(self.inflight.fragment, PENDING))

    # ------------------------------------------------------------------ the loop's hook
    def after_step(self, step: int) -> None:
        """Launch and apply the syncs of optimizer step ``step`` (before it is checkpointed)."""
        if self.cfg.algorithm == "sync":
            return
        due = self.schedule.applied_at(step)
        if due is not None and self.schedule.tau:
            self._apply(due, self._finish(due))
        launch = self.schedule.launched_at(step)
        if launch is not None:
            self._start(launch, self._launch(launch))
            if not self.schedule.tau:
                self._apply(launch, self._finish(launch))

    def _flat(self, fragment: int, key: str | None = None) -> torch.Tensor:
        ps = self.fragments[fragment]
        src = [self.core.optimizer.state[p][key] if key else p for p in ps]
        return torch.cat([_local(t).detach().reshape(-1).float() for t in src])  # the outer math: float32

    def _unflat(self, fragment: int, flat: torch.Tensor, key: str | None = None) -> None:
        offset = 0
        with torch.no_grad():
            for p in self.fragments[fragment]:
                dst = _local(self.core.optimizer.state[p][key] if key else p)
                dst.copy_(flat[offset:offset + dst.numel()].view_as(dst))
                offset += dst.numel()

    def _launch(self, sync: Sync) -> torch.Tensor:
        """This island's outer gradient of ``sync``'s fragment (the residual is updated now)."""
        f, how = sync.fragment, self.cfg.quantize
        delta = self._flat(f, ANCHOR) - self._flat(f, None)
        feedback = how in ("int8", "int4")
        if feedback:
            delta += self._flat(f, RESIDUAL)
        payload = quantize(delta, how, self.cfg.block)
        if feedback:  # what the rounding lost goes into the next outer gradient
            self._unflat(f, delta - dequantize(payload, delta.numel(), how, self.cfg.block), RESIDUAL)
        if self.schedule.tau:
            self._unflat(f, delta, PENDING)
            self.inflight = sync
        return payload

    # ------------------------------------------------------------------ the exchange
    def _start(self, sync: Sync, payload_or_delta: torch.Tensor) -> None:
        """Rank 0 starts the exchange of ``sync`` on a thread; the island's other ranks wait in ``_finish``."""
        if self.link is None:
            return
        if payload_or_delta.dtype != torch.uint8:  # a resumed in-flight sync: the pending outer gradient
            payload_or_delta = quantize(payload_or_delta, self.cfg.quantize, self.cfg.block)
        out: dict = {}
        n = self._flat(sync.fragment, ANCHOR).numel()

        def run() -> None:
            try:
                out["result"] = self.link.run(lambda pg: self._exchange(pg, sync, payload_or_delta, n))
            except BaseException as e:  # noqa: BLE001 - raised on the training thread by _finish
                out["error"] = e

        thread = threading.Thread(target=run, name=f"island-sync-{sync.index}", daemon=True)
        thread.start()
        self._thread = (thread, out)

    def _exchange(self, pg, sync: Sync, payload: torch.Tensor, n: int) -> tuple[str, torch.Tensor]:
        """("mean", the islands' mean outer gradient) or ("state", anchor and momentum after ``sync``,
        sent by an island ahead). Islands ahead serve the ones behind, then exchange again."""
        while True:
            where = torch.tensor([sync.index, self.last_fragment], dtype=torch.int64)
            every = [torch.zeros(2, dtype=torch.int64) for _ in range(self.k)]
            pg.allgather([every], [where]).wait()
            at = [int(t[0]) for t in every]
            ahead, lo = max(at), min(at)
            if lo == ahead:
                break
            # The islands furthest behind get the result of the sync they are at from the first island
            # ahead (it keeps its last results); the others wait, then exchange again.
            source = at.index(ahead)
            head = torch.zeros(3, dtype=torch.int64)
            if self.island == source and lo in self.kept:
                frag, kept = self.kept[lo]
                head = torch.tensor([1, frag, kept.numel()], dtype=torch.int64)
            _broadcast(pg, head, source)
            if not int(head[0]):
                raise IslandLost(f"islands at outer syncs {at}: island {at.index(lo)} restored further behind than "
                                 f"the {self.keep} syncs the others keep; restart every island from one checkpoint")
            state = kept if self.island == source else torch.empty(int(head[2]))
            _broadcast(pg, state, source)
            if at[self.island] == lo:
                if int(head[1]) != sync.fragment:
                    raise IslandLost(f"island {self.island} is at sync {sync.index} of fragment {sync.fragment}, "
                                     f"the result sent is of fragment {int(head[1])}")
                return "state", state
            # The islands behind now train to this sync; exchange again when they arrive.
        how = self.cfg.quantize
        size = payload.numel()  # every island's payload has this size (planner/islands.py: payload_bytes)
        if how == "none":
            total = payload.view(torch.float32).clone()
            pg.allreduce([total]).wait()
            self.sent_bytes += size
            return "mean", total / self.k
        gathered = [torch.empty(size, dtype=torch.uint8) for _ in range(self.k)]
        pg.allgather([gathered], [payload]).wait()
        self.sent_bytes += size
        return "mean", average(gathered, n, how, self.cfg.block)

    def _finish(self, sync: Sync) -> tuple[str, torch.Tensor]:
        """Wait for ``sync``'s exchange (rank 0's thread) and share its result with the island."""
        t0 = time.perf_counter()
        kind, result = "mean", None
        if self._thread is not None:
            thread, out = self._thread
            thread.join()
            self._thread = None
            if "error" in out:
                raise out["error"]
            kind, result = out["result"]
        if self.env.world_size > 1:
            n = self._flat(sync.fragment, ANCHOR).numel()
            head = torch.tensor([1 if kind == "state" else 0], dtype=torch.int64)
            dist.broadcast(head, src=0)
            kind = "state" if int(head) else "mean"
            if result is None:
                result = torch.empty(2 * n if kind == "state" else n)
            dist.broadcast(result, src=0)
        self.wait_s += time.perf_counter() - t0
        self.inflight = None
        return kind, result

    def _apply(self, sync: Sync, got: tuple[str, torch.Tensor]) -> None:
        """The outer step of ``sync``'s fragment, and the island's parameters after it."""
        kind, result = got
        f = sync.fragment
        anchor, momentum = self._flat(f, ANCHOR), self._flat(f, MOMENTUM)
        if kind == "state":
            n = anchor.numel()
            anchor, momentum = result[:n].clone(), result[n:].clone()
        else:
            nesterov(anchor, momentum, result, self.cfg.outer_lr, self.cfg.outer_momentum)
        self._unflat(f, anchor, ANCHOR)
        self._unflat(f, momentum, MOMENTUM)
        self.kept[sync.index] = (f, torch.cat([anchor, momentum]))  # for an island that comes back behind
        self.kept.pop(sync.index - self.keep, None)
        if self.schedule.tau and self.cfg.mixing > 0:
            local = self._flat(f, None)
            self._unflat(f, local.mul_(self.cfg.mixing).add_(anchor, alpha=1 - self.cfg.mixing))
        else:
            self._unflat(f, anchor)
        self.syncs, self.last_fragment = sync.index + 1, f
        self.events("island_sync", step=self.core.state.step, index=sync.index, fragment=f, launched=sync.launch, applied=sync.apply,
                    caught_up=kind == "state", sent_bytes=self.sent_bytes, wait_s=round(self.wait_s, 4),
                    rebuilds=self.link.rebuilds if self.link else 0)

    # ------------------------------------------------------------------ algorithm = sync
    def _sync_gradients(self, step: int, loss: torch.Tensor | None) -> torch.Tensor | None:
        """Synchronous baseline: the island's (already reduced) gradients averaged over the islands."""
        grads = [_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p)) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        t0 = time.perf_counter()
        if self.link is not None:
            sync = Sync(step - 1, 0, step, step)

            def work(pg):
                where = torch.tensor([sync.index], dtype=torch.int64)
                every = [torch.zeros(1, dtype=torch.int64) for _ in range(self.k)]
                pg.allgather([every], [where]).wait()
                if len({int(t) for t in every}) > 1:
                    raise IslandLost(f"islands at steps {[int(t) + 1 for t in every]}: synchronous islands restart "
                                     "together (restart every island from one checkpoint)")
                total = quantize(flat, "none", 0).view(torch.float32).clone()
                pg.allreduce([total]).wait()
                return total / self.k
            flat = self.link.run(work)
            self.sent_bytes += 4 * flat.numel()
        if self.env.world_size > 1:
            dist.broadcast(flat, src=0)
        self.wait_s += time.perf_counter() - t0
        offset = 0
        for p, g in zip(self.params, grads):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            _local(p.grad).copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        return loss

    def final(self) -> None:
        """At the run's last step: the sync in flight applied, then every fragment synced and taken
        whole (every island ends on the same global model: the one evaluated and saved)."""
        if self.cfg.algorithm == "sync":
            return
        if self.inflight is not None:
            self._apply(self.inflight, self._finish(self.inflight))
        if self.schedule.p == 1 and self.schedule.launched_at(self.core.state.step) is not None:
            return  # diloco synced at this very step
        for f in range(self.schedule.p):
            sync = Sync(self.syncs, f, self.core.state.step, self.core.state.step)
            tau, self.schedule.tau = self.schedule.tau, 0
            try:
                self._start(sync, self._launch(sync))
                self._apply(sync, self._finish(sync))
            finally:
                self.schedule.tau = tau

    def record(self) -> dict:
        """This island's figures for the step's metrics row (cumulative over the session)."""
        return {"island_syncs": self.syncs, "island_sent_bytes": self.sent_bytes,
                "island_wait_s": round(self.wait_s, 4)}

    def summary(self) -> dict:
        return {"islands": self.k, "algorithm": self.cfg.algorithm, "syncs": self.syncs,
                "params": sum(_local(p).numel() for p in self.params),
                "fragment_params": [sum(_local(p).numel() for p in f) for f in self.fragments],
                "sent_bytes": self.sent_bytes, "sync_wait_s": round(self.wait_s, 3)}

