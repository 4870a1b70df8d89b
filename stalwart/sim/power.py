"""Facility power swings: a synchronous job draws full power or almost none, all GPUs at once.

When a 16k-GPU job stops (fault, checkpoint stall, planned stop) every GPU drops from training power
to idle within milliseconds, and jumps back on restart: a swing of ~10-15 MW that the utility and the
facility's power train see as a step. Ramping (clocks raised gradually, or a dummy load that decays)
turns the step into a slope; the grid cares about the change inside a short window.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PowerReport:
    busy_mw: float              # facility power while training
    idle_mw: float              # while the job is stalled
    swing_mw: float             # busy - idle
    peak_step_mw: float         # largest change within one window, after ramping
    swings_per_day: float       # stalls long enough to count, times two (down and up)
    interruptions_per_day: float

    def to_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


def job_power_mw(gpus: int, gpus_per_host: int, gpu_w: float, host_w: float, pue: float) -> float:
    return (gpus * gpu_w + gpus / gpus_per_host * host_w) * pue / 1e6


def step_change_mw(swing_mw: float, ramp_s: float, window_s: float) -> float:
    """Largest power change inside ``window_s`` when a swing is spread linearly over ``ramp_s``."""
    if ramp_s <= window_s:
        return swing_mw
    return swing_mw * window_s / ramp_s


def power_report(cfg_power, gpus: int, gpus_per_host: int, days: float, down_events_per_day: float,
                 checkpoints_per_day: float, checkpoint_stall_s: float) -> PowerReport:
    """``cfg_power`` is the ``power`` config section; stall counts come from the simulation."""
    p = cfg_power
    busy = job_power_mw(gpus, gpus_per_host, p.gpu_busy_w, p.host_busy_w, p.pue)
    idle = job_power_mw(gpus, gpus_per_host, p.gpu_idle_w, p.host_idle_w, p.pue)
    swing = busy - idle
    stalls = down_events_per_day + (checkpoints_per_day if checkpoint_stall_s >= p.min_stall_s else 0.0)
    return PowerReport(busy_mw=busy, idle_mw=idle, swing_mw=swing,
                       peak_step_mw=step_change_mw(swing, p.ramp_s, p.window_s),
                       swings_per_day=2.0 * stalls, interruptions_per_day=down_events_per_day)
