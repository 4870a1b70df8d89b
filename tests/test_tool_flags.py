"""The flag-taking tools (argparse) answer a bad flag as the config does: one line naming it, exit 2."""

from __future__ import annotations

import importlib

import pytest

pytestmark = pytest.mark.unit

CASES = [
    ("stalwart.cli.doctor", ["--nproc", "0"], "argument --nproc: must be at least 1 (got 0)"),
    ("stalwart.cli.doctor", ["--iters", "0"], "argument --iters: must be at least 1"),
    ("stalwart.cli.doctor", ["--tolerance", "nan"], "--tolerance is a fraction worse than the median"),
    ("stalwart.cli.doctor", ["--nproc", "two"], "argument --nproc: expected an integer, got 'two'"),
    ("stalwart.cli.report", [], "the following arguments are required: run_dir"),
    ("stalwart.cli.export", ["--format", "onnx"], "invalid choice: 'onnx'"),
    ("stalwart.bench.sandbox", ["--programs", "0"], "must be at least 1"),
    ("stalwart.cli.dashboard", [".", "--port", "99999"], "--port must be within 0-65535 (got 99999)"),
    ("stalwart.cli.generate", ["--run", ".", "--temperature", "nan"], "--temperature must be a number in [0, 2]"),
    ("stalwart.cli.generate", ["--run", ".", "--temperature", "-1"], "--temperature must be a number in [0, 2]"),
    ("stalwart.cli.generate", ["--run", ".", "--temperature", "2.5"], "--temperature must be a number in [0, 2]"),
    ("stalwart.cli.generate", ["--run", ".", "--max-new-tokens", "-5"], "argument --max-new-tokens: must be at least 0 (got -5)"),
    ("stalwart.cli.generate", ["--run", ".", "--seed", str(2**70)], "--seed must be within"),
    ("stalwart.cli.generate", ["--run", ".", "--prompt", "ab\udcff"], "--prompt is not valid UTF-8 text"),
    # the benchmarks' flags are range-checked as they are parsed (config.arguments)
    ("stalwart.bench.inference", ["--flavors", "tiny"], "argument --flavors: 'tiny': expected FLAVOR:VOCAB"),
    ("stalwart.bench.inference", ["--flavors", "tiny:1024,nope:8"], "'nope:8': choose from debug, tiny"),
    ("stalwart.bench.inference", ["--workloads", "batch 2"], "'batch 2': choose from batch 1, batch 32, mixed"),
    ("stalwart.bench.inference", ["--max-batch-tokens", "0"], "--max-batch-tokens: must be at least 64 (got 0)"),
    ("stalwart.bench.inference", ["--decode-attention", "grouped,grouped"], "give each value once"),
    ("stalwart.bench.inference", ["--precisions", "int4"], "'int4': choose from float32, bfloat16, int8"),
    ("stalwart.bench.inference", ["--heldout", "x.txt"], "--heldout needs --weights"),
    ("stalwart.bench.throughput", ["--procs", "1,x"], "argument --procs: expected an integer, got 'x'"),
    ("stalwart.bench.throughput", ["--warmup", "0"], "argument --warmup: must be at least 1 (got 0)"),
    ("stalwart.bench.data", ["--rss-mb", "100,-1"], "argument --rss-mb: '-1': must be above 0 (got -1)"),
    ("stalwart.bench.moe", ["--tokens", "200"], "--tokens must be a multiple of 128 (got 200)"),
    ("stalwart.bench.observe_overhead", ["--steps", "0"], "argument --steps: must be at least 1 (got 0)"),
    ("stalwart.bench.layouts", ["--only", "tp=3"], "argument --only: 'tp=3': choose from 1 process"),
    ("stalwart.bench.checkpoint", ["--seq", "-1"], "argument --seq: must be at least 1 (got -1)"),
    ("stalwart.bench.speculative", ["--run", ".", "--temperature", "-1"], "--temperature: must be at least 0.0"),
]


@pytest.mark.parametrize("module,argv,message", CASES)
def test_a_bad_flag_is_one_line_and_exit_2(module, argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        importlib.import_module(module).main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "--help" in err[0], err


def test_the_dashboard_names_the_host_or_the_port_it_cannot_bind(tmp_path):
    import socket

    from stalwart.cli import dashboard
    from stalwart.errors import UserError

    with pytest.raises(UserError, match="--host: cannot resolve 'example.invalid'"):
        dashboard.main([str(tmp_path), "--host", "example.invalid"])
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(UserError, match=f"--port: cannot listen on 127.0.0.1:{port} .*choose another --port"):
            dashboard.main([str(tmp_path), "--port", str(port)])


def test_diagnose_names_a_missing_run_directory(tmp_path):
    from stalwart.cli import diagnose
    from stalwart.errors import UserError

    with pytest.raises(UserError, match="no run directory at"):
        diagnose.main([str(tmp_path / "missing")])


def test_a_checkpoint_knows_the_run_that_holds_it(tmp_path):
    from stalwart.paths import RunPaths

    run = RunPaths(tmp_path / "run")
    run.checkpoint(4).mkdir(parents=True)
    assert RunPaths.holding(run.checkpoint(4)) is None  # no config.toml: not a run directory
    run.config.write_text("")
    assert RunPaths.holding(run.checkpoint(4)).root == run.root
    assert RunPaths.holding(tmp_path / "loose" / "step-4") is None


def test_an_output_directory_that_is_a_file_is_named(tmp_path):
    from stalwart.cli import report
    from stalwart.errors import UserError
    from stalwart.ft.runlock import RunLock
    from stalwart.paths import RunPaths

    with pytest.raises(UserError, match="is not a run directory .*nothing to report"):
        report.main([str(tmp_path)])
    assert not (tmp_path / "report").exists()
    RunPaths(tmp_path).events.write_text("")
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="--out: .*file is a file, not a directory"):
        report.main([str(tmp_path), "--out", str(tmp_path / "file")])
    from stalwart.cli import data

    with pytest.raises(UserError, match="--out: .*file is a file, not a directory"):
        data.main(["prepare", "--input", str(tmp_path / "file"), "--out", str(tmp_path / "file")])
    with pytest.raises(UserError, match="--trace-steps: FIRST 3 is after LAST 1"):
        report.main([str(tmp_path), "--trace", "--trace-steps", "3:1"])
    with pytest.raises(UserError, match="run.dir: cannot make the directory .*file/run"):
        RunLock(RunPaths(tmp_path / "file" / "run")).acquire()
    assert (tmp_path / "file").read_text() == ""
