"""Everything the dashboard and report show, read fresh from a run directory (and nothing else)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from stalwart.metrics.records import read_jsonl
from stalwart.observe.aggregate import heatmap, load_timings, phase_names, straggler_scores
from stalwart.observe.diagnose import analyze, format_diagnosis, load_dumps
from stalwart.observe.experts import expert_view
from stalwart.observe.goodput import account
from stalwart.observe.profiler import list_profiles
from stalwart.paths import RunPaths

TRAIN_FIELDS = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s", "data_wait_s", "mem_bytes",
                "reward_mean")


def _num(v: Any) -> float | None:
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _clean(obj: Any) -> Any:
    """JSON-safe (no NaN/Inf, which browsers' JSON.parse rejects)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def load_run(run_dir: str | Path, heatmap_steps: int = 200, max_events: int = 500,
             straggler_threshold: float = 1.2) -> dict[str, Any]:
    run_dir = Path(run_dir)
    paths = RunPaths(run_dir)
    metrics = read_jsonl(paths.metrics)
    events = read_jsonl(paths.events)
    timings = load_timings(run_dir)
    # NOTE: after a restart, steps are recomputed; the curves show each step's newest record.
    newest = {m["step"]: m for m in metrics if "loss" in m and "step" in m and m.get("kind") != "sft"}
    train = [{"step": s, **{k: _num(m.get(k)) for k in TRAIN_FIELDS}, "time": m.get("time")}
             for s, m in sorted(newest.items())]
    evals = [{"step": m["step"], "eval_loss": _num(m.get("eval_loss")), "time": m.get("time")}
             for m in metrics if "eval_loss" in m and "step" in m]
    fields = ["step_time_s"] + phase_names(timings)
    summary = None
    if paths.summary.is_file():
        try:
            summary = json.loads(paths.summary.read_text())
        except json.JSONDecodeError:
            summary = None
        summary = summary if isinstance(summary, dict) else None
    dumps = load_dumps(run_dir)
    flight = analyze(dumps) if dumps else None
    data = {
        "run_dir": str(run_dir), "name": run_dir.name,
        "train": train, "eval": evals,
        "events": events[-max_events:], "n_events": len(events),
        "heatmaps": {f: heatmap(timings, f, heatmap_steps) for f in fields} if timings else {},
        "stragglers": straggler_scores(timings, straggler_threshold) if timings else None,
        "goodput": account(events, metrics),
        "summary": summary,
        "flight": flight,
        "flight_text": format_diagnosis(flight) if flight else None,
        "n_ranks": len({t["rank"] for t in timings}),
        "experts": expert_view([m for _, m in sorted(newest.items())], heatmap_steps),
    }
    return _clean(data)


def panels(data: dict[str, Any], run_dir: str | Path, profile_href: str) -> dict[str, Any]:
    """What the page shows for one run besides its curves (which come downsampled from the series
    reader): ``data`` (from :func:`load_run`) without ``train``/``eval``, plus the newest training record
    and the profiler outputs (``profile_href`` formats each file's link from its ``{name}``)."""
    out = {k: v for k, v in data.items() if k not in ("train", "eval")}
    out["last"] = data["train"][-1] if data["train"] else None
    out["profiles"] = [{**p, "href": profile_href.format(name=p["name"])} for p in list_profiles(RunPaths(run_dir))]
    return out


def to_json(data: dict[str, Any]) -> str:
    return json.dumps(data, separators=(",", ":"), default=str)
