"""What-if studies: dotted-key sweeps (``--sweep checkpoint.interval_min=5,10,20``) and a fixed
list of named interventions, each expressed as config overrides so they share one mechanism."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from stalwart.config import ConfigError
from stalwart.sim.config import SimConfig, spare_hosts

MAX_POINTS = 64


def parse_sweep(spec: str) -> tuple[str, list[str]]:
    """``'job.gpus=1024,16384'`` -> ``('job.gpus', ['1024', '16384'])``."""
    key, sep, values = spec.partition("=")
    vals = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not key.strip() or not vals:
        raise ConfigError(f"--sweep {spec!r}: expected KEY=V1,V2,... (e.g. --sweep checkpoint.interval_min=5,10,20)")
    return key.strip().lstrip("-"), vals


def grid(specs: list[str]) -> list[list[tuple[str, str]]]:
    """The cartesian product of several sweeps, as lists of (key, value) overrides."""
    axes = [parse_sweep(s) for s in specs]
    points = [list(zip([k for k, _ in axes], combo)) for combo in itertools.product(*[v for _, v in axes])]
    if len(points) > MAX_POINTS:
        raise ConfigError(f"--sweep: {len(points)} points is more than {MAX_POINTS}; sweep fewer values")
    return points


def as_overrides(pairs: list[tuple[str, str]]) -> list[str]:
    return [x for k, v in pairs for x in (f"--{k}", v)]


# name -> overrides computed from the baseline config (some what-ifs are relative to it).
WHATIFS: dict[str, Callable[[SimConfig], list[tuple[str, str]]]] = {
    "in-memory checkpoints (peer replicas: 15 s to durable, 20 s restore)": lambda c: [
        ("checkpoint.restore_from", "memory"), ("checkpoint.save_s", "15")],
    "10x faster detection": lambda c: [("recovery.detection_scale", str(c.recovery.detection_scale / 10))],
    "2x faster restart (init and restore)": lambda c: [
        ("recovery.init_base_s", str(c.recovery.init_base_s / 2)),
        ("recovery.init_per_sqrt_kgpu_s", str(c.recovery.init_per_sqrt_kgpu_s / 2)),
        ("checkpoint.restore_storage_s", str(c.checkpoint.restore_storage_s / 2))],
    "more spares (3x the pool)": lambda c: [("spares.hosts", str(3 * spare_hosts(c)))],
    "no spares (wait for repairs)": lambda c: [("spares.hosts", "0")],
    "synchronous checkpoints": lambda c: [("checkpoint.mode", "sync")],
    "per-replica-group recovery (recovery.model per_group)": lambda c: [("recovery.model", "per_group")],
    "no planned maintenance": lambda c: [("maintenance.interval_h", "0")],
    "half the hardware failure rate": lambda c: [
        (f"failures.{name}.rate", str(getattr(c.failures, name).rate / 2))
        for name in type(c.failures).__dataclass_fields__ if getattr(c.failures, name).hardware],
}
