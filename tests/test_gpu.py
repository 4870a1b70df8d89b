"""The GPU tier (`make test-gpu`): the same code on CUDA. Skipped, with the reason, on a machine without
CUDA; run for real whenever a GPU machine is at hand (docs/gpu.md keeps the figures with the card's name).

- one process trains in bfloat16 on ``cuda`` and reports MFU against that device's measured matmul peak
- with two or more GPUs, FSDP over NCCL equals one process
- ``stalwart serve --device cuda`` answers greedy requests with the CPU engine's tokens
- the engine on ``cuda`` attends all decodes in one call per layer (batched) with the CPU engine's tokens
- one RL step with generator and trainer on ``cuda``
- a weight sync between trainer and generator ranks on ``cuda``
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import SMALL_CORPUS, TINY_RUN, run_cli, step_losses

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA device here: the GPU tier runs on a machine with one (make test-gpu)"),
]

FIGURES = Path(__file__).resolve().parents[1] / "gpu-figures.jsonl"  # gathered by make test-gpu for docs/gpu.md


def record(name: str, **figures) -> None:
    """Print a figure and keep it (with the card's name) for the docs."""
    line = {"test": name, "device": torch.cuda.get_device_name(0), "torch": torch.__version__, **figures}
    print(json.dumps(line))
    with open(FIGURES, "a") as fh:
        fh.write(json.dumps(line) + "\n")


def test_bf16_training_on_cuda_reports_mfu_against_the_measured_peak(tmp_path: Path) -> None:
    from stalwart.metrics.mfu import measure_matmul_tflops

    peak = measure_matmul_tflops(torch.bfloat16, n=8192, seconds=2.0, device=torch.device("cuda", 0))
    run = tmp_path / "run"
    out = run_cli("train", "--run.dir", str(run), "--device", "cuda", "--model.flavor", "125M",
                  "--data.path", SMALL_CORPUS, "--data.vocab_size", "4096", "--data.tokenizer_train_mb", "0.5",
                  "--data.seq_len", "1024", "--training.global_batch", "16", "--training.micro_batch", "16",
                  "--training.steps", "40", "--training.dtype", "bfloat16", "--scheduler.warmup_steps", "5",
                  "--eval.interval", "0", "--eval.batches", "1", "--sample.max_new_tokens", "8",
                  "--metrics.peak_tflops", f"{peak:.3f}", "--metrics.progress", "false",
                  "--launch.nproc_per_node", "1", timeout=900)
    summary = json.loads((run / "summary.json").read_text())
    losses = step_losses(run)
    assert all(math.isfinite(v) for v in losses.values())
    assert losses[max(losses)] < losses[min(losses)]
    assert "cuda" in out.stdout  # the banner names the device it ran on
    assert 0.0 < summary["mfu"] < 1.0
    record("bf16 training, 125M, seq 1024, batch 16, 1 GPU", measured_bf16_peak_tflops=round(peak, 1),
           tokens_per_s=round(summary["tokens_per_s"]), mfu=round(summary["mfu"], 4))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="FSDP over NCCL needs two or more GPUs")
def test_fsdp_over_nccl_equals_one_process(tmp_path: Path) -> None:
    common = [*TINY_RUN, "--device", "cuda", "--training.steps", "6", "--sample.max_new_tokens", "0"]
    run_cli("train", "--run.dir", str(tmp_path / "one"), *common, "--launch.nproc_per_node", "1")
    run_cli("train", "--run.dir", str(tmp_path / "two"), *common, "--nproc-per-node", "2",
            "--parallelism.dp_shard", "2", timeout=600)
    one, two = step_losses(tmp_path / "one"), step_losses(tmp_path / "two")
    assert one.keys() == two.keys()
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-4, abs=1e-5), step
    record("FSDP over NCCL vs one process", steps=len(one), max_abs_diff=max(abs(one[s] - two[s]) for s in one))


def test_serve_on_cuda_gives_the_cpu_engines_greedy_tokens(tmp_path: Path) -> None:
    from test_serve_e2e import PROMPTS, Server, train

    run = tmp_path / "run"
    train(run, 0)
    texts = {}
    for device in ("cpu", "cuda"):
        server = Server(tmp_path, "--run", str(run), "--device", device)
        try:
            texts[device] = server.greedy(PROMPTS, max_tokens=12)
        finally:
            assert server.stop() == 0, server.output()
    assert texts["cuda"] == texts["cpu"]
    record("serve --device cuda greedy == cpu", prompts=len(PROMPTS), equal=True)


def test_engine_on_cuda_decodes_in_one_call_with_the_cpu_engines_tokens(monkeypatch) -> None:
    """engine.decode_attention = auto is batched on CUDA: prompts of 1-70 tokens, unevenly placed in the
    cache, decode in one gathered call per layer, with the CPU (grouped) engine's greedy tokens."""
    import stalwart.infer.attention as attention
    from test_infer_engine import GREEDY, ByteTokenizer, build, logprobs, prompts, run

    from stalwart.config.serve import EngineConfig
    from stalwart.infer.engine import Engine

    seen: list[attention.StepLayout] = []
    real = attention.build_layout
    monkeypatch.setattr("stalwart.infer.engine.build_layout", lambda *a: seen.append(real(*a)) or seen[-1])
    batch = prompts(16)
    cpu, gpu = build(), build().to("cuda")
    engine = Engine(gpu, ByteTokenizer(), None, EngineConfig())
    assert engine.decode_mode == "batched"
    assert run(engine, batch, GREEDY) == run(Engine(cpu, ByteTokenizer(), None, EngineConfig()), batch, GREEDY)
    assert any(d.table is not None and d.count == 16 for layout in seen for d in layout.decodes)
    got = [logprobs(Engine(m, ByteTokenizer(), None, EngineConfig()), batch) for m in (cpu, gpu)]
    diff = max(abs(a - b) for g, h in zip(*got) for a, b in zip(g, h))
    assert diff < 1e-3, diff
    record("engine on cuda: batched decode attention == cpu greedy", prompts=len(batch),
           max_abs_logprob_diff=diff)


def test_one_rl_step_with_generator_and_trainer_on_cuda(tmp_path: Path) -> None:
    run = tmp_path / "rl"
    run_cli("rl", "--config", "rl_code", "--device", "cuda", "--run.dir", str(run), "--rl.steps", "1",
            "--rl.eval_interval", "1", timeout=900)
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in records if r.get("kind") == "rl"]
    assert len(steps) == 1 and math.isfinite(steps[0]["loss"])
    record("rl step on cuda", step_s=round(steps[0]["step_s"], 2), weight_sync_s=round(steps[0]["weight_sync_s"], 3))


def test_weight_sync_on_cuda(tmp_path: Path) -> None:
    out = run_cli("bench", "weight-sync", "--device", "cuda", "--flavor", "125M", "--trainers", "1",
                  "--repeats", "2", "--json", str(tmp_path / "sync.json"), timeout=900)
    rows = json.loads((tmp_path / "sync.json").read_text())
    assert rows and all(r["seconds"] > 0 and r["weights_match"] for r in rows), out.stdout
    assert all(r["controller_bytes"] < 4096 for r in rows if r["path"] == "direct")
    record("weight sync on cuda, 125M", rows=rows)
