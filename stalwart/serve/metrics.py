"""Prometheus metrics of the server (prometheus_client, one registry per app)."""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServeMetrics:
    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model": model}
        self.model = model
        r = self.registry
        self.requests = Counter("stalwart_serve_requests", "Requests answered, by outcome.", ["model", "outcome"],
                                registry=r)
        # Per latency class (the request's priority; infer/scheduler.py): one series per class seen.
        self._ttft = Histogram("stalwart_serve_time_to_first_token_seconds", "From arrival to the first token.",
                               ["model", "priority"], buckets=LATENCY_BUCKETS, registry=r)
        self._tpot = Histogram("stalwart_serve_time_per_output_token_seconds",
                               "Between consecutive output tokens of one request.", ["model", "priority"],
                               buckets=LATENCY_BUCKETS, registry=r)
        self.ttft, self.tpot = self.latency(0)
        self.prompt_tokens = Counter("stalwart_serve_prompt_tokens", "Prompt tokens received.", ["model"],
                                     registry=r).labels(**labels)
        self.generation_tokens = Counter("stalwart_serve_generation_tokens", "Tokens generated.", ["model"],
                                         registry=r).labels(**labels)
        self.queue_depth = Gauge("stalwart_serve_queue_depth", "Requests waiting to be scheduled.", ["model"],
                                 registry=r).labels(**labels)
        self.running = Gauge("stalwart_serve_running_requests", "Requests being decoded.", ["model"],
                             registry=r).labels(**labels)
        self.kv_usage = Gauge("stalwart_serve_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use.",
                              ["model"], registry=r).labels(**labels)
        self.tokens_per_s = Gauge("stalwart_serve_generation_tokens_per_second",
                                  "Output tokens per second over the last 10 seconds.", ["model"],
                                  registry=r).labels(**labels)
        self.weight_version = Gauge("stalwart_serve_weight_version", "Version of the weights being served.",
                                    ["model"], registry=r).labels(**labels)
        self.step_seconds = Histogram("stalwart_serve_engine_step_seconds", "One engine step (forward + sampling).",
                                      ["model"], buckets=LATENCY_BUCKETS, registry=r).labels(**labels)
        # Speculative decoding (engine.speculative): drafts checked and kept since start; their ratio is
        # the acceptance rate. Absent while speculation is off.
        self.drafts = Gauge("stalwart_serve_speculative_drafts", "Speculative drafts since start, proposed or kept.",
                            ["model", "kind"], registry=r)
        self.prefix_cached = Gauge("stalwart_serve_prefix_cached_tokens", "Prompt tokens served from the prefix "
                                   "cache since start (over stalwart_serve_prompt_tokens_total: the hit rate).",
                                   ["model"], registry=r).labels(**labels)
        self.handoff = Gauge("stalwart_serve_kv_handoff_tokens", "Positions whose keys and values were handed to a "
                             "decode replica (exported) or taken from a prefill replica (imported) since start.",
                             ["model", "kind"], registry=r)
        self._window: deque[tuple[float, int]] = deque()

    def latency(self, priority: int) -> tuple:
        """The (time to first token, time per output token) histograms of a latency class."""
        return (self._ttft.labels(model=self.model, priority=str(priority)),
                self._tpot.labels(model=self.model, priority=str(priority)))

    def outcome(self, name: str) -> None:
        self.requests.labels(model=self.model, outcome=name).inc()

    def step(self, tokens: int, seconds: float, stats: dict[str, float]) -> None:
        """After every engine step (on the engine thread)."""
        now = time.monotonic()
        self.step_seconds.observe(seconds)
        self.generation_tokens.inc(tokens)
        self._window.append((now, tokens))
        while self._window and self._window[0][0] < now - 10.0:
            self._window.popleft()
        span = max(1e-9, now - self._window[0][0]) if len(self._window) > 1 else 10.0
        self.tokens_per_s.set(sum(t for _, t in self._window) / max(span, 1.0))
        self.queue_depth.set(stats["waiting"])
        self.running.set(stats["running"])
        self.kv_usage.set(stats["kv_blocks_used"] / stats["kv_blocks_total"])
        self.weight_version.set(stats["weight_version"])
        self.prefix_cached.set(stats["prefix_cached_tokens"])
        for kind in ("exported", "imported"):
            self.handoff.labels(model=self.model, kind=kind).set(stats[f"kv_{kind}_tokens"])
        if "speculative_proposed" in stats:
            self.drafts.labels(model=self.model, kind="proposed").set(stats["speculative_proposed"])
            self.drafts.labels(model=self.model, kind="kept").set(stats["speculative_accepted"])
