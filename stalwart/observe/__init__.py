"""Observability building blocks: per-rank phase timings, a collective flight recorder,
metric sinks, straggler scores, goodput, trace export, and the dashboard / report / diagnose / doctor
tools. Everything except the recorders reads only the run directory (docs/run-directory.md).
See docs/observability.md.
"""

from stalwart.config.job import ObserveConfig
from stalwart.observe.flight import FlightRecorder
from stalwart.observe.prometheus import PrometheusSink
from stalwart.observe.sinks import JsonlSink, MetricsFanout, Sink, TensorBoardSink, WandbSink, build_sinks
from stalwart.observe.timer import PhaseTimer, TimingsWriter

__all__ = ["ObserveConfig", "FlightRecorder", "PhaseTimer", "TimingsWriter", "Sink", "JsonlSink",
           "TensorBoardSink", "PrometheusSink", "WandbSink", "MetricsFanout", "build_sinks"]
