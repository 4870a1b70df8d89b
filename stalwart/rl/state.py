"""The RL loop's own state at a step: with the trainers' snapshot (or checkpoint) of the same step, all a
rerun of a killed controller needs to go on as if it had never stopped.

The trainers hold the policy and its optimizer (in memory, ``checkpoint.snapshot``, and on disk every
``workers.checkpoint_interval`` steps); the controller's part is small and written here, one
``<run>/controller/rl-state/step-<s>.json`` per state (:attr:`RunPaths.rl_state`), *before* the
trainers' snapshot of ``s`` is taken, so every trainer snapshot that exists has its loop state:

- ``step``: the RL steps done; the sampler needs nothing more (``rollout.plan_step`` is a pure
  function of the run's seed and the step, so the task order and every sampling seed follow);
- ``pending``: in async mode, the groups already generated for later steps (with the weight version
  that generated each, so their staleness is known, and with routing replay the experts recorded for
  them, compactly: ``rl/routing.py``), collected before the state is written, and (``pending_figures``)
  their generation's figures (seconds, tokens), which the metrics row of the step that trains them reports;
- ``verdicts``: the reward cache (a program already judged is never run again, so its verdict is part
  of the run's history);
- ``figures``: the counters the summary reports (groups trained, the largest staleness, steps to a
  reward, the balancer's measurements), the warm-up's figures and the first evaluation;
- ``layout``: the generator and trainer counts (adaptive balancing changes them).

Pure logic and files; no processes.
"""

from __future__ import annotations

import json
from pathlib import Path
import dataclasses
from typing import Any

from stalwart.atomic import write_json_atomic, write_text_atomic
from stalwart.controller.journal import config_key
from stalwart.controller.replay import ReplayDiverged, divergence
from stalwart.errors import UserError
from stalwart.metrics.records import read_jsonl
from stalwart.paths import RunPaths
from stalwart.rl import routing
from stalwart.rl.rollout import Group, GroupRequest
from stalwart.rl.tasks import Instance

KEEP = 3  # state files kept: the newest snapshot's and, behind it, the newest disk checkpoint's


def group_record(g: Group) -> dict[str, Any]:
    """A generated (not yet scored) group as JSON (floats round-trip exactly)."""
    q = g.request
    return {"step": q.step, "index": q.index, "instance": q.instance.key, "seeds": list(q.seeds), "prompt": g.prompt,
            "responses": g.responses, "logprobs": g.logprobs, "version": g.version, "ref_logprobs": g.ref_logprobs,
            "masks": g.masks, "routing": routing.to_json(g.routing)}


def group_of(rec: dict[str, Any], instances: dict[str, Instance]) -> Group:
    """:func:`group_record` read back; ``instances`` by key (the run's task)."""
    req = GroupRequest(int(rec["step"]), int(rec["index"]), instances[rec["instance"]], tuple(rec["seeds"]))
    return Group(req, rec["prompt"], rec["responses"], rec["logprobs"], int(rec["version"]), rec["ref_logprobs"],
                 masks=rec.get("masks"), routing=routing.from_json(rec.get("routing")))


def state_name(step: int) -> str:
    return f"step-{step}.json"


class StateFiles:
    """The loop states of a run, by step."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def steps(self) -> list[int]:
        out = []
        for p in self.root.glob("step-*.json") if self.root.is_dir() else []:
            try:
                out.append(int(p.stem.split("-", 1)[1]))
            except ValueError:
                continue
        return sorted(out)

    def write(self, state: dict[str, Any], keep: set[int] = frozenset()) -> None:
        """Write ``state`` (durably; its ``step`` names it), then drop all but the newest :data:`KEEP` and
        the steps in ``keep`` (the state of the newest disk checkpoint)."""
        self.root.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.root / state_name(int(state["step"])), state, indent=None)
        steps = self.steps()
        for s in steps[:-KEEP]:
            if s not in keep:
                (self.root / state_name(s)).unlink(missing_ok=True)

    def read(self, step: int) -> dict[str, Any] | None:
        try:
            return json.loads((self.root / state_name(step)).read_text())
        except (OSError, ValueError):
            return None


def rewind_metrics(path: Path, step: int, final: int) -> None:
    """A resumed run's ``metrics.jsonl`` without the rows of the steps it computes again: the RL steps
    and evaluations after ``step`` (the killed session's), and the final evaluation (``final``, always
    run again); the warm-up's rows stay. Each step then has one row, the one of the run that went on
    (``stalwart train`` appends instead and the later row wins; an RL step computed again in async mode
    may differ, and its first row would then describe samples that were never trained)."""
    def again(m: dict[str, Any]) -> bool:
        kind, at = m.get("kind"), int(m.get("step", 0))
        return (kind == "rl" and at > step) or (kind == "eval" and (at > step or at == final))

    if Path(path).exists():  # rewritten whole: a torn last line (the kill mid-write) goes too
        write_text_atomic(path, "".join(json.dumps(m) + "\n" for m in read_jsonl(path) if not again(m)))


def resume_point(memory: int | None, disk: int | None, states: list[int]) -> tuple[str, int] | None:
    """Where a rerun resumes: the newest of the trainers' complete in-memory snapshot (``memory``) and
    their newest disk checkpoint (``disk``) that has its loop state; None = start afresh."""
    options = [(s, src) for s, src in ((memory, "memory"), (disk, "disk")) if s is not None and s in states]
    if not options:
        return None
    step, source = max(options)
    return source, step


def capture(stepper: Any, step: int) -> dict[str, Any]:
    """The loop's part of the state of ``step`` (a ``loop.Stepper`` whose generations in flight were
    collected): pending groups, the reward cache, the summary's counters, the layout."""
    svc = stepper.svc
    return {"step": step,
            "pending": {str(t): [group_record(g) for g in groups] for t, (groups, _) in sorted(stepper.ready.items())},
            "pending_figures": {str(t): {k: v if isinstance(v, int) else float(v) for k, v in fig.items()}
                                for t, (_, fig) in sorted(stepper.ready.items())},
            "verdicts": [[k, prog, list(v)] for (k, prog), v in svc.rewards.verdicts.items()],
            "figures": {"groups_trained": stepper.groups_before + len(stepper.trained),
                        "staleness_max": stepper.staleness_max, "busy": stepper.busy, "steps_to": stepper.steps_to},
            "layout": {"generators": svc.generators.n, "trainers": svc.trainers.n}}


def resume(stepper: Any, state: dict[str, Any], instances: dict[str, Instance]) -> None:
    """Put ``state`` (:func:`capture`) back into a new session's ``loop.Stepper``, whose trainers hold
    the weights of the same step."""
    fig = state["figures"]
    stepper.first = stepper.snap_step = int(state["step"])
    stepper.groups_before = int(fig["groups_trained"])
    stepper.staleness_max = int(fig["staleness_max"])
    stepper.busy = [tuple(b) for b in fig["busy"]]
    stepper.steps_to = dict(fig["steps_to"])
    figures = state["pending_figures"]  # their generation's figures: the step's metrics row reports them
    stepper.ready = {int(t): ([group_of(r, instances) for r in groups], dict(figures[t]))
                     for t, groups in state["pending"].items()}
    stepper.svc.rewards.verdicts = {(k, prog): tuple(v) for k, prog, v in state["verdicts"]}


# Settings that do not change a run's numbers: a rerun may change them and still resume (and check).
UNDEFINING = {"controller": None, "metrics": None, "sandbox": None,
              "workers": ("reward_threads", "sandbox_urls", "sandbox_retry_s", "reward_timeout_s", "generate_timeout_s",
                          "checkpoint_interval")}


def run_key(cfg: Any) -> str:
    """The digest of the settings that define an RL run's numbers (``journal.config_key``)."""
    d = dataclasses.asdict(cfg)
    for section, fields in UNDEFINING.items():
        if fields is None:
            d.pop(section, None)
        else:
            d[section] = {k: v for k, v in d[section].items() if k not in fields}
    return config_key(d)


def resumable(paths: RunPaths, key: str) -> tuple[str, int] | None:
    """Where a rerun of this run resumes (:func:`resume_point`: the newest trainer snapshot complete in
    ``/dev/shm`` or disk checkpoint whose loop state was written under the same settings), from files
    alone; None = start afresh. A run left by other settings is refused (one line)."""
    from stalwart.checkpoint.manager import newest_complete_checkpoint
    from stalwart.checkpoint.snapshot import SnapshotStore
    from stalwart.paths import checkpoint_step

    files = StateFiles(paths.rl_state)
    keys = {s: (files.read(s) or {}).get("config") for s in files.steps()}
    if keys and key not in keys.values():
        raise UserError(f"run.dir {paths.root} holds an unfinished RL run with other settings; rerun the command "
                        "that started it to resume it, or pass another --run.dir")
    states = [s for s, k in keys.items() if k == key]
    memory = max(SnapshotStore.common_steps(paths.snapshots()) & set(states), default=None)
    disk = newest_complete_checkpoint(paths.checkpoints)
    return resume_point(memory, checkpoint_step(disk) if disk is not None else None, states)


class Checks:
    """The steps an earlier session (ended by the controller's crash) completed after the resumed step,
    checked as this session computes them again: the same groups from the same weight versions, the same
    loss and gradient norm. ``strict`` (sync mode): a difference stops the run (:class:`ReplayDiverged`);
    otherwise (async, where a resumed run may generate a pending group with newer weights than the
    uninterrupted one did) each step's comparison is reported as an ``rl_resume_check`` event."""

    FIELDS = ("loss", "grad_norm")

    def __init__(self, earlier: dict[int, dict[str, Any]], strict: bool, events: Any) -> None:
        self.earlier, self.strict, self.events = earlier, strict, events
        self.matched = self.differed = 0

    def __call__(self, step: int, issued: dict[str, Any], applied: dict[str, Any]) -> None:
        was = self.earlier.get(step)
        if was is None:
            return
        problem = None
        for key in ("groups", "versions"):
            if issued[key] != was["issued"][key]:
                problem = f"resumed step {step} trained {key} {issued[key]}, the journal holds {was['issued'][key]}"
        problem = problem or divergence(step, applied, was["applied"], self.FIELDS)
        if problem is not None and self.strict:
            raise ReplayDiverged(problem)
        self.matched += problem is None
        self.differed += problem is not None
        if not self.strict:
            self.events("rl_resume_check", step=step, matched=problem is None, detail=problem)
