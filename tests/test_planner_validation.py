"""The planner predicts the published throughput points within +-15%."""

from __future__ import annotations

import pytest

from stalwart.planner.validation import POINTS, TOLERANCE, predict

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("point", POINTS, ids=[p.name for p in POINTS])
def test_published_point(point):
    best = predict(point)
    assert best.fits, f"{point.name}: the published layout should fit in memory"
    value = getattr(best.time, point.metric)
    assert abs(value / point.published - 1) <= TOLERANCE, (point.name, value, point.published)


def test_scaling_from_8k_to_16k_gpus_loses_throughput():
    a, b = predict(POINTS[0]), predict(POINTS[1])
    assert b.time.tflops_per_gpu < a.time.tflops_per_gpu      # published: 430 -> 400
