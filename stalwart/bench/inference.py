"""`stalwart bench inference`: the engine against Hugging Face `transformers` generate, side by side.

Both run the same weights (the engine on Stalwart's model, transformers on the exported Llama) on the
same request sets, interleaved repeat by repeat, in this process:
- batch 1: one request;
- batch 32: 32 equal requests at once;
- mixed: 32 requests with prompt and output lengths drawn from a seeded range, all arriving at t=0.
  transformers runs them as static batches in arrival order (each batch runs to its longest output);
  the engine batches continuously.
Reported per run: output tokens/s, time to first token and time per output token (p50, p99).
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

import torch

from stalwart.config.arguments import ArgumentParser
from stalwart.config.serve import EngineConfig
from stalwart.export.hf import hf_config, to_hf_state
from stalwart.infer.engine import Engine
from stalwart.infer.sampling import SamplingParams
from stalwart.models.flavors import FLAVORS
from stalwart.models.llama import Transformer
from stalwart.runtime.device import DEVICES, accelerator_name, resolve_device, synchronize


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


def workloads(vocab: int, seed: int = 0) -> dict[str, list[Req]]:
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    return {"batch 1": [Req(prompt(64), 64)], "batch 32": [Req(prompt(64), 64) for _ in range(32)],
            "mixed": [Req(prompt(rng.randint(8, 384)), rng.randint(8, 128)) for _ in range(32)]}


def run_engine(model: Transformer, reqs: list[Req], cfg: EngineConfig) -> Result:
    engine = Engine(model, None, None, cfg)
    start = time.perf_counter()
    for i, r in enumerate(reqs):
        engine.add(str(i), r.prompt, SamplingParams(max_tokens=r.out, temperature=0.0, ignore_eos=True))
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    while engine.has_work():
        outs = engine.step()
        now = time.perf_counter() - start
        for o in outs:
            first.setdefault(o.rid, now)
            last[o.rid] = now
            count[o.rid] = count.get(o.rid, 0) + len(o.choices)
    seconds = time.perf_counter() - start
    tpot = [(last[k] - first[k]) / (count[k] - 1) for k in first if count[k] > 1]
    return Result(seconds, sum(count.values()), list(first.values()), tpot)


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
    ttft, tpot, tokens = [], [], 0
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
        t = [x - start for x in clock.times]
        for r in group:
            ttft.append(t[0])
            if r.out > 1:
                tpot.append((t[r.out - 1] - t[0]) / (r.out - 1))
            tokens += r.out
    return Result(time.perf_counter() - start, tokens, ttft, tpot)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def build(flavor: str, vocab: int, seed: int = 0):
    import dataclasses

    from transformers import LlamaConfig, LlamaForCausalLM

    args = dataclasses.replace(FLAVORS[flavor], vocab_size=vocab, max_seq_len=1024)
    torch.manual_seed(seed)
    model = Transformer(args).eval()
    cfg = LlamaConfig(**{k: v for k, v in hf_config(args, None).items() if k not in ("architectures",)})
    hf = LlamaForCausalLM(cfg).eval()
    state = to_hf_state(model.state_dict(), args)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    return model, hf


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="stalwart bench inference", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavors", default="tiny:1024,125M:32768", help="flavor:vocab pairs, comma separated")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--workloads", default="batch 1,batch 32,mixed")
    p.add_argument("--hf-batch", type=int, default=32, help="static batch size of transformers on the mixed trace")
    p.add_argument("--device", default="auto", choices=DEVICES, help="where both run (auto = cuda if available)")
    a = p.parse_args(argv)
    device = resolve_device(a.device)
    torch.set_grad_enabled(False)
    where = accelerator_name(device) or f"{device.type}, {torch.get_num_threads()} thread(s)"
    print(f"# torch {torch.__version__}, {where}; greedy, fp32")
    print(f"{'model':<8} {'workload':<9} {'rep':>3} {'system':<13} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'TPOT p50':>9} {'TPOT p99':>9}   (ms)")
    for spec in a.flavors.split(","):
        flavor, vocab = spec.split(":")
        model, hf = build(flavor, int(vocab))
        model, hf = model.to(device), hf.to(device)
        loads = workloads(int(vocab))
        for name in a.workloads.split(","):
            reqs = loads[name]
            ratios = []
            for rep in range(a.repeats):
                pair = {}
                for system in ("stalwart", "transformers"):
                    r = (run_engine(model, reqs, EngineConfig()) if system == "stalwart"
                         else run_hf(hf, reqs, a.hf_batch if name == "mixed" else len(reqs)))
                    pair[system] = r
                    print(f"{flavor:<8} {name:<9} {rep:>3} {system:<13} {r.tokens / r.seconds:8.1f} "
                          f"{1e3 * pct(r.ttft, .5):9.1f} {1e3 * pct(r.ttft, .99):9.1f} {1e3 * pct(r.tpot, .5):9.1f} "
                          f"{1e3 * pct(r.tpot, .99):9.1f}", flush=True)
                s, h = pair["stalwart"], pair["transformers"]
                ratios.append((h.seconds / s.seconds) * (s.tokens / h.tokens))
            print(f"{flavor:<8} {name:<9} throughput ratio stalwart/transformers per repeat: "
                  + ", ".join(f"{x:.2f}x" for x in ratios), flush=True)
    return 0
