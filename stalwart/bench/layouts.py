"""`stalwart bench layouts`: tokens/s and per-rank state bytes of parallel layouts vs one process.

Each layout runs the real `stalwart train` (the tiny flavor, seq 256) for a few steps; the figures
come from the run's summary.json (steady-state tokens/s excludes the first three steps).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from stalwart.config.arguments import ArgumentParser, at_least, listed, one_of
from stalwart.paths import RunPaths
from stalwart.runtime.settings import DEVICES

LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "1 process": (1, []),
    "dp_shard=2": (2, ["--parallelism.data_parallel", "shard"]),
    "replicate=2 (auto)": (2, []),
    "tp=2": (2, ["--parallelism.tp", "2", "--parallelism.dp_shard", "1"]),
    "pp=2 (1f1b)": (2, ["--parallelism.pp", "2", "--parallelism.dp_shard", "1"]),
    "cp=2": (2, ["--parallelism.cp", "2", "--parallelism.dp_shard", "1"]),
    "dp_shard=4": (4, ["--parallelism.data_parallel", "shard"]),
    "hsdp 2x2": (4, ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2"]),
    "dp2 x tp2": (4, ["--parallelism.tp", "2", "--parallelism.dp_shard", "2"]),
    "pp2 x dp2": (4, ["--parallelism.pp", "2", "--parallelism.dp_shard", "2"]),
}

COMMON = ["--model.flavor", "tiny", "--model.tie_embeddings", "false", "--data.seq_len", "256",
          "--data.vocab_size", "1024", "--data.tokenizer_train_mb", "0.5", "--training.global_batch", "8",
          "--training.micro_batch", "2", "--scheduler.warmup_steps", "2", "--eval.interval", "0",
          "--eval.at_start", "false", "--eval.batches", "1", "--checkpoint.at_end", "false",
          "--sample.max_new_tokens", "0", "--metrics.progress", "false"]


def run_layout(nproc: int, extra: list[str], steps: int, workdir: Path, device: str = "auto") -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "stalwart", "train", "--run.dir", str(workdir), *COMMON,
           "--training.steps", str(steps), "--nproc-per-node", str(nproc), "--device", device, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return json.loads(RunPaths(workdir).summary.read_text())


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="stalwart bench layouts", description=__doc__)
    p.add_argument("--steps", type=at_least(1), default=12)
    p.add_argument("--only", type=listed(one_of(LAYOUTS)), default=[], help="comma-separated layout names (default: all)")
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="auto", choices=DEVICES, help="where each layout trains (auto = cuda if available)")
    a = p.parse_args(argv)
    from stalwart.runtime.device import check_device  # imports torch: after the flags are parsed

    names = [n for n in LAYOUTS if not a.only or n in a.only]
    check_device(a.device, max(LAYOUTS[n][0] for n in names), "--device")
    results = {}
    print(f"{'layout':<14} {'procs':>5} {'tokens/s':>9} {'vs 1 proc':>9} {'params MiB':>10} {'grads MiB':>9} "
          f"{'optim MiB':>9}   (per-rank state bytes of rank 0)")
    base = None
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names):
            nproc, extra = LAYOUTS[name]
            s = run_layout(nproc, extra, a.steps, Path(tmp) / f"r{i}", a.device)
            base = base or (s["tokens_per_s"] if nproc == 1 else None)
            rel = f"{s['tokens_per_s'] / base:.2f}x" if base else "-"
            mib = 1 / 2**20
            print(f"{name:<14} {nproc:>5} {s['tokens_per_s']:>9.0f} {rel:>9} {s['param_bytes'] * mib:>10.2f} "
                  f"{s['grad_bytes'] * mib:>9.2f} {s['optim_bytes'] * mib:>9.2f}", flush=True)
            results[name] = s
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
