"""A chaos drill: a clean run, the same run under faults sent from outside, and their comparison.

``run_drill(train_argv, opts)`` trains the reference (or takes a finished one), starts the chaos run
(``job.py``), sends ``opts.faults`` faults of the kinds asked for on a seeded schedule (``faults.py``),
each once every group trains again and the groups it restarts have saved a state since their previous
restart (so the crash-loop guard sees progress) and not in the last steps, and bounded by
``opts.timeout_s`` in all. When the run has ended it writes the fault log (``<run>/chaos.jsonl``:
each fault beside what the run recorded about it, ``faultlog.py``; with replica groups also the
restarts of the groups it did not hit and their redone steps, ``groups.py``) and compares every step's
state fingerprint with the reference's. Exit 0 only when every fault was sent, the run finished, every
fingerprint equals the reference's and, with replica groups, no group was restarted by a fault that
did not hit it.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from stalwart.chaos import groups
from stalwart.chaos.faultlog import annotate, summarize
from stalwart.chaos.faults import KINDS, RESTARTING, fire, unavailable
from stalwart.chaos.groups import GROUP_KINDS, Layout
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
    kinds: tuple[str, ...] = ()  # () = every kind that can run against the job
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
        self.layout = Layout.of(cfg, self.nproc)
        self.paths = RunPaths.of(cfg.run)
        self.run, self.steps = self.paths.root, cfg.training.steps
        if self.paths.events.exists() or self.paths.metrics.exists():
            raise UserError(f"run.dir {self.run} has trained already: a chaos run needs a fresh run directory")
        self.reference = opts.reference or self.run.with_name(self.run.name + "-reference")
        if self.reference.resolve() == self.run.resolve():
            raise UserError("--reference must be another directory than the chaos run's run.dir")
        ck = cfg.checkpoint
        self.memory_dir = ck.memory_dir if ck.memory_interval else None
        ns = namespaces_unavailable()
        kinds = []
        for kind in opts.kinds or (KINDS + GROUP_KINDS if self.layout.grouped else KINDS):
            if kind not in KINDS + GROUP_KINDS:
                raise UserError(f"--kinds: unknown fault kind {kind!r} (one of {', '.join(KINDS + GROUP_KINDS)})")
            why = unavailable(kind, self.nproc, ck.memory_interval, ck.interval, ns, self.layout.grouped)
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
        # Each group's supervisor has the whole budget (a job without groups: the one supervisor).
        budget = cfg.launch.restarts() if self.nproc > 1 else max(cfg.launch.max_restarts, 0)
        restarting = sum(k in RESTARTING for k in self.schedule)
        if budget < restarting:
            raise UserError(f"launch.max_restarts is {budget}: the schedule has {restarting} faults that restart "
                            f"{'a replica group' if self.layout.grouped else 'the group'}; set --launch.max_restarts "
                            f"{restarting} or more")
        self.margin = max(2, self.steps // 10)

    # ------------------------------------------------------------------ when a fault may land
    def _ready(self, job: Job, kind: str, victim: int, last_progress: dict[int, int],
               restart: tuple[dict[int, int], float]) -> dict[int, dict] | None:
        beats = job.training()
        attempts, since = restart
        if beats is None:
            return None
        for g, attempt in attempts.items():
            if min(beats[r]["attempt"] for r in self.layout.ranks(g)) <= attempt:
                return None  # the previous fault's restart has not happened yet (a stopped rank looks alive)
            if not any(e.get("event") == "recovered" and e.get("time", 0) >= since for e in job.events(g)):
                return None  # ... or has not completed its first step (the supervisor's `recovered`)
        step = max(b.get("step", 0) for b in beats.values())
        margin = max(self.margin, 2 * self.cfg.checkpoint.interval) if kind == "disk_full" else self.margin
        if step > self.steps - margin:
            return None
        hit = self.layout.groups_hit(kind, victim)
        if kind in RESTARTING and any(job.progress(g) <= last_progress.get(g, -1) for g in hit):
            return None  # no state saved since the group's previous restart: another now would look like a loop
        if kind == "corrupt_snapshot":
            for g in hit:
                snaps = SnapshotStore.common_steps(job.snapshot_dirs[g]) if job.snapshot_dirs[g] else set()
                disk = newest_complete_checkpoint(job.checkpoints(g))
                if not snaps or disk is None or max(snaps) <= checkpoint_step(disk):
                    return None  # no disk checkpoint to fall back to yet, or the restart would take it anyway
        return beats

    def run_chaos(self, deadline: float) -> tuple[Job, list[dict], int | None]:
        self.paths.root.mkdir(parents=True, exist_ok=True)
        job = Job(self.argv, self.run, self.layout, self.memory_dir, self.isolated, self.opts.disk_mb,
                  self.paths.chaos_output)
        shape = (f"{self.layout.groups} replica groups of {self.layout.size}" if self.layout.grouped else
                 f"{self.nproc}")
        print(f"chaos: run {self.run} ({shape} processes{', own mount + network namespace' if self.isolated else ''}"
              f"); {len(self.schedule)} faults: {', '.join(self.schedule)}", flush=True)
        sent: list[dict] = []
        last_progress: dict[int, int] = {}
        restart: tuple[dict[int, int], float] = ({}, 0.0)
        lo, hi = self.opts.gap_s
        try:
            for kind in self.schedule:
                victim = self.rng.randrange(self.nproc)
                wake = time.time() + self.rng.uniform(lo, hi)
                beats = None
                while job.running() and time.time() < deadline:
                    if time.time() >= wake and (beats := self._ready(job, kind, victim, last_progress, restart)):
                        break
                    time.sleep(0.02)
                if not beats or not job.running():
                    break
                hit = self.layout.groups_hit(kind, victim)
                progress = {g: job.progress(g) for g in hit}
                rec = fire(kind, job, beats, victim, self.layout.hit(kind, victim), self.opts.hold_s,
                           self.opts.slow_s)
                if kind in RESTARTING:
                    last_progress.update(progress)
                    if kind == "partition":  # the groups whose supervisor found the stall
                        hit = sorted({g for g, events in job.all_events().items() for e in events
                                      if e.get("event") == "failure" and e.get("detect_time", 0) >= rec["time"]})
                    if rec.get("sent") and hit:  # wait for the restart
                        restart = ({g: min(beats[r]["attempt"] for r in self.layout.ranks(g)) for g in hit},
                                   rec["time"])
                rec["t"] = round(rec["time"] - job.started, 2)
                sent.append(rec)
                where = f"group {rec['group']} rank {rec['rank']}" if self.layout.grouped else f"rank {victim}"
                print(f"chaos: {len(sent):3d} t={rec['t']:7.2f} s  {kind:<16} {where} (pid {rec['pid']}) at "
                      f"step {rec['step']}", flush=True)
            code = job.wait(deadline)
        finally:
            job.stop()
        return job, sent, code


_PER_RUN = ("run.dir", "fault.lighthouse")  # differ between any two runs of one command


def config_drift(reference: Path, run: Path) -> list[str]:
    """The settings in which the two runs' ``config.toml`` differ (besides the run's own directory and
    lighthouse): a reference taken as it is, or a shipped config edited between the two runs."""
    def flat(path: Path) -> dict[str, object]:
        try:
            tree = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError):
            return {}
        return {f"{section}.{k}": v for section, keys in tree.items() if isinstance(keys, dict)
                for k, v in keys.items()}

    a, b = flat(RunPaths(reference).config), flat(RunPaths(run).config)
    if not a or not b:
        return []
    return sorted(k for k in set(a) | set(b) if k not in _PER_RUN and a.get(k) != b.get(k))


def _compare(drill: "_Drill") -> tuple[bool, str]:
    """Whether the chaos run's every step equals the reference's, and one line saying so."""
    if drill.layout.grouped:
        return groups.compare(drill.reference, drill.run, drill.layout, drill.steps)
    step, line = compare_runs(drill.reference, drill.run)
    steps_a, steps_b = set(read_fingerprints(drill.reference)), set(read_fingerprints(drill.run))
    if step is None and steps_a != steps_b:
        line += f"; but the runs logged different steps ({len(steps_a)} vs {len(steps_b)})"
    return step is None and steps_a == steps_b, line


def run_drill(argv: list[str], opts: DrillOptions) -> int:
    drill = _Drill(argv, opts)
    t0 = time.time()
    _train_reference(argv, drill.reference, drill.steps, t0 + opts.timeout_s)
    job, sent, code = drill.run_chaos(time.time() + opts.timeout_s)
    grouped = drill.layout.grouped
    events = job.all_events()
    rows = annotate(sent, events, job.step_times() if grouped else None)
    verdict = []
    if code is None:
        verdict.append(f"the chaos run did not end within --timeout {opts.timeout_s:g} s")
    elif code != 0:
        verdict.append(f"the chaos run exited {code} (see {job.log.name})")
    if len(sent) < len(drill.schedule):
        verdict.append(f"only {len(sent)} of {len(drill.schedule)} faults were sent before the run ended: "
                       "give it more steps (--training.steps) or shorter gaps (--gap)")
    restarted = [i + 1 for i, r in enumerate(rows) if r.get("survivor_restarts")]
    if restarted:
        verdict.append(f"groups a fault did not hit were restarted (faults {', '.join(map(str, restarted))})")
    same, line = False, "not compared"
    if code == 0:
        try:
            same, line = _compare(drill)
        except UserError as e:
            line = str(e)
    drift = config_drift(drill.reference, drill.run)
    if drift:
        line += f"; the reference's config.toml differs in {', '.join(drift)}"
    result = {"result": "equal" if same and not verdict else "failed", "exit": code, "faults": len(sent),
              "wall_s": round(time.time() - job.started, 1), "comparison": line, "problems": verdict}
    if grouped:
        result.update(survivor_restarts=sum(r.get("survivor_restarts", 0) for r in rows),
                      restarts_per_group={str(g): groups.restarts(events, [g], 0, float("inf")) for g in events})
    with drill.paths.chaos_log.open("w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
        fh.write(json.dumps(result) + "\n")
    print(*summarize(rows), sep="\n")
    print(f"chaos: {len(sent)} faults in {result['wall_s']} s; run exit {code}; fault log {drill.paths.chaos_log}")
    if grouped:
        print(f"chaos: restarts per replica group {result['restarts_per_group']}; of groups a fault did not hit: "
              f"{result['survivor_restarts']}")
    print(f"chaos: compared with {drill.reference}: {line}")
    for problem in verdict:
        print(f"chaos: {problem}")
    return 0 if result["result"] == "equal" else 1
