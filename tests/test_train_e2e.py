"""End to end through the real CLI: train, resume, parity between layouts, generate, errors."""

import json

import pytest

from conftest import TINY_RUN, read_metrics, run_cli, step_losses
from stalwart.checkpoint.inspect import digest

pytestmark = pytest.mark.e2e


def train(run_dir, *extra, nproc=1, check=True):
    return run_cli("train", "--run.dir", str(run_dir), *TINY_RUN, "--nproc-per-node", str(nproc), *extra,
                   check=check)


def test_train_then_generate(run_dir):
    proc = train(run_dir, "--training.steps", "6", "--eval.interval", "3", "--checkpoint.interval", "3")
    assert "Stalwart run summary" in proc.stdout and "tokens/s" in proc.stdout
    for name in ("config.toml", "tokenizer.json", "metrics.jsonl", "events.jsonl", "summary.json"):
        assert (run_dir / name).is_file(), name
    metrics = read_metrics(run_dir)
    steps = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s", "data_wait_s", "mem_bytes"):
        assert key in steps[0], key
    evals = [m for m in metrics if "eval_loss" in m]
    assert [m["step"] for m in evals] == [0, 3, 6]
    records = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    events = [e["event"] for e in records]
    assert events[0] == "start" and events[-1] == "finished" and "checkpoint_saved" in events
    # One process runs in the command's own process: its start-up is timed from the command.
    (startup,) = [e for e in records if e["event"] == "startup"]
    assert 0 < startup["to_first_step_s"] == startup["from_command_s"] and startup["launcher_s"] == 0
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step-3", "step-6"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-6"
    out = run_cli("generate", "--run", str(run_dir), "--prompt", "def ", "--max-new-tokens", "12",
                  "--temperature", "0")
    assert out.stdout.startswith("def ") and len(out.stdout) > len("def ")
    again = run_cli("generate", "--run", str(run_dir), "--prompt", "def ", "--max-new-tokens", "12",
                    "--temperature", "0")
    assert again.stdout == out.stdout  # greedy decoding is deterministic


def test_two_processes_match_one_process(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    train(one, "--training.steps", "10", "--checkpoint.at_end", "false")
    train(two, "--training.steps", "10", "--checkpoint.at_end", "false", nproc=2)
    l1, l2 = step_losses(one), step_losses(two)
    assert sorted(l1) == sorted(l2) == list(range(1, 11))
    for step in l1:
        assert abs(l1[step] - l2[step]) <= 1e-5 * abs(l1[step]), (step, l1[step], l2[step])
    assert l1[10] < l1[1]


@pytest.mark.parametrize("nproc", [1, 2])
def test_resume_is_bit_for_bit(tmp_path, nproc):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(straight, "--training.steps", "8", nproc=nproc)
    stop = train(resumed, "--training.steps", "8", "--training.stop_at_step", "4", nproc=nproc)
    assert "stopped early" in stop.stdout
    assert (resumed / "checkpoints" / "step-4").is_dir()
    train(resumed, "--training.steps", "8", nproc=nproc)
    events = [json.loads(x) for x in (resumed / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "resumed" and e["step"] == 4 for e in events)
    # Each rank checked the one shard file it wrote (and read only records of the others).
    resumed_event = next(e for e in events if e["event"] == "resumed")
    assert resumed_event["shard_files_checked"] == [1] * nproc
    if nproc == 2:  # rank 0 reads the pages of the step counters in rank 1's file, not the file
        other = (resumed / "checkpoints" / "step-4" / "__1_0.distcp").stat().st_size
        assert resumed_event["shard_files_read_in_part"] == [1, 0]
        read = resumed_event["shard_bytes_read_in_part"]
        assert 0 < read[0] < other and read[1] == 0, (read, other)
    assert len(list((resumed / "checkpoints" / "step-4").glob("*.distcp"))) == nproc
    assert step_losses(straight) == step_losses(resumed)  # exact float equality, every step
    a, b = straight / "checkpoints" / "step-8", resumed / "checkpoints" / "step-8"
    assert digest(a, "model.") == digest(b, "model.")
    assert digest(a, "optim.") == digest(b, "optim.")


def test_resume_under_four_ddp_replicas_is_bit_for_bit(tmp_path):
    """Four replicas (DDP's bucketed all-reduce, parallel/replicate.py): the resumed run's reducer starts
    with the bucket layout the uninterrupted run kept, so gloo adds every gradient in the same order.
    The `tiny` flavor spans several buckets; with DDP's default rebuild this run differed at step 8."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    layout = ("--parallelism.data_parallel", "replicate", "--model.flavor", "tiny", "--training.global_batch", "8",
              "--sample.max_new_tokens", "0")
    first = train(straight, "--training.steps", "8", *layout, nproc=4)
    assert "replicated (DDP" in first.stdout
    train(resumed, "--training.steps", "8", "--training.stop_at_step", "4", *layout, nproc=4)
    train(resumed, "--training.steps", "8", *layout, nproc=4)
    assert step_losses(straight) == step_losses(resumed)
    a, b = straight / "checkpoints" / "step-8", resumed / "checkpoints" / "step-8"
    assert digest(a, "model.") == digest(b, "model.")


@pytest.mark.parametrize("nproc", [1, 2])
def test_corrupt_newest_checkpoint_falls_back(tmp_path, nproc):
    """With two ranks the damaged file is rank 1's: rank 0 reads only some records of it and leaves
    the checksum to rank 1, and both fall back all the same."""
    run_dir = tmp_path / "run"
    train(run_dir, "--training.steps", "4", "--checkpoint.interval", "2", nproc=nproc)
    shard = sorted((run_dir / "checkpoints" / "step-4").glob("*.distcp"))[-1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    proc = train(run_dir, "--training.steps", "6", nproc=nproc)
    assert "falling back" in proc.stdout
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    fallback = [e for e in events if e["event"] == "checkpoint_fallback"]
    assert fallback and "step-4" in fallback[0]["path"] and "checksum" in fallback[0]["error"]
    assert any(e["event"] == "resumed" and e["step"] == 2 for e in events)


def one_line_error(proc, pattern):
    assert proc.returncode == 2, proc.stderr
    lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1, proc.stderr
    assert pattern in lines[0], lines[0]


def test_user_errors_are_one_line(tmp_path):
    one_line_error(run_cli("train", "--training.stepz", "3", check=False), "did you mean 'training.steps'")
    one_line_error(run_cli("train", "--data.path", str(tmp_path / "nope"), check=False), "does not exist")
    one_line_error(run_cli("train", "--config", "nonexistent", check=False), "config 'nonexistent' not found")
    one_line_error(run_cli("train", "--config", "llama3-8b", check=False), "did you mean 'llama3_8b'?")
    one_line_error(run_cli("train", "--nproc-per-node", "0", check=False), "--nproc-per-node must be a whole number")
    one_line_error(run_cli("train", *TINY_RUN, "--nproc-per-node", "2", "--parallelism.dp_shard", "3",
                           check=False), "but the world size is 2")
    one_line_error(run_cli("train", *TINY_RUN, "--nproc-per-node", "2", "--parallelism.tp", "3", check=False),
                   "does not divide the world size 2")
    one_line_error(run_cli("generate", "--run", str(tmp_path), check=False), "not a run directory")
    latin, npy = tmp_path / "latin.txt", tmp_path / "tokens.npy"
    latin.write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e\n".encode("latin-1") * 400)
    npy.write_bytes(b"\x93NUMPY\x01\x00" + bytes(200))
    one_line_error(run_cli("train", *TINY_RUN, "--data.path", str(latin), "--run.dir", str(tmp_path / "r1"),
                           check=False), "latin.txt is not valid UTF-8 (byte 3")
    one_line_error(run_cli("train", *TINY_RUN, "--data.path", str(npy), "--nproc-per-node", "2", "--run.dir",
                           str(tmp_path / "r2"), check=False), "binary data files no data.format reads")


def test_a_run_with_checkpoints_refuses_overwrite_and_a_model_of_another_shape(run_dir):
    train(run_dir, "--training.steps", "2")
    config = (run_dir / "config.toml").read_bytes()
    proc = train(run_dir, "--training.steps", "2", "--checkpoint.resume", "none", check=False)
    one_line_error(proc, "already holds checkpoints")
    assert (run_dir / "checkpoints" / "step-2").is_dir()
    # Refused before any process starts (the launcher) or any group forms (one process), naming both
    # shapes, and the run's config stays the one its checkpoints were trained with.
    more = train(run_dir, "--training.steps", "4", "--model.n_layers", "4", nproc=2, check=False)
    one_line_error(more, "dim 64, 2 layers, 4 heads (2 key/value)")
    assert "than the config asks for (dim 64, 4 layers," in more.stderr
    assert f"resume with the config it was trained with (--config {run_dir / 'config.toml'})" in more.stderr
    fewer = train(run_dir, "--training.steps", "4", "--model.n_layers", "1", check=False)
    one_line_error(fewer, "than the config asks for (dim 64, 1 layers,")
    assert (run_dir / "config.toml").read_bytes() == config


def test_help_documents_every_field():
    out = run_cli("train", "--help").stdout
    for key in ("--training.steps", "--data.path", "--checkpoint.resume", "--metrics.log_interval",
                "--training.stop_at_step", "--run.dir", "--model.flavor", "--checkpoint.interval"):
        assert key in out


def test_plain_torchrun_launch(run_dir):
    """The documented multi-node form: torchrun -m stalwart.train (here with --standalone)."""
    import subprocess
    import sys

    from conftest import REPO, cli_env

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "stalwart.train", "--run.dir", str(run_dir), *TINY_RUN, "--training.steps", "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(step_losses(run_dir)) == [1, 2, 3]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2
