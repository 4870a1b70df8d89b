"""Human table, JSON document and PNG figure of a simulation; formatting only, no simulation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stalwart.sim.causes import CATALOG, LLAMA3_DAYS, LLAMA3_GPUS, LLAMA3_PLANNED, unit_hours
from stalwart.sim.engine import BUCKETS
from stalwart.sim.montecarlo import RECOVERY_MODELS, Estimate, Summary

MODEL_LABELS = {"whole_job": "whole-job restart", "per_group": "per replica group"}


def published_scaled(gpus: int, gpus_per_host: int, days: float) -> dict[str, float]:
    """Llama 3's per-cause counts scaled to this job's exposure (equal to the published ones at 16k x 54 d)."""
    out = {}
    for c in CATALOG:
        ref = unit_hours(c.per, LLAMA3_GPUS, 8, LLAMA3_DAYS)
        out[c.name] = c.llama3_count * unit_hours(c.per, gpus, gpus_per_host, days) / ref
    return out


def pct(e: Estimate) -> str:
    return (f"{100 * e.mean:6.2f}% (95% CI {100 * e.lo:.2f}-{100 * e.hi:.2f}; "
            f"runs p5-p95 {100 * e.p5:.1f}-{100 * e.p95:.1f})")


def recovery_row(s: Summary) -> dict[str, Any]:
    """One recovery model's figures for the side-by-side comparison."""
    return {"ettr": s.ettr.to_dict(), "groups": s.model.groups, "interval_s": s.model.interval_s,
            "whole_job_restarts": s.unplanned.mean + s.planned.mean - s.group_recoveries,
            "group_recoveries": s.group_recoveries, "wall_time_s": {k: v.mean for k, v in s.buckets_s.items()}}


def ci(e: dict[str, Any]) -> str:
    return f"{100 * e['mean']:6.2f}% ({100 * e['ci95'][0]:.2f}-{100 * e['ci95'][1]:.2f})"


def format_recovery(doc: dict[str, Any]) -> list[str]:
    rm = doc["recovery_models"]
    chosen = doc["config"]["recovery"]["model"]
    lines = ["", "recovery models, same failure traces   ETTR (95% CI)          checkpoint   whole-job    group",
             "                                                                 interval     restarts     recoveries"]
    for name in RECOVERY_MODELS:
        r = rm[name]
        mark = "*" if name == chosen else " "
        lines.append(f" {mark}{MODEL_LABELS[name]:<37} {ci(r['ettr'])}   {r['interval_s'] / 60:5.1f} min "
                     f"{r['whole_job_restarts']:10.1f} {r['group_recoveries']:12.1f}")
    lines.append("  (* recovery.model: the model of the figures above and below this table)")
    lines.append("  per-group assumptions:")
    lines += [f"  - {line}" for line in rm["assumptions"]["lines"]]
    return lines


def format_table(doc: dict[str, Any], s: Summary) -> str:
    job = doc["config"]["job"]
    lines = [(f"stalwart simulate: {job['gpus']:,} GPUs ({job['gpus'] // job['gpus_per_host']:,} hosts), "
             f"{job['days']:g} days, {s.replications} replications"),
             "", f"ETTR (productive / wall time): {pct(s.ettr)}",
             f"checkpoint interval: {s.model.interval_s / 60:.1f} min  ({s.checkpoints:.0f} checkpoints per run)", ""]
    rm = doc.get("recovery_models")
    columns = {n: rm[n]["wall_time_s"] for n in RECOVERY_MODELS} if rm else \
        {"": {b: s.buckets_s[b].mean for b in BUCKETS}}
    lines.append("wall-time breakdown     " + "".join(f"{MODEL_LABELS.get(n, ''):>22}" for n in columns))
    lines.append(" " * 24 + "".join(f"{'hours':>12}{'share':>10}" for _ in columns))
    for b in BUCKETS:
        cells = [f"{w[b] / 3600:12.1f}{100 * w[b] / sum(w.values()):9.2f}%" for w in columns.values()]
        lines.append(f"  {b:<22}" + "".join(cells))
    pub = published_scaled(job["gpus"], job["gpus_per_host"], job["days"])
    lines += ["", "interruptions by cause     simulated (95% CI)     Llama 3 rates at this exposure"]
    for c in CATALOG:
        e = s.causes[c.name]
        lines.append(f"  {c.label:<30} {e.mean:7.1f} ({e.lo:6.1f}-{e.hi:6.1f})   {pub[c.name]:8.1f}")
    lines.append(f"  {'unplanned total':<30} {s.unplanned.mean:7.1f} ({s.unplanned.lo:6.1f}-{s.unplanned.hi:6.1f})"
                 f"   {sum(pub.values()):8.1f}")
    lines.append(f"  {'planned':<30} {s.planned.mean:7.1f}                    "
                 f"{LLAMA3_PLANNED * job['days'] / LLAMA3_DAYS:8.1f}")
    if rm:
        lines += format_recovery(doc)
    yd = doc["checkpoint_interval"]
    mtbf = "MTBF between whole-job rollbacks" if s.model.groups > 1 else "job MTBF"
    lines += ["", (f"checkpoint interval: {mtbf} {yd['mtbf_s'] / 3600:.2f} h, "
                   f"checkpoint cost {yd['delta_s']:.0f} s -> "
              f"Young {yd['young_s'] / 60:.1f} min, Daly {yd['daly_s'] / 60:.1f} min "
              f"(first-order ETTR {100 * yd['predicted_ettr']:.2f}%)")]
    if yd.get("simulated_optimum_s"):
        lines.append(f"  simulated optimum: {yd['simulated_optimum_s'] / 60:.1f} min "
                     f"(ETTR {100 * yd['simulated_optimum_ettr']:.2f}%)")
    p = doc["power"]
    lines += ["", (f"power: {p['busy_mw']:.1f} MW training, {p['idle_mw']:.1f} MW stalled -> "
                   f"swing {p['swing_mw']:.1f} MW; "
              f"peak step change {p['peak_step_mw']:.2f} MW per {doc['config']['power']['window_s']:g} s "
              f"(ramp {doc['config']['power']['ramp_s']:g} s); {p['swings_per_day']:.1f} swings/day")]
    if doc.get("cluster"):
        c = doc["cluster"]
        cc = doc["config"]["cluster"]
        lines += ["", (f"cluster ({cc['placement']} placement, {cc['policy']}): "
                  f"{c['completed']}/{c['jobs']} jobs, utilisation {100 * c['utilisation']:.1f}% "
                  f"(goodput {100 * c['goodput_utilisation']:.1f}%), queue wait mean {c['wait_mean_h']:.1f} h, "
                  f"p95 {c['wait_p95_h']:.1f} h; racks per multi-host job {c['racks_per_job']:.2f} "
                  f"({c['rack_excess']:.2f}x the fewest possible); {c['failures']} failures, "
                  f"{c['spare_waits']} waits for a spare")]
    if doc.get("whatifs"):
        lines += ["", f"{'what-ifs (ranked by ETTR)':<72}  ETTR      change"]
        for w in doc["whatifs"]:
            lines.append(f"  {w['name']:<70} {100 * w['ettr']['mean']:6.2f}%  {100 * w['delta']:+6.2f} pts")
    if doc.get("sweep") and "recovery_models" in doc["sweep"][0]:
        lines += ["", (f"{'sweep':<46} {'whole-job ETTR (95% CI)':<25} {'per-group ETTR (95% CI)':<25} "
                       f"{'groups':>6}   interruptions")]
        for pt in doc["sweep"]:
            label = ", ".join(f"{k}={v}" for k, v in pt["overrides"])
            w, g = (pt["recovery_models"][n] for n in RECOVERY_MODELS)
            lines.append(f"  {label:<44} {ci(w['ettr']):<25} {ci(g['ettr']):<25} {g['groups']:6d}   "
                         f"{pt['unplanned']:8.1f}")
    elif doc.get("sweep"):
        lines += ["", "sweep                                          ETTR (95% CI)           interruptions"]
        for pt in doc["sweep"]:
            label = ", ".join(f"{k}={v}" for k, v in pt["overrides"])
            lines.append(f"  {label:<44} {ci(pt['ettr'])}   {pt['unplanned']:8.1f}")
    return "\n".join(lines)


def write_json(doc: dict[str, Any], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")


def power_trace(down: list[tuple[float, float]], busy: float, idle: float, ramp_s: float,
                until_s: float) -> tuple[list[float], list[float]]:
    """Piecewise-linear facility power from the job's down intervals (drops and ramps back up)."""
    ts, mw = [0.0], [busy]
    for start, end in down:
        if start >= until_s:
            break
        ts += [start, start + min(ramp_s, end - start), end, end + ramp_s]
        mw += [busy, idle, idle, busy]
    ts.append(until_s)
    mw.append(busy)
    return ts, mw


def write_plot(doc: dict[str, Any], s: Summary, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(3, 2, figsize=(13, 13))
    total = sum(s.buckets_s[b].mean for b in BUCKETS)
    shares = [100 * s.buckets_s[b].mean / total for b in BUCKETS]
    ax[0, 0].barh(BUCKETS, shares, color=["tab:green"] + ["tab:red"] * (len(BUCKETS) - 1))
    ax[0, 0].set_xscale("log")
    ax[0, 0].set_xlabel("% of wall time (log)")
    ax[0, 0].set_title(f"Wall time: ETTR {100 * s.ettr.mean:.2f}% "
                       f"(95% CI {100 * s.ettr.lo:.2f}-{100 * s.ettr.hi:.2f})")
    job = doc["config"]["job"]
    pub = published_scaled(job["gpus"], job["gpus_per_host"], job["days"])
    names = [c.label for c in CATALOG]
    y = range(len(CATALOG))
    ax[0, 1].barh([i + 0.2 for i in y], [s.causes[c.name].mean for c in CATALOG], height=0.4, label="simulated")
    ax[0, 1].barh([i - 0.2 for i in y], [pub[c.name] for c in CATALOG], height=0.4, label="Llama 3 rates")
    ax[0, 1].set_yticks(list(y), names, fontsize=7)
    ax[0, 1].invert_yaxis()
    ax[0, 1].legend(loc="lower right")
    ax[0, 1].set_title("Unplanned interruptions by cause")
    curve = doc["checkpoint_interval"].get("curve")
    if doc.get("sweep"):
        labels = [", ".join(f"{v}" for _, v in pt["overrides"]) for pt in doc["sweep"]]
        ax[1, 0].errorbar(range(len(labels)), [100 * p["ettr"]["mean"] for p in doc["sweep"]],
                          yerr=[100 * (p["ettr"]["ci95"][1] - p["ettr"]["mean"]) for p in doc["sweep"]], marker="o")
        ax[1, 0].set_xticks(range(len(labels)), labels, rotation=30, fontsize=7)
        ax[1, 0].set_title("Sweep: " + ", ".join(k for k, _ in doc["sweep"][0]["overrides"]))
        ax[1, 0].set_ylabel("ETTR %")
    elif curve:
        ax[1, 0].plot([c["interval_s"] / 60 for c in curve], [100 * c["ettr"] for c in curve], marker="o")
        ax[1, 0].axvline(doc["checkpoint_interval"]["daly_s"] / 60, color="k", ls="--", label="Young/Daly")
        ax[1, 0].set_xscale("log")
        ax[1, 0].set_xlabel("checkpoint interval (min)")
        ax[1, 0].set_ylabel("ETTR %")
        ax[1, 0].legend()
        ax[1, 0].set_title("Checkpoint interval: simulated vs Young/Daly")
    ax[1, 1].hist([100 * x for x in doc["ettr_runs"]], bins=20)
    ax[1, 1].set_xlabel("ETTR % of one replication")
    ax[1, 1].set_title("Spread across replications")
    days = min(3.0, job["days"])
    ts, mw = power_trace(s.first.down_intervals, doc["power"]["busy_mw"], doc["power"]["idle_mw"],
                         doc["config"]["power"]["ramp_s"], days * 86400.0)
    ax[2, 0].plot([t / 3600 for t in ts], mw, lw=0.8)
    ax[2, 0].set_xlabel("hours (replication 0)")
    ax[2, 0].set_ylabel("facility MW")
    ax[2, 0].set_title(f"Job power, first {days:g} days: swing {doc['power']['swing_mw']:.1f} MW, "
                       f"peak step {doc['power']['peak_step_mw']:.2f} MW/{doc['config']['power']['window_s']:g} s")
    if doc.get("whatifs"):
        rows = doc["whatifs"]
        ax[2, 1].barh([w["name"][:40] for w in rows], [100 * w["delta"] for w in rows])
        ax[2, 1].axvline(0, color="k", lw=0.8)
        ax[2, 1].invert_yaxis()
        ax[2, 1].tick_params(axis="y", labelsize=7)
        ax[2, 1].set_xlabel("ETTR change (percentage points)")
        ax[2, 1].set_title("What-ifs")
    else:
        ax[2, 1].axis("off")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
