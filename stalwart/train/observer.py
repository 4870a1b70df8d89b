"""What the training loop reports, and to whom: one object the loop enters once and tells about steps.

The observer owns the run's records (``events.jsonl``, the metrics fan-out: ``metrics.jsonl`` plus the
configured TensorBoard / Prometheus / W&B sinks), the per-rank phase timer (``timings/``), the
collective flight recorder (``flight/``), the progress display and the step profiler
(``profile/``, with ``profile.steps``). Entering it installs the flight
recorder's patches and handlers; leaving it, on any exit, undoes them and closes every file.

    with observer:
        with observer.step(n):            # step timing, phases
            record = core.train_step(loader.next())
        observer.log(record)              # adds throughput, MFU, memory; writes the sinks
        ...                               # evaluation, checkpoint: still phases of step n's timings

A step's timings record closes when the next step begins (or at exit), so the work done between
steps (evaluation, checkpoint stall) is attributed to the step it follows.

Rank filtering happens here, at the edges: the records and the progress display are rank 0's.
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Iterator
from typing import Any

import torch

from stalwart.errors import UserError
from stalwart.metrics.mfu import mfu as model_flops_utilisation
from stalwart.metrics.progress import Progress, RateWindow
from stalwart.metrics.records import EventLog, read_jsonl
from stalwart.observe import FlightRecorder, PhaseTimer, TimingsWriter, build_sinks
from stalwart.observe.profiler import StepProfiler
from stalwart.paths import RunPaths
from stalwart.runtime.device import is_accelerator, max_memory_allocated, synchronize
from stalwart.runtime.env import DistEnv

WARMUP_STEPS = 3  # steady-state throughput excludes this session's first steps
PROGRESS_WINDOW = 20  # the progress display's tokens/s is over this many recent steps


def run_history(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What a run's records say of all its sessions (attempts, restarts, relaunches), oldest first:
    ``{"started": unix time of its first start, "attempts": starts, "first_eval_loss": its first
    evaluation}``; the values are None (attempts 0) without records.

    The run begins at its first ``start`` event, except that a fresh start (step 0) after the run had
    ``finished`` or ``stopped`` begins a new run in the same directory: what came before is another run's."""
    begin, ended = None, False
    for i, e in enumerate(events):
        if e.get("event") == "start" and (begin is None or (ended and e.get("step") == 0)):
            begin, ended = i, False
        elif e.get("event") in ("finished", "stopped") and begin is not None:
            ended = True
    run = events[begin:] if begin is not None else []
    starts = [e for e in run if e.get("event") == "start"]
    evals = [e["eval_loss"] for e in run if e.get("event") == "eval" and e.get("eval_loss") is not None]
    return {"started": starts[0].get("time") if starts else None, "attempts": len(starts),
            "first_eval_loss": evals[0] if evals else None}


class TimedLoader:
    """A data loader whose ``next()`` is timed as the step's ``data`` phase; everything else passes through."""

    def __init__(self, loader, observer: "Observer") -> None:
        self._loader, self._observer = loader, observer

    def next(self):
        t0 = time.perf_counter()
        with self._observer.timer.phase("data"):
            batch = self._loader.next()
        self._observer.data_wait_s = time.perf_counter() - t0
        self._observer.data_tokens = self._loader.source_tokens()
        return batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class Observer:
    def __init__(self, observe_cfg, metrics_cfg, paths: RunPaths, run_name: str, env: DistEnv,
                 flops_per_token: float, peak_flops: float, tokens_per_step: int,
                 config_dict: dict | None = None, profile_cfg=None) -> None:
        self.cfg, self.metrics_cfg, self.env = observe_cfg, metrics_cfg, env
        self.profiler = StepProfiler(profile_cfg, paths, env.rank, env.device) if profile_cfg is not None else None
        self.flops_per_token, self.peak_flops, self.tokens_per_step = flops_per_token, peak_flops, tokens_per_step
        self.events = EventLog(paths.events, enabled=env.is_main)
        self.metrics = build_sinks(observe_cfg, paths.root, run_name, is_main=env.is_main, config_dict=config_dict,
                                   rank=env.rank, local_rank=env.local_rank)
        self.recorder = (FlightRecorder(env.rank, env.world_size, paths.root, observe_cfg.flight_entries,
                                        observe_cfg.hang_timeout_s)
                         if env.is_distributed and observe_cfg.flight_recorder else None)
        self.timer = PhaseTimer(env.rank, env.device, TimingsWriter(paths.root, env.rank),
                                observe_cfg.timings_flush_every, enabled=observe_cfg.timings,
                                on_phase=self.recorder.set_phase if self.recorder else None,
                                comm_clock=self.recorder.blocked_seconds if self.recorder else None,
                                on_flush=self.metrics.write_timings if self.metrics.sinks else None)
        self.progress: Progress | None = None
        self._end = 0
        self.last: dict[str, Any] = {}  # the newest step record of this session
        self._open_step: int | None = None
        self.data_wait_s = 0.0
        self.data_tokens: dict[str, int] = {}  # training tokens served per data source, all ranks
        self._step_time = 0.0
        self._t_start = self._t_end = time.perf_counter()
        self._steps = 0               # steps logged this session
        self._steady: tuple[float, int] | None = None  # (time, tokens) after the warm-up steps
        self._tokens = 0
        self._rate = RateWindow(PROGRESS_WINDOW)  # the progress display's smoothed tokens/s

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Observer":
        if self.recorder is not None:
            self.recorder.install()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.recorder is not None and exc_type is not None and not issubclass(exc_type, UserError):
            self.recorder.dump(f"exception {exc_type.__name__}: {exc}"[:300])  # what each rank was doing
        try:
            self.close_step()
            if self.profiler is not None:
                self.profiler.close()
            self.timer.close()
            if self.progress is not None:
                self.progress.close()
            self.metrics.close()
            self.events.close()
        finally:
            if self.recorder is not None:
                self.recorder.uninstall()

    def begin(self, total_steps: int, start_step: int, end_step: int, banner: str, **start_fields: Any) -> None:
        """The session starts at ``start_step``: the ``start`` event, the progress display, the banner."""
        self._end = end_step
        self.progress = Progress(total_steps, start_step, self.metrics_cfg.progress, self.env.is_main)
        self.events("start", step=start_step, world_size=self.env.world_size, **start_fields)
        self.progress.log(banner)
        self._t_start = self._t_end = time.perf_counter()

    def say(self, message: str) -> None:
        if self.progress is not None:
            self.progress.log(message)

    # ------------------------------------------------------------------ per step
    def close_step(self) -> None:
        if self._open_step is not None:
            self.timer.end_step()
            if self.recorder is not None:
                self.recorder.mark_progress(self._open_step)
            self._open_step = None

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        self.close_step()
        self._open_step = step
        self.timer.begin_step(step)
        if self.profiler is not None:
            self.profiler.begin_step(step)
        t0 = time.perf_counter()
        self.data_wait_s = 0.0
        yield
        synchronize(self.env.device)
        self._step_time = time.perf_counter() - t0
        if self.profiler is not None and self.profiler.active:
            self.profiler.end_step(step)
            if not self.profiler.active:
                self.say("profile: wrote " + ", ".join(str(p) for p in self.profiler.written))

    def phase(self, name: str):
        return self.timer.phase(name)

    def log(self, record: dict[str, Any]) -> dict[str, Any]:
        """Complete the step's record (timing, throughput, MFU, memory), write it, close the step."""
        step = record["step"]
        tps = self.tokens_per_step / self._step_time if self._step_time > 0 else 0.0
        record.update(step_time_s=self._step_time, data_wait_s=self.data_wait_s, tokens_per_s=tps,
                      mfu=self.mfu(tps), mem_bytes=self.memory(), **self.data_tokens)
        self._steps += 1
        self._tokens += self.tokens_per_step
        self._t_end = time.perf_counter()
        if self._steps == WARMUP_STEPS:
            self._steady = (self._t_end, self._tokens)
        if step % self.metrics_cfg.log_interval == 0 or step == self._end:
            self.metrics.write({**record, "time": time.time()})
        if self.progress is not None:
            smooth = self._rate.add(self.tokens_per_step, self._step_time)
            self.progress.update(step, f"loss {record['loss']:.3f}  {smooth:.0f} tok/s  "
                                       f"mfu {100 * self.mfu(smooth):.1f}%")
        self.last = record
        return record

    def eval(self, step: int, loss: float) -> None:
        self.metrics.write({"step": step, "eval_loss": loss, "time": time.time()})
        self.events("eval", step=step, eval_loss=loss)
        self.say(f"step {step}: eval loss {loss:.4f}")

    # ------------------------------------------------------------------ figures
    def mfu(self, tokens_per_s: float) -> float:
        return model_flops_utilisation(tokens_per_s, self.flops_per_token, self.peak_flops, self.env.world_size)

    def throughput(self) -> float | None:
        """Tokens/s of this session's training loop, excluding the warm-up steps when there were more."""
        if self._steady is not None and self._tokens > self._steady[1]:
            return (self._tokens - self._steady[1]) / (self._t_end - self._steady[0])
        if self._steps:
            return self._tokens / max(self._t_end - self._t_start, 1e-9)
        return None

    def elapsed(self) -> float:
        """Seconds since this session's ``start`` (its own attempt only; :meth:`history` spans the run)."""
        return time.perf_counter() - self._t_start

    def history(self) -> dict[str, Any]:
        """The run so far, from ``events.jsonl`` (rank 0's; other ranks see only this session): see
        :func:`run_history`."""
        return run_history(read_jsonl(self.events.path) if self.env.is_main else [])

    def memory(self) -> int:
        if is_accelerator(self.env.device):
            return max_memory_allocated(self.env.device)
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
