"""The quality side of `stalwart bench inference --precisions ... --heldout FILE`: log-likelihood of a
held-out text through the engine's echo path and transformers' forward, and greedy agreement."""

from __future__ import annotations

import os

import torch

from collections.abc import Callable

from stalwart.config.serve import EngineConfig
from stalwart.infer.engine import Engine
from stalwart.infer.sampling import SamplingParams
from stalwart.models.llama import Transformer


def windows_of(path: str, tokenizer, width: int, count: int) -> list[list[int]]:
    """The held-out file's tokens in up to ``count`` windows of ``width`` tokens."""
    with open(path, encoding="utf-8") as f:
        ids = tokenizer.encode(f.read(), add_special_tokens=False).ids
    out = [ids[i:i + width] for i in range(0, len(ids) - width + 1, width)][:count]
    if not out:
        raise SystemExit(f"--heldout {path}: fewer than {width} tokens")
    return out


def engine_loglik(model: Transformer, windows: list[list[int]], cfg: EngineConfig) -> float:
    """The summed log-probability of every window's tokens after its first, through the engine's echo
    path (``prompt_logprobs`` 0 with ``max_tokens`` 0), all windows in flight at once."""
    engine = Engine(model, None, None, cfg)
    for i, w in enumerate(windows):
        engine.add(str(i), w, SamplingParams(max_tokens=0, prompt_logprobs=0))
    total = 0.0
    while engine.has_work():
        for o in engine.step():
            total += sum(c.logprob for c in o.prompt or [])
    return total


def hf_loglik(hf, windows: list[list[int]]) -> float:
    """The same log-likelihood from transformers' forward, window by window."""
    total = 0.0
    for w in windows:
        ids = torch.tensor([w], device=hf.device)
        logp = hf(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
        total += logp.gather(-1, ids[0, 1:, None]).sum().item()
    return total


def report_quality(path: str, count: int, tokenizer, engines: dict[str, Transformer], hfs: dict,
                   config: Callable[[Transformer, list[list[int]]], EngineConfig]) -> None:
    """Each system's log-likelihood of ``path``'s first ``count`` windows: ``engines`` (name -> model,
    through the engine, each sized by ``config(model, windows)``) and ``hfs`` (name -> transformers
    model); names end in the precision (``-fp32``, ``-bf16``, ``-int8``), each compared with its
    system's ``-fp32`` (or transformers')."""
    width = min(256, next(iter(engines.values())).args.max_seq_len)
    windows = windows_of(path, tokenizer, width, count)
    scored = sum(len(w) - 1 for w in windows)
    print(f"# held-out log-likelihood: {path}, {len(windows)} windows, {scored} tokens scored (nats; "
          "difference from the same system in float32)")
    got = {name: engine_loglik(m, windows, config(m, windows)) for name, m in engines.items()}
    got |= {name: hf_loglik(h, windows) for name, h in hfs.items()}
    for system, ll in got.items():
        ref = got.get(system.rsplit("-", 1)[0] + "-fp32") or got["transformers-fp32"]
        print(f"#   {system:<18} {ll:12.2f}  {ll / scored:8.4f} per token  {100 * (ll - ref) / abs(ref):+7.3f}%  "
              f"load {os.getloadavg()[0]:.2f}", flush=True)
