"""A chaos drill: a clean run, the same run under faults sent from outside, and their comparison.

``run_drill(train_argv, opts)`` trains the reference (or takes a finished one), starts the chaos run
(``job.py``), sends ``opts.faults`` faults of the kinds asked for on a seeded schedule (``faults.py``),
each once the group trains again and has saved a state since the previous restarting fault (so the
crash-loop guard sees progress) and not in the last steps, and bounded by ``opts.timeout_s`` in all.
When the run has ended it reads what the run recorded about each fault (``events.jsonl``: the
supervisor's ``failure`` and ``recovered``, ``checkpoint_failed`` / ``checkpoint_saved``, ``resumed``,
``straggler``), writes the fault log (``<run>/chaos.jsonl``) and compares every step's state
fingerprint with the reference's. Exit 0 only when every fault was sent, the run finished and every
fingerprint equals the reference's.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from stalwart.chaos.faults import KINDS, RESTARTING, fire, unavailable
from stalwart.chaos.job import Job, namespaces_unavailable
from stalwart.checkpoint.manager import newest_complete_checkpoint
from stalwart.checkpoint.snapshot import SnapshotStore
from stalwart.config.loading import parse_train_argv
from stalwart.errors import UserError
from stalwart.observe.fingerprints import compare_runs, read_fingerprints
from stalwart.paths import RunPaths, checkpoint_step
from stalwart.procs import die_with_parent


@dataclass
class DrillOptions:
    faults: int = 20
    kinds: tuple[str, ...] = KINDS
    explicit_kinds: bool = False  # asked for by name: a kind that cannot run is an error, not a skip
    gap_s: tuple[float, float] = (1.0, 3.0)
    seed: int = 0
    hold_s: float = 15.0
    slow_s: float = 5.0
    timeout_s: float = 1800.0
    disk_mb: int = 256
    reference: Path | None = None


def plan(kinds: tuple[str, ...], n: int, rng: random.Random) -> list[str]:
    """``n`` kinds in a seeded order, every kind at least once when ``n`` allows, the rest drawn evenly."""
    out = list(kinds) * (n // len(kinds)) + rng.sample(list(kinds), n % len(kinds))
    rng.shuffle(out)
    return out


def _with_run_dir(argv: list[str], run: Path) -> list[str]:
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--run.dir":
            i += 2
            continue
        if not argv[i].startswith("--run.dir="):
            out.append(argv[i])
        i += 1
    return [*out, "--run.dir", str(run)]


def _finished(run: Path, steps: int) -> bool:
    try:
        return steps in read_fingerprints(run)
    except UserError:
        return False


def _train_reference(argv: list[str], ref: Path, steps: int, deadline: float) -> None:
    if _finished(ref, steps):
        print(f"chaos: reference {ref} (taken as it is: it has trained step {steps})", flush=True)
        return
    print(f"chaos: training the reference run into {ref}", flush=True)
    t0 = time.time()
    try:
        proc = subprocess.run([sys.executable, "-m", "stalwart", "train", *_with_run_dir(argv, ref)],
                              capture_output=True, text=True, timeout=max(1.0, deadline - time.time()),
                              preexec_fn=die_with_parent)
    except subprocess.TimeoutExpired:
        raise UserError(f"the reference run into {ref} did not finish within --timeout") from None
    if proc.returncode != 0 or not _finished(ref, steps):
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        raise UserError(f"the reference run into {ref} failed (exit {proc.returncode}): {tail}")
    print(f"chaos: reference trained in {time.time() - t0:.1f} s", flush=True)


class _Drill:
    def __init__(self, argv: list[str], opts: DrillOptions) -> None:
        flags, cfg = parse_train_argv(argv)
        if flags.get("--controller"):
            raise UserError("stalwart chaos drives the SPMD launcher: drop --controller")
        self.argv, self.opts, self.cfg = argv, opts, cfg
        self.nproc = int(flags.get("--nproc-per-node", flags.get("--nproc_per_node", cfg.launch.nproc_per_node)))
        self.paths = RunPaths.of(cfg.run)
        self.run, self.steps = self.paths.root, cfg.training.steps
        if self.paths.events.exists() or self.paths.metrics.exists():
            raise UserError(f"run.dir {self.run} has trained already: a chaos run needs a fresh run directory")
        self.reference = opts.reference or self.run.with_name(self.run.name + "-reference")
        if self.reference.resolve() == self.run.resolve():
            raise UserError("--reference must be another directory than the chaos run's run.dir")
        ck = cfg.checkpoint
        self.snapshot_dir = self.paths.snapshots(ck.memory_dir) if ck.memory_interval else None
        ns = namespaces_unavailable()
        kinds = []
        for kind in opts.kinds:
            if kind not in KINDS:
                raise UserError(f"--kinds: unknown fault kind {kind!r} (one of {', '.join(KINDS)})")
            why = unavailable(kind, self.nproc, ck.memory_interval, ck.interval, ns)
            if why and opts.explicit_kinds:
                raise UserError(f"--kinds {kind}: {why}")
            if why:
                print(f"chaos: skipping {kind}: {why}", flush=True)
            else:
                kinds.append(kind)
        if not kinds:
            raise UserError("no fault kind can run against this job (see the lines above)")
        self.isolated = ns is None and any(k in ("disk_full", "partition") for k in kinds)
        self.rng = random.Random(opts.seed)
        self.schedule = plan(tuple(kinds), opts.faults, self.rng)
        budget = cfg.launch.restarts() if self.nproc > 1 else max(cfg.launch.max_restarts, 0)
        restarting = sum(k in RESTARTING for k in self.schedule)
        if budget < restarting:
            raise UserError(f"launch.max_restarts is {budget}: the schedule has {restarting} faults that restart "
                            f"the group; set --launch.max_restarts {restarting} or more")
        self.margin = max(2, self.steps // 10)

    # ------------------------------------------------------------------ when a fault may land
    def _ready(self, job: Job, kind: str, last_progress: int, restart: tuple[int, float]) -> dict[int, dict] | None:
        beats = job.training(self.nproc)
        attempt, since = restart
        if beats is None or min(b["attempt"] for b in beats.values()) <= attempt:
            return None  # the previous fault's restart has not happened yet (a stopped rank looks alive)
        if since and not any(e.get("event") == "recovered" and e.get("time", 0) >= since for e in job.events()):
            return None  # ... or has not completed its first step (the supervisor's `recovered`)
        step = max(b.get("step", 0) for b in beats.values())
        margin = max(self.margin, 2 * self.cfg.checkpoint.interval) if kind == "disk_full" else self.margin
        if step > self.steps - margin:
            return None
        if kind in RESTARTING and job.progress() <= last_progress:
            return None  # no state saved since the previous restart: another now would look like a loop
        if kind == "corrupt_snapshot":
            snaps = SnapshotStore.common_steps(self.snapshot_dir) if self.snapshot_dir else set()
            disk = newest_complete_checkpoint(job.checkpoints)
            if not snaps or disk is None or max(snaps) <= checkpoint_step(disk):
                return None  # no disk checkpoint to fall back to yet, or the restart would take it anyway
        return beats

    def run_chaos(self, deadline: float) -> tuple[Job, list[dict], int | None]:
        self.paths.root.mkdir(parents=True, exist_ok=True)
        job = Job(self.argv, self.run, self.snapshot_dir, self.isolated, self.opts.disk_mb, self.paths.chaos_output)
        print(f"chaos: run {self.run} ({self.nproc} processes{', own mount + network namespace' if self.isolated else ''}); "
              f"{len(self.schedule)} faults: {', '.join(self.schedule)}", flush=True)
        sent: list[dict] = []
        last_progress, restart, lo, hi = -1, (-1, 0.0), *self.opts.gap_s
        try:
            for kind in self.schedule:
                victim = self.rng.randrange(self.nproc)
                wake = time.time() + self.rng.uniform(lo, hi)
                beats = None
                while job.running() and time.time() < deadline:
                    if time.time() >= wake and (beats := self._ready(job, kind, last_progress, restart)):
                        break
                    time.sleep(0.02)
                if not beats or not job.running():
                    break
                progress = job.progress()
                rec = fire(kind, job, beats, victim, self.opts.hold_s, self.opts.slow_s)
                if kind in RESTARTING:
                    last_progress = progress
                    if rec.get("sent") and (kind != "partition" or any(
                            e.get("event") == "failure" and e.get("detect_time", 0) >= rec["time"] for e in job.events())):
                        restart = (min(b["attempt"] for b in beats.values()), rec["time"])  # wait for the restart
                rec["t"] = round(rec["time"] - job.started, 2)
                sent.append(rec)
                print(f"chaos: {len(sent):3d} t={rec['t']:7.2f} s  {kind:<16} rank {victim} (pid {rec['pid']}) at "
                      f"step {rec['step']}", flush=True)
            code = job.wait(deadline)
        finally:
            job.stop()
        return job, sent, code


def _p50_max(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None]
    return f"{statistics.median(xs):.2f} / {max(xs):.2f}" if xs else "-"


def _restored(rec: dict, events: list[dict], detected: float, recovered: float) -> dict:
    """What the restart after corrupting the snapshots restored (its ``resumed`` event, or none: a fresh start)."""
    resumed = next((e for e in events if e["event"] == "resumed" and detected <= e["time"] <= recovered), None)
    newest = max(rec.get("snapshot_steps") or [0])
    if resumed is None:
        return {"resumed": None, "outcome": f"snapshot step {newest} refused by its checksum; no disk checkpoint "
                                            "yet: started again from the seeded initialisation"}
    out = {"resumed": {"source": resumed.get("source"), "step": resumed.get("step")}}
    if resumed.get("source") != "memory":
        out["outcome"] = f"snapshot step {newest} refused by its checksum; resumed from disk step {resumed['step']}"
    elif resumed.get("step") in (rec.get("snapshot_steps") or []):
        out["outcome"] = f"restored the corrupted snapshot of step {resumed['step']}"
    else:
        out["outcome"] = f"restored a newer snapshot (step {resumed.get('step')}) than the corrupted ones"
    return out


def annotate(sent: list[dict], events: list[dict]) -> list[dict]:
    """Each fault's record with what the run recorded about it: its failure (detection), recovery."""
    out = []
    for i, rec in enumerate(sent):
        t, until = rec["time"], rec["until"]
        nxt = sent[i + 1]["time"] if i + 1 < len(sent) else float("inf")
        within = [e for e in events if t <= e.get("detect_time", e.get("time", 0)) < nxt]
        row = {"time": round(t, 3), "t": rec["t"], "kind": rec["kind"],
               "target": {"rank": rec["rank"], "pid": rec["pid"], "step": rec["step"]},
               **{k: v for k, v in rec.items() if k not in ("time", "t", "kind", "rank", "pid", "step", "until", "freed")}}
        fail = next((e for e in within if e["event"] == "failure"), None)
        if fail is not None:
            row.update(detected_as={"rank": fail.get("rank"), "kind": fail.get("kind"), "phase": fail.get("phase"),
                                    "decision": fail.get("decision")},
                       detection_s=round(fail["detect_time"] - t, 3),
                       run_detection_latency_s=fail.get("detection_latency_s"))
            rec_ev = next((e for e in events if e["event"] == "recovered" and fail["detect_time"] <= e["time"] < nxt),
                          None)
            if rec_ev is not None:
                row.update(recovery_s=rec_ev.get("recovery_s"),
                           fault_to_step_s=round(fail["detect_time"] + rec_ev.get("recovery_s", 0) - t, 3),
                           steps_recomputed=rec_ev.get("steps_recomputed"))
            if rec["kind"] == "corrupt_snapshot":
                row.update(_restored(rec, events, fail["detect_time"], rec_ev["time"] if rec_ev else float("inf")))
        if rec["kind"] == "disk_full":
            failed = next((e for e in within if e["event"] == "checkpoint_failed"), None)
            freed = rec.get("freed", until)
            saved = next((e for e in events if e["event"] == "checkpoint_saved" and e["time"] >= freed), None)
            if failed is not None:
                row.update(detection_s=round(failed["time"] - t, 3), error=failed.get("error"),
                           outcome=f"save of step {failed.get('step')} failed, training went on")
            if saved is not None:
                row.update(recovery_s=round(saved["time"] - freed, 3), next_save_step=saved.get("step"))
        if rec["kind"] == "slow":
            flagged = next((e for e in events if e["event"] == "straggler" and t <= e["time"] <= until + 10), None)
            row["outcome"] = (f"straggler rank {flagged.get('rank')} reported" if flagged else
                              "ridden out: slowed, not failed")
            if flagged:
                row["detection_s"] = round(flagged["time"] - t, 3)
        if rec["kind"] == "partition" and fail is None:
            row["outcome"] = "ridden out: connections resumed before any timeout"
        if not rec.get("sent", True):
            row["outcome"] = "not delivered (the target left first)"
        out.append(row)
    return out


def summarize(rows: list[dict]) -> list[str]:
    lines = [f"{'kind':<17} {'n':>3}  {'detected':>8}  {'detection s p50/max':>19}  {'recovery s p50/max':>18}"]
    for kind in KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        if mine:
            det = [r.get("detection_s") for r in mine]
            lines.append(f"{kind:<17} {len(mine):>3}  {sum(d is not None for d in det):>8}  {_p50_max(det):>19}  "
                         f"{_p50_max([r.get('recovery_s') for r in mine]):>18}")
    return lines


def run_drill(argv: list[str], opts: DrillOptions) -> int:
    drill = _Drill(argv, opts)
    t0 = time.time()
    _train_reference(argv, drill.reference, drill.steps, t0 + opts.timeout_s)
    job, sent, code = drill.run_chaos(time.time() + opts.timeout_s)
    rows = annotate(sent, job.events())
    verdict = []
    if code is None:
        verdict.append(f"the chaos run did not end within --timeout {opts.timeout_s:g} s")
    elif code != 0:
        verdict.append(f"the chaos run exited {code} (see {job.log.name})")
    if len(sent) < len(drill.schedule):
        verdict.append(f"only {len(sent)} of {len(drill.schedule)} faults were sent before the run ended: "
                       "give it more steps (--training.steps) or shorter gaps (--gap)")
    same, line = False, "not compared"
    if code == 0:
        try:
            step, line = compare_runs(drill.reference, drill.run)
            steps_a, steps_b = set(read_fingerprints(drill.reference)), set(read_fingerprints(drill.run))
            same = step is None and steps_a == steps_b
            if step is None and steps_a != steps_b:
                line += f"; but the runs logged different steps ({len(steps_a)} vs {len(steps_b)})"
        except UserError as e:
            line = str(e)
    result = {"result": "equal" if same and not verdict else "failed", "exit": code, "faults": len(sent),
              "wall_s": round(time.time() - job.started, 1), "comparison": line, "problems": verdict}
    with drill.paths.chaos_log.open("w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
        fh.write(json.dumps(result) + "\n")
    print(*summarize(rows), sep="\n")
    print(f"chaos: {len(sent)} faults in {result['wall_s']} s; run exit {code}; fault log {drill.paths.chaos_log}")
    print(f"chaos: compared with {drill.reference}: {line}")
    for problem in verdict:
        print(f"chaos: {problem}")
    return 0 if result["result"] == "equal" else 1
