"""Every path under a run directory, built in one place (the contract is docs/run-directory.md).

Nothing else in Stalwart joins a file name onto a run directory: writers and readers alike ask a
:class:`RunPaths` for it, so the layout can be read (and changed) here alone. Names of checkpoint
directories and snapshot files are parsed here too.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

_CHECKPOINT = re.compile(r"^step-(\d+)$")
_SNAPSHOT = re.compile(r"^step-(\d+)\.snap$")


def checkpoint_step(path: Path | str) -> int | None:
    """N for a complete checkpoint directory name ``step-N``; None for anything else (``.tmp-*``)."""
    m = _CHECKPOINT.match(Path(path).name)
    return int(m.group(1)) if m else None


def snapshot_step(path: Path | str) -> int | None:
    """N for a snapshot file name ``step-N.snap``; None for anything else (a ``.tmp`` file)."""
    m = _SNAPSHOT.match(Path(path).name)
    return int(m.group(1)) if m else None


def snapshot_name(step: int) -> str:
    return f"step-{step}.snap"


class CheckpointDir:
    """Names inside a checkpoints directory: ``step-N`` (complete), ``.tmp-step-N`` (being written),
    ``.failed-step-N-<time>`` (quarantined), ``latest`` (names the newest complete one)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def step(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def tmp(self, step: int) -> Path:
        return self.root / f".tmp-step-{step}"

    def failed(self, step: int, when: int) -> Path:
        return self.root / f".failed-step-{step}-{when}"

    @property
    def latest(self) -> Path:
        return self.root / "latest"

    def complete(self) -> list[Path]:
        """``step-N`` directories, oldest first (by name only: a ``.tmp-*`` one is never listed)."""
        if not self.root.is_dir():
            return []
        found = [(s, p) for p in self.root.iterdir() if (s := checkpoint_step(p)) is not None and p.is_dir()]
        return [p for _, p in sorted(found)]


def default_run_dir(name: str, directory: str = "") -> Path:
    """``run.dir`` if set, else ``runs/<run.name>``."""
    return Path(directory or f"runs/{name}")


class RunPaths:
    """The layout of one run directory. Cheap to build; touches no file."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    @classmethod
    def of(cls, run_cfg) -> "RunPaths":
        """From the ``[run]`` config section."""
        return cls(default_run_dir(run_cfg.name, run_cfg.dir))

    @classmethod
    def holding(cls, checkpoint: str | Path) -> "RunPaths | None":
        """The run whose ``checkpoints/step-N`` this is, or None for a checkpoint outside a run directory."""
        checkpoint = Path(checkpoint)
        run = cls(checkpoint.parent.parent)
        return run if checkpoint.parent == run.checkpoints and run.config.is_file() else None

    def __repr__(self) -> str:
        return f"RunPaths({str(self.root)!r})"

    # -- written once at start, read by every tool -------------------------------------------
    @property
    def config(self) -> Path:
        return self.root / "config.toml"

    @property
    def lock(self) -> Path:
        """Held by the one run that uses this directory (``stalwart.ft.runlock``)."""
        return self.root / "run.lock"

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer.json"

    @property
    def publish(self) -> Path:
        """Where a run that publishes live weights (``publish.interval``) says how to reach its store;
        present while its training runs."""
        return self.root / "publish.json"

    @property
    def prepared_data(self) -> Path:
        """Text data given as data.path, tokenized once into shards (``stalwart data prepare``'s layout)."""
        return self.root / "data"

    # -- records ----------------------------------------------------------------------------------
    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def fingerprints(self) -> Path:
        """Per-tensor sums of the state fingerprint (``stalwart.train.fingerprint``), rank 0."""
        return self.root / "fingerprints.jsonl"

    @property
    def events(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def goodput(self) -> Path:
        return self.root / "goodput.json"

    @property
    def chaos_log(self) -> Path:
        """The faults ``stalwart chaos`` sent to this run from outside, one JSON line each, and its verdict."""
        return self.root / "chaos.jsonl"

    @property
    def chaos_output(self) -> Path:
        """What the `stalwart train` command under ``stalwart chaos`` printed."""
        return self.root / "chaos-train.log"

    @property
    def timings_dir(self) -> Path:
        return self.root / "timings"

    def timings(self, rank: int) -> Path:
        return self.timings_dir / f"rank-{rank}.jsonl"

    @property
    def flight_dir(self) -> Path:
        return self.root / "flight"

    def flight(self, rank: int) -> Path:
        return self.flight_dir / f"rank-{rank}.json"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def report_dir(self) -> Path:
        return self.root / "report"

    @property
    def profile_dir(self) -> Path:
        return self.root / "profile"

    def profile_trace(self, rank: int, first: int, last: int) -> Path:
        """torch.profiler's Chrome trace of steps ``first..last`` on one rank."""
        return self.profile_dir / f"rank-{rank}-steps-{first}-{last}.trace.json"

    def memory_snapshot(self, rank: int, first: int, last: int) -> Path:
        """The CUDA caching allocator's snapshot over the same window (``torch.cuda.memory._dump_snapshot``)."""
        return self.profile_dir / f"rank-{rank}-steps-{first}-{last}.memory.pickle"

    @property
    def debug_dir(self) -> Path:
        return self.root / "debug"

    def grad_dump(self, step: int, name: str) -> Path:
        return self.debug_dir / f"grad-step{step}-{name}.safetensors"

    # -- checkpoints ----------------------------------------------------------------------------
    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        return CheckpointDir(self.checkpoints).step(step)

    def snapshots(self, memory_dir: str = "") -> Path:
        """In-memory snapshots live outside the run directory, in RAM that outlives the workers:
        ``checkpoint.memory_dir``, or ``/dev/shm/stalwart-<sha256(absolute run dir)[:16]>``."""
        if memory_dir:
            return Path(memory_dir)
        key = hashlib.sha256(str(self.root.resolve()).encode()).hexdigest()[:16]
        return Path("/dev/shm") / f"stalwart-{key}"

    # -- fault tolerance ------------------------------------------------------------------------
    def replica_group(self, group: int) -> "RunPaths":
        """The run directory of replica group ``group`` (``fault.group_recovery``): group 0 trains in this
        one, group g > 0 in ``groups/<g>`` (each its own metrics, events, snapshots and checkpoints)."""
        return self if group == 0 else RunPaths(self.root / "groups" / str(group))

    @property
    def ft_dir(self) -> Path:
        return self.root / "ft"

    @property
    def heartbeat_dir(self) -> Path:
        return self.ft_dir / "heartbeat"

    @property
    def demoted(self) -> Path:
        """Restore sources whose first steps went non-finite: never restored again (train/checkpointer.py)."""
        return self.ft_dir / "demoted.json"

    @property
    def restore_watch(self) -> Path:
        """The restored source being watched and its non-finite steps so far (train/demotion.py)."""
        return self.ft_dir / "restore_watch.json"

    def heartbeat(self, rank: int) -> Path:
        return self.heartbeat_dir / f"rank-{rank}.json"

    @property
    def startup_dir(self) -> Path:
        return self.ft_dir / "startup"

    def startup(self, rank: int) -> Path:
        """Rank ``rank``'s start-up phases (``stalwart.ft.records.mark_startup``)."""
        return self.startup_dir / f"rank-{rank}.json"

    @property
    def exit_dir(self) -> Path:
        return self.ft_dir / "exit"

    def exit_record(self, rank: int) -> Path:
        return self.exit_dir / f"rank-{rank}.json"

    @property
    def fired_dir(self) -> Path:
        return self.ft_dir / "fired"

    def fired(self, fault_id: str) -> Path:
        return self.fired_dir / f"{fault_id}.json"

    @property
    def skip_steps(self) -> Path:
        return self.ft_dir / "skip_steps.json"

    @property
    def excluded(self) -> Path:
        return self.ft_dir / "excluded.json"

    @property
    def policy(self) -> Path:
        """`stalwart rl`'s final policy: a run directory of its own (config, tokenizer, checkpoint), so
        `stalwart generate --run`, `stalwart serve --run` and `stalwart export --run` read it."""
        return self.root / "policy"

    @property
    def reference(self) -> Path:
        """`stalwart rl`'s frozen KL reference (the fine-tuned policy), written once in the same form: a
        generator that joins after the start reads it from here."""
        return self.root / "reference"

    @property
    def rebalance(self) -> Path:
        """Where `stalwart rl`'s trainers checkpoint their state across a change of their count."""
        return self.controller_dir / "rebalance"

    @property
    def rl_state(self) -> Path:
        """`stalwart rl`'s own state (step, pending groups, verdicts, figures) at each trainer snapshot or
        checkpoint, one ``step-<s>.json`` each: what a rerun of a killed controller resumes with."""
        return self.controller_dir / "rl-state"

    # -- single controller ----------------------------------------------------------------------
    @property
    def controller_dir(self) -> Path:
        return self.root / "controller"

    @property
    def journal(self) -> Path:
        """The controller's command history (append-only JSON lines, fsync'd per command)."""
        return self.controller_dir / "journal.jsonl"


def rank_files(directory: Path, suffix: str) -> dict[int, Path]:
    """``rank-<r><suffix>`` files in ``directory`` by rank (timings, flight dumps, heartbeats, exits)."""
    out: dict[int, Path] = {}
    if directory.is_dir():
        for p in directory.glob(f"rank-*{suffix}"):
            try:
                out[int(p.name[len("rank-"):-len(suffix)])] = p
            except ValueError:
                continue
    return dict(sorted(out.items()))
