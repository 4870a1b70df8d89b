"""The generator actor: the inference engine behind a Monarch endpoint, with versioned weight updates.

``setup`` builds the policy model and the engine (``stalwart.infer.engine``) from the arguments the
controller sends; ``load(weights, version)`` installs a full state dict as weight version ``version``;
``generate(requests)`` answers whole groups, every response sampled with its own seed, so a group
generated again anywhere (its first generator died) is bitwise the same group: the engine pads every
forward pass (``engine.pad_rows``) so a request's tokens do not depend on its batch neighbours.

With ``exact`` log-probabilities, each finished group is re-scored by a plain copy of the model with
the trainer's forward on the trainer's micro-batch shape (one group, rows padded to one length): the
old log-probabilities the trainer reads are then the very numbers its own forward computes.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
from monarch.actor import Actor, endpoint


def _tensors(weights: dict[str, np.ndarray]):
    import torch

    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in weights.items()}


class GeneratorActor(Actor):
    def __init__(self) -> None:
        self.engine = None
        self.scorer = None
        self.reference = None
        self.busy_s = 0.0

    @endpoint
    def warm(self) -> int:
        import stalwart.infer.engine  # noqa: F401 - torch and the engine, before any failure needs a spare

        return os.getpid()

    @endpoint
    def setup(self, args: Any, tokenizer_json: str, engine_cfg: Any, sampling: dict[str, Any], exact: bool,
              row_length: int, pad: int) -> int:
        import torch
        from tokenizers import Tokenizer

        from stalwart.data.tokenizer import eos_id
        from stalwart.infer.engine import Engine
        from stalwart.models.llama import Transformer

        torch.set_num_threads(1)
        tok = Tokenizer.from_str(tokenizer_json)
        self.eos = eos_id(tok)
        self.engine = Engine(Transformer(args), tok, self.eos, engine_cfg, weight_version=-1)
        self.scorer = Transformer(args).eval() if exact else None
        self.sampling, self.row_length, self.pad = sampling, row_length, pad
        self.args = args
        return os.getpid()

    @endpoint
    def load(self, weights: dict[str, np.ndarray], version: int, reference: bool = False) -> dict[str, float]:
        """Install ``weights`` as version ``version`` (and as the frozen reference when ``reference``)."""
        from stalwart.infer.load import copy_full_state
        from stalwart.models.llama import Transformer

        t0 = time.perf_counter()
        state = _tensors(weights)
        self.engine.load_full_state(state, version)
        if self.scorer is not None:
            copy_full_state(self.scorer, state)
        if reference:
            self.reference = Transformer(self.args).eval()
            copy_full_state(self.reference, state)
        return {"load_s": time.perf_counter() - t0, "version": version}

    @endpoint
    def generate(self, requests: list[Any], prompts: list[list[int]]) -> dict[str, Any]:
        """Every request's group, generated with the current weights; plus timings."""
        from stalwart.infer.sampling import SamplingParams
        from stalwart.rl.rollout import Group

        t0 = time.perf_counter()
        eng = self.engine
        version = eng.weight_version
        s = self.sampling
        for req, prompt in zip(requests, prompts):
            for j, seed in enumerate(req.seeds):
                eng.add(f"{req.gid}#{j}", prompt, SamplingParams(max_tokens=s["max_tokens"], temperature=s["temperature"],
                                                                top_k=s["top_k"], seed=seed, logprobs=0))
        tokens: dict[str, list[int]] = {}
        logps: dict[str, list[float]] = {}
        while eng.has_work():
            for out in eng.step():
                for c in out.choices:
                    tokens.setdefault(out.rid, []).append(c.token)
                    logps.setdefault(out.rid, []).append(c.logprob)
        groups = []
        for req, prompt in zip(requests, prompts):
            ids = [f"{req.gid}#{j}" for j in range(len(req.seeds))]
            groups.append(Group(req, list(prompt), [tokens.get(i, []) for i in ids], [logps.get(i, []) for i in ids],
                                version))
        gen_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        if self.scorer is not None or self.reference is not None:
            for g in groups:
                self._rescore(g)
        rescore_s = time.perf_counter() - t1
        self.busy_s += gen_s + rescore_s
        return {"groups": groups, "gen_s": gen_s, "rescore_s": rescore_s, "version": version,
                "tokens": sum(len(r) for g in groups for r in g.responses), "pid": os.getpid()}

    def _rescore(self, g: Any) -> None:
        """The trainer's forward on the trainer's micro-batch (this group, padded rows): its log-probabilities
        replace the engine's (exact mode), and the reference's are attached (KL penalty)."""
        import torch

        from stalwart.rl.objective import token_logprobs
        from stalwart.rl.rollout import TOKEN, pack_group

        inputs, rows = pack_group(g, np.zeros(len(g.responses)), self.row_length, self.pad, 0.0, g.version, False)
        x = torch.from_numpy(inputs)
        tokens = torch.from_numpy(rows[..., TOKEN]).long()
        p = len(g.prompt)
        with torch.no_grad():
            if self.scorer is not None:
                lp = token_logprobs(self.scorer(x), tokens)
                g.logprobs = [lp[i, p - 1:p - 1 + len(r)].tolist() for i, r in enumerate(g.responses)]
            if self.reference is not None:
                ref = token_logprobs(self.reference(x), tokens)
                g.ref_logprobs = [ref[i, p - 1:p - 1 + len(r)].tolist() for i, r in enumerate(g.responses)]
