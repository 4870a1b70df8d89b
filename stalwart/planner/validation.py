"""Published throughput points the planner must reproduce within +-15% (a test asserts it).

Each point fixes what the source states (degrees, batch, sequence, hardware) and lets the planner
choose what it does not (micro-batch, virtual stages, activation checkpointing) among layouts that
fit in memory; it is a prediction, not a lookup: no number below is an input to the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from stalwart.planner.cost import Network, Options
from stalwart.planner.hardware import GPUS
from stalwart.planner.layout import Workload
from stalwart.planner.search import Candidate, Space, rank_layouts
from stalwart.planner.shapes import FLAVORS

TOLERANCE = 0.15


@dataclass(frozen=True)
class Point:
    name: str
    source: str
    workload: Workload
    gpus: int
    gpu: str
    space: Space
    options: Options
    metric: str                 # "tflops_per_gpu" or "tokens_per_s_per_gpu"
    published: float


POINTS: tuple[Point, ...] = (
    Point("Llama 3 405B, 8,192 H100", "Llama 3 paper, table 4: TP8 CP1 PP16 DP64, seq 8192, 16M tokens/batch",
          Workload(FLAVORS["llama3-405B"], 8192, 2048), 8192, "H100",
          Space(tp=(8,), pp=(16,), cp=(1,), schedules=("1f1b", "interleaved"), fsdp=(True,)),
          Options(), "tflops_per_gpu", 430.0),
    Point("Llama 3 405B, 16,384 H100", "Llama 3 paper, table 4: TP8 CP1 PP16 DP128, seq 8192, 16M tokens/batch",
          Workload(FLAVORS["llama3-405B"], 8192, 2048), 16384, "H100",
          Space(tp=(8,), pp=(16,), cp=(1,), schedules=("1f1b", "interleaved"), fsdp=(True,)),
          Options(), "tflops_per_gpu", 400.0),
    Point("torchtitan Llama 3.1 8B, 8 H100", "torchtitan docs/performance.md table 1: FSDP + compile, local "
          "batch 2, seq 8192, selective op AC, H100 96GB HBM2e at 500 W",
          Workload(FLAVORS["llama3-8B"], 8192, 16), 8, "H100-96G",
          Space(tp=(1,), pp=(1,), cp=(1,), micro_batch=(2,), ac=("op",), fsdp=(True,)),
          Options(compile=True, power_limit_w=500.0), "tokens_per_s_per_gpu", 6667.0),
)


def predict(p: Point) -> Candidate:
    ranked = rank_layouts(p.workload, p.gpus, GPUS[p.gpu], Network(), p.options, space=p.space)
    return ranked[0]


def check_all() -> list[dict]:
    rows = []
    for p in POINTS:
        c = predict(p)
        value = getattr(c.time, p.metric)
        rows.append({"name": p.name, "source": p.source, "metric": p.metric, "published": p.published,
                     "predicted": value, "error": value / p.published - 1.0, "fits": c.fits,
                     "layout": c.layout.describe()})
    return rows
