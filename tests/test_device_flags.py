"""Every command that runs a model takes ``--device auto|cpu|cuda``; on a machine without the device it
asks for, the command says so in one line naming the flag and exits 2, before starting anything."""

from __future__ import annotations

import pytest
import torch

from conftest import run_cli

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: nothing to refuse")]

COMMANDS = {
    "train": ["train", "--config", "debug", "--device", "cuda"],
    "train, 2 processes": ["train", "--config", "debug", "--device", "cuda", "--nproc-per-node", "2"],
    "bench throughput": ["bench", "throughput", "--device", "cuda"],
    "bench layouts": ["bench", "layouts", "--device", "cuda"],
    "bench moe": ["bench", "moe", "--device", "cuda"],
    "bench checkpoint": ["bench", "checkpoint", "--device", "cuda"],
}


def test_a_device_the_machine_lacks_is_one_line_and_exit_2(tmp_path):
    for name, argv in COMMANDS.items():
        proc = run_cli(*argv, "--run.dir", str(tmp_path / "run"), check=False) if argv[0] == "train" \
            else run_cli(*argv, check=False)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, (name, proc.stderr[-2000:])
        assert len(lines) == 1 and "cuda" in lines[0] and "device" in lines[0] and "cpu or auto" in lines[0], \
            (name, proc.stderr)
        assert "Traceback" not in proc.stdout + proc.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written
