"""`stalwart bench checkpoint` end to end at a small size: the table the docs quote, from real saves,
an async save, a memory snapshot and a restore, bracketed by raw-disk measurements."""

from __future__ import annotations

import re

import pytest

from conftest import run_cli

pytestmark = pytest.mark.e2e


def test_checkpoint_bench_prints_one_row_per_repeat_and_leaves_nothing_behind(tmp_path):
    out = run_cli("bench", "checkpoint", "--repeats", "2", "--flavor", "debug", "--seq", "16",
                  "--dir", str(tmp_path), timeout=300).stdout
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+\d+\s+\d+\.\d\d\s", line)]
    assert [r[0] for r in rows] == ["0", "1"], out
    for r in rows:
        raw_w = [float(x) for x in r[2].split("/")]
        raw_r = [float(x) for x in r[12].split("/")]
        assert len(raw_w) == 2 == len(raw_r) and min(raw_w + raw_r) > 0, r
        sync_s, restore_s = float(r[3]), float(r[13])
        assert 0 < sync_s < 60 and 0 < restore_s < 60, r
        assert r[-3] in ("True", "False")  # whether the page cache could be dropped is reported
    assert list(tmp_path.iterdir()) == []  # the temporary directory is gone


def test_checkpoint_bench_refuses_an_unknown_flavor_in_one_line():
    p = run_cli("bench", "checkpoint", "--flavor", "nope", check=False)
    assert p.returncode == 2 and "--flavor: unknown flavor 'nope'" in p.stderr and "Traceback" not in p.stderr
