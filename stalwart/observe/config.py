"""The ``[observe]`` config section: per-rank timings, flight recorder, metric sinks.

The trainer passes this section (never the root config) to :func:`stalwart.observe.build_observer`-style
helpers; every field's help text is what ``stalwart train --help`` prints.
"""

from __future__ import annotations

from dataclasses import dataclass

from stalwart.config.core import option


@dataclass
class ObserveConfig:
    timings: bool = option("Write per-rank, per-phase step timings to timings/rank-<r>.jsonl.", True)
    timings_flush_every: int = option(
        "Flush the per-rank timings file (and resolve CUDA events) every N steps; no collective is "
        "involved, each rank writes its own file and the tools merge them.", 10, min=1)
    flight_recorder: bool = option("Record each rank's last collectives in a ring buffer and dump them to "
                                   "flight/rank-<r>.json on a hang, an exception, SIGTERM or SIGUSR1.", True)
    flight_entries: int = option("Ring-buffer size of the flight recorder (collectives kept per rank).",
                                 2000, min=16)
    hang_timeout_s: float = option(
        "Watchdog: dump the flight recorder when a collective has been in flight, or no progress was "
        "made, for this many seconds (0 = no watchdog thread).", 300.0, min=0.0)
    tensorboard: bool = option("Also write metrics as TensorBoard event files under <run_dir>/tensorboard.",
                               False)
    prometheus_port: int = option("Serve Prometheus text metrics at http://<host>:<port>/metrics from rank 0 "
                                  "(0 = off).", 0, min=0, max=65535)
    prometheus_host: str = option("Address the Prometheus endpoint binds to (loopback by default).",
                                  "127.0.0.1")
    wandb: bool = option("Also log metrics to Weights & Biases (needs the wandb package).", False)
    wandb_project: str = option("Weights & Biases project name.", "stalwart")
