"""`stalwart plan`: rank parallel layouts for a model on a cluster, or check the published points."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from stalwart.atomic import output_file, writing_output
from stalwart.config import ConfigError, help_text, load, to_dict
from stalwart.config.loading import split_args
from stalwart.planner.config import PlanConfig, apply_shape_overrides
from stalwart.planner.cost import Network, Options
from stalwart.planner.hardware import GPUS
from stalwart.planner.islands import compare, table
from stalwart.planner.layout import Workload
from stalwart.planner.search import Space, explain, rank_layouts
from stalwart.planner.shapes import FLAVORS
from stalwart.planner.validation import TOLERANCE, check_all

INTRO = """usage: stalwart plan [--config PATH] [--json PATH] [--validate | --islands] [--section.key VALUE ...]

Enumerates parallel layouts (fsdp/dp, tp, pp with schedule and virtual stages, cp, micro-batch,
activation checkpointing, and expert parallel for mixture-of-experts shapes) for a model on a cluster,
predicts per-GPU memory and step time (compute, exposed communication per dimension and network tier,
pipeline bubble), ranks the layouts that fit by tokens/s and explains the best one.

options:
  --config PATH   TOML file with the sections below
  --json PATH     also write the ranking (and validation) as JSON
  --validate      compare the model with published throughput (Megatron-LM, Llama 3, torchtitan), fitted
                  and held-out rows (exit 1 if any is off by >20% or drifts from its documented error)
  --islands       islands joined by a slow link: step time, utilisation and link bytes of synchronous
                  training vs DiLoCo vs streaming DiLoCo (the [islands] section)
  -h, --help      this help"""


def build_workload(cfg: PlanConfig) -> Workload:
    shape = apply_shape_overrides(FLAVORS[cfg.model.flavor], cfg.model)
    w = cfg.workload
    batch = w.global_batch_tokens // w.seq_len if w.global_batch_tokens else (
        w.global_batch or max(16, cfg.cluster.gpus // 4))
    return Workload(shape, w.seq_len, batch)


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(INTRO)
        print("\nConfiguration (TOML [section] key = value, or --section.key VALUE; CLI > file > defaults):")
        print(help_text(PlanConfig))
        return 0
    flags, rest = split_args(argv, {"--config": True, "--json": True, "--validate": False, "--islands": False})
    validate = "--validate" in flags
    if validate and "--islands" in flags:
        raise ConfigError("--validate and --islands are two different reports: pass one")
    cfg = load(PlanConfig, flags.get("--config"), rest)
    out = output_file(flags["--json"], "--json") if "--json" in flags else None
    doc: dict = {"config": to_dict(cfg)}
    rc = 0
    if validate:
        rows = check_all()
        print("published point                              role      metric            published  predicted   error")
        for r in rows:
            print(f"  {r['name']:<42} {r['role']:<9} {r['metric']:<17} {r['published']:9.0f}  {r['predicted']:9.0f}  "
                  f"{100 * r['error']:+6.1f}%   ({r['layout']})")
            if not r["ok"]:
                rc = 1
        print(f"\nerror: fitted rows max {100 * max(abs(r['error']) for r in rows if r['role'] == 'fit'):.1f}%, "
              f"held-out rows max {100 * max(abs(r['error']) for r in rows if r['role'] == 'held_out'):.1f}% "
              f"(bound {100 * TOLERANCE:.0f}%)")
        doc["validation"] = rows
    elif "--islands" in flags:
        doc["islands"] = plan_islands(cfg)
    else:
        w = build_workload(cfg)
        c, s = cfg.cluster, cfg.search
        gpu = GPUS[c.gpu]
        net = Network(gpus_per_host=c.gpus_per_host, nic_gbps=c.nic_gbps, pod_gpus=c.pod_gpus,
                      spine_oversubscription=c.spine_oversubscription)
        opt = Options(compile=s.compile, async_tp=s.async_tp, power_limit_w=c.power_limit_w,
                      reduce_bytes=s.reduce_bytes)
        space = Space(tp=tuple(s.tp), pp=tuple(s.pp), cp=tuple(s.cp), micro_batch=tuple(s.micro_batch),
                      virtual_stages=tuple(s.virtual_stages), schedules=tuple(s.schedules), ac=tuple(s.ac),
                      fsdp=tuple(s.fsdp), ep=tuple(s.ep) if w.shape.is_moe else (1,))
        ranked = rank_layouts(w, c.gpus, gpu, net, opt, space=space, headroom_gb=s.headroom_gb)
        fitting = [x for x in ranked if x.fits]
        active = f", {w.shape.active_params / 1e9:.1f}B active" if w.shape.is_moe else ""
        print(f"stalwart plan: {cfg.model.flavor} ({w.shape.params / 1e9:.1f}B params{active}), seq {w.seq_len}, "
              f"{w.global_batch} sequences/step ({w.tokens_per_step:,} tokens), {c.gpus} x {gpu.name}")
        print(f"{len(ranked)} valid layouts, {len(fitting)} fit in {gpu.hbm_gb - s.headroom_gb:.0f} GB\n")
        if not ranked:
            raise ConfigError(f"no valid layout: {w.global_batch} sequences/step cannot be split over {c.gpus} GPUs "
                              "with the searched tp/pp/cp degrees and micro-batches; raise --workload.global_batch "
                              "(a multiple of the data-parallel degree), or widen the search lists")
        shown = (fitting or ranked)[: s.top]
        print(f"  {'#':>2}  {'layout':<56} {'tokens/s/GPU':>12} {'TFLOP/s':>8} {'MFU':>6} {'step s':>7} "
              f"{'mem GB':>7}")
        for k, x in enumerate(shown, 1):
            print(f"  {k:>2}  {x.layout.describe():<56} {x.time.tokens_per_s_per_gpu:12,.0f} "
                  f"{x.time.tflops_per_gpu:8.0f} {100 * x.time.mfu:5.1f}% {x.time.step_s:7.2f} "
                  f"{x.memory.total / 1e9:7.1f}")
        if not fitting:
            print("\nnothing fits in memory: the list shows the fastest layouts regardless; add GPUs, "
                  "allow activation checkpointing or a larger pp/tp")
            rc = 1
        print("\nbest layout:")
        for line in explain(shown[0], w, gpu):
            print("  " + line)
        doc["layouts"] = [{"layout": dataclasses.asdict(x.layout), "describe": x.layout.describe(), "fits": x.fits,
                           "memory_bytes": x.memory.to_dict(), "time": x.time.to_dict()} for x in shown]
        doc["explanation"] = explain(shown[0], w, gpu)
    if out is not None:
        with writing_output(out, "--json"):
            out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"\nwrote {flags['--json']}")
    return rc


def plan_islands(cfg: PlanConfig) -> list[dict]:
    """`--islands`: print the comparison; its rows for --json."""
    w, i = build_workload(cfg), cfg.islands
    params = i.params or w.shape.params
    step_s, source = i.step_s, "islands.step_s"
    if not step_s:
        ranked = [x for x in rank_layouts(w, i.procs, GPUS[cfg.cluster.gpu], Network(gpus_per_host=cfg.cluster.gpus_per_host),
                                          Options(), space=Space(tp=(1, 2, 4, 8), pp=(1,), cp=(1,)))
                  if x.fits]
        if not ranked:
            raise ConfigError(f"no layout of {i.procs} x {cfg.cluster.gpu} fits {cfg.model.flavor} at "
                              f"{w.global_batch} sequences per island: pass --islands.step_s (a measured step time)")
        step_s, source = ranked[0].time.step_s, f"planner: {ranked[0].layout.describe()} on {i.procs} x {cfg.cluster.gpu}"
    rows = compare(i, params, step_s)
    print(f"stalwart plan --islands: {i.count} islands x {i.procs} process(es), link {i.link_mbit:g} Mbit/s, "
          f"{i.latency_ms:g} ms one way ({i.congestion}); {params:,} parameters; inner step {step_s:.4g} s ({source}); "
          f"{w.tokens_per_step:,} tokens per island step" + (f"; a run of {i.steps} steps" if i.steps else "; steady state"))
    for line in table(rows, w.tokens_per_step):
        print(line)
    return [{"label": label, **p.to_dict()} for label, p in rows]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
