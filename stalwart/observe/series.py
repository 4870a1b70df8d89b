"""The dashboard's curves: a run's metrics.jsonl read incrementally into columns, served downsampled.

``SeriesCache`` keeps one ``RunSeries`` per run directory. Each request first reads only the bytes
appended to ``metrics.jsonl`` since the previous request (a 1M-step file is parsed once, then a few
lines per refresh), then answers with every field downsampled (LTTB) to a point budget, or with only
the points after the step the page already has. A re-logged step (training resumed from an older
checkpoint: the later line wins) replaces its value in place and bumps ``gen``, which tells a page
holding older points to ask for the whole curve again.

``find_runs(root)``: ``root`` itself when it is a run directory, else the run directories below it.
"""

from __future__ import annotations

import json
import math
import threading
from array import array
from bisect import bisect_left, bisect_right
from pathlib import Path
from typing import Any

import numpy as np

from stalwart.observe.downsample import downsample
from stalwart.paths import RunPaths

FIELDS = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s", "data_wait_s", "mem_bytes",
          # `stalwart rl` steps (their warm-up fine-tuning lines, kind "sft", are not the run's curve)
          "reward_mean", "kl", "clip_fraction", "logprob_mismatch_max", "staleness_max", "rollout_tokens_per_s",
          "trainer_tokens_per_s", "generator_idle_frac", "trainer_idle_frac")
EVAL = "eval_loss"
EVALS = (EVAL, "held_out_reward")  # evaluation lines: pre-training's eval loss, RL's held-out reward
RUN_MARKERS = ("metrics.jsonl", "events.jsonl", "config.toml")


def is_run(path: Path) -> bool:
    return path.is_dir() and any((path / m).is_file() for m in RUN_MARKERS)


def find_runs(root: str | Path, depth: int = 2) -> dict[str, Path]:
    """``{run id: directory}``: ``{"name": root}`` for a run directory, else the runs up to ``depth``
    levels below ``root``, keyed by their path relative to it."""
    root = Path(root)
    if is_run(root):
        return {root.resolve().name: root}
    found: dict[str, Path] = {}
    level = [root]
    for _ in range(depth):
        nxt = []
        for d in level:
            try:
                children = sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith("."))
            except OSError:
                continue
            for c in children:
                if is_run(c):
                    found[c.relative_to(root).as_posix()] = c
                else:
                    nxt.append(c)
        level = nxt
    return found


_NUM = (float, int)  # exact classes: a bool is not a number here


def _num(v: Any) -> float:
    return float(v) if v.__class__ in _NUM else math.nan


class _Column:
    """Steps (ascending, unique) and their values, appendable in place."""

    def __init__(self, fields: tuple[str, ...]) -> None:
        self.steps = array("q")
        self.vals = {f: array("d") for f in fields}

    def extend(self, recs: list[dict[str, Any]]) -> bool:
        """Add records in step order; True when an existing point changed. Records that only append
        (the common case: one column at a time) take the fast path."""
        steps = [r["step"] for r in recs]
        if steps and (not self.steps or steps[0] > self.steps[-1]) and all(a < b for a, b in zip(steps, steps[1:])):
            self.steps.extend(steps)
            for f, col in self.vals.items():
                col.extend([v if (v := r.get(f)).__class__ in _NUM else math.nan for r in recs])
            return False
        changed = False
        for r in recs:
            changed |= self.put(r["step"], r)
        return changed

    def put(self, step: int, rec: dict[str, Any]) -> bool:
        """Add or replace ``step``; True when an existing point changed (a re-logged step)."""
        if not self.steps or step > self.steps[-1]:
            self.steps.append(step)
            for f, col in self.vals.items():
                col.append(_num(rec.get(f)))
            return False
        i = bisect_left(self.steps, step)
        if i < len(self.steps) and self.steps[i] == step:
            for f, col in self.vals.items():
                col[i] = _num(rec.get(f))
        else:
            self.steps.insert(i, step)
            for f, col in self.vals.items():
                col.insert(i, _num(rec.get(f)))
        return True

    def view(self, since: int | None, points: int) -> dict[str, dict[str, list[float]]]:
        start = 0 if since is None else bisect_right(self.steps, since)
        x = np.frombuffer(self.steps, dtype=np.int64)[start:]
        out = {}
        for f, col in self.vals.items():
            xs, ys = downsample(x, np.frombuffer(col, dtype=np.float64)[start:], points)
            out[f] = {"x": xs, "y": ys}
        return out


class RunSeries:
    def __init__(self, run_dir: Path) -> None:
        self.path = RunPaths(run_dir).metrics
        self.offset = 0
        self.gen = 0
        self.records = 0
        self.train = _Column(FIELDS)
        self.eval = _Column(EVALS)
        self.lock = threading.Lock()

    def update(self) -> None:
        """Parse the complete lines appended since the last call."""
        try:
            size = self.path.stat().st_size
        except OSError:
            return
        if size < self.offset:  # the file was replaced: start over
            self.__init__(self.path.parent)
        if size == self.offset:
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read(size - self.offset)
        end = chunk.rfind(b"\n")
        if end < 0:
            return
        self.offset += end + 1
        lines = [ln for ln in chunk[:end].split(b"\n") if ln.strip()]
        try:  # one parser call for the whole chunk is several times faster than one per line
            recs = json.loads(b"[" + b",".join(lines) + b"]")
        except json.JSONDecodeError:
            recs = []
            for ln in lines:
                try:
                    recs.append(json.loads(ln))
                except json.JSONDecodeError:
                    continue  # a torn or foreign line: skip it, as the other readers do
        recs = [r for r in recs if isinstance(r, dict) and r.get("step").__class__ is int]
        changed = self.train.extend([r for r in recs if "loss" in r and r.get("kind") != "sft"])
        changed |= self.eval.extend([r for r in recs if any(f in r for f in EVALS)])
        self.records += len(recs)
        if changed:
            self.gen += 1

    def query(self, since: int | None = None, gen: int | None = None, points: int = 2000) -> dict[str, Any]:
        """Every field downsampled to ``points``; only the steps after ``since`` when ``gen`` is current."""
        with self.lock:
            self.update()
            full = since is None or gen != self.gen
            cut = None if full else since
            fields = self.train.view(cut, points)
            fields.update(self.eval.view(cut, points))
            last = self.train.steps[-1] if self.train.steps else None
            return {"gen": self.gen, "full": full, "last_step": last, "steps_logged": len(self.train.steps),
                    "since": cut, "fields": fields}


class SeriesCache:
    """One :class:`RunSeries` per run directory, kept across requests."""

    def __init__(self) -> None:
        self._runs: dict[Path, RunSeries] = {}
        self._lock = threading.Lock()

    def get(self, run_dir: Path) -> RunSeries:
        key = Path(run_dir).resolve()
        with self._lock:
            if key not in self._runs:
                self._runs[key] = RunSeries(key)
            return self._runs[key]
