"""`stalwart serve --plan`: place an inference server (tp x pp x replicas) on hosts and explain the choice."""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from stalwart.atomic import output_file, writing_output
from stalwart.config import ConfigError, help_text, load, option, section, to_dict
from stalwart.config.loading import split_args
from stalwart.planner.config import ModelSection as PlanModelSection
from stalwart.planner.config import apply_shape_overrides
from stalwart.models.flavors import FLAVORS as MODEL_FLAVORS
from stalwart.planner.serving import (DTYPE_BYTES, HostSpec, ServingRequest, format_bytes, host_presets, plan,
                                      shape_from_args)
from stalwart.planner.shapes import FLAVORS, ModelShape

FLAVOR_NAMES = tuple(dict.fromkeys([*FLAVORS, *MODEL_FLAVORS]))
PRESETS = host_presets()

INTRO = """usage: stalwart serve --plan [--config PATH] [--json PATH] [--section.key VALUE ...]

Enumerates placements of a paged-KV, continuously batched inference server (tensor parallel inside a
host, pipeline stages across hosts, replicas behind a least-loaded router), predicts per device the
weight shard and KV cache, and per placement the time to first token, the time per output token and
the output tokens/s of all replicas; ranks them by the target and explains the chosen one.

options:
  --config PATH   TOML file with the sections below
  --json PATH     also write the ranking as JSON
  -h, --help      this help"""


@dataclass
class ModelSection(PlanModelSection):
    flavor: str = option(f"Model shape: {', '.join(FLAVOR_NAMES)} (stalwart/planner/shapes.py, then "
                         "stalwart/models/flavors.py).", "tiny", choices=FLAVOR_NAMES)
    params_dtype: Literal["bf16", "fp32"] = option("Weight (and activation) dtype.", "bf16")
    kv_dtype: Literal["auto", "bf16", "fp32"] = option("KV cache dtype; auto = params_dtype.", "auto")


@dataclass
class HostsSection:
    preset: str = option(f"Host type: {', '.join(PRESETS)} (stalwart/planner/serving.py); the keys below "
                         "override it (0 = the preset's).", "cpu", choices=tuple(PRESETS))
    hosts: int = option("Number of hosts.", 1, min=1)
    procs_per_host: int = option("Serving processes (devices) per host.", 0, min=0)
    memory_gb: float = option("Memory per device, GB.", 0.0, min=0.0)
    headroom_gb: float = option("Memory kept free per device for the runtime and activations, GB "
                                "(negative = the preset's).", -1.0)
    gflops: float = option("Sustained matmul GFLOP/s per device.", 0.0, min=0.0)
    memory_gb_per_s: float = option("Sustained memory bandwidth per device, GB/s.", 0.0, min=0.0)
    intra_host_gb_per_s: float = option("Link bandwidth between devices of one host, GB/s.", 0.0, min=0.0)
    intra_host_latency_us: float = option("Link latency inside a host, microseconds.", 0.0, min=0.0)
    inter_host_gb_per_s: float = option("Link bandwidth between hosts per device, GB/s.", 0.0, min=0.0)
    inter_host_latency_us: float = option("Link latency between hosts, microseconds.", 0.0, min=0.0)
    host_layer_us: float = option("The host's work per layer per forward pass (dispatching its operators), "
                                  "microseconds (negative = the preset's).", -1.0)
    host_seq_layer_us: float = option("The host's work per sequence and layer per forward pass, microseconds "
                                      "(negative = the preset's).", -1.0)
    host_step_us: float = option("The host's work per forward pass (scheduling, head, sampler), microseconds "
                                 "(negative = the preset's).", -1.0)
    host_token_us: float = option("The host's work per sequence per step (its token sampled, detokenized and "
                                  "streamed), microseconds (negative = the preset's).", -1.0)


@dataclass
class TargetSection:
    kind: Literal["latency", "throughput"] = option(
        "latency: least time per output token at batch 1; throughput: most output tokens/s over all replicas.",
        "throughput")
    max_tpot_ms: float = option("Bound on the time per output token, ms (0 = none).", 0.0, min=0.0)
    context: int = option("Longest sequence (prompt + output) one request may reach, tokens.", 4096, min=1)
    prompt_tokens: int = option("Mean prompt length, tokens.", 512, min=1)
    output_tokens: int = option("Mean output length, tokens.", 256, min=1)
    max_batch: int = option("Most concurrent sequences the engine batches per replica.", 256, min=1)
    replicas: int = option("With N >= 2: also choose how many of N one-process replicas prefill and how many "
                           "decode (`serve --prefill-replicas P --decode-replicas D`, planner/disagg.py), against "
                           "all N colocated; 0 = not asked.", 0, min=0)
    chunk_tokens: int = option("The replicas' engine.max_batch_tokens: the prompt chunk a colocated replica's decode "
                               "step may carry.", 512, min=1)


@dataclass
class SearchSection:
    tp: list[int] = option("Tensor-parallel degrees to try.", factory=lambda: [1, 2, 4, 8])
    pp: list[int] = option("Pipeline-parallel degrees to try.", factory=lambda: [1, 2, 4, 8, 16])
    top: int = option("Placements to list.", 10, min=1)


@dataclass
class ServePlanConfig:
    model: ModelSection = section(ModelSection, "Model shape and dtypes.")
    hosts: HostsSection = section(HostsSection, "The hosts and their devices and links.")
    target: TargetSection = section(TargetSection, "What to optimise and the traffic.")
    search: SearchSection = section(SearchSection, "The placements to enumerate.")

    def __post_init__(self) -> None:
        for name in ("tp", "pp"):
            vals = getattr(self.search, name)
            if not vals or min(vals) < 1:
                raise ConfigError(f"search.{name} must list positive integers")
        t = self.target
        if t.prompt_tokens + t.output_tokens > t.context:
            raise ConfigError(f"target.context ({t.context}) must hold target.prompt_tokens + "
                              f"target.output_tokens ({t.prompt_tokens + t.output_tokens})")


def build_shape(m: ModelSection) -> ModelShape:
    base = FLAVORS[m.flavor] if m.flavor in FLAVORS else shape_from_args(MODEL_FLAVORS[m.flavor])
    return apply_shape_overrides(base, m)


def build_hosts(h: HostsSection) -> HostSpec:
    base = PRESETS[h.preset]
    changes = {k: getattr(h, k) for k in ("procs_per_host", "memory_gb", "memory_gb_per_s", "intra_host_gb_per_s",
                                          "intra_host_latency_us", "inter_host_gb_per_s", "inter_host_latency_us")
               if getattr(h, k)}
    if h.gflops:
        changes["flops_per_s"] = h.gflops * 1e9
    if h.headroom_gb >= 0:
        changes["headroom_gb"] = h.headroom_gb
    changes |= {k: getattr(h, k) for k in ("host_layer_us", "host_seq_layer_us", "host_step_us", "host_token_us")
                if getattr(h, k) >= 0}
    return dataclasses.replace(base, hosts=h.hosts, **changes)


def build_request(cfg: ServePlanConfig) -> ServingRequest:
    t, m = cfg.target, cfg.model
    return ServingRequest(context_tokens=t.context, prompt_tokens=t.prompt_tokens, output_tokens=t.output_tokens,
                          param_bytes=DTYPE_BYTES[m.params_dtype],
                          kv_bytes=DTYPE_BYTES[m.params_dtype if m.kv_dtype == "auto" else m.kv_dtype],
                          target=t.kind, max_tpot_ms=t.max_tpot_ms, max_batch=t.max_batch)


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(INTRO)
        print("\nConfiguration (TOML [section] key = value, or --section.key VALUE; CLI > file > defaults):")
        print(help_text(ServePlanConfig))
        return 0
    flags, rest = split_args(argv, {"--config": True, "--json": True})
    cfg = load(ServePlanConfig, flags.get("--config"), rest)
    out = output_file(flags["--json"], "--json") if "--json" in flags else None
    shape, hosts, req = build_shape(cfg.model), build_hosts(cfg.hosts), build_request(cfg)
    result = plan(shape, hosts, req, tuple(cfg.search.tp), tuple(cfg.search.pp))
    print(f"stalwart serve --plan: {cfg.model.flavor} ({_count(shape.params)} params, {cfg.model.params_dtype}), "
          f"{hosts.hosts} host(s) x {hosts.procs_per_host} x {hosts.name} ({hosts.memory_gb:g} GB each), "
          f"target {req.target}, context {req.context_tokens}, prompt {req.prompt_tokens}, output {req.output_tokens}")
    print(f"{len(result.ranked)} placements fit, {len(result.rejected)} do not\n")
    print(f"  {'#':>2} {'tp':>3} {'pp':>3} {'replicas':>8} {'weights/dev':>11} {'KV tok/dev':>11} {'max batch':>9} "
          f"{'batch':>5} {'TTFT ms':>9} {'TPOT@1 ms':>9} {'TPOT ms':>9} {'tokens/s':>10}")
    shown = result.ranked[: cfg.search.top]
    for k, p in enumerate(shown, 1):
        print(f"  {k:>2} {p.tp:>3} {p.pp:>3} {p.replicas:>8} {format_bytes(p.weight_bytes_per_device):>11} "
              f"{p.kv_tokens_per_device:>11,} {p.max_batch:>9,} {p.batch:>5} {p.ttft_s * 1e3:>9.2f} "
              f"{p.tpot_batch1_s * 1e3:>9.3f} {p.tpot_s * 1e3:>9.3f} {p.tokens_per_s:>10,.0f}")
    best = result.ranked[0]
    print(f"\nchosen: tp={best.tp} pp={best.pp} replicas={best.replicas}")
    for line in result.why:
        print("  " + line)
    if cfg.target.replicas >= 2:
        _print_splits(shape, hosts, req, cfg.target)
    if out is not None:
        doc = {"config": to_dict(cfg), "hosts": dataclasses.asdict(hosts), "shape": dataclasses.asdict(shape),
               "chosen": best.to_dict(), "why": result.why, "ranked": [p.to_dict() for p in shown],
               "rejected": [p.to_dict() for p in result.rejected]}
        with writing_output(out, "--json"):
            out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"\nwrote {flags['--json']}")
    return 0


def _print_splits(shape, hosts, req, t: TargetSection) -> None:
    from stalwart.planner.disagg import choose, splits

    cands = splits(shape, hosts, req, t.replicas, t.max_batch, t.chunk_tokens, hosts.devices)
    best = choose(cands, req.max_tpot_ms * 1e-3)
    print(f"\nprefill:decode over {t.replicas} one-process replicas (batch {t.max_batch} per decode replica, prompt "
          f"chunks of {t.chunk_tokens} tokens):")
    print(f"  {'split':<14} {'tokens/s':>10} {'TPOT p99 ms':>12}  bound by")
    for c in cands:
        print(f"  {c.name:<14} {c.tokens_per_s:>10,.0f} {c.tpot_p99_s * 1e3:>12.2f}  {c.bound}")
    flags = (f"--prefill-replicas {best.prefill} --decode-replicas {best.decode}" if best.prefill
             else f"--replicas {best.decode}")
    print(f"chosen: {best.name} ({flags})")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
