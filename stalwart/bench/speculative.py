"""`stalwart bench speculative`: speculative decoding (prompt lookup, or a draft model with
``--speculative draft --draft-model DIR``) against plain decoding, on a code workload, with a trained
run's weights.

The workload: windows of Python source (``--source``, default the standard library's ``json``,
``email`` and ``importlib`` packages) as prompts, continued (``--workload continue``) or written out
again after a comment (``--workload edit``, as when a model rewrites code it was given), greedily or
seeded at ``--temperature``, for ``--max-tokens`` tokens each. Each
configuration runs the same requests through the engine, one at a time (batch 1) and all at once,
interleaved repeat by repeat. Reported: seconds and output tokens/s (medians), engine steps, the
acceptance rate (drafts kept / drafts proposed), tokens emitted per sequence-step, the speed-up over
plain decoding, and whether greedy tokens are identical (they must be).
"""

from __future__ import annotations

import os
import statistics
import sysconfig
import time
from pathlib import Path

import torch

from stalwart.config.arguments import ArgumentParser, at_least
from stalwart.config.serve import EngineConfig
from stalwart.infer.engine import Engine
from stalwart.infer.load import Source, build_model, read_source
from stalwart.infer.sampling import SamplingParams
from stalwart.infer.speculative import load_draft_model
from stalwart.runtime.device import HOST

DEFAULT_SOURCES = ("json", "email", "importlib")


def code_prompts(tokenizer, sources: list[Path], n: int, length: int, workload: str) -> list[list[int]]:
    """``n`` prompts from the source files, in name order: 'continue', the first ``length`` tokens of a
    file; 'edit', those tokens, a comment line, and their first quarter again (the rest is to be
    written out once more, as when a model rewrites code it was given)."""
    files = sorted(f for s in sources for f in (s.rglob("*.py") if s.is_dir() else [s]))
    prompts = []
    for f in files:
        ids = tokenizer.encode(f.read_text(errors="replace")).ids
        if len(ids) >= length:
            code = ids[:length]
            if workload == "edit":
                code = code + tokenizer.encode("\n\n# The same code, again:\n").ids + code[:length // 4]
            prompts.append(code)
        if len(prompts) == n:
            break
    return prompts


def run_once(engine: Engine, prompts: list[list[int]], max_tokens: int, together: bool, temperature: float):
    out: dict[str, list[int]] = {}
    steps = 0
    t0 = time.perf_counter()

    def drain() -> None:
        nonlocal steps
        while engine.has_work():
            steps += 1
            for o in engine.step():
                out.setdefault(o.rid, []).extend(c.token for c in o.choices)

    for i, p in enumerate(prompts):
        engine.add(f"{i}", p, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i, ignore_eos=True))
        if not together:
            drain()
    drain()
    seconds = time.perf_counter() - t0
    return seconds, [out[f"{i}"] for i in range(len(prompts))], steps


def main(argv: list[str]) -> int:
    ap = ArgumentParser(prog="stalwart bench speculative", description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="a training run directory (its newest checkpoint)")
    ap.add_argument("--source", action="append", default=[],
                    help="Python files or directories the prompts come from (repeatable; default: stdlib "
                         f"{', '.join(DEFAULT_SOURCES)})")
    ap.add_argument("--requests", type=at_least(1), default=8)
    ap.add_argument("--prompt-tokens", type=at_least(1), default=192)
    ap.add_argument("--max-tokens", type=at_least(1), default=96)
    ap.add_argument("--tokens", type=at_least(1), action="append", default=[],
                    help="speculative_tokens to try (repeatable; default 2, 4, 8)")
    ap.add_argument("--speculative", choices=("ngram", "draft"), default="ngram",
                    help="how drafts are proposed: prompt lookup, or the --draft-model")
    ap.add_argument("--draft-model", default="",
                    help="the draft model's run directory (or checkpoint, or HF directory), same tokenizer")
    ap.add_argument("--draft-window", type=at_least(1), default=64, help="context tokens the draft reads each step")
    ap.add_argument("--ngram", type=at_least(1), default=3)
    ap.add_argument("--repeats", type=at_least(1), default=3)
    ap.add_argument("--threads", type=at_least(1), default=1)
    ap.add_argument("--workload", choices=("continue", "edit"), default="continue",
                    help="continue a file's start, or write out again code the prompt holds (see code_prompts)")
    ap.add_argument("--temperature", type=at_least(0.0, float), default=0.0, help="0 = greedy; else seeded sampling")
    args = ap.parse_args(argv)
    if (args.speculative == "draft") != bool(args.draft_model):
        ap.error("--speculative draft and --draft-model go together")
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    loaded = read_source(Source(run=Path(args.run)))
    model = build_model(loaded, torch.float32, HOST)
    draft = (load_draft_model(args.draft_model, loaded.args.vocab_size, loaded.tokenizer, torch.float32, HOST)
             if args.speculative == "draft" else None)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = [Path(s) for s in args.source] or [stdlib / s for s in DEFAULT_SOURCES]
    prompts = code_prompts(loaded.tokenizer, sources, args.requests, args.prompt_tokens, args.workload)
    room = loaded.args.max_seq_len - max((len(p) for p in prompts), default=args.prompt_tokens)
    if room < 1:
        ap.error(f"--prompt-tokens {args.prompt_tokens} leaves no room in the model's context of "
                 f"{loaded.args.max_seq_len} tokens; pass fewer")
    if len(prompts) < args.requests:
        ap.error(f"--source has {len(prompts)} files of at least {args.prompt_tokens} tokens; "
                 f"--requests {args.requests} needs more")
    max_tokens = min(args.max_tokens, room)
    print(f"model: {loaded.origin} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, vocab "
          f"{loaded.args.vocab_size}); {len(prompts)} code prompts ({args.workload}, {args.prompt_tokens} tokens of code), "
          f"{'greedy' if args.temperature <= 0 else f'temperature {args.temperature:g}'}, "
          f"{max_tokens} tokens each; {args.threads} thread(s); load average {os.getloadavg()[0]:.1f}")
    if draft is not None:
        print(f"draft: {args.draft_model} ({sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M params), "
              f"window {args.draft_window} tokens")
    configs = [("off", 0)] + [(args.speculative, k) for k in (args.tokens or [2, 4, 8])]
    kv_mb = 64.0
    for together in (False, True):
        label = "batch 1" if not together else f"batch {len(prompts)}"
        seconds: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
        result = {}
        for _ in range(args.repeats):
            for mode, k in configs:
                cfg = EngineConfig(kv_cache_mb=kv_mb, speculative=mode, speculative_tokens=max(k, 1),
                                   speculative_ngram=args.ngram, prefix_caching=False,
                                   draft_model=args.draft_model if mode == "draft" else "",
                                   draft_window=args.draft_window)
                engine = Engine(model, loaded.tokenizer, loaded.eos_id, cfg, draft=draft)
                s, tokens, steps = run_once(engine, prompts, max_tokens, together, args.temperature)
                seconds[(mode, k)].append(s)
                result[(mode, k)] = (tokens, steps, engine.stats())
        base = statistics.median(seconds[("off", 0)])
        plain_tokens = result[("off", 0)][0]
        total = sum(len(t) for t in plain_tokens)
        print(f"\n{label}: {total} output tokens per run, medians of {args.repeats}; load average "
              f"{os.getloadavg()[0]:.1f}")
        print(f"  {'mode':<10} {'seconds':>8} {'tok/s':>8} {'steps':>6} {'accept':>7} {'tok/seq-step':>12} "
              f"{'speed-up':>8}  identical")
        for mode, k in configs:
            s = statistics.median(seconds[(mode, k)])
            tokens, steps, stats = result[(mode, k)]
            proposed, accepted = stats.get("speculative_proposed", 0), stats.get("speculative_accepted", 0)
            rate = f"{accepted / proposed:.1%}" if proposed else "-"
            seq_steps = sum(len(t) for t in tokens) - accepted  # one per forward pass a sequence took part in
            name = "off" if mode == "off" else f"{mode} k={k}"
            same = tokens == plain_tokens if args.temperature <= 0 else "-"  # sampling: same law, other draws
            print(f"  {name:<10} {s:8.2f} {total / s:8.1f} {steps:6d} {rate:>7} "
                  f"{sum(len(t) for t in tokens) / seq_steps:12.2f} {base / s:7.2f}x  {same}")
    return 0
