"""The worker side of fault tolerance: the trainer calls four hooks per step, and this decides.

    before_step(step)                 heartbeat progress; fires injected kill/hang/exception/corrupt faults
    after_backward(step, loss, ps)    injects nan / slow
    commit(step, loss, grad_norm)     collective: apply the optimizer step? (non-finite flag, skip list,
                                      per-rank timings for the straggler detector)
    after_step(rec)                   loss-spike detection; may request a rollback

A rollback raises ``RollbackRequested`` on every rank at the same step (the decision is made on
all-reduced values): the worker exits with EXIT_ROLLBACK, the supervisor restarts the group from the
last good state, and the steps in ``<run>/ft/skip_steps.json`` are then not applied (their data is
consumed, so the data order stays deterministic).
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from stalwart.ft.detect import SpikeDetector, StragglerDetector
from stalwart.ft.plan import Fault, fired_ids, mark_fired, parse_plan, pending
from stalwart.metrics.records import JsonlWriter


class RollbackRequested(Exception):
    """Raised on every rank together: restart from the last good state, skipping the given steps."""


class InjectedFault(RuntimeError):
    """An ``exception`` fault from --fault.inject (or chaos)."""


def heartbeat_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "ft" / "heartbeat"


def skip_file(run_dir: Path) -> Path:
    return Path(run_dir) / "ft" / "skip_steps.json"


def read_skip_steps(run_dir: Path) -> set[int]:
    p = skip_file(run_dir)
    try:
        return {int(s) for s in json.loads(p.read_text())["steps"]} if p.is_file() else set()
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


class Heartbeat:
    """A daemon thread writing ``<run>/ft/heartbeat/rank-<r>.json`` every ``interval`` seconds."""

    def __init__(self, run_dir: Path, rank: int, attempt: int, interval: float) -> None:
        self.path = heartbeat_dir(run_dir) / f"rank-{rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.interval = interval
        self.state = {"rank": rank, "attempt": attempt, "pid": os.getpid(), "step": 0, "resumed_step": 0,
                      "phase": "init", "progress_time": time.time()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stalwart-heartbeat", daemon=True)

    def start(self) -> None:
        self.beat()
        self._thread.start()

    def progress(self, step: int, phase: str = "train") -> None:
        self.state = {**self.state, "step": step, "phase": phase, "progress_time": time.time()}
        self.beat()  # at once: the supervisor times recovery from the step's completion

    def beat(self) -> None:
        try:
            _write_json_atomic(self.path, {**self.state, "beat_time": time.time()})
        except OSError:
            pass  # a full disk must not kill training; the watchdog will notice missing beats

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.beat()

    def stop(self) -> None:
        self._stop.set()


class StepGuard:
    def __init__(self, cfg, run_dir: Path, rank: int, world_size: int, device: torch.device, log_event) -> None:
        self.cfg, self.run_dir, self.rank, self.world = cfg, Path(run_dir), rank, world_size
        self.device, self.log_event = device, log_event
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        # A rollback is a restart: without a supervisor that restarts, spikes are only reported and
        # non-finite steps skipped.
        self.can_restart = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
        self.faults: list[Fault] = [f for f in pending(parse_plan(cfg.inject), fired_ids(run_dir))]
        self.skip_steps = read_skip_steps(run_dir)
        self.spikes = SpikeDetector(cfg.spike_zscore, cfg.spike_window)
        self.stragglers = StragglerDetector(cfg.straggler_threshold, cfg.straggler_window)
        self.straggler_found: list[dict] = []
        self.skipped: list[int] = []
        self.heartbeat = Heartbeat(run_dir, rank, self.attempt, cfg.heartbeat_interval_s)
        self._t0 = self._t1 = 0.0
        self._skip_this = False
        self._fault_log = JsonlWriter(self.run_dir / "events.jsonl", enabled=True)
        # Chaos faults arrive from the supervisor as SIGUSR2 ("raise here").
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR2, _raise_injected)

    # ------------------------------------------------------------------ lifecycle
    def start(self, step: int) -> None:
        self.heartbeat.state["resumed_step"] = step
        self.heartbeat.progress(step, phase="init")
        self.heartbeat.start()

    def finishing(self, step: int) -> None:
        self.heartbeat.progress(step, phase="finishing")

    def close(self) -> None:
        self.heartbeat.stop()
        self.heartbeat.progress(self.heartbeat.state["step"], phase="done")
        self._fault_log.close()

    # ------------------------------------------------------------------ injection
    def _mine(self, kind: str, step: int) -> list[Fault]:
        return [f for f in self.faults if f.kind == kind and f.rank == self.rank and f.step == step]

    def _fire(self, fault: Fault, step: int) -> None:
        now = time.time()
        rec = mark_fired(self.run_dir, fault, step, now, attempt=self.attempt)
        self._fault_log.write({"time": now, "event": "fault_injected", **rec})
        self.faults.remove(fault)

    def before_step(self, step: int) -> None:
        """Called before step ``step`` (1-based) runs."""
        self._t0 = time.perf_counter()
        for f in [f for f in self.faults if f.kind == "corrupt_checkpoint"]:
            if self.rank == 0 and step > f.step and _corrupt_checkpoint(self.run_dir / "checkpoints", f.step):
                self._fire(f, step)
        for f in self._mine("kill", step):
            self._fire(f, step)
            os.kill(os.getpid(), signal.SIGKILL)
        for f in self._mine("exception", step):
            self._fire(f, step)
            raise InjectedFault(f"injected fault {f.describe()} (--fault.inject)")
        for f in self._mine("hang", step):
            self._fire(f, step)
            while True:  # the heartbeat thread keeps beating: only the progress watchdog can see this
                time.sleep(3600)

    def after_backward(self, step: int, local_loss: torch.Tensor | None, params) -> torch.Tensor | None:
        for f in self._mine("nan", step):
            self._fire(f, step)
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(float("nan"))
            local_loss = torch.full((), float("nan")) if local_loss is None else local_loss * float("nan")
        for f in self.faults:
            if f.kind == "slow" and f.rank == self.rank and f.first <= step <= f.last:
                time.sleep((f.factor - 1.0) * (time.perf_counter() - self._t0))
        self._t1 = time.perf_counter()
        return local_loss

    # ------------------------------------------------------------------ decisions
    def commit(self, step: int, local_loss: torch.Tensor | None, grad_norm) -> bool:
        """Collective. True = apply this step's update; False = skip it on every rank."""
        # 2 = this rank's own loss is non-finite (it is the source); 1 = only the (global) gradient norm is.
        bad = 2 if local_loss is not None and not bool(torch.isfinite(local_loss.detach()).all()) else 0
        gn = float(grad_norm) if grad_norm is not None else 0.0
        bad = bad or (1 if not math.isfinite(gn) else 0)
        mine = torch.tensor([float(bad), self._t1 - self._t0], dtype=torch.float64)
        if dist.is_available() and dist.is_initialized() and self.world > 1:
            parts = [torch.zeros(2, dtype=torch.float64) for _ in range(self.world)]
            dist.all_gather(parts, mine)
        else:
            parts = [mine]
        flags = [int(p[0].item()) for p in parts]
        self._check_stragglers(step, [float(p[1]) for p in parts])
        self._skip_this = False
        if step in self.skip_steps:
            self._skip_this = True
            self.log_event("step_skipped", step=step, reason="skip list (rolled-back data window)")
        elif any(flags):
            ranks = [r for r, f in enumerate(flags) if f == 2] or [r for r, f in enumerate(flags) if f]
            self.log_event("failure", kind="nonfinite", step=step, ranks=ranks, policy=self.cfg.nonfinite)
            if self.cfg.nonfinite == "rollback" and self.can_restart:
                self._rollback([step], f"non-finite loss/gradients on rank(s) {ranks}")
            if self.cfg.nonfinite != "off":
                self._skip_this = True
        if self._skip_this:
            self.skipped.append(step)
        return not self._skip_this

    def _check_stragglers(self, step: int, compute: list[float]) -> None:
        if self.world < 2:
            return
        for s in self.stragglers.update({"forward_backward": compute}):
            rec = {"rank": s.rank, "phase": s.phase, "ratio": round(s.ratio, 3), "steps": s.steps, "step": step,
                   "policy": self.cfg.straggler_policy}
            self.straggler_found.append(rec)
            self.log_event("straggler", **rec)
            if self.cfg.straggler_policy == "exclude" and self.rank == 0:
                self._record_exclusion(rec)

    def _record_exclusion(self, rec: dict) -> None:
        """NOTE: recorded for the next launch/scheduler only; this run does not yet drop the node."""
        path = self.run_dir / "ft" / "excluded.json"
        try:
            old = json.loads(path.read_text()) if path.is_file() else {"excluded": []}
        except (OSError, ValueError):
            old = {"excluded": []}
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        old["excluded"].append({"rank": rec["rank"], "node": rec["rank"] // max(local, 1), "reason": "straggler",
                                "step": rec["step"], "time": time.time()})
        _write_json_atomic(path, old)

    def after_step(self, rec: dict) -> None:
        step = rec["step"]
        if self._skip_this:
            rec["skipped"] = True
        elif math.isfinite(rec["loss"]):
            z = self.spikes.update(rec["loss"])
            if z is not None:
                self.log_event("failure", kind="loss_spike", step=step, loss=rec["loss"], zscore=round(z, 2),
                               policy="rollback" if self.can_restart else "report")
                if not self.can_restart:
                    self.heartbeat.progress(step)
                    return
                window = list(range(max(1, step - self.cfg.spike_skip_steps + 1), step + 1))
                self._rollback(window, f"loss spike at step {step} (robust z = {z:.1f})")
        self.heartbeat.progress(step)

    def _rollback(self, steps: list[int], why: str) -> None:
        self.skip_steps.update(steps)
        if self.rank == 0:
            path = skip_file(self.run_dir)
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_json_atomic(path, {"steps": sorted(self.skip_steps)})
            self.log_event("rollback", steps=steps, reason=why)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # the skip list is durable before any rank exits
        raise RollbackRequested(why)

    def summary(self) -> dict:
        return {"skipped_steps": self.skipped, "stragglers": self.straggler_found}


def exit_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "ft" / "exit"


def record_exit(run_dir: Path, rank: int, error: BaseException) -> None:
    """Note when and why this rank is failing: the supervisor names the earliest as the root cause."""
    try:
        d = exit_dir(run_dir)
        d.mkdir(parents=True, exist_ok=True)
        _write_json_atomic(d / f"rank-{rank}.json", {"rank": rank, "time": time.time(), "pid": os.getpid(),
                                                    "error": f"{type(error).__name__}: {error}"[:500]})
    except OSError:
        pass


def _raise_injected(signum, frame) -> None:
    raise InjectedFault("injected fault: exception (chaos, SIGUSR2 from the supervisor)")


def _corrupt_checkpoint(root: Path, step: int) -> bool:
    """Flip one byte in the middle of a shard of complete checkpoint ``step-N``; False if absent."""
    d = root / f"step-{step}"
    if not (d / "manifest.json").is_file():
        return False
    shard = next(iter(sorted(d.glob("*.distcp"))), None)
    if shard is None:
        return False
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return True
