"""Storage that fails under a running job, for real (tmpfs in a private mount namespace: `unshare -rm`,
no privileges needed): a checkpoint write that fails (disk full, read-only remount; EIO and EACCES at the
writer boundary) is reported and retried at the next interval while training continues, with the older
checkpoints untouched; `export` and `report --out` onto a full or read-only disk say so in one line and
leave the output directory as it was."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO, TINY_RUN, cli_env
from test_checkpoint_unit import Events, manager, tiny

from stalwart.checkpoint.inspect import digest


def _can_unshare() -> bool:
    return bool(shutil.which("unshare")) and subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True).returncode == 0


@pytest.mark.unit
@pytest.mark.parametrize("code", [errno.EIO, errno.EACCES])
def test_an_io_or_permission_error_is_reported_and_the_next_save_retries(tmp_path, monkeypatch, code):
    from torch.distributed.checkpoint import FileSystemWriter

    events = Events()
    m = manager(tmp_path, events, async_save=True)
    model, opt = tiny()
    assert m.save(1, model, opt, {"tokens_seen": 1}, block=True) == tmp_path / "step-1"
    before = digest(tmp_path / "step-1")

    def fail(self, *a, **k):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(FileSystemWriter, "write_data", fail)
    m.save(2, model, opt, {"tokens_seen": 2})
    assert m.wait() is None  # failed: training goes on
    (failed,) = events.named("checkpoint_failed")
    assert failed["step"] == 2 and os.strerror(code).lower() in failed["error"].lower(), failed
    assert not (tmp_path / "step-2").exists() and digest(tmp_path / "step-1") == before  # untouched
    monkeypatch.undo()
    assert m.save(3, model, opt, {"tokens_seen": 3}, block=True) == tmp_path / "step-3"  # the next interval
    assert digest(tmp_path / "step-1") == before


@pytest.mark.unit
def test_a_failed_last_save_does_not_say_training_continues(tmp_path, monkeypatch, capsys):
    """The save on SIGTERM or at the end is the session's last: its warning names what a rerun resumes
    from instead of saying that training continues (exit 75 or 2 follows it)."""
    from torch.distributed.checkpoint import FileSystemWriter

    m = manager(tmp_path, Events(), async_save=True)
    model, opt = tiny()
    assert m.save(1, model, opt, {"tokens_seen": 1}, block=True) == tmp_path / "step-1"

    def fail(self, *a, **k):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(FileSystemWriter, "write_data", fail)
    capsys.readouterr()
    assert m.save(2, model, opt, {"tokens_seen": 2}, block=True) is None  # an interval's save: training goes on
    assert capsys.readouterr().err.rstrip().endswith("the previous checkpoint is kept, training continues")
    assert m.save(3, model, opt, {"tokens_seen": 3}, block=True, last=True) is None
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("warning: checkpoint step-3 failed: ") and "training continues" not in line
    assert line.endswith("this session ends without it; a rerun resumes from step-1, the newest complete checkpoint")


_DRIVER = textwrap.dedent("""
    import json, os, subprocess, sys, time
    from pathlib import Path
    run, out, args = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
    ck = run / "checkpoints"
    ck.mkdir(parents=True)
    sh = lambda cmd: subprocess.run(cmd, shell=True, check=True)
    sh(f"mount -t tmpfs -o size=32m tmpfs {ck}")
    def events(name):
        p = run / "events.jsonl"
        return [e for e in map(json.loads, p.read_text().splitlines() if p.is_file() else []) if e["event"] == name]
    def until(what, test, limit=240):
        end = time.time() + limit
        while not test():
            assert time.time() < end and train.poll() is None, f"gave up waiting for {what}"
            time.sleep(0.05)
    train = subprocess.Popen([sys.executable, "-m", "stalwart", "train", "--run.dir", str(run), *args],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    until("the first checkpoint", lambda: events("checkpoint_saved"))
    first = events("checkpoint_saved")[0]["path"]
    kept = {p.name: p.stat().st_mtime_ns for p in Path(first).iterdir()}
    sh(f"dd if=/dev/zero of={ck}/filler bs=64k 2>/dev/null || true")      # disk full
    until("a failed save", lambda: events("checkpoint_failed"))
    os.remove(ck / "filler")
    n = len(events("checkpoint_saved"))
    until("a save after space came back", lambda: len(events("checkpoint_saved")) > n)
    sh(f"mount -o remount,ro {ck}")                                         # read-only
    until("a failed save on read-only storage", lambda: len(events("checkpoint_failed")) > 1)
    sh(f"mount -o remount,rw {ck}")
    _, err = train.communicate(timeout=300)
    still = {p.name: p.stat().st_mtime_ns for p in Path(first).iterdir()} if Path(first).is_dir() else None
    json.dump({"rc": train.returncode, "stderr": err, "failed": events("checkpoint_failed"),
               "saved": [e["step"] for e in events("checkpoint_saved")], "first": first,
               "first_untouched": still == kept,
               "finished": bool(events("finished"))}, out.open("w"))
""")


@pytest.mark.e2e
def test_failing_saves_never_stop_training_and_are_retried(tmp_path):
    if not _can_unshare():
        pytest.fail("needs `unshare -rm` (an unprivileged user + mount namespace) to mount a private tmpfs")
    run, out = tmp_path / "run", tmp_path / "result.json"
    args = [*TINY_RUN, "--training.steps", "80", "--checkpoint.interval", "10", "--checkpoint.keep_last", "0",
            "--sample.max_new_tokens", "0", "--fault.inject", "slow:rank=0,factor=20,steps=1-80"]
    proc = subprocess.run(["unshare", "-rm", sys.executable, "-c", _DRIVER, str(run), str(out), json.dumps(args)],
                          env=cli_env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and out.is_file(), proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["rc"] == 0 and res["finished"], res["stderr"][-3000:]
    errors = [f["error"] for f in res["failed"]]
    assert any("no space left on the device writing" in e for e in errors), errors
    assert any("read-only file system writing" in e for e in errors), errors
    failed_steps = {f["step"] for f in res["failed"]}
    assert max(res["saved"]) == 80 and any(s > min(failed_steps) for s in res["saved"]), res  # retried
    assert res["first_untouched"] is True, res
    warnings = [x for x in res["stderr"].splitlines() if x.startswith("warning: checkpoint")]
    assert len(warnings) == len(res["failed"]) and "Traceback" not in res["stderr"]


_OUTPUTS = textwrap.dedent("""
    set -u
    stalwart() { "$PY" -m stalwart "$@"; }
    mkdir -p "$D/full" "$D/ro"
    mount -t tmpfs -o size=256k tmpfs "$D/full"
    dd if=/dev/zero of="$D/full/filler" bs=4k 2>/dev/null                       # full to the last block
    mount -t tmpfs -o size=4m tmpfs "$D/ro"
    stalwart export --run "$RUN" --out "$D/ro/hf" >/dev/null 2>&1 || exit 90     # an earlier export, intact after
    sha256sum "$D/ro/hf/"* > "$D/before"
    mount -o remount,ro "$D/ro"
    stalwart export --run "$RUN" --out "$D/full/hf"; echo "export-full=$?"
    stalwart export --run "$RUN" --out "$D/ro/hf"; echo "export-ro=$?"
    stalwart report "$RUN" --out "$D/full/report"; echo "report-full=$?"
    stalwart report "$RUN" --out "$D/ro/hf"; echo "report-ro=$?"
    rm "$D/full/filler"; ls -A "$D/full"; echo "--"
    sha256sum "$D/ro/hf/"* | diff - "$D/before" && echo "ro-untouched"
""")


@pytest.mark.e2e
def test_export_and_report_onto_a_full_or_read_only_disk_say_so_and_write_nothing(tmp_path):
    if not _can_unshare():
        pytest.fail("needs `unshare -rm` (an unprivileged user + mount namespace) to mount a private tmpfs")
    run = tmp_path / "run"
    subprocess.run([sys.executable, "-m", "stalwart", "train", "--run.dir", str(run), *TINY_RUN, "--training.steps",
                    "2", "--sample.max_new_tokens", "0"], env=cli_env(), cwd=REPO, check=True, capture_output=True)
    env = {**cli_env(), "PY": sys.executable, "RUN": str(run), "D": str(tmp_path)}
    proc = subprocess.run(["unshare", "-rm", "bash", "-c", _OUTPUTS], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    out, err = proc.stdout, proc.stderr
    for name in ("export-full", "export-ro", "report-full", "report-ro"):
        assert f"{name}=2" in out, (name, out, err[-3000:])
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 4 and all(x.startswith(("stalwart export: error: --out:", "stalwart report: error: --out:"))
                                   for x in lines), err[-3000:]
    assert sum("no space left on the device" in x for x in lines) == 2, lines
    assert sum("read-only file system" in x for x in lines) == 2, lines
    assert out.split("--")[0].split("report-ro=2")[1].strip() == "", out  # nothing left on the full disk
    assert "ro-untouched" in out, out
