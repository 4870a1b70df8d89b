"""`stalwart bench inference`: the engine against Hugging Face `transformers`, side by side.

All systems run the same weights (the engine on Stalwart's model, transformers on the exported Llama)
on the same request sets, interleaved repeat by repeat, in this process:
- batch 1: one request;
- batch 32: 32 equal requests at once;
- mixed: 32 requests with prompt and output lengths drawn from a seeded range, all arriving at t=0.
The peers: `transformers` is `generate` on static batches in arrival order (on the mixed trace each batch
runs to its longest output); `transformers-cb` is transformers' own continuous batching
(`init_continuous_batching`, the engine behind `generate_batch`, one manager per model kept running),
where the installed version has it.
Each system is warmed up once per model before anything is timed (the warm-up's seconds are printed).
The engine's KV cache is sized to hold the whole workload, as transformers' caches are.
Reported per run: output tokens/s, time to first token and time per output token (p50, p99), the load
average when it ran; then each repeat's throughput ratio over every peer.

Precisions (``--precisions float32,bfloat16,int8``): each is an engine system of its own
(``stalwart-bf16``: the weights and activations in bfloat16; ``stalwart-int8``: ``engine.quantize =
int8``, infer/quant.py), and transformers runs in float32 (``transformers``) and, when bfloat16 or int8 is
asked for, in bfloat16 (``transformers-bf16``). Every engine is compared with every peer.
Quality (``--heldout FILE``): the log-likelihood of the file's tokens, in windows of the context, through
the engine's echo path (``prompt_logprobs``, ``max_tokens`` 0: what the server runs for lm-evaluation-harness's
``echo=True, max_tokens=0`` requests) in each precision, transformers' in its precisions, each one's
difference from float32's, and each engine's greedy agreement with float32's (the share of greedy output
tokens equal to float32's, position by position, over the workloads run). ``--weights`` serves a
trained model (a run directory, one of its checkpoints, or a Hugging Face directory) instead of the
flavors' random initialisations, which make a log-likelihood meaningless.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import time
import typing
from copy import deepcopy
from dataclasses import dataclass

import torch

from stalwart.bench.quality import report_quality
from stalwart.config.arguments import ArgumentParser, at_least, listed, one_of
from stalwart.config.serve import EngineConfig
from stalwart.export.hf import hf_config, to_hf_state
from stalwart.infer.attention import decode_mode
from stalwart.infer.engine import Engine
from stalwart.infer.sampling import SamplingParams
from stalwart.models.flavors import FLAVORS
from stalwart.models.llama import Transformer
from stalwart.runtime.device import DEVICES, HOST, accelerator_name, resolve_device, synchronize


@dataclass
class Req:
    prompt: list[int]
    out: int


@dataclass
class Result:
    seconds: float
    tokens: int
    ttft: list[float]
    tpot: list[float]
    outputs: list[list[int]] = dataclasses.field(default_factory=list)  # each request's tokens (the engine's)


WORKLOADS = ("batch 1", "batch 32", "mixed")
PEERS = ("transformers", "transformers-cb")
PRECISIONS = ("float32", "bfloat16", "int8")
SHORT = {"float32": "fp32", "bfloat16": "bf16", "int8": "int8"}


def flavor_vocab(text: str) -> tuple[str, int]:
    """``--flavors``' item: FLAVOR:VOCAB (a model flavor and its vocabulary size)."""
    flavor, sep, vocab = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError("expected FLAVOR:VOCAB, e.g. tiny:1024")
    return one_of(FLAVORS)(flavor), at_least(2)(vocab)


def workloads(vocab: int, seed: int = 0, context: int = 1024) -> dict[str, list[Req]]:
    """The request sets; the mixed trace's prompts stay within a ``context`` of fewer than 512 tokens."""
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    return {"batch 1": [Req(prompt(64), 64)], "batch 32": [Req(prompt(64), 64) for _ in range(32)],
            "mixed": [Req(prompt(rng.randint(8, min(384, context - 128))), rng.randint(8, 128)) for _ in range(32)]}


def engine_config(model: Transformer, reqs: list[Req], base: EngineConfig) -> EngineConfig:
    """``base`` with a KV cache that holds every request of ``reqs`` at once, as transformers' caches do
    (the default 256 MiB would preempt the 125M model's batch of 32)."""
    a = model.args
    per_token = 2 * a.n_layers * a.n_kv_heads * a.head_dim * next(model.parameters()).element_size()
    blocks = sum(-(-(len(r.prompt) + r.out) // base.block_size) for r in reqs) + 2
    return dataclasses.replace(base, kv_cache_mb=blocks * base.block_size * per_token / 2**20)


def timings(start: float, stamps: dict[str, list[float]], seconds: float) -> Result:
    """A run's figures from each request's token times (seconds after ``start``)."""
    ttft = [t[0] - start for t in stamps.values() if t]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in stamps.values() if len(t) > 1]
    return Result(seconds, sum(len(t) for t in stamps.values()), ttft, tpot)


def run_engine(model: Transformer, reqs: list[Req], cfg: EngineConfig) -> Result:
    engine = Engine(model, None, None, cfg)
    device = engine.device
    start = time.perf_counter()
    for i, r in enumerate(reqs):
        engine.add(str(i), r.prompt, SamplingParams(max_tokens=r.out, temperature=0.0, ignore_eos=True))
    stamps: dict[str, list[float]] = {str(i): [] for i in range(len(reqs))}
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(reqs))}
    while engine.has_work():
        outs = engine.step()
        synchronize(device)
        now = time.perf_counter()
        for o in outs:
            stamps[o.rid] += [now] * len(o.choices)
            tokens[o.rid] += [c.token for c in o.choices]
    result = timings(start, stamps, time.perf_counter() - start)
    result.outputs = [tokens[str(i)] for i in range(len(reqs))]
    return result


class _Clock:
    """A logits processor that only records when each decoding step of a batch happened (once the
    device has finished it)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        synchronize(self.device)
        self.times.append(time.perf_counter())
        return scores


def run_hf(hf, reqs: list[Req], batch: int) -> Result:
    from transformers import LogitsProcessorList

    device = hf.device
    start = time.perf_counter()
    stamps: dict[str, list[float]] = {}
    for b in range(0, len(reqs), batch):
        group = reqs[b:b + batch]
        width = max(len(r.prompt) for r in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(group):  # left padding, as decoder-only generation needs
            ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[i, width - len(r.prompt):] = 1
        clock = _Clock(device)
        steps = max(r.out for r in group)
        hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=steps,
                    min_new_tokens=steps, do_sample=False, logits_processor=LogitsProcessorList([clock]),
                    pad_token_id=0, eos_token_id=None)
        for i, r in enumerate(group):
            stamps[str(b + i)] = clock.times[:r.out]
    return timings(start, stamps, time.perf_counter() - start)


def has_continuous_batching(hf) -> bool:
    return hasattr(hf, "init_continuous_batching")


class HfContinuous:
    """transformers' continuous batching: one manager per model, started and warmed up once (its cache
    is set up on its own thread when started), sized for the largest of ``sizing``'s requests; each
    ``run`` queues every request at t=0 with its own output length."""

    def __init__(self, hf, sizing: list[Req]) -> None:
        from transformers import GenerationConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints

        gen = GenerationConfig(max_new_tokens=max(r.out for r in sizing), do_sample=False, eos_token_id=-1,
                               pad_token_id=0)
        hints = WorkloadHints(max(len(r.prompt) for r in sizing), max(r.out for r in sizing), len(sizing))
        self.manager = hf.init_continuous_batching(generation_config=gen, workload_hints=hints)
        self.manager.start()
        self.runs = 0
        self.run([Req(sizing[0].prompt[:8], 1)])

    def run(self, reqs: list[Req]) -> Result:
        m, tag = self.manager, f"r{self.runs}-"
        self.runs += 1
        start = time.perf_counter()
        for i, r in enumerate(reqs):
            m.add_request(r.prompt, f"{tag}{i}", max_new_tokens=r.out, record_timestamps=True, eos_token_id=-1)
        stamps: dict[str, list[float]] = {}
        while len(stamps) < len(reqs):
            out = m.get_result(timeout=1)
            if out is None and not m.is_running():
                raise RuntimeError("transformers' continuous batching stopped before finishing")
            if out is not None and out.is_finished():
                stamps[out.request_id] = list(out.timestamps)
        return timings(start, stamps, time.perf_counter() - start)

    def close(self) -> None:
        self.manager.stop(block=True, timeout=60)
        self.manager.destroy()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def build(flavor: str, vocab: int, seed: int = 0):
    args = dataclasses.replace(FLAVORS[flavor], vocab_size=vocab, max_seq_len=1024)
    torch.manual_seed(seed)
    model = Transformer(args).eval()
    return model, hf_peer(model)


def hf_peer(model: Transformer):
    """transformers' Llama with ``model``'s weights (float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    args = model.args
    cfg = LlamaConfig(**{k: v for k, v in hf_config(args, None).items() if k not in ("architectures",)})
    hf = LlamaForCausalLM(cfg).eval()
    state = to_hf_state(model.state_dict(), args)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    return hf


def in_precision(model: Transformer, precision: str) -> Transformer:
    """A copy of ``model`` served in ``precision`` (``PRECISIONS``)."""
    from stalwart.infer.quant import apply_quantization

    copy = deepcopy(model)
    if precision == "bfloat16":
        return copy.to(torch.bfloat16)
    return apply_quantization(copy, "int8" if precision == "int8" else "none")


def agreement(got: list[list[int]], want: list[list[int]]) -> tuple[int, float]:
    """Greedy agreement: outputs identical, and the share of tokens before each output's first difference."""
    same = sum(g == w for g, w in zip(got, want))
    lead = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) for g, w in zip(got, want)]
    return same, sum(lead) / max(1, sum(len(w) for w in want))


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="stalwart bench inference", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavors", type=listed(flavor_vocab), default="tiny:1024,125M:32768",
                   help="flavor:vocab pairs, comma separated")
    p.add_argument("--repeats", type=at_least(1), default=3)
    p.add_argument("--workloads", type=listed(one_of(WORKLOADS)), default=",".join(WORKLOADS))
    p.add_argument("--peers", type=listed(one_of(PEERS), empty=True), default=",".join(PEERS),
                   help="systems compared with stalwart, comma separated (transformers-cb: transformers' "
                        "continuous batching, skipped where the installed version lacks it)")
    p.add_argument("--hf-batch", type=at_least(1), default=32,
                   help="static batch size of transformers on the mixed trace")
    p.add_argument("--max-batch-tokens", type=at_least(EngineConfig().max_seqs), default=8192,
                   help="the engine's token budget per forward pass (engine.max_batch_tokens; serve's default is "
                        "512). 8192 takes every prompt of these workloads in the first step, as transformers' "
                        "static batch does; a smaller budget prefills in chunks between decode steps, which "
                        "raises the last prompts' time to first token and the first ones' time per token; at "
                        "least the engine's max_seqs, so every running sequence decodes each step")
    p.add_argument("--device", default="auto", choices=DEVICES, help="where all run (auto = cuda if available)")
    modes = typing.get_args(typing.get_type_hints(EngineConfig)["decode_attention"])
    p.add_argument("--decode-attention", type=listed(one_of(modes)), default="auto",
                   help=f"engine.decode_attention, or several comma separated ({', '.join(modes)}): each runs as "
                        "its own system (stalwart-<mode>), interleaved with the others, and the later ones' "
                        "throughput ratios over the first are printed too")
    p.add_argument("--precisions", type=listed(one_of(PRECISIONS)), default="float32",
                   help="the engine's precisions, each a system (stalwart-fp32, -bf16, -int8); transformers runs in "
                        "float32 and, with bfloat16 or int8, in bfloat16 too (transformers-bf16)")
    p.add_argument("--weights", default=None, help="a trained model instead of --flavors' random ones: a run "
                   "directory, one of its checkpoints, or a Hugging Face directory")
    p.add_argument("--heldout", default=None, help="a text file (with --weights): its log-likelihood per precision")
    p.add_argument("--heldout-windows", type=at_least(1), default=16, help="windows of the context's length read")
    a = p.parse_args(argv)
    device = resolve_device(a.device)
    chosen, precisions = a.decode_attention, a.precisions
    for flag, values in (("--decode-attention", chosen), ("--precisions", precisions)):
        if len(set(values)) < len(values):
            p.error(f"{flag} {','.join(values)}: give each value once")
    if a.heldout and not a.weights:
        p.error("--heldout needs --weights: a random model's log-likelihood means nothing")
    if "int8" in precisions and device.type != HOST.type:
        p.error("--precisions int8 runs on the CPU (engine.quantize)")
    torch.set_grad_enabled(False)
    base = EngineConfig(max_batch_tokens=a.max_batch_tokens)
    engines = {}  # system -> (precision, engine config)
    for prec in precisions:
        for m in chosen:
            parts = ["stalwart"] + ([SHORT[prec]] if precisions != ["float32"] else []) + ([m] if len(chosen) > 1 else [])
            engines["-".join(parts)] = (prec, dataclasses.replace(base, decode_attention=m))
    hf_precisions = ["float32"] + (["bfloat16"] if {"bfloat16", "int8"} & set(precisions) else [])
    where = accelerator_name(device) or f"{device.type}, {torch.get_num_threads()} thread(s)"
    print(f"# torch {torch.__version__}, {where}; greedy; precisions {', '.join(precisions)}; engine.max_batch_tokens "
          f"{base.max_batch_tokens}; engine.decode_attention "
          + ", ".join(f"{m} ({decode_mode(m, base.pad_rows, device)})" for m in chosen))
    print(f"{'model':<8} {'workload':<9} {'rep':>3} {'system':<16} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'TPOT p50':>9} {'TPOT p99':>9}  {'load':>5}   (times in ms; load: 1-minute load average)")
    for flavor, vocab, model, hf, tokenizer in models(a):
        model, hf = model.to(device), hf.to(device)
        loads = workloads(model.args.vocab_size, context=model.args.max_seq_len)
        hfs = {"float32": hf} | ({"bfloat16": deepcopy(hf).to(torch.bfloat16)} if "bfloat16" in hf_precisions else {})
        variants = {prec: in_precision(model, prec) for prec in precisions}
        peers = [s for s in a.peers if s != "transformers-cb" or has_continuous_batching(hf)]
        if "transformers-cb" in a.peers and "transformers-cb" not in peers:
            print("# transformers-cb skipped: this transformers has no continuous batching")
        peers += [f"transformers-{SHORT[q]}" for q in hf_precisions[1:] if "transformers" in a.peers]
        cb: HfContinuous | None = None
        runners = {name: (lambda reqs, _, prec=prec, cfg=cfg: run_engine(variants[prec], reqs,
                                                                        engine_config(variants[prec], reqs, cfg)))
                   for name, (prec, cfg) in engines.items()}
        runners |= {f"transformers{'' if q == 'float32' else '-' + SHORT[q]}":
                    (lambda reqs, name, h=hfs[q]: run_hf(h, reqs, a.hf_batch if name == "mixed" else len(reqs)))
                    for q in hf_precisions}
        runners["transformers-cb"] = lambda reqs, name: cb.run(reqs)
        if a.heldout:
            report_quality(a.heldout, a.heldout_windows, tokenizer,
                           {f"stalwart-{SHORT[p]}": m for p, m in variants.items()},
                           {f"transformers-{SHORT[q]}": h for q, h in hfs.items()},
                           lambda m, windows: engine_config(m, [Req(w, 0) for w in windows], base))
        warm = loads["mixed"][:2]
        systems = [*engines, *peers]
        for system in systems:
            t = time.perf_counter()
            if system == "transformers-cb":
                cb = HfContinuous(hf, [r for reqs in loads.values() for r in reqs])
            runners[system](warm, "mixed")
            print(f"# {flavor} {system} warm-up: {time.perf_counter() - t:.1f} s", flush=True)
        for name in a.workloads:
            reqs = loads[name]
            # (engine, peer): every engine over every peer, and every later engine over the first
            compared = [(e, p) for e in engines for p in peers] + [(e, [*engines][0]) for e in [*engines][1:]]
            ratios: dict[tuple[str, str], list[float]] = {c: [] for c in compared}
            agreed: dict[str, list[tuple[int, float]]] = {e: [] for e in engines}
            for rep in range(a.repeats):
                pair = {}
                for system in systems:
                    load = os.getloadavg()[0]
                    r = pair[system] = runners[system](reqs, name)
                    print(f"{flavor:<8} {name:<9} {rep:>3} {system:<16} {r.tokens / r.seconds:8.1f} "
                          f"{1e3 * pct(r.ttft, .5):9.1f} {1e3 * pct(r.ttft, .99):9.1f} {1e3 * pct(r.tpot, .5):9.1f} "
                          f"{1e3 * pct(r.tpot, .99):9.1f}  {load:5.2f}", flush=True)
                for e, peer in compared:
                    s, h = pair[e], pair[peer]
                    ratios[e, peer].append((h.seconds / s.seconds) * (s.tokens / h.tokens))
                reference = next((e for e, (prec, _) in engines.items() if prec == "float32"), None)
                for e in engines:
                    if reference is not None and e != reference:
                        agreed[e].append(agreement(pair[e].outputs, pair[reference].outputs))
            for e, peer in compared:
                print(f"{flavor:<8} {name:<9} throughput ratio {e}/{peer} per repeat: "
                      + ", ".join(f"{x:.2f}x" for x in ratios[e, peer]), flush=True)
            for e, got in agreed.items():
                if got:
                    print(f"{flavor:<8} {name:<9} greedy agreement {e} with float32 per repeat: " + ", ".join(
                        f"{same}/{len(reqs)} outputs identical, {100 * lead:.1f}% of tokens before the first "
                        "difference" for same, lead in got), flush=True)
        if cb is not None:
            cb.close()
    return 0


def models(a):
    """(label, vocab, model, transformers peer, tokenizer or None) per model benchmarked."""
    if a.weights is None:
        for flavor, vocab in a.flavors:
            model, hf = build(flavor, vocab)
            yield flavor, vocab, model, hf, None
        return
    from stalwart.infer.load import build_model, read_source, source_from

    loaded = read_source(source_from(a.weights))
    model = build_model(loaded, torch.float32, HOST)
    yield loaded.origin.name[:8], loaded.args.vocab_size, model, hf_peer(model), loaded.tokenizer
