"""Published throughput points the planner must reproduce: the rows of ``published.py`` (Megatron-LM,
Llama 3, torchtitan), each within ``TOLERANCE`` and within half a point of the error the documentation
reports for it (``stalwart plan --validate``; ``calibration.py`` fits the constants on the ``fit`` rows).

Each row fixes what the source states and lets the planner choose what it does not among layouts that
fit in memory; it is a prediction, not a lookup: no published figure is an input to the model.
"""

from __future__ import annotations

from stalwart.planner.calibration import report

TOLERANCE = 0.20
DRIFT = 0.005   # a row's error may move this far from the reported one before the check fails


def check_all() -> list[dict]:
    """Every published row: role, published, predicted, error, reported error, whether it passes."""
    rows = report()
    for r in rows:
        r["ok"] = abs(r["error"]) <= TOLERANCE and abs(r["error"] - r["reported_error"]) <= DRIFT and r["fits"]
    return rows
