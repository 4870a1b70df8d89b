"""Metric sinks behind one interface, and the fan-out the trainer calls once per logged step.

``Sink.write(record)`` takes one metrics record (docs/run-directory.md: ``step``, ``loss``, ``lr``, ...;
eval records carry ``eval_loss``); ``Sink.close()`` releases it. Optional backends (TensorBoard,
Weights & Biases) are imported only when enabled, and a missing package is a clear error.
"""

from __future__ import annotations

import math
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol

from stalwart.errors import UserError
from stalwart.metrics.records import JsonlWriter
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


def _label_value(v: str) -> str:
    """Prometheus text format: backslash, double quote and newline escaped."""
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class PrometheusSink:
    """Serves the newest value of every numeric metric at ``http://host:port/metrics`` (text format).

    A stdlib HTTP server in a daemon thread; ``port=0`` picks a free port (see ``.port``). Bound to
    loopback unless ``host`` says otherwise.
    """

    def __init__(self, port: int = 0, host: str = "127.0.0.1", prefix: str = "stalwart",
                 labels: dict[str, str] | None = None) -> None:
        self.prefix = prefix
        self._labels = ",".join(f'{k}="{_label_value(v)}"' for k, v in (labels or {}).items())
        self._values: dict[str, float] = {}
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                body = sink.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, name="stalwart-prometheus",
                                        daemon=True)
        self._thread.start()

    def write(self, record: dict[str, Any]) -> None:
        vals = _scalars(record)
        if "step" in record:
            vals["step"] = float(record["step"])
        with self._lock:
            self._values.update(vals)

    def render(self) -> str:
        with self._lock:
            items = sorted(self._values.items())
        lab = "{" + self._labels + "}" if self._labels else ""
        lines = []
        for k, v in items:
            name = f"{self.prefix}_{''.join(c if c.isalnum() else '_' for c in k)}"
            lines += [f"# TYPE {name} gauge", f"{name}{lab} {v!r}" if math.isfinite(v) else f"{name}{lab} NaN"]
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


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

    def close(self) -> None:
        for s in self.sinks:
            try:
                s.close()
            except Exception as e:  # noqa: BLE001
                print(f"stalwart: closing metrics sink {type(s).__name__} failed: {e}", file=sys.stderr)
        self.sinks = []


def build_sinks(cfg: Any, run_dir: str | Path, run_name: str = "run", is_main: bool = True,
                config_dict: dict[str, Any] | None = None) -> MetricsFanout:
    """The fan-out for ``cfg`` (an :class:`~stalwart.config.job.ObserveConfig`); empty off rank 0."""
    if not is_main:
        return MetricsFanout([])
    paths = RunPaths(run_dir)
    sinks: list[Sink] = [JsonlSink(paths.metrics)]
    if cfg.tensorboard:
        sinks.append(TensorBoardSink(paths.tensorboard))
    if cfg.prometheus_port:
        # `run` names the run directory (run.name stays "default" when only run.dir is given).
        sinks.append(PrometheusSink(cfg.prometheus_port, cfg.prometheus_host,
                                    labels={"run": paths.root.resolve().name, "run_dir": str(paths.root.resolve())}))
    if cfg.wandb:
        sinks.append(WandbSink(cfg.wandb_project, run_name, config_dict, paths.root))
    return MetricsFanout(sinks)
