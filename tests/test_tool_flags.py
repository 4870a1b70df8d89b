"""The flag-taking tools (argparse) answer a bad flag as the config does: one line naming it, exit 2."""

from __future__ import annotations

import importlib

import pytest

pytestmark = pytest.mark.unit

CASES = [
    ("stalwart.cli.doctor", ["--nproc", "0"], "--nproc must be at least 1 (got 0)"),
    ("stalwart.cli.doctor", ["--iters", "0"], "--iters must be at least 1"),
    ("stalwart.cli.doctor", ["--tolerance", "nan"], "--tolerance is a fraction worse than the median"),
    ("stalwart.cli.doctor", ["--nproc", "two"], "argument --nproc: invalid int value: 'two'"),
    ("stalwart.cli.report", [], "the following arguments are required: run_dir"),
    ("stalwart.cli.export", ["--format", "onnx"], "invalid choice: 'onnx'"),
    ("stalwart.bench.sandbox", ["--programs", "0"], "must be at least 1"),
]


@pytest.mark.parametrize("module,argv,message", CASES)
def test_a_bad_flag_is_one_line_and_exit_2(module, argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        importlib.import_module(module).main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "--help" in err[0], err
