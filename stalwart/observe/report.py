"""``stalwart report``: a static, self-contained HTML report, PNG plots and a Perfetto trace."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from stalwart.observe.aggregate import load_timings
from stalwart.observe.page import render_page
from stalwart.observe.reader import load_run, panels, to_json
from stalwart.observe.series import RunSeries
from stalwart.observe.trace import build_trace
from stalwart.paths import RunPaths


def _plots(data: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)

    train, evals = data["train"], data["eval"]

    def xy(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(*xy(train, "loss"), label="train loss")
    ax.plot(*xy(evals, "eval_loss"), "o-", label="eval loss")
    ax.set_xlabel("step"), ax.set_ylabel("loss"), ax.legend(), ax.grid(alpha=0.3)
    save(fig, "loss.png")

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.2))
    a1.plot(*xy(train, "tokens_per_s")), a1.set_title("tokens/s"), a1.set_xlabel("step"), a1.grid(alpha=0.3)
    a2.plot(*xy(train, "mfu")), a2.set_title("MFU"), a2.set_xlabel("step"), a2.grid(alpha=0.3)
    save(fig, "throughput.png")

    st = data["stragglers"] or {"rows": []}
    worst = sorted((r for r in st["rows"] if r["flagged"] and not r["wait"] and r["phase"] != "step_time_s"),
                   key=lambda r: -r["score"])
    for field in ["step_time_s"] + ([worst[0]["phase"]] if worst else []):
        hm = data["heatmaps"].get(field)
        if not hm or not hm["ranks"]:
            continue
        import numpy as np

        m = np.array([[np.nan if v is None else v * 1e3 for v in row] for row in hm["matrix"]])
        fig, ax = plt.subplots(figsize=(9, 1.5 + 0.45 * len(hm["ranks"])))
        im = ax.imshow(m, aspect="auto", cmap="RdYlGn_r", interpolation="nearest",
                       extent=(hm["steps"][0] - 0.5, hm["steps"][-1] + 0.5, len(hm["ranks"]) - 0.5, -0.5))
        ax.set_yticks(range(len(hm["ranks"])), [f"rank {r}" for r in hm["ranks"]])
        ax.set_xlabel("step"), ax.set_title(f"{field} per rank and step")
        fig.colorbar(im, ax=ax, label="ms")
        save(fig, "heatmap.png" if field == "step_time_s" else f"heatmap-{field}.png")

    ex = data.get("experts")
    if ex:
        import numpy as np

        layers = ex["layers"]
        fig, axes = plt.subplots(len(layers), 1, figsize=(9, 0.9 + 1.6 * len(layers)), squeeze=False)
        for ax, layer in zip(axes[:, 0], layers):
            m = np.array([[np.nan if v is None else v for v in row] for row in ex["load"][layer]])
            im = ax.imshow(m, aspect="auto", cmap="RdYlGn_r", interpolation="nearest", vmin=0,
                           extent=(ex["steps"][0] - 0.5, ex["steps"][-1] + 0.5, m.shape[0] - 0.5, -0.5))
            ax.set_ylabel(f"layer {layer}\nexpert"), fig.colorbar(im, ax=ax, label="load / mean")
        axes[0, 0].set_title("tokens per expert and step, relative to the mean"), axes[-1, 0].set_xlabel("step")
        save(fig, "experts.png")

    gp = data["goodput"]
    if gp:
        fig, ax = plt.subplots(figsize=(9, 1.8))
        left = 0.0
        for k, v in gp["buckets"].items():
            ax.barh([0], [v], left=left, label=f"{k} {v:.1f}s")
            left += v
        ax.set_yticks([]), ax.set_xlabel("seconds")
        ax.set_title(f"goodput: ETTR {100 * (gp['ettr'] or 0):.1f}% of {gp['wall_s']:.1f} s wall-clock")
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
        save(fig, "goodput.png")
    return written


POINTS = 4000  # per curve in the static report


def write_report(run_dir: str | Path, out: str | Path | None = None, trace: bool = True,
                 trace_steps: tuple[int | None, int | None] = (None, None), plots: bool = True) -> dict[str, Any]:
    """Write ``report.html`` (+ PNGs, ``trace.json``) into ``out`` (default ``<run_dir>/report``)."""
    run_dir = Path(run_dir)
    out = Path(out) if out else RunPaths(run_dir).report_dir
    out.mkdir(parents=True, exist_ok=True)
    data = load_run(run_dir)
    rid = run_dir.resolve().name
    href = Path(os.path.relpath(RunPaths(run_dir).profile_dir, out.resolve())).as_posix() + "/{name}"
    page = {"root": str(run_dir), "runs": [{"id": rid, "path": str(run_dir)}], "message": None,
            "series": {rid: RunSeries(run_dir).query(points=POINTS)}, "panels": {rid: panels(data, run_dir, href)}}
    (out / "report.html").write_text(render_page(run_dir.name, to_json(page)), encoding="utf-8")
    files = [out / "report.html"]
    if plots:
        files += _plots(data, out)
    if trace:
        timings = load_timings(run_dir)
        first, last = trace_steps
        if first is None and last is None and timings:  # default window: the last 20 steps
            last = max(r["step"] for r in timings)
            first = last - 19
        (out / "trace.json").write_text(json.dumps(build_trace(timings, first, last)))
        files.append(out / "trace.json")
    return {"out": out, "files": files, "data": data}
