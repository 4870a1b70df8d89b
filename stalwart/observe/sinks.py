"""Metric sinks behind one interface, and the fan-out the trainer calls once per logged step.

``Sink.write(record)`` takes one metrics record (docs/run-directory.md: ``step``, ``loss``, ``lr``, ...;
eval records carry ``eval_loss``); ``Sink.close()`` releases it. Optional backends (TensorBoard,
Weights & Biases) are imported only when enabled, and a missing package is a clear error.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Protocol

from stalwart.errors import UserError
from stalwart.metrics.records import JsonlWriter
from stalwart.observe.prometheus import PrometheusSink
from stalwart.paths import RunPaths


class Sink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in record.items()
            if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)}


class JsonlSink:
    """metrics.jsonl (always on): one JSON object per record."""

    def __init__(self, path: str | Path) -> None:
        self._w = JsonlWriter(Path(path))

    def write(self, record: dict[str, Any]) -> None:
        self._w.write(record)

    def close(self) -> None:
        self._w.close()


class TensorBoardSink:
    """TensorBoard event files via ``torch.utils.tensorboard`` (needs the ``tensorboard`` package)."""

    def __init__(self, log_dir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise UserError("observe.tensorboard is on but the 'tensorboard' package is not installed "
                            "(pip install tensorboard)") from e
        self._w = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        for k, v in _scalars(record).items():
            if math.isfinite(v):
                self._w.add_scalar(k, v, global_step=step, walltime=record.get("time"))
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class WandbSink:
    """Weights & Biases (``pip install wandb``); imported only when enabled."""

    def __init__(self, project: str, name: str, config: dict[str, Any] | None = None,
                 dir: str | Path | None = None) -> None:
        try:
            import wandb
        except ImportError as e:
            raise UserError("observe.wandb is on but the 'wandb' package is not installed (pip install wandb)") from e
        self._run = wandb.init(project=project, name=name, config=config or {}, dir=str(dir) if dir else None)

    def write(self, record: dict[str, Any]) -> None:
        self._run.log(_scalars(record), step=int(record.get("step", 0)))

    def close(self) -> None:
        self._run.finish()


class MetricsFanout:
    """Sends each record to every sink. A sink that raises is reported once and dropped, so a broken
    dashboard backend never stops training."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = list(sinks)

    def write(self, record: dict[str, Any]) -> None:
        for s in list(self.sinks):
            try:
                s.write(record)
            except Exception as e:  # noqa: BLE001 (a sink must not kill the run)
                print(f"stalwart: metrics sink {type(s).__name__} failed and is disabled: {e}", file=sys.stderr)
                self.sinks.remove(s)

    def write_timings(self, records: list[dict[str, Any]]) -> None:
        """A rank's flushed timings records, for the sinks that export per-rank phase times."""
        for s in self.sinks:
            if hasattr(s, "write_timings"):
                s.write_timings(records)

    def close(self) -> None:
        for s in self.sinks:
            try:
                s.close()
            except Exception as e:  # noqa: BLE001
                print(f"stalwart: closing metrics sink {type(s).__name__} failed: {e}", file=sys.stderr)
        self.sinks = []


def build_sinks(cfg: Any, run_dir: str | Path, run_name: str = "run", is_main: bool = True,
                config_dict: dict[str, Any] | None = None, rank: int = 0, local_rank: int = 0) -> MetricsFanout:
    """The fan-out for ``cfg`` (an :class:`~stalwart.config.job.ObserveConfig`).

    Rank 0 gets every configured sink; the other ranks only their Prometheus endpoint (per-rank series
    at ``prometheus_port + local_rank``), or nothing.
    """
    paths = RunPaths(run_dir)
    sinks: list[Sink] = []
    if cfg.prometheus_port:
        root = paths.root.resolve()
        sinks.append(PrometheusSink(cfg.prometheus_port + local_rank, cfg.prometheus_host, rank=rank, main=is_main,
                                    labels={"run": root.name, "run_dir": str(root)}))
    if not is_main:
        return MetricsFanout(sinks)
    sinks.insert(0, JsonlSink(paths.metrics))
    if cfg.tensorboard:
        sinks.append(TensorBoardSink(paths.tensorboard))
    if cfg.wandb:
        sinks.append(WandbSink(cfg.wandb_project, run_name, config_dict, paths.root))
    return MetricsFanout(sinks)
