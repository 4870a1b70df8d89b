"""`stalwart data prepare|inspect` and training from a prepared, mixed dataset, through the real CLI."""

import sysconfig
from pathlib import Path

import pytest

from conftest import SMALL_CORPUS, TINY_RUN, read_metrics, run_cli
from stalwart.data.tokenizer import train_bpe

pytestmark = pytest.mark.e2e

EMAIL = str(Path(sysconfig.get_paths()["stdlib"]) / "email" / "mime")
PREPARE = ["data", "prepare", "--input", f"json={SMALL_CORPUS}", "--input", f"mime={EMAIL}", "--vocab-size", "384",
           "--tokenizer-train-mb", "0.1", "--val-fraction", "0.2", "--shard-mb", "0.01", "--no-progress"]


def one_line_error(proc, *words):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    for w in words:
        assert w in proc.stderr, proc.stderr


def test_prepare_train_resume_from_a_mixed_prepared_dataset(tmp_path):
    data, again = tmp_path / "data", tmp_path / "again"
    run_cli(*PREPARE, "--out", str(data), "--workers", "2")
    run_cli(*PREPARE, "--out", str(again), "--workers", "1")
    files = sorted(p.name for p in data.iterdir())
    assert files == sorted(p.name for p in again.iterdir()) and "index.json" in files
    assert all((data / f).read_bytes() == (again / f).read_bytes() for f in files)  # same bytes, any workers
    shown = run_cli("data", "inspect", str(data), "--verify").stdout
    assert "source json" in shown and "source mime" in shown and "checksums verified" in shown

    run = [*TINY_RUN, "--data.path", str(data), "--data.mix", "json:0.5,mime:0.5", "--training.steps", "4",
           "--nproc-per-node", "2"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_cli("train", *run, "--run.dir", str(straight))
    run_cli("train", *run, "--run.dir", str(resumed), "--training.stop_at_step", "2")
    run_cli("train", *run, "--run.dir", str(resumed))
    losses = [{m["step"]: m["loss"] for m in read_metrics(d) if "loss" in m} for d in (straight, resumed)]
    assert losses[0] == losses[1] and sorted(losses[0]) == [1, 2, 3, 4]  # bit for bit
    last = [m for m in read_metrics(straight) if "loss" in m][-1]
    assert last["data_tokens/json"] == last["data_tokens/mime"] == 4 * 2 * 32  # 4 steps x 2 of 4 sequences x 32

    other = tmp_path / "other-tokenizer.json"
    other.write_text(train_bpe(["another text entirely"] * 20, 280).to_str())
    one_line_error(run_cli("train", *TINY_RUN, "--data.path", str(data), "--run.dir", str(tmp_path / "r2"),
                           "--data.tokenizer", str(other), check=False),
                   "data.tokenizer", "differs from the one")
    shard = data / "json.train.00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 1  # same size: only the checksum sees it
    shard.write_bytes(bytes(raw))
    one_line_error(run_cli("train", *TINY_RUN, "--data.path", str(data), "--run.dir", str(tmp_path / "r3"),
                           check=False), "json.train.00000.bin", "checksum")
    one_line_error(run_cli("data", "inspect", str(tmp_path / "nothing"), check=False), "index.json")
