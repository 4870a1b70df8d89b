"""kill -9 a single controller (`stalwart train --controller` or `stalwart rl`) at random moments, run the
same command again after each kill, and compare the finished run with an uninterrupted one.

    python benchmarks/controller_chaos.py --kills 4 --gap 2-10 --seed 0 --reference runs/ref -- \\
        train --controller --nproc-per-node 2 --config debug --training.steps 40 \\
        --checkpoint.memory_interval 5 --eval.interval 0 --run.dir runs/chaos

Each session is killed (SIGKILL, the controller process alone) GAP seconds (uniform in the range) after
its journal shows the session started, i.e. at a random moment of training: a step being sent, trained,
journaled, a snapshot, a weight sync, a generation. After each kill every process the controller had
started must be gone within 30 s (an orphan is reported). After KILLS kills the command runs to its
end. With ``--reference DIR`` the same command is first run without faults into DIR and compared:
`train`: every step's loss, the state fingerprints (`stalwart compare`) and the final checkpoint's model
and optimizer digests; `rl`: every RL step's reward, loss and gradient norm, and the final held-out reward.
Prints where each kill landed (the journal's last command), where each rerun resumed, and how many
journaled steps it computed again and checked.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from stalwart.metrics.records import read_jsonl  # noqa: E402 - after the repository is on the path
from stalwart.paths import RunPaths  # noqa: E402
from stalwart.procs import descendants, pid_alive  # noqa: E402


def _journal(run: Path) -> list[dict]:
    return read_jsonl(RunPaths(run).journal)


def _sessions(run: Path) -> list[dict]:
    return [e for e in _journal(run) if e["cmd"] == "session"]


def _stalwart(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "stalwart", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def _arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _kill_once(cmd: list[str], run: Path, gap: float) -> dict:
    """Start ``cmd``, wait for its session, then ``gap`` s more, SIGKILL it; where the kill landed."""
    before = len(_sessions(run))
    proc = _stalwart(cmd)
    while len(_sessions(run)) == before:
        if proc.poll() is not None:
            raise SystemExit(f"the command ended (exit {proc.returncode}) before its session began:\n"
                             f"{proc.stdout.read()[-2000:]}")
        time.sleep(0.05)
    session = _sessions(run)[-1]
    time.sleep(gap)
    if proc.poll() is not None:
        return {"session": session, "finished_first": True}
    children = descendants(proc.pid)
    last = _journal(run)[-1]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while (left := {p for p in children if pid_alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    return {"session": session, "gap_s": round(gap, 2), "last_command": f"{last['cmd']} {last.get('step')}",
            "actors": len(children), "orphans": sorted(left)}


def _compare(kind: str, ref: Path, run: Path) -> dict:
    def lines(r: Path) -> list[dict]:
        return [json.loads(x) for x in (r / "metrics.jsonl").read_text().splitlines() if x.strip()]

    if kind == "train":
        from stalwart.checkpoint.inspect import digest

        la, lb = ({m["step"]: m["loss"] for m in lines(r) if "loss" in m} for r in (ref, run))
        final = max(la)
        a, b = ref / "checkpoints" / f"step-{final}", run / "checkpoints" / f"step-{final}"
        same_fp = subprocess.run([sys.executable, "-m", "stalwart", "compare", str(ref), str(run)], cwd=REPO,
                                 capture_output=True, text=True).returncode == 0
        return {"losses_equal": la == lb, "fingerprints_equal": same_fp,
                "model_equal": digest(a, "model.") == digest(b, "model."),
                "optimizer_equal": digest(a, "optim.") == digest(b, "optim.")}
    fields = ("reward_mean", "loss", "grad_norm")
    sa, sb = ({m["step"]: tuple(m[k] for k in fields) for m in lines(r) if m.get("kind") == "rl"} for r in (ref, run))
    fa, fb = (json.loads((r / "summary.json").read_text()) for r in (ref, run))
    stale = max(m["staleness_max"] for m in lines(run) if m.get("kind") == "rl")
    return {"rl_steps_equal": sa == sb, "differing_steps": sorted(s for s in sa if sa[s] != sb.get(s)),
            "final_reward_equal": fa["final_reward_mean"] == fb["final_reward_mean"], "staleness_max": stale,
            "groups_trained": [fa["groups_trained"], fb["groups_trained"]]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--gap", default="2-10", help="seconds after a session starts, uniform in A-B")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reference", type=Path, help="train the command without faults here and compare")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- train --controller ... | -- rl ...")
    a = p.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    kind, run = cmd[0], Path(_arg(cmd, "--run.dir"))
    lo, hi = (float(x) for x in a.gap.split("-"))
    rng = random.Random(a.seed)
    t0 = time.time()
    if a.reference is not None:
        ref_cmd = [x if x != str(run) else str(a.reference) for x in cmd]
        out = _stalwart(ref_cmd).communicate()[0]
        print(f"reference: {time.time() - t0:.0f} s", flush=True)
    kills = []
    for i in range(a.kills):
        k = _kill_once(cmd, run, rng.uniform(lo, hi))
        kills.append(k)
        print(f"kill {i + 1}: {json.dumps(k)}", flush=True)
        if k.get("finished_first") or (run / "summary.json").exists():  # the kill came after the end
            break
    t1 = time.time()
    proc = _stalwart(cmd) if not (kind == "rl" and (run / "summary.json").exists()) else None
    out = proc.communicate()[0] if proc is not None else ""
    code = proc.returncode if proc is not None else 0
    print(f"final session: exit {code}, {time.time() - t1:.0f} s; sessions:", flush=True)
    for s in _sessions(run):
        print("  ", {k: s.get(k) for k in ("step", "source", "checks")})
    if code != 0:
        print(out[-3000:])
        return 1
    result = {"kills": len(kills), "orphans": sum(len(k.get("orphans", [])) for k in kills)}
    if a.reference is not None:
        result.update(_compare(kind, a.reference, run))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
