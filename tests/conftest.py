"""Shared test helpers: run the real CLI in a subprocess, and a small real-text corpus."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A small slice of the standard library: real text, quick to tokenize.
SMALL_CORPUS = str(Path(sysconfig.get_paths()["stdlib"]) / "json")

# Overrides that make a training run take seconds on 2 cores.
TINY_RUN = [
    "--model.flavor", "debug", "--data.path", SMALL_CORPUS, "--data.vocab_size", "384",
    "--data.tokenizer_train_mb", "0.1", "--data.seq_len", "32", "--data.val_fraction", "0.2",
    "--training.global_batch", "4", "--training.micro_batch", "2", "--scheduler.warmup_steps", "2",
    "--eval.batches", "1", "--eval.interval", "0", "--sample.max_new_tokens", "8",
    "--metrics.peak_tflops", "0.1", "--metrics.progress", "false",
]


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONWARNINGS"] = "ignore"
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def run_cli(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "stalwart", *args], capture_output=True, text=True,
                          env=cli_env(), cwd=REPO, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"stalwart {' '.join(args)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                             f"\n--- stderr\n{proc.stderr[-4000:]}")
    return proc


def read_metrics(run_dir: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return lines


def step_losses(run_dir: Path) -> dict[int, float]:
    """step -> training loss (the last line wins if a step was logged twice)."""
    return {m["step"]: m["loss"] for m in read_metrics(run_dir) if "loss" in m}


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"
