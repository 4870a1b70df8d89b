"""The peer benchmark's table and its vendored peer (the measurements themselves are a script)."""

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FLOPS = {"stalwart": 24e6, "torchtitan": 24e6, "nanogpt": 20e6, "hf": 24e6}


def _results(runs, **extra) -> list[dict]:
    return [{"peer": p, "procs": n, "threads": t, "tokens_per_s": x, "flops_per_token": FLOPS[p], **extra}
            for p, n, t, xs in runs for x in xs]


def test_table_compares_stalwart_with_the_best_peer_per_config_by_model_flops():
    bench = _load("peer_bench", BENCH / "peer_bench.py")
    runs = [("stalwart", 1, 1, [100, 110, 90]), ("nanogpt", 1, 1, [120, 118, 119]), ("hf", 1, 1, [80, 81, 82]),
            ("torchtitan", 1, 1, [95, 96, 97]),
            ("stalwart", 2, 1, [200, 210]), ("nanogpt", 2, 1, [150, 160]), ("hf", 2, 1, [170, 190]),
            ("torchtitan", 2, 1, [100, 101])]
    rows = bench.summarize(_results(runs))
    assert [(r["procs"], r["threads"]) for r in rows] == [(1, 1), (2, 1)]
    # By FLOP/s at 1x1: nanoGPT 119 x 20 MFLOP = 2.38 GFLOP/s beats torchtitan's 96 x 24 = 2.30, and
    # Stalwart's 100 x 24 = 2.40 is 1.01x of it (by tokens/s it would read 0.84x).
    assert rows[0]["best_peer"] == "nanogpt" and rows[0]["ratio"] == pytest.approx(100 * 24 / (119 * 20))
    assert rows[1]["best_peer"] == "hf" and rows[1]["ratio"] == pytest.approx(205 / 180)
    table = bench.format_table(rows)
    assert "1.01x vs nanoGPT" in table and "1.14x vs HF transformers (Llama)" in table
    assert "100 (100, 110, 90)" in table  # every repeat is shown, not only the median
    assert "0.002 TFLOP/s" in table


def test_vendored_nanogpt_keeps_its_licence_and_commit():
    source = (BENCH / "peers" / "nanogpt_model.py").read_text()
    assert "MIT License" in source and "Copyright (c) 2022 Andrej Karpathy" in source
    assert "3adf61e154c3fe3fca428ad6bc3818b27a3b8291" in source and "class GPT(nn.Module)" in source


def test_table_keeps_precisions_apart():
    bench = _load("peer_bench", BENCH / "peer_bench.py")
    results = [{"peer": p, "procs": 1, "threads": 1, "tokens_per_s": x, "dtype": d, "flops_per_token": 1e6}
               for p, d, x in [("stalwart", "bfloat16", 300), ("nanogpt", "bfloat16", 200), ("hf", "bfloat16", 150),
                               ("stalwart", "float32", 100), ("nanogpt", "float32", 125), ("hf", "float32", 90)]]
    rows = bench.summarize(results)
    assert [(r["dtype"], r["ratio"]) for r in rows] == [("float32", pytest.approx(0.8)), ("bfloat16", pytest.approx(1.5))]
    assert "| 1 process x 1 thread, bfloat16 |" in bench.format_table(rows)


def test_table_keeps_compiled_and_eager_apart():
    bench = _load("peer_bench", BENCH / "peer_bench.py")
    runs = [("stalwart", 1, 1, [100]), ("torchtitan", 1, 1, [90])]
    rows = bench.summarize(_results(runs, compile=False) + _results([("stalwart", 1, 1, [130]),
                                                                      ("torchtitan", 1, 1, [100])], compile=True))
    assert [(r["compile"], r["best_peer"], r["ratio"]) for r in rows] == [
        (False, "torchtitan", pytest.approx(100 / 90)), (True, "torchtitan", pytest.approx(1.3))]
    assert "| 1 process x 1 thread, compiled |" in bench.format_table(rows)


def test_failed_run_is_named_in_one_line_and_cpu_seconds_are_tabled():
    bench = _load("peer_bench", BENCH / "peer_bench.py")
    stderr = ["Traceback (most recent call last):", "torch.multiprocessing.spawn.ProcessRaisedException:",
              "RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo", "[W] a warning after it"]
    assert bench.error_line(stderr) == "RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo"
    assert bench.error_line(["killed"]) == "killed" and bench.error_line([]) == "exited without output"
    rows = bench.summarize(_results([("stalwart", 1, 1, [100]), ("torchtitan", 1, 1, [90])], cpu_s_per_step=0.5))
    assert "; 0.50 CPU s/step" in bench.format_table(rows)
