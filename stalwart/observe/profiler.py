"""A torch.profiler window over a few training steps, one trace per rank.

The training loop does not know about it: the observer tells it when a step begins and ends, and it
decides whether to act (start at the window's first step, stop and write at its last).

    prof = StepProfiler(cfg.profile, paths, rank, device)
    prof.begin_step(n)     # starts the profiler when n is the window's first step
    ...                    # the step
    prof.end_step(n)       # at the window's last step: stop, write the trace (and memory snapshot)
    prof.close()           # a run that stops inside the window still writes what it recorded

Each profiled step is a ``stalwart.step <n>`` range in the trace, so the step boundaries are visible
next to the operators (and, on CUDA, the kernels).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from stalwart.paths import RunPaths
from stalwart.runtime.device import is_accelerator


class StepProfiler:
    def __init__(self, cfg: Any, paths: RunPaths, rank: int, device: torch.device) -> None:
        """``cfg``: a :class:`~stalwart.config.profile.ProfileConfig`."""
        self.cfg, self.paths, self.rank, self.device = cfg, paths, rank, device
        window = cfg.window
        self.window = window if window and (not cfg.ranks or rank in cfg.ranks) else None
        self._prof: Any = None
        self._step_range: Any = None
        self._first = self._last = 0
        self.written: list[Path] = []

    @property
    def active(self) -> bool:
        return self._prof is not None

    def begin_step(self, step: int) -> None:
        if self.window is None:
            return
        first, last = self.window
        if self._prof is None and first <= step <= last and not self.written:
            self._start(step)
        if self._prof is not None:
            self._step_range = torch.profiler.record_function(f"stalwart.step {step}")
            self._step_range.__enter__()

    def end_step(self, step: int) -> None:
        if self._prof is None:
            return
        self._close_range()
        self._last = step
        if step >= self.window[1]:
            self._stop()

    def close(self) -> None:
        """Stop a window the run left early; write what it recorded."""
        if self._prof is not None:
            self._close_range()
            self._stop()

    # ------------------------------------------------------------------ internals
    def _start(self, step: int) -> None:
        acts = [torch.profiler.ProfilerActivity.CPU]
        cuda = is_accelerator(self.device)
        if cuda:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
            if self.cfg.memory_snapshot:
                torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._first = step
        self._prof = torch.profiler.profile(activities=acts, record_shapes=self.cfg.record_shapes,
                                            profile_memory=True, with_stack=self.cfg.with_stack)
        self._prof.start()

    def _close_range(self) -> None:
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None

    def _stop(self) -> None:
        prof, self._prof = self._prof, None
        prof.stop()
        first, last = self._first, max(self._last, self._first)
        trace = self.paths.profile_trace(self.rank, first, last)
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
        self.written.append(trace)
        if is_accelerator(self.device) and self.cfg.memory_snapshot:
            snap = self.paths.memory_snapshot(self.rank, first, last)
            torch.cuda.memory._dump_snapshot(str(snap))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.written.append(snap)


def list_profiles(paths: RunPaths) -> list[dict[str, Any]]:
    """The profiler outputs of a run: ``{"name", "rank", "kind" (trace | memory), "bytes"}``, by name."""
    out = []
    if paths.profile_dir.is_dir():
        for p in sorted(paths.profile_dir.iterdir()):
            kind = ("trace" if p.name.endswith(".trace.json") else
                    "memory" if p.name.endswith(".memory.pickle") else None)
            if kind and p.name.startswith("rank-"):
                out.append({"name": p.name, "rank": int(p.name.split("-")[1]), "kind": kind,
                            "bytes": p.stat().st_size})
    return out
