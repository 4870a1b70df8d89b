"""Stalwart beside its peers on the reference workload, measured in one interleaved session.

    python benchmarks/peer_bench.py --setup            # once: the peers' environment (pinned versions)
    python benchmarks/peer_bench.py [--repeats 3] [--steps 8] [--configs 1x1,1x2,2x1] [--dtypes float32,bfloat16]
                                    [--modes eager,compiled]

Peers (see benchmarks/peers/worker.py for exactly what each runs): Stalwart's training core,
torchtitan's Llama 3 model (PyPI ``torchtitan``, FSDP2 for several processes, as torchtitan trains),
karpathy/nanoGPT's model.py (vendored at a fixed commit, MIT licence) and Hugging Face transformers'
LlamaForCausalLM. They run in their own virtual environment (``benchmarks/.peers-venv``), which holds
the pinned packages below and sees torch from the environment that created it (a ``.pth`` file), so
every peer runs the same torch build. torchtitan's own requirements are wide (datasets, wandb, ...);
only the modules its model code imports are installed, pinned, without their dependencies (``triton``
among them: torchtitan's MoE module imports it unconditionally; on CPU tensors inductor still generates
C++).

Every figure is reported as tokens/s and as model TFLOP/s (tokens/s x the peer's FLOPs per token, the
same 6N + attention convention for all): nanoGPT's GPT-2 block does fewer FLOPs per token than the Llama
block of the others, so its tokens/s compares different work.

The measurements interleave: every repeat runs every configuration and every peer, with the peers'
order rotated from repeat to repeat, so a change in the machine's load hits all of them alike. The
table prints every repeat, the median, and Stalwart's median over the best peer's. ``uptime`` is
printed before and after: on a shared machine the absolute figures move, the ratios much less.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKER = HERE / "peers" / "worker.py"
DEFAULT_VENV = HERE / ".peers-venv"
PINNED = ["transformers==5.23.0", "torchtitan==0.3.0", "spmd_types==0.2.3", "tyro==1.0.17",
          "docstring_parser==0.18.0", "triton==3.9.0"]  # the `peers` extra in pyproject.toml
PEERS = ("stalwart", "torchtitan", "nanogpt", "hf")
NAMES = {"stalwart": "Stalwart", "torchtitan": "torchtitan", "nanogpt": "nanoGPT", "hf": "HF transformers (Llama)"}


def setup(venv: Path) -> None:
    """Create the peers' environment: its own site-packages with the pinned packages, torch shared."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "shared-torch.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--ignore-installed", "--no-deps", *PINNED],
                   check=True)
    subprocess.run([str(py), "-c", "import transformers, torch, torchtitan.models.llama3; print('peers env: "
                    "transformers', transformers.__version__, 'from', transformers.__file__, '; torchtitan', "
                    "torchtitan.__file__, '; torch', torch.__version__)"], check=True)


def measure(py: Path, peer: str, procs: int, threads: int, steps: int, warmup: int, dtype: str = "float32",
            compiled: bool = False, workload: str = "reference") -> dict:
    """One measurement; a run that fails comes back as ``{"error": its last line}``."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([str(py), str(WORKER), "--peer", peer, "--procs", str(procs), "--threads", str(threads),
                           "--steps", str(steps), "--warmup", str(warmup), "--dtype", dtype, "--workload", workload]
                          + (["--compile"] if compiled else []),
                          capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith(" ")]
        return {"error": error_line(lines)}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def error_line(stderr_lines: list[str]) -> str:
    """The line that names a failed run's error: the last ``SomethingError: ...`` line, else the last line."""
    errors = [ln for ln in stderr_lines if ln.split(":")[0].endswith(("Error", "Exception"))]
    return (errors or stderr_lines or ["exited without output"])[-1][:300]


def _key(r: dict) -> tuple:
    return r.get("dtype", "float32"), bool(r.get("compile")), r["procs"], r["threads"]


def summarize(results: list[dict]) -> list[dict]:
    """Per configuration and precision: every peer's repeats and median, and Stalwart's median over the
    best peer's."""
    rows = []
    configs = sorted({_key(r) for r in results}, key=lambda c: (c[0] != "float32", c[1], c[2], c[3]))
    for key in configs:
        dtype, compiled, procs, threads = key
        here = [r for r in results if _key(r) == key]
        runs = {p: [r["tokens_per_s"] for r in here if r["peer"] == p] for p in PEERS}
        cpu = {p: statistics.median(v) for p in PEERS
               if (v := [r["cpu_s_per_step"] for r in here if r["peer"] == p and "cpu_s_per_step" in r])}
        tflops = {p: [r["tokens_per_s"] * r["flops_per_token"] / 1e12 for r in here if r["peer"] == p]
                  for p in PEERS}
        medians = {p: statistics.median(v) for p, v in runs.items() if v}
        tflops_medians = {p: statistics.median(v) for p, v in tflops.items() if v}
        others = {p: m for p, m in tflops_medians.items() if p != "stalwart"}
        best = max(others, key=others.get) if others else None
        ratio = tflops_medians["stalwart"] / others[best] if best and "stalwart" in tflops_medians else None
        rows.append({"dtype": dtype, "compile": compiled, "procs": procs, "threads": threads, "runs": runs,
                     "medians": medians, "tflops": tflops_medians, "cpu": cpu, "best_peer": best, "ratio": ratio})
    return rows


def format_table(rows: list[dict]) -> str:
    """tokens/s: median (every repeat), then the median's model TFLOP/s; the ratio is by model FLOP/s."""
    lines = ["| config | " + " | ".join(NAMES[p] for p in PEERS) + " | Stalwart / best peer (FLOP/s) |",
             "|---|" + "---|" * (len(PEERS) + 1)]
    for row in rows:
        cells = []
        for p in PEERS:
            v = row["runs"].get(p) or []
            cells.append(f"{row['medians'][p]:,.0f} ({', '.join(f'{x:,.0f}' for x in v)}); "
                         f"{row['tflops'][p]:.3f} TFLOP/s" + (f"; {row['cpu'][p]:.2f} CPU s/step" if p in row.get("cpu", {})
                                                              else "") if v else "-")
        ratio = f"{row['ratio']:.2f}x vs {NAMES[row['best_peer']]}" if row["ratio"] else "-"
        precision = "" if row.get("dtype", "float32") == "float32" else f", {row['dtype']}"
        precision += ", compiled" if row.get("compile") else ""
        lines.append(f"| {row['procs']} process x {row['threads']} thread{precision} | " + " | ".join(cells)
                     + f" | {ratio} |")
    return "\n".join(lines)


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setup", action="store_true", help="create the peers' environment and exit")
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="timed steps per measurement")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--configs", default="1x1,1x2,2x1", help="processes x threads per process, comma-separated")
    p.add_argument("--peers", default=None, help="comma-separated (default: all four for the reference workload, "
                   "stalwart,torchtitan for the others)")
    p.add_argument("--workload", default="reference", choices=("reference", "long", "moe"),
                   help="reference; long: 4x the sequence, context parallel over the processes; moe: debug-moe, "
                        "expert parallel over the processes")
    p.add_argument("--dtypes", default="float32",
                   help="precisions, comma-separated: float32 (the reference) and/or bfloat16 (mixed precision: "
                        "Stalwart's training.dtype, the peers under torch.autocast)")
    p.add_argument("--modes", default="eager", help="eager and/or compiled (regional compile of every peer's "
                   "blocks; the warm-up absorbs compilation), comma-separated")
    p.add_argument("--json", type=Path, default=None, help="also write every measurement here")
    a = p.parse_args(argv)
    if a.setup:
        setup(a.venv)
        return 0
    py = a.venv / "bin" / "python"
    if not py.exists():
        print(f"peer_bench: no peers' environment at {a.venv}; run with --setup first", file=sys.stderr)
        return 2
    configs = [tuple(int(x) for x in c.split("x")) for c in a.configs.split(",")]
    peers = (a.peers or (",".join(PEERS) if a.workload == "reference" else "stalwart,torchtitan")).split(",")
    print(f"before: {_uptime()}", flush=True)
    results, failures = [], []
    for rep in range(a.repeats):
        order = peers[rep % len(peers):] + peers[:rep % len(peers)]
        for dtype in a.dtypes.split(","):
            for mode in a.modes.split(","):
                for procs, threads in configs:
                    for peer in order:
                        r = measure(py, peer, procs, threads, a.steps, a.warmup, dtype, mode == "compiled",
                                    a.workload)
                        head = f"repeat {rep + 1} {procs}x{threads} {dtype} {mode} {peer:>10}:"
                        if "error" in r:
                            failures.append(f"{peer} {procs}x{threads} {mode}: {r['error']}")
                            print(f"{head} failed: {r['error']}", flush=True)
                            continue
                        results.append({**r, "repeat": rep})
                        cpu = f", {r['cpu_s_per_step']:.2f} CPU s/step" if "cpu_s_per_step" in r else ""
                        print(f"{head} {r['tokens_per_s']:8.0f} tokens/s ({r['step_s'] * 1e3:.0f} ms/step{cpu}, "
                              f"warm-up {r['warmup_s']:.1f} s)", flush=True)
    print(f"after: {_uptime()}\n")
    print(format_table(summarize(results)))
    for line in sorted(set(failures)):
        print(f"failed: {line}")
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
