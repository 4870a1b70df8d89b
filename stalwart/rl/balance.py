"""Adaptive balancing between the generator and trainer meshes: pure decisions from measured time.

Every ``window`` steps the controller hands over what each mesh spent per step: the seconds the
generators were busy (generation and re-scoring, summed over generators) and the trainers' (their step
and weight gather, summed over trainers), with the actor counts. A worker moves to the mesh whose
per-worker load is higher when the move is expected to shorten the step: the busier side's time is
assumed to divide by its worker count, the other side's to grow accordingly, and a move that would not
gain at least ``min_gain`` of the step is not made (no oscillation between two near-equal layouts).
Trainer counts must divide the prompts per step (every trainer rank trains whole groups).
No clocks, no processes: the thin layer that moves actors is ``rl.loop``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    generators: int
    trainers: int


@dataclass(frozen=True)
class Move:
    to: Layout
    reason: str


def critical(gen_busy_s: float, train_busy_s: float, layout: Layout) -> float:
    """Seconds of a step's generation plus training when each side's work divides over its workers."""
    return gen_busy_s / layout.generators + train_busy_s / layout.trainers


def decide(gen_busy_s: float, train_busy_s: float, layout: Layout, prompts: int, min_gain: float = 0.1,
           min_each: int = 1) -> Move | None:
    """The layout to move to, or None. ``gen_busy_s``/``train_busy_s``: summed worker-seconds of one step."""
    now = critical(gen_busy_s, train_busy_s, layout)
    if now <= 0:
        return None
    options = []
    if layout.trainers > min_each:
        t = layout.trainers - 1
        while t > min_each and prompts % t:
            t -= 1
        if prompts % t == 0 and t < layout.trainers:
            options.append(Layout(layout.generators + layout.trainers - t, t))
    if layout.generators > min_each:
        t = layout.trainers + 1
        total = layout.generators + layout.trainers
        while t < total and prompts % t:
            t += 1
        if t < total and prompts % t == 0:
            options.append(Layout(total - t, t))
    best = min(options, key=lambda lay: critical(gen_busy_s, train_busy_s, lay), default=None)
    if best is None:
        return None
    after = critical(gen_busy_s, train_busy_s, best)
    if now - after < min_gain * now:
        return None
    side = "generation" if best.generators > layout.generators else "training"
    return Move(best, f"{side} is the longer phase: expected {now:.2f} s -> {after:.2f} s of generation + "
                      f"training per step with {best.generators} generators, {best.trainers} trainers")
