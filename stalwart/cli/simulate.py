"""`stalwart simulate`: failures, recovery and checkpointing of a long job, at cluster scale.

Flow: load the config (defaults < --config TOML < --section.key overrides), run seeded
replications, then optionally the interval search, what-ifs, sweeps and the cluster study; print a
table, and write --json / --plot.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from stalwart.atomic import output_file, writing_output
from stalwart.config import ConfigError, help_text, load, to_dict
from stalwart.sim import report
from stalwart.sim.cluster import simulate_cluster
from stalwart.sim.config import SimConfig
from stalwart.sim.montecarlo import build_job_model, compare_recovery, optimal_interval, run, young_daly
from stalwart.sim.power import power_report
from stalwart.sim.recovery import assumptions
from stalwart.sim.sweep import WHATIFS, as_overrides, grid

PRESETS = Path(__file__).resolve().parents[2] / "configs" / "sim"

INTRO = """usage: stalwart simulate [--config PRESET|PATH] [--json PATH] [--plot PATH] [--sweep KEY=V1,V2,...]...
                         [--section.key VALUE ...]

Discrete-event simulation of one long training job on many GPUs: interruptions by cause, detection,
restart, spares, checkpoints and planned maintenance; reports ETTR (effective training time ratio)
with 95% confidence intervals over seeded replications, the wall-time breakdown, whole-job restarts
side by side with per-replica-group recovery (with its assumptions), the Young/Daly vs simulated
checkpoint interval, facility power swings, and optionally what-ifs, sweeps and a multi-job cluster
study.

options:
  --config NAME|PATH   TOML preset: a path, or a name from configs/sim/ (e.g. llama3_405b)
  --json PATH          also write every figure as JSON
  --plot PATH          also write a PNG figure
  --sweep KEY=V1,V2    what-if sweep over a config key (repeat for a grid), e.g. --sweep job.gpus=1024,1048576
  --whatifs            run the built-in what-ifs (same as --report.whatifs true)
  -h, --help           this help"""


def find_preset(name: str) -> Path:
    p = Path(name)
    if p.is_file():
        return p
    for cand in (PRESETS / name, PRESETS / f"{name}.toml"):
        if cand.is_file():
            return cand
    shipped = ", ".join(sorted(f.stem for f in PRESETS.glob("*.toml")))
    raise ConfigError(f"simulation preset '{name}' not found (a TOML path, or one of: {shipped})")


def parse_args(argv: list[str]) -> tuple[dict[str, str], list[str], list[str]]:
    """(flags, sweeps, dotted overrides)."""
    flags: dict[str, str] = {}
    sweeps: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        name, eq, inline = argv[i].partition("=")
        if name in ("--config", "--json", "--plot", "--sweep"):
            if eq:
                value, i = inline, i + 1
            elif i + 1 < len(argv):
                value, i = argv[i + 1], i + 2
            else:
                raise ConfigError(f"{name} needs a value")
            if name == "--sweep":
                sweeps.append(value)
            else:
                flags[name] = value
        elif name == "--whatifs":
            rest += ["--report.whatifs", "true"]
            i += 1
        else:
            rest.append(argv[i])
            i += 1
    return flags, sweeps, rest


def simulate(cfg: SimConfig) -> tuple[dict, object]:
    """Run the baseline study described by ``cfg``; returns (JSON-able document, Summary)."""
    model = build_job_model(cfg)
    s = run(model, cfg.run.replications, cfg.run.seed)
    yd = young_daly(model)
    doc: dict = {"config": to_dict(cfg), "ettr_runs": s.ettr_runs.tolist(), **s.to_dict(), "checkpoint_interval": yd}
    if cfg.report.recovery_models:
        doc["recovery_models"] = recovery_models(cfg, s)
    if cfg.report.optimize_interval:
        best, curve = optimal_interval(model, cfg.report.optimize_replications, cfg.run.seed)
        best_e = max(curve, key=lambda p: p[1].mean)[1]
        yd.update(simulated_optimum_s=best, simulated_optimum_ettr=best_e.mean,
                  curve=[{"interval_s": i, "ettr": e.mean, "ci95": [e.lo, e.hi]} for i, e in curve])
    days = cfg.job.days
    down_per_day = (s.unplanned.mean + s.planned.mean) / days
    doc["power"] = power_report(cfg.power, cfg.job.gpus, cfg.job.gpus_per_host, days, down_per_day,
                                s.checkpoints / days, model.stall_s).to_dict()
    if cfg.cluster.enabled:
        per_host = float(model.cause_rate_s[model.hardware].sum()) / (cfg.job.gpus / cfg.job.gpus_per_host)
        doc["cluster"] = simulate_cluster(cfg.cluster, cfg.job.gpus_per_host, per_host, model.repair_mean_s,
                                          model.restart_s, model.interval_s,
                                          np.random.default_rng(cfg.run.seed)).to_dict()
    return doc, s


def recovery_models(cfg: SimConfig, done) -> dict:
    """Both recovery models on the same failure traces, with the per-group assumptions."""
    both = compare_recovery(cfg, done)
    return {"assumptions": assumptions(cfg), **{name: report.recovery_row(x) for name, x in both.items()}}


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(INTRO)
        print("\nConfiguration (TOML [section] key = value, or --section.key VALUE; CLI > file > defaults):")
        print(help_text(SimConfig))
        return 0
    flags, sweeps, overrides = parse_args(argv)
    file = find_preset(flags["--config"]) if "--config" in flags else None
    cfg = load(SimConfig, file, overrides)
    outputs = {flag: output_file(flags[flag], flag) for flag in ("--json", "--plot") if flag in flags}
    points = grid(sweeps) if sweeps else []
    for pt in points:                      # validate every sweep point before spending time
        load(SimConfig, file, overrides + as_overrides(pt))

    doc, summary = simulate(cfg)
    if cfg.report.whatifs:
        base = summary.ettr.mean
        rows = []
        for name, make in WHATIFS.items():
            pairs = make(cfg)
            alt = load(SimConfig, file, overrides + as_overrides(pairs))
            e = run(build_job_model(alt), cfg.run.replications, cfg.run.seed).ettr
            rows.append({"name": name, "overrides": pairs, "ettr": e.to_dict(), "delta": e.mean - base})
        doc["whatifs"] = sorted(rows, key=lambda r: -r["ettr"]["mean"])
    if points:
        doc["sweep"] = []
        for pt in points:
            alt = load(SimConfig, file, overrides + as_overrides(pt))
            s = run(build_job_model(alt), alt.run.replications, alt.run.seed)
            doc["sweep"].append({"overrides": pt, "ettr": s.ettr.to_dict(), "unplanned": s.unplanned.mean,
                                 "interval_s": s.model.interval_s,
                                 "wall_time_s": {k: v.mean for k, v in s.buckets_s.items()}})
            if alt.report.recovery_models:
                doc["sweep"][-1]["recovery_models"] = recovery_models(alt, s)
    print(report.format_table(doc, summary))
    if "--json" in outputs:
        with writing_output(outputs["--json"], "--json"):
            report.write_json(doc, outputs["--json"])
        print(f"\nwrote {flags['--json']}")
    if "--plot" in outputs:
        with writing_output(outputs["--plot"], "--plot"):
            report.write_plot(doc, summary, outputs["--plot"])
        print(f"wrote {flags['--plot']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
