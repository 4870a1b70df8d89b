"""Training metrics for Prometheus, through ``prometheus_client`` and its naming conventions.

Every rank serves its own endpoint at ``http://<host>:<port + local_rank>/metrics`` (one scrape target
per training process, as with any per-process exporter; on a node with 8 GPUs that is 8 consecutive
ports). Every series carries the labels ``run`` (the run directory's name) and ``run_dir`` (its
absolute path), so runs sharing a Prometheus stay apart.

Per-rank series (label ``rank``), on every rank:

- ``stalwart_train_step_duration_seconds``  gauge: the newest logged step's wall time
- ``stalwart_train_step_seconds_total`` / ``stalwart_train_steps_total``  counters of this process
  (``rate(a) / rate(b)`` is the mean step time over any window)
- ``stalwart_train_phase_seconds_total{phase}``  counter: time in each phase (data, forward, backward,
  optimizer, comm, checkpoint); updated when the rank's timings are flushed
  (every ``observe.timings_flush_every`` steps)
- ``stalwart_train_memory_bytes``  gauge: peak device memory (CUDA) or peak resident set size (CPU)

Run-level series, on rank 0 only: ``stalwart_train_step``, ``stalwart_train_tokens_total`` (counter,
the tokens trained since the run began; it survives resume), ``stalwart_train_loss``,
``stalwart_train_eval_loss``, ``stalwart_train_learning_rate``, ``stalwart_train_grad_norm``,
``stalwart_train_tokens_per_second``, ``stalwart_train_mfu_ratio``, ``stalwart_train_data_wait_seconds``,
and any other numeric field of the metrics record as ``stalwart_train_<field>``.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "stalwart_train"

# metrics-record field -> (series name without prefix, HELP text); every one is a rank-0 gauge.
RUN_GAUGES: dict[str, tuple[str, str]] = {
    "step": ("step", "Newest completed training step."),
    "loss": ("loss", "Training loss of the newest logged step."),
    "eval_loss": ("eval_loss", "Loss on the held-out split at the newest evaluation."),
    "lr": ("learning_rate", "Learning rate of the newest logged step."),
    "grad_norm": ("grad_norm", "Global gradient norm before clipping, newest logged step."),
    "tokens_per_s": ("tokens_per_second", "Training throughput of the newest logged step (tokens/s)."),
    "mfu": ("mfu_ratio", "Model FLOPs utilisation of the newest logged step (0-1)."),
    "data_wait_s": ("data_wait_seconds", "Time the newest logged step waited for its batch."),
    "fingerprint_s": ("fingerprint_seconds", "Time the newest logged step spent taking the state fingerprint."),
    "fingerprint_wait_s": ("fingerprint_wait_seconds", "Of the fingerprint's time, the newest logged step's "
                           "exchange between ranks (waiting for the slowest included)."),
}
# Fields exported otherwise (per rank, or as a counter) or not at all.
_SPECIAL = {"time", "tokens_seen", "step_time_s", "mem_bytes"}


def _name(field: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", field)


class TrainCollector(Collector):
    """Holds the newest values and renders them as metric families at scrape time."""

    def __init__(self, rank: int, main: bool, labels: dict[str, str]) -> None:
        self.rank, self.main = rank, main
        self._keys, self._vals = list(labels), list(labels.values())
        self._lock = threading.Lock()
        self._run: dict[str, float] = {}
        self._tokens: float | None = None
        self._step_time: float | None = None
        self._step_total = 0.0
        self._steps = 0
        self._mem: float | None = None
        self._phases: dict[str, float] = {}

    # -- updates (training thread) -----------------------------------------------------------
    def record(self, rec: dict[str, Any]) -> None:
        with self._lock:
            if "step_time_s" in rec:
                self._step_time = float(rec["step_time_s"])
                self._step_total += self._step_time
                self._steps += 1
            if "mem_bytes" in rec:
                self._mem = float(rec["mem_bytes"])
            if not self.main:
                return
            if "tokens_seen" in rec:
                self._tokens = float(rec["tokens_seen"])
            for k, v in rec.items():
                if k not in _SPECIAL and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._run[k] = float(v)

    def timings(self, records: Iterable[dict[str, Any]]) -> None:
        with self._lock:
            for r in records:
                for phase, s in (r.get("phases") or {}).items():
                    self._phases[phase] = self._phases.get(phase, 0.0) + float(s)

    # -- scrape (server thread) --------------------------------------------------------------
    def collect(self) -> Iterator[Any]:
        with self._lock:
            run, tokens, step_time = dict(self._run), self._tokens, self._step_time
            step_total, steps, mem, phases = self._step_total, self._steps, self._mem, dict(self._phases)
        keys, vals, rk = self._keys, self._vals, self._keys + ["rank"]
        rv = vals + [str(self.rank)]

        def fam(cls, name: str, doc: str, labels: list[str] | None = None) -> Any:
            return cls(f"{PREFIX}_{name}", doc, labels=labels or rk)

        if step_time is not None:
            g = fam(GaugeMetricFamily, "step_duration_seconds", "Wall time of the newest logged step, per rank.")
            g.add_metric(rv, step_time)
            yield g
        c = fam(CounterMetricFamily, "step_seconds", "Wall time spent in logged training steps by this process.")
        c.add_metric(rv, step_total)
        yield c
        c = fam(CounterMetricFamily, "steps", "Training steps logged by this process.")
        c.add_metric(rv, steps)
        yield c
        if phases:
            c = fam(CounterMetricFamily, "phase_seconds", "Time spent in each phase of the step, per rank.",
                    rk + ["phase"])
            for phase, s in sorted(phases.items()):
                c.add_metric(rv + [phase], s)
            yield c
        if mem is not None:
            g = fam(GaugeMetricFamily, "memory_bytes",
                    "Peak device memory allocated (CUDA) or peak resident set size (CPU), per rank.")
            g.add_metric(rv, mem)
            yield g
        if not self.main:
            return
        if tokens is not None:
            c = fam(CounterMetricFamily, "tokens", "Tokens trained since the run began (kept across resume).", keys)
            c.add_metric(vals, tokens)
            yield c
        for field, v in sorted(run.items()):
            name, doc = RUN_GAUGES.get(field, (_name(field), f"The metrics record's '{field}' field (newest)."))
            g = fam(GaugeMetricFamily, name, doc, keys)
            g.add_metric(vals, v if math.isfinite(v) else math.nan)
            yield g


class PrometheusSink:
    """A metrics sink that serves :class:`TrainCollector` over HTTP at ``port + local_rank``.

    ``write`` takes metrics records (step and eval records); ``write_timings`` the rank's timings
    records (``timings/rank-<r>.jsonl`` lines). ``port=0`` picks a free port (see ``.port``).
    """

    def __init__(self, port: int = 0, host: str = "127.0.0.1", rank: int = 0, main: bool = True,
                 labels: dict[str, str] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = TrainCollector(rank, main, dict(labels or {}))
        self.registry.register(self.collector)
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.host, self.port = self._server.server_address[:2]

    def write(self, record: dict[str, Any]) -> None:
        self.collector.record(record)

    def write_timings(self, records: list[dict[str, Any]]) -> None:
        self.collector.timings(records)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
