"""Islands joined by a slow, distant link: step time, compute utilisation and bytes of synchronous,
DiLoCo and Streaming DiLoCo training, as a pure model of what Stalwart runs (``parallelism.islands``,
the schedule in ``parallel/islands.py``, the exchange in ``train/islands.py``).

**What crosses.** Rank 0 of every island joins one gloo group. Before every sync the islands
all-gather two int64 (their sync counters); then a float32 outer gradient (or, for ``sync``, the
gradient) goes through gloo's ring all-reduce, a quantized one (bf16, int8/int4 with a float32 scale
per block) through a ring all-gather of every island's payload. ``sync`` does this every step,
blocking; ``diloco`` every ``H`` steps for the whole model, blocking; ``streaming`` one of ``P``
fragments every ``H / P`` steps on a thread, waited for ``tau`` steps later (the stall is what the
exchange takes beyond those ``tau`` steps of compute). A run's last step syncs what is left
(:func:`_final`), as ``Islands.final`` does.

**Gloo over TCP.** A message leaves only once its receiver has posted the buffer and said so (a
recv-ready notice), so a message posted on both sides at once costs a one-way latency for the notice,
then the data's: a round trip plus its serialization. A ring all-gather of K islands is K - 1 such
steps (two half-messages in flight); gloo's ring all-reduce is a reduce-scatter and an all-gather,
each K - 1 steps over segments of at most 1 MiB, two in flight.

**TCP's window.** A connection starts with ``initial_window`` segments and doubles its window each
round trip while a message is larger than it (slow start), up to the bandwidth-delay product; the
window a connection has grown is kept for later messages. ``congestion = "bbr"`` (Linux's BBR, what
these machines run) keeps it across idle periods; ``"cubic"`` with ``tcp_slow_start_after_idle``
halves it for every retransmission timeout the connection was idle.

Everything here is arithmetic on floats: no torch, no clock. :func:`predict` is the one entry point
(``stalwart plan --islands`` and ``stalwart bench islands`` call it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALGORITHMS = ("sync", "diloco", "streaming")
QUANTIZE = ("none", "bf16", "int8", "int4")
CONGESTION = ("bbr", "cubic")

MSS = 1448                    # TCP payload per segment (1500-byte MTU, timestamps on)
FRAME = 66                    # Ethernet 14 + IPv4 20 + TCP 20 + timestamp option 12 bytes per segment
PREAMBLE = 48                 # gloo's per-message header (six 64-bit fields)
MAX_SEGMENT = 1 << 20         # gloo's ring all-reduce: largest segment, two in flight
COUNTER_BYTES = 16            # the sync counters every island all-gathers before an exchange
MIN_RTO_S = 0.2               # Linux: RTO = srtt + max(4 rttvar, 200 ms)
BBR_STARTUP_GAIN = 2.885      # BBR's pacing gain (2/ln 2) while its bandwidth estimate is still growing


@dataclass(frozen=True)
class Link:
    """The inter-island link: ``mbit`` (Mbit/s each way) and ``latency_ms`` (one way)."""

    mbit: float
    latency_ms: float
    initial_window: int = 10
    congestion: str = "bbr"

    @property
    def bytes_per_s(self) -> float:
        return self.mbit * 1e6 / 8.0

    @property
    def one_way_s(self) -> float:
        return self.latency_ms / 1000.0

    @property
    def rtt_s(self) -> float:
        return 2.0 * self.one_way_s

    @property
    def bdp_bytes(self) -> float:
        return max(self.bytes_per_s * self.rtt_s, float(MSS))

    @property
    def rto_s(self) -> float:
        return self.rtt_s + MIN_RTO_S


def payload_bytes(n: int, how: str, block: int) -> int:
    """Bytes of an island's payload for ``n`` values (the layout of ``parallel.islands.quantize``:
    float32, bfloat16, or one float32 scale per ``block`` values and 1 or 1/2 byte a value)."""
    if how == "none":
        return 4 * n
    if how == "bf16":
        return 2 * n
    blocks = -(-n // block)
    values = blocks * block
    return 4 * blocks + (values if how == "int8" else (values + values % 2) // 2)


# ---------------------------------------------------------------------------------------------
# One message, one collective
# ---------------------------------------------------------------------------------------------

def transfer_s(nbytes: float, link: Link, window: float) -> tuple[float, float]:
    """(seconds from the first byte sent to the last received, the window afterwards) for one burst of
    ``nbytes`` on a connection whose congestion window is ``window`` segments.

    Slow start: while the rest does not fit the window, a window's worth goes and the next waits a
    round trip, every acknowledged segment widening the window by one (it doubles per round trip), up
    to the bandwidth-delay product. Then the rest is serialized, paced under BBR: an application-limited
    flow (a message, then silence) is paced at ~2.89x the rate it delivered lately, which for a stream
    of equal messages spreads each over about a round trip / 2.89 beyond the first two segments (Linux
    sends two at once); the link's rate bounds it from below.
    """
    segments = max(1, math.ceil(nbytes / MSS))
    cap = 2.0 * link.bdp_bytes / MSS
    rest, w, rounds = float(segments), window, 0
    while rest > w and w * MSS < link.bdp_bytes:
        rest -= w
        w *= 2.0
        rounds += 1
    share = rest / segments
    wire = share * nbytes / link.bytes_per_s
    if link.congestion == "bbr" and rest > 2:
        wire = max(wire, link.rtt_s / BBR_STARTUP_GAIN * (rest - 2) / rest)
    return rounds * link.rtt_s + wire + link.one_way_s, min(max(window, w + rest), max(cap, window))


def _messages_s(count: int, size: float, link: Link, window: float) -> tuple[float, float]:
    """``count`` messages of ``size`` bytes sent one after another with two in flight, each posted when the
    one two before it completed (gloo's rings): the first pair pays the notice and the data's latency,
    every later pair the longer of its serialization and a round trip plus one message's serialization."""
    if count <= 0:
        return 0.0, window
    first, window = transfer_s(min(count, 2) * size, link, window)
    t = link.one_way_s + first
    pairs = math.ceil(count / 2) - 1
    per_pair = max(2 * size / link.bytes_per_s, link.rtt_s + size / link.bytes_per_s)
    return t + pairs * per_pair, window


def all_gather_s(payload: float, k: int, link: Link, window: float) -> tuple[float, float]:
    """gloo's ring all-gather of ``payload`` bytes from each of ``k`` islands: k - 1 steps, each the
    payload in two halves."""
    t = 0.0
    for _ in range(k - 1):
        step, window = _messages_s(2, payload / 2, link, window)
        t += step
    return t, window


def _ring_segments(nbytes: float, k: int) -> tuple[int, float]:
    """gloo's ring all-reduce of ``nbytes``: (segments each rank sends per phase, segment bytes). The
    buffer is cut into ``n`` segments of at most 1 MiB, at least ``2 k`` and a multiple of ``k``, and each
    phase sends ``n - 2`` of them (as gloo's loop does: (k - 1) / k of the buffer when n = 2k, more for
    buffers over 2k MiB)."""
    seg = max(1, min(math.ceil(nbytes / (2 * k)), MAX_SEGMENT))
    n = max(math.ceil(nbytes / seg), 2 * k)
    n = math.ceil(n / k) * k
    return n - 2, nbytes / n


def all_reduce_s(nbytes: float, k: int, link: Link, window: float) -> tuple[float, float]:
    """gloo's ring all-reduce: a reduce-scatter and an all-gather, each :func:`_ring_segments` two in flight."""
    count, size = _ring_segments(nbytes, k)
    t = 0.0
    for _ in range(2):
        phase, window = _messages_s(count, size, link, window)
        t += phase
    return t, window


def exchange_s(values: int, how: str, block: int, k: int, link: Link, window: float) -> tuple[float, float]:
    """One outer sync's exchange (the counters, then the payload) of ``values`` parameters."""
    t, window = all_gather_s(COUNTER_BYTES, k, link, window)
    if how == "none":
        body, window = all_reduce_s(4.0 * values, k, link, window)
    else:
        body, window = all_gather_s(payload_bytes(values, how, block), k, link, window)
    return t + body, window


def wire_bytes(values: int, how: str, block: int, k: int) -> float:
    """Bytes one island sends onto its link in one exchange: payload with gloo's headers, TCP/IP and
    Ethernet framing, the recv-ready/send-ready notices and the acknowledgements of what it receives
    (one per two segments)."""
    messages = 2 * (k - 1)                                   # the counters' all-gather: two halves per step
    sent = (k - 1) * COUNTER_BYTES
    if how == "none":
        count, size = _ring_segments(4.0 * values, k)
        messages += 2 * count
        sent += 2.0 * count * size
    else:
        messages += 2 * (k - 1)
        sent += (k - 1) * payload_bytes(values, how, block)
    data = sent + messages * PREAMBLE
    segments = math.ceil(data / MSS) + messages                # every message starts a segment of its own
    notices = 2 * messages * (PREAMBLE + FRAME)              # send-ready for what it sends, recv-ready for what it gets
    acks = math.ceil(segments / 2) * FRAME                    # symmetric: it receives as much as it sends
    return data + segments * FRAME + notices + acks


def _broadcast_s(nbytes: float, procs: int, island_gbit: float) -> float:
    """The result shared inside an island (gloo broadcast from rank 0; unshaped, fast)."""
    if procs <= 1:
        return 0.0
    return math.ceil(math.log2(procs)) * (nbytes / (island_gbit * 1e9 / 8.0) + 1e-4)


# ---------------------------------------------------------------------------------------------
# A run
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Setup:
    """What :func:`predict` takes, checked."""

    params: int
    step_compute_s: float
    islands: int
    procs: int
    link: Link
    algorithm: str
    inner_steps: int
    fragments: int
    overlap: int
    quantize: str
    block: int
    fragment_params: tuple[int, ...]
    island_gbit: float

    @property
    def every(self) -> int:
        """Steps between two launches (one fragment each)."""
        return 1 if self.algorithm == "sync" else self.inner_steps // self.fragments

    @property
    def tau(self) -> int:
        return self.overlap if self.algorithm == "streaming" else 0


@dataclass(frozen=True)
class Prediction:
    algorithm: str
    step_s: float                  # wall seconds per optimizer step (steady state, or averaged over `steps`)
    utilisation: float             # compute busy / wall
    stall_s_per_step: float        # waiting for the link, per step
    exchange_s: float              # one sync's exchange on the link (settled; the largest fragment)
    syncs_per_step: float
    payload_bytes_per_step: float  # one island's payload per step (what ``Islands.sent_bytes`` counts)
    link_bytes_per_step: float     # bytes one island sends onto its link per step, framing and notices included
    run_s: float                   # wall seconds of `steps` steps (0 when steady state was asked)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _simulate(s: Setup, steps: int, final: bool) -> tuple[float, float, float, list[float]]:
    """(wall seconds, payload bytes, link bytes, every exchange's seconds) of ``steps`` steps."""
    link, k = s.link, s.islands
    window = float(link.initial_window)
    last_end = -math.inf
    t = payload = wire = 0.0
    took_each: list[float] = []
    pending: dict[int, tuple[float, float]] = {}   # apply step -> (when its exchange is done, sharing it)

    def exchange(start: float, values: int, how: str) -> tuple[float, float]:
        """(seconds on the link, seconds sharing the result inside the island, after the link's)."""
        nonlocal window, payload, wire, last_end
        if link.congestion == "cubic" and last_end > -math.inf and start - last_end > link.rto_s:
            halvings = int((start - last_end) // link.rto_s)
            window = max(float(link.initial_window), window / 2.0 ** min(halvings, 60))
        took, window = exchange_s(values, how, s.block, k, link, window)
        payload += payload_bytes(values, how, s.block)
        wire += wire_bytes(values, how, s.block, k)
        last_end = start + took
        took_each.append(took)
        return took, _broadcast_s(4.0 * values, s.procs, s.island_gbit)

    launches = 0
    for step in range(1, steps + 1):
        t += s.step_compute_s
        if s.algorithm == "sync":
            t += sum(exchange(t, s.params, "none"))
            continue
        if step in pending:
            done, share = pending.pop(step)
            t = max(t, done) + share
        if step % s.every == 0:
            values = s.fragment_params[launches % s.fragments]
            launches += 1
            took, share = exchange(t, values, s.quantize)
            if s.tau:  # the exchange runs on a thread; the island shares its result when it applies it
                pending[step + s.tau] = (t + took, share)
            else:
                t += took + share
    if final:
        t = _final(s, steps, t, pending, exchange)
    return t, payload, wire, took_each


def _final(s: Setup, steps: int, t: float, pending: dict[int, tuple[float, float]], exchange) -> float:
    """``Islands.final``: the sync in flight applied, then every fragment synced, blocking (DiLoCo that
    synced at the last step has nothing left)."""
    if s.algorithm == "sync":
        return t
    for done, share in pending.values():
        t = max(t, done) + share
    if s.fragments == 1 and steps % s.every == 0:
        return t
    for values in s.fragment_params:
        t += sum(exchange(t, values, s.quantize))
    return t


def check(params: int, step_compute_s: float, islands: int, procs_per_island: int, link_mbit: float,
          latency_ms: float, algorithm: str, inner_steps: int, fragments: int, overlap: int, quantize: str,
          block: int, fragment_params: list[int] | None = None, congestion: str = "bbr",
          initial_window: int = 10, island_gbit: float = 10.0) -> Setup:
    """The arguments as a :class:`Setup`; ``ValueError`` with one line naming what to fix."""
    def finite(name: str, v: float, low: float, strict: bool = True) -> None:
        if not isinstance(v, (int, float)) or not math.isfinite(v) or (v <= low if strict else v < low):
            raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {low:g}, got {v!r}")

    for name, v in (("model_params", params), ("islands", islands), ("procs_per_island", procs_per_island),
                    ("inner_steps", inner_steps), ("fragments", fragments), ("block", block),
                    ("initial_window", initial_window)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if not isinstance(overlap, int) or isinstance(overlap, bool) or overlap < 0:
        raise ValueError(f"overlap must be an integer >= 0, got {overlap!r}")
    if islands < 2:
        raise ValueError(f"islands must be at least 2 (one island has no link to plan), got {islands}")
    finite("step_compute_s", step_compute_s, 0.0, strict=False)
    finite("link_mbit", link_mbit, 0.0)
    finite("latency_ms", latency_ms, 0.0, strict=False)
    finite("island_gbit", island_gbit, 0.0)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE)}, got {quantize!r}")
    if congestion not in CONGESTION:
        raise ValueError(f"congestion must be one of {', '.join(CONGESTION)}, got {congestion!r}")
    if algorithm != "streaming":
        fragments, overlap = 1, 0
    if algorithm == "sync":
        quantize = "none"
    if algorithm == "streaming":
        if inner_steps % fragments:
            raise ValueError(f"inner_steps ({inner_steps}) must be a multiple of fragments ({fragments})")
        if overlap >= inner_steps // fragments:
            raise ValueError(f"overlap ({overlap}) must be below the {inner_steps // fragments} steps between "
                             "two fragments' syncs")
    if fragment_params is None:
        base, extra = divmod(params, fragments)
        sizes = tuple(base + (1 if i < extra else 0) for i in range(fragments))
    else:
        sizes = tuple(fragment_params)
        if len(sizes) != fragments or any(not isinstance(v, int) or v < 0 for v in sizes) or sum(sizes) != params:
            raise ValueError(f"fragment_params must list {fragments} non-negative sizes summing to {params}")
    return Setup(params, float(step_compute_s), islands, procs_per_island,
                 Link(float(link_mbit), float(latency_ms), initial_window, congestion), algorithm, inner_steps,
                 fragments, overlap, quantize, block, sizes, float(island_gbit))


def predict(model_params: int, step_compute_s: float, islands: int, procs_per_island: int, link_mbit: float,
            latency_ms: float, algorithm: str, inner_steps: int = 50, fragments: int = 1, overlap: int = 0,
            quantize: str = "none", block: int = 256, *, steps: int = 0, fragment_params: list[int] | None = None,
            congestion: str = "bbr", initial_window: int = 10, island_gbit: float = 10.0) -> Prediction:
    """Predicted step time, utilisation and bytes of one islands configuration.

    ``step_compute_s``: one inner step of an island without the link (measured, or the planner's);
    ``algorithm``: sync | diloco | streaming; ``inner_steps`` H, ``fragments`` P, ``overlap`` tau and
    ``quantize``/``block`` as in the ``[islands]`` config (fragments/overlap count for streaming only,
    sync sends float32 gradients). ``steps`` > 0: a run of that many steps from a fresh connection,
    its final sync included (``run_s``; ``step_s`` = ``run_s / steps``); 0: the steady state.
    ``fragment_params``: each fragment's parameter count (default: equal parts).
    """
    s = check(model_params, step_compute_s, islands, procs_per_island, link_mbit, latency_ms, algorithm,
              inner_steps, fragments, overlap, quantize, block, fragment_params, congestion, initial_window,
              island_gbit)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ValueError(f"steps must be an integer >= 0, got {steps!r}")
    # Steady state: the difference between two runs long enough for the window to settle.
    period = s.every * s.fragments                         # steps in which every fragment syncs once
    n1 = period * max(1, math.ceil(40 / period))
    w1, p1, b1, _ = _simulate(s, n1, final=False)
    w2, p2, b2, took = _simulate(s, 2 * n1, final=False)
    one = max(took[len(took) // 2:])                       # the longest exchange on the link once settled
    if steps:
        wall, payload, wire, _ = _simulate(s, steps, final=True)
        n, run = steps, wall
    else:
        n, wall, payload, wire, run = n1, w2 - w1, p2 - p1, b2 - b1, 0.0
    busy = n * s.step_compute_s
    step = wall / n
    return Prediction(algorithm=s.algorithm, step_s=step, utilisation=busy / wall if wall > 0 else 1.0,
                      stall_s_per_step=max(0.0, step - s.step_compute_s), exchange_s=one,
                      syncs_per_step=1.0 / s.every, payload_bytes_per_step=payload / n,
                      link_bytes_per_step=wire / n, run_s=run)


# ---------------------------------------------------------------------------------------------
# The comparison `stalwart plan --islands` prints
# ---------------------------------------------------------------------------------------------

def compare(section, params: int, step_s: float) -> list[tuple[str, Prediction]]:
    """(label, prediction) for synchronous training, then DiLoCo and streaming at every H of the
    ``[islands]`` config section (``planner.config.IslandsSection``; streaming where P divides H)."""
    i = section
    common = dict(model_params=params, step_compute_s=step_s, islands=i.count, procs_per_island=i.procs,
                  link_mbit=i.link_mbit, latency_ms=i.latency_ms, block=i.block, steps=i.steps,
                  congestion=i.congestion, island_gbit=i.island_gbit)
    rows = [("sync", predict(algorithm="sync", **common))]
    for h in i.inner_steps:
        rows.append((f"diloco H={h} {i.diloco_quantize}",
                     predict(algorithm="diloco", inner_steps=h, quantize=i.diloco_quantize, **common)))
        if h % i.fragments:
            continue  # streaming syncs a fragment every H / P steps
        rows.append((f"streaming H={h} P={i.fragments} tau={i.overlap} {i.quantize}",
                     predict(algorithm="streaming", inner_steps=h, fragments=i.fragments, overlap=i.overlap,
                             quantize=i.quantize, **common)))
    return rows


def table(rows: list[tuple[str, Prediction]], tokens_per_step: float) -> list[str]:
    """The comparison as text lines: step time, utilisation, stall, exchange, bytes, and each row's
    speed and link bytes relative to synchronous training (the first row)."""
    base = rows[0][1]
    lines = [f"  {'algorithm':<34} {'step s':>8} {'util':>6} {'stall s/step':>12} {'exchange s':>10} "
             f"{'link B/step':>12} {'B/token':>9} {'speed':>6} {'bytes':>8}"]
    for label, p in rows:
        lines.append(f"  {label:<34} {p.step_s:8.4f} {100 * p.utilisation:5.1f}% {p.stall_s_per_step:12.4f} "
                     f"{p.exchange_s:10.3f} {p.link_bytes_per_step:12,.0f} {p.link_bytes_per_step / tokens_per_step:9.2f} "
                     f"{base.step_s / p.step_s:5.2f}x {base.link_bytes_per_step / p.link_bytes_per_step:7.0f}x")
    return lines
