"""Faults from outside the job: kill -9 or SIGSTOP a random worker of a running `stalwart train`.

    python benchmarks/chaos_outside.py --faults 6 --gap 6-12 --seed 0 -- \\
        --config debug --nproc-per-node 2 --launch.max_restarts 10 --training.steps 300 \\
        --checkpoint.memory_interval 5 --eval.interval 0 --run.dir runs/chaos

Starts the training command, then every GAP seconds (uniform in the range) picks one live worker of
the launcher at random and sends it SIGKILL or SIGSTOP, FAULTS times; waits for the command to end
and prints its exit code, each fault (when, which pid, which signal) and the supervisor's failure
records (rank, phase, detection latency, decision). With ``--reference DIR`` it also trains the same
command without faults into DIR and compares every step's loss and the final checkpoint bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path


def _children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (the launcher's workers)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            out.append(int(entry))
    return out


def _arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _losses(run: Path) -> dict[int, float]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec and "step" in rec:
            out[rec["step"]] = rec["loss"]  # a recomputed step overwrites: the last value counts
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", type=int, default=6)
    ap.add_argument("--gap", default="6-12", help="seconds between faults, LO-HI")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default="kill,stop")
    ap.add_argument("--reference", default="", help="train the same command without faults here and compare")
    ap.add_argument("train", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    argv = [a for a in args.train if a != "--"]
    lo, hi = (float(x) for x in args.gap.split("-"))
    rng = random.Random(args.seed)
    cmd = [sys.executable, "-m", "stalwart", "train", *argv]
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    fired = []
    for _ in range(args.faults):
        deadline = time.time() + rng.uniform(lo, hi)
        while time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        while not (workers := _children(proc.pid)) and proc.poll() is None:  # none yet, or between attempts
            time.sleep(0.05)
        if proc.poll() is not None:
            break
        pid, kind = rng.choice(workers), rng.choice(args.kinds.split(","))
        with_signal = signal.SIGKILL if kind == "kill" else signal.SIGSTOP
        try:
            os.kill(pid, with_signal)
        except ProcessLookupError:
            continue
        fired.append({"t": round(time.time() - t0, 2), "pid": pid, "signal": with_signal.name})
    _, err = proc.communicate()
    code = proc.returncode
    run = Path(_arg(argv, "--run.dir"))
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]
    print(f"exit {code} after {time.time() - t0:.1f} s; {len(fired)} faults fired")
    for f in fired:
        print(f"  fault  t={f['t']:7.2f} s  pid {f['pid']}  {f['signal']}")
    for e in events:
        if e["event"] == "failure":
            print(f"  failure t={e['detect_time'] - t0:7.2f} s  rank {e['rank']} {e['kind']} in {e.get('phase')} "
                  f"(exit {e['exitcode']}), latency {e['detection_latency_s']} s, {e['decision']}, "
                  f"{e.get('failures_in_a_row')} in a row")
        elif e["event"] == "recovered":
            print(f"  recovered attempt {e['attempt']}: fault -> next step {e['fault_to_step_s']} s")
    if code != 0:
        print(err[-2000:], file=sys.stderr)
    if not args.reference:
        return code
    ref = Path(args.reference)
    ref_argv = list(argv)
    ref_argv[ref_argv.index("--run.dir") + 1] = str(ref)
    subprocess.run([sys.executable, "-m", "stalwart", "train", *ref_argv], check=True, capture_output=True)
    from stalwart.checkpoint.inspect import digest

    a, b = _losses(ref), _losses(run)
    steps = int(_arg(argv, "--training.steps"))
    same_losses = a == b and len(a) == steps
    last = f"step-{steps}"
    same_state = all(digest(ref / "checkpoints" / last, p) == digest(run / "checkpoints" / last, p)
                     for p in ("model.", "optim."))
    print(f"bit for bit: losses of all {steps} steps {'equal' if same_losses else 'DIFFER'}; final weights and "
          f"optimizer state {'equal' if same_state else 'DIFFER'}")
    return code or int(not (same_losses and same_state))


if __name__ == "__main__":
    sys.exit(main())
