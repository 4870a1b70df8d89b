"""The cost of exact log-probabilities per trainer layout: `stalwart rl` step time with
`--rl.logprobs exact` over the same run with `--rl.logprobs engine` (the fast path), interleaved.

    python benchmarks/rl_exact_cost.py --repeats 2 --steps 6 --out runs/exact-cost

Per repeat, every layout runs once in each mode, alternating (exact, engine, exact, engine, ...), so a
change of the machine's load falls on both. Per timed RL step (every step after the
first, `metrics.jsonl`) of the exact run: its `step_s` and the exact mode's extra work in it
(`rescore_s`: the generator's re-scoring forward; `exact_score_s`: the trainers' scoring pass under
tp/ep), the extra over the rest of the step, and their median plus one: the estimated ratio exact /
fast from work measured in the same steps, which a change of the machine's load between two runs does
not skew. Also the ratio of the two runs' median step times, the CPU seconds of each whole run (the
command and every process it waited for) and the load average before and after each run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# name -> the layout's flags (rl_code's model unless it names another)
LAYOUTS = {
    "dp (1 trainer)": [],
    "fsdp (dp_shard=2)": ["--workers.trainers", "2", "--parallelism.dp_shard", "2"],
    "tp=2": ["--workers.trainers", "2", "--parallelism.tp", "2"],
    "moe dp_shard=2": ["--model.flavor", "debug-moe", "--workers.trainers", "2", "--parallelism.dp_shard", "2"],
    "moe ep=2": ["--model.flavor", "debug-moe", "--workers.trainers", "2", "--parallelism.dp_shard", "2",
                 "--parallelism.ep", "2"],
}


def run_once(out: Path, flags: list[str], mode: str, steps: int) -> dict:
    cmd = [sys.executable, "-m", "stalwart", "rl", "--config", "rl_code", "--rl.mode", "sync", "--rl.steps", str(steps),
           "--sft.steps", "4", "--rl.eval_interval", "1000", "--rl.eval_samples", "1", "--task.eval_per_family", "1",
           "--rl.logprobs", mode, *flags, "--run.dir", str(out)]
    load0 = os.getloadavg()[0]
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("kind") == "rl" and r["step"] > 1]
    extra = [(r["step_s"], r["rescore_s"] + r.get("exact_score_s", 0.0)) for r in rl]
    return {"steps": extra, "step_s": statistics.median(r["step_s"] for r in rl),
            "train_s": statistics.median(r["train_s"] for r in rl),
            "rescore_s": statistics.median(r["rescore_s"] for r in rl),
            "exact_score_s": statistics.median(r.get("exact_score_s", 0.0) for r in rl),
            "mismatch_max": max(r["logprob_mismatch_max"] for r in rl),
            "cpu_s": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime),
            "load": (load0, os.getloadavg()[0])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6, help="RL steps per run (the first is not timed)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated names of LAYOUTS")
    ap.add_argument("--out", default="runs/exact-cost")
    a = ap.parse_args()
    names = [n.strip() for n in a.layouts.split(",")]
    print("| layout | repeat | exact: step_s (extra) per step | extra / (step - extra) | estimate (median) | "
          "exact / engine step_s | mismatch (exact) | CPU s exact / engine | load before-after |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rep in range(a.repeats):
        for i, name in enumerate(names):
            got = {}
            for mode in (("exact", "engine") if (rep + i) % 2 == 0 else ("engine", "exact")):
                got[mode] = run_once(Path(a.out) / f"{i}-{mode}-{rep}", LAYOUTS[name], mode, a.steps)
            e, f = got["exact"], got["engine"]
            shares = [x / (t - x) for t, x in e["steps"]]
            print(f"| {name} | {rep + 1} | {', '.join(f'{t:.1f} ({x:.2f})' for t, x in e['steps'])} | "
                  f"{', '.join(f'{x:.2f}' for x in shares)} | {1 + statistics.median(shares):.2f} | "
                  f"{e['step_s']:.2f} / {f['step_s']:.2f} = {e['step_s'] / f['step_s']:.2f} | {e['mismatch_max']} | "
                  f"{e['cpu_s']:.0f} / {f['cpu_s']:.0f} | {e['load'][0]:.1f}-{e['load'][1]:.1f}, "
                  f"{f['load'][0]:.1f}-{f['load'][1]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
