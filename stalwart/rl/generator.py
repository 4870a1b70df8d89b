"""The generator actor: the inference engine behind a Monarch endpoint, with versioned weight updates.

``setup`` builds the policy model and the engine (``stalwart.infer.engine``) on the device the runtime
gives this generator; ``link`` joins this generator's weight link to the trainer ranks and
``receive_weights(version)`` takes a sync over it (``comm.weight_sync``: each trainer rank's own
shards, assembled here into full tensors) and installs it between engine calls as weight version
``version`` (``Engine.load_full_state``), or as the frozen KL reference when the sync is flagged so.
A sync that is not newer than the installed version is refused; one that fails (a trainer lost
mid-sync) installs nothing and drops the link, so the trainers still sending fail at once instead
of waiting. ``generate(requests)`` answers whole groups, every response sampled with its own seed,
so a group generated again anywhere (its first generator died) is bitwise the same group: the engine
pads every forward pass (``engine.pad_rows``) so a request's tokens do not depend on its batch
neighbours.

With ``exact`` log-probabilities, each finished group is re-scored by a plain copy of the model with
the trainer's forward on the trainer's micro-batch shape (one group, rows padded to one length): the
old log-probabilities the trainer reads are then the very numbers its own forward computes.

A generator of several processes (``workers.generator_tp``, a gang: ``controller/gang.py``) splits its
engine tensor-parallel the way ``stalwart serve --tp`` does (``infer/load.layout_model``, ``Engine`` over
``infer/group.StepLink``): the processes form their own process group (``runtime.group.join_attempt``
under a scope per generator), member 0 schedules and samples and the others run each step it sends
(``infer/group.follow``) until it says stop at the end of the call. Each member is a receiver of the
generator's weight link and takes only its own shards, except member 0 where it keeps the re-scoring
copy (exact mode) or the reference, which take the full tensors; the members agree before any installs
(``Engine.update_weights``), so a sync that failed anywhere leaves every member's weights as they were.

With routing replay (``sampling["record_routing"]``, a mixture-of-experts policy) the engine records
every token's experts and each trained group carries them (``Group.routing``, ``rl/routing.py``); the
re-scoring copy replays them, as the trainer does. In exact mode the reply also measures how far the
sampler's own log-probabilities are from the re-scored ones (``sampler_gap``).
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from monarch.actor import Actor, endpoint


@dataclass(frozen=True)
class Member:
    """A process's place in a generator of several (``workers.generator_tp``): its tensor-parallel rank,
    and where and how its members form their process group (attempt ``attempt`` under the generator's scope
    of the controller's store)."""
    member: int
    width: int
    store_port: int
    attempt: int
    setup_s: float
    timeout_s: float  # a follower waits this long for member 0's next step (a generation call's bound)


class GeneratorActor(Actor):
    def __init__(self) -> None:
        self.engine = None
        self.scorer = None
        self.reference = None
        self.link_ = None  # comm.weight_sync.Link to the trainer ranks
        self.busy_s = 0.0
        self.member, self.width = 0, 1

    @endpoint
    def warm(self) -> int:
        import stalwart.infer.engine  # noqa: F401 - torch and the engine, before any failure needs a spare

        return os.getpid()

    @endpoint
    def setup(self, args: Any, tokenizer_json: str, engine_cfg: Any, sampling: dict[str, Any], exact: bool,
              row_length: int, pad: int, device: str, episode: Any, index: int,
              place: Member | None = None) -> dict[str, Any]:
        """The engine (and the re-scoring copy) of generator ``index``, on the device of its accelerator
        process; with ``place`` this process is one member of the generator (its engine split over them);
        with ``episode`` (``rl.episode.EpisodeSpec``, several turns) the visible tests' sandbox."""
        import torch
        from tokenizers import Tokenizer

        from stalwart.data.tokenizer import eos_id
        from stalwart.infer.engine import Engine
        from stalwart.infer.load import layout_model
        from stalwart.models.llama import Transformer
        from stalwart.runtime.placement import shared_device

        torch.set_num_threads(1)
        self.member, self.width = (0, 1) if place is None else (place.member, place.width)
        self.device = shared_device(device, index * self.width + self.member, "--device")
        tp_mesh = step_link = None
        if self.width > 1:
            from stalwart.infer.group import StepLink
            from stalwart.runtime.group import device_mesh, join_attempt

            join_attempt(place.member, place.width, place.store_port, place.attempt, self.device, place.timeout_s,
                         place.setup_s, scope=f"generator-{index}/")
            tp_mesh, step_link = device_mesh(self.device, (self.width,), ("tp",)), StepLink()
        tok = Tokenizer.from_str(tokenizer_json)
        self.eos = eos_id(tok)
        # The engine computes in engine.dtype (its weights cast as they arrive); the trainers and the exact
        # re-scoring copy in float32.
        policy = layout_model(args, self.device, tp_mesh).to(getattr(torch, engine_cfg.dtype))
        self.engine = Engine(policy, tok, self.eos, engine_cfg, tp_size=self.width, link=step_link, weight_version=-1,
                             record_routing=bool(sampling.get("record_routing")))
        self.scorer = Transformer(args).to(self.device).eval() if exact and self.member == 0 else None
        self.reference = None
        self.sampling, self.row_length, self.pad = sampling, row_length, pad
        self.turns = 1 if episode is None else episode.turns
        if episode is not None:
            from stalwart.rl.episode import VisibleTests

            self.tests = VisibleTests(episode, tok, self.eos)
        else:
            self.tests = None
        self.args = args
        return {"pid": os.getpid(), "device": str(self.device)}

    @endpoint
    def link(self, generator: int, attempt: int, trainers: int, generators: int, store_port: int, setup_s: float,
             timeout_s: float) -> dict[str, Any]:
        """Join this generator's weight link (attempt ``attempt``) with the ``trainers`` trainer ranks, as
        its group rank ``trainers + member``, telling them what this process takes: its own shards, or
        the full tensors where it keeps a plain copy (the re-scoring copy, the reference: member 0)."""
        from stalwart.comm.weight_sync import Want, boxes_of
        from stalwart.rl.links import open_link

        self.link_ = None  # an earlier link is dropped: its connections close
        whole = self.width == 1 or self.scorer is not None
        want = Want(None if whole else boxes_of(self.engine.model.state_dict()), reference=self.member == 0)
        try:
            self.link_ = open_link(store_port, generator, attempt, trainers + self.member, trainers, generators,
                                   self.device, setup_s, timeout_s, self.width, want)
        except (RuntimeError, OSError) as e:  # given up by the controller, or a member lost while connecting
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}
        return {"ok": True, "generator": generator, "attempt": attempt}

    @endpoint
    def receive_weights(self, version: int, reference: bool = False) -> dict[str, Any]:
        """Take the trainers' sync of ``version`` and install it (as the frozen reference when
        ``reference``: member 0's alone). Never raises for a failed transfer: the reply says so (``ok``
        false) and the old weights stay (on every member: they agree first); the link is dropped and must
        be joined again."""
        from stalwart.comm.weight_sync import WeightSyncError, receive_weights
        from stalwart.errors import UserError
        from stalwart.infer.load import copy_full_state
        from stalwart.models.llama import Transformer

        t0 = time.perf_counter()
        if reference and self.member > 0:  # the plain reference copy is member 0's; nothing was sent here
            return {"ok": True, "version": self.engine.weight_version, "recv_s": 0.0, "load_s": 0.0, "bytes": 0}
        state, failed = None, None
        try:
            if self.link_ is None:
                raise WeightSyncError("no weight link")
            state = receive_weights(self.link_, version, reference, self.engine.weight_version, into=self.device)
        except (WeightSyncError, RuntimeError) as e:
            # Kept as a message: the exception's traceback would hold the frames that hold the link, and
            # with them its connections, which must close now so that the senders fail instead of waiting.
            failed = f"{type(e).__name__}: {e}"
        except BaseException:  # anything else: the link is dropped all the same (the senders fail at once)
            self.link_ = None
            raise
        recv_s = time.perf_counter() - t0
        if reference:
            if failed is None:
                self.reference = Transformer(self.args).to(self.device).eval()
                copy_full_state(self.reference, state)
        else:
            def read() -> dict[str, Any]:
                if failed is not None:
                    raise WeightSyncError(failed)
                return state

            try:  # the members agree first: a sync that failed on one installs on none
                self.engine.update_weights(read, version)
            except (WeightSyncError, RuntimeError, UserError) as e:
                failed = failed or f"{type(e).__name__}: {e}"
            if failed is None and self.scorer is not None:
                copy_full_state(self.scorer, state)
        if failed is not None:
            self.link_ = None
            gc.collect()  # whatever else still holds the link: its connections close now, not later
            return {"ok": False, "error": failed, "version": self.engine.weight_version}
        return {"ok": True, "version": self.engine.weight_version, "recv_s": recv_s,
                "load_s": time.perf_counter() - t0 - recv_s, "bytes": sum(t.numel() * t.element_size()
                                                                          for t in state.values())}

    @endpoint
    def load_reference(self, run: str) -> dict[str, Any]:
        """The frozen reference from the policy directory the trainers wrote at the start (a generator
        that joins after the reference sync). Every member reads it (reading a run checkpoint is a
        collective over their group); member 0 keeps it."""
        from stalwart.infer.load import Source, copy_full_state, read_source
        from stalwart.models.llama import Transformer

        t0 = time.perf_counter()
        state = read_source(Source(run=Path(run))).state
        if self.member == 0:
            self.reference = Transformer(self.args).to(self.device).eval()
            copy_full_state(self.reference, state)
        return {"load_s": time.perf_counter() - t0}

    @endpoint
    def generate(self, requests: list[Any], prompts: list[list[int]]) -> dict[str, Any]:
        """Every request's group of episodes (``rl/episode.py``), generated with the current weights; plus
        timings. A follower (member > 0) runs the steps member 0 sends until it says stop."""
        from stalwart.rl.episode import run_episodes

        t0 = time.perf_counter()
        if self.member > 0:
            from stalwart.infer.group import follow

            follow(self.engine, self.engine.link, _no_load)
            return {"pid": os.getpid(), "gen_s": time.perf_counter() - t0}
        version = self.engine.weight_version
        try:
            groups, episodes = run_episodes(self.engine, requests, prompts, self.sampling, version, self.tests,
                                            self.turns)
        finally:
            if self.engine.link is not None:  # the followers' call ends here (re-scoring is member 0's)
                self.engine.link.send_stop()
        if self.engine.routes is not None:
            self._attach_routing(groups)
        gen_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        gap = [0.0, 0.0, 0]  # sampler vs re-scored log-probabilities: sum, max, tokens
        if self.scorer is not None or self.reference is not None:
            for g in groups:
                self._rescore(g, gap)
        rescore_s = time.perf_counter() - t1
        self.busy_s += gen_s + rescore_s
        extra = {"sampler_gap": gap} if self.scorer is not None else {}
        return {"groups": groups, "gen_s": gen_s, "rescore_s": rescore_s, "version": version, **extra,
                "tokens": sum(g.policy_tokens() for g in groups), "pid": os.getpid(), **episodes}

    def _attach_routing(self, groups: list[Any]) -> None:
        """Each trained group's recorded experts, per response (``Group.routing``): those of the request
        that produced the response's last tokens (in a multi-turn episode, the last turn's request, whose
        prompt holds the turns before it). Evaluation groups (step < 0) carry none."""
        routed, self.engine.routed = self.engine.routed, {}
        for g in groups:
            if g.request.step < 0:
                continue
            g.routing = []
            for j, resp in enumerate(g.responses):
                base = f"{g.gid}#{j}"
                rids = [rid for rid in routed if rid == base or rid.startswith(base + "@")]
                rec = max((routed[rid] for rid in rids), key=len).numpy()
                if len(rec) != len(g.prompt) + len(resp) - 1:
                    raise RuntimeError(f"response {base}: experts recorded for {len(rec)} positions, "
                                       f"{len(g.prompt) + len(resp) - 1} fed")
                g.routing.append(rec)

    def _rescore(self, g: Any, gap: list) -> None:
        """The trainer's forward on the trainer's micro-batch (this group, padded rows; replaying the
        recorded experts where the group has them): its log-probabilities replace the engine's (exact
        mode), and the reference's are attached (KL penalty). ``gap`` sums how far the engine's were."""
        import torch

        from stalwart.models.moe import Routing
        from stalwart.rl import routing
        from stalwart.rl.objective import token_logprobs
        from stalwart.rl.rollout import TOKEN, pack_group

        inputs, rows = pack_group(g, np.zeros(len(g.responses)), self.row_length, self.pad, 0.0, g.version, False)
        x = torch.from_numpy(inputs).to(self.device)
        tokens = torch.from_numpy(rows[..., TOKEN]).long().to(self.device)
        replay = None if g.routing is None else Routing(torch.from_numpy(routing.pack(g.routing, self.row_length)))
        p = len(g.prompt)
        with torch.no_grad():
            if self.scorer is not None:
                lp = token_logprobs(self.scorer(x, routing=replay), tokens)
                scored = [lp[i, p - 1:p - 1 + len(r)].tolist() for i, r in enumerate(g.responses)]
                for i, (was, now) in enumerate(zip(g.logprobs, scored)):
                    d = [abs(a - b) for a, b, m in zip(was, now, g.mask(i)) if m]
                    gap[0], gap[1], gap[2] = gap[0] + sum(d), max([gap[1], *d]), gap[2] + len(d)
                g.logprobs = scored
            if self.reference is not None:
                ref = token_logprobs(self.reference(x), tokens)
                g.ref_logprobs = [ref[i, p - 1:p - 1 + len(r)].tolist() for i, r in enumerate(g.responses)]


def _no_load(where: str) -> dict:
    raise RuntimeError(f"an RL generator takes its weights from its weight link, not from {where}")
