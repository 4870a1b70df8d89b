"""Young/Daly optimal checkpoint interval: the analytic baseline the simulation is compared with.

Young (1974): tau = sqrt(2 * delta * M). Daly (2006), first order with restart time R:
tau = sqrt(2 * delta * (M + R)) - delta, valid for delta < 2M (else checkpoint every M). Here delta is
what a checkpoint costs the critical path (the full save when synchronous, the snapshot stall when
asynchronous) and M the job's mean time between interruptions.
"""

from __future__ import annotations

import math


def young_interval(delta_s: float, mtbf_s: float) -> float:
    return math.sqrt(2.0 * delta_s * mtbf_s)


def daly_interval(delta_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    if delta_s >= 2.0 * mtbf_s:
        return mtbf_s
    return max(math.sqrt(2.0 * delta_s * (mtbf_s + restart_s)) - delta_s, 0.0)


def expected_waste_fraction(interval_s: float, delta_s: float, mtbf_s: float, downtime_s: float,
                            persist_s: float = 0.0) -> float:
    """First-order waste: checkpoint overhead, plus per failure half an interval of lost work, the
    async persist lag (work not yet durable) and the downtime."""
    return delta_s / (interval_s + delta_s) + (interval_s / 2.0 + persist_s + downtime_s) / mtbf_s
