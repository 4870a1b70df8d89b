"""deploy/slurm/stalwart.sbatch on a real one-node Slurm cluster started here (munged, slurmctld, slurmd
from Debian's slurm-wlm and munge): the job trains, is preempted with `scancel --signal=USR1 --batch`,
requeues itself and resumes from its newest checkpoint, re-training the same steps bit for bit.

Skips when the Slurm or munge binaries are absent (.ci/run installs them) or when not root (slurmd
launches jobs as their owner).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import REPO, SMALL_CORPUS, cli_env
from stalwart.comm.launch import free_port

pytestmark = pytest.mark.e2e

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "squeue")
SBATCH = REPO / "deploy" / "slurm" / "stalwart.sbatch"

SLURM_CONF = """ClusterName=stalwarttest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
# cred_expire is also how long a requeued job waits before it may start again (default 120 s)
AuthInfo=socket={d}/munge.sock,cred_expire=5
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
InactiveLimit=0
MinJobAge=300
KillWait=5
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def _wait(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture
def slurm():
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing): apt-get install -y slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("the one-node Slurm cluster needs root (slurmd starts jobs as their owner)")
    d = Path(tempfile.mkdtemp(prefix="slurm-"))  # short: the munge socket path has a length limit
    (d / "state").mkdir()
    (d / "spool").mkdir()
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    host = socket.gethostname().split(".")[0]
    (d / "slurm.conf").write_text(SLURM_CONF.format(host=host, d=d, ctld_port=free_port(), slurmd_port=free_port(),
                                                    cpus=os.cpu_count() or 1))
    env = {**cli_env(), "SLURM_CONF": str(d / "slurm.conf")}
    procs = []
    log = open(d / "daemons.out", "w")
    try:
        procs.append(subprocess.Popen(["munged", "-f", "-F", f"--socket={d}/munge.sock", f"--key-file={key}",
                                       f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log",
                                       f"--seed-file={d}/munged.seed"], stdout=log, stderr=log))
        _wait(lambda: (d / "munge.sock").exists(), 20, "munged")
        procs.append(subprocess.Popen(["slurmctld", "-D", "-i", "-f", str(d / "slurm.conf")], env=env,
                                      stdout=log, stderr=log))
        procs.append(subprocess.Popen(["slurmd", "-D", "-N", host, "-f", str(d / "slurm.conf")], env=env,
                                      stdout=log, stderr=log))

        def idle():
            p = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True)
            return p.stdout.strip() == "idle"

        _wait(idle, 60, "the Slurm node to be idle")
        yield env, d
    finally:
        subprocess.run(["scancel", "--full", "--user=root"], env=env, capture_output=True)
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()
        shutil.rmtree(d, ignore_errors=True)


def _job(env, job_id):
    out = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def _steps(run):
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip() and '"loss"' in x]


def test_sbatch_job_is_preempted_requeued_and_resumes_bit_for_bit(slurm, tmp_path):
    env, d = slurm
    run = tmp_path / "run"
    args = ["--run.dir", str(run), "--model.flavor", "debug", "--data.path", SMALL_CORPUS, "--data.vocab_size", "384",
            "--data.tokenizer_train_mb", "0.1", "--data.seq_len", "32", "--data.val_fraction", "0.2",
            "--training.global_batch", "4", "--training.micro_batch", "2", "--scheduler.warmup_steps", "2",
            "--eval.batches", "1", "--eval.interval", "0", "--sample.max_new_tokens", "0",
            "--metrics.peak_tflops", "0.1", "--metrics.progress", "false", "--training.steps", "24",
            "--checkpoint.interval", "10",
            # steps 11-20 are slowed so the preemption lands inside the run, after its first checkpoint
            "--fault.inject", "slow:rank=0,factor=8,steps=11-20"]
    job_env = {**env, "STALWART_ARGS": " ".join(args), "STALWART_PYTHON": sys.executable, "NPROC_PER_NODE": "1",
               "RDZV_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "job.out"
    sub = subprocess.run(["sbatch", "--parsable", "--nodes=1", f"--chdir={REPO}", f"--output={out}", str(SBATCH)],
                         env=job_env, capture_output=True, text=True, check=True)
    job_id = sub.stdout.strip().split(";")[0]

    # preempt once step 10 is checkpointed and step 12 logged (so steps 11-12 are trained twice)
    _wait(lambda: (run / "checkpoints" / "step-10").is_dir() and any(s["step"] >= 12 for s in _steps(run)), 120,
          "step 12 of the first start")
    t0 = time.monotonic()
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=env, check=True)
    _wait(lambda: _job(env, job_id).get("Restarts") == "1", 60, "the job to requeue itself")
    t1 = time.monotonic()
    _wait(lambda: _job(env, job_id).get("JobState") == "RUNNING", 150, "the requeued job to start")
    t2 = time.monotonic()
    _wait(lambda: _job(env, job_id).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"), 150,
          "the requeued job to finish")
    print(f"\nSlurm: preempted -> requeued {t1 - t0:.1f} s, requeued -> running {t2 - t1:.1f} s, "
          f"running -> completed {time.monotonic() - t2:.1f} s")
    text = out.read_text()
    job = _job(env, job_id)
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", (job, text[-3000:])
    assert "start 0:" in text and "start 1:" in text and "requeueing job" in text and "stalwart: finished" in text
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    resumed = [e for e in events if e["event"] == "resumed"]
    assert [(e["step"], e["source"]) for e in resumed] == [(10, "disk")], resumed
    # every step the first start logged after the checkpoint was trained again with the same loss, bit for bit
    by_step: dict[int, list[float]] = {}
    for s in _steps(run):
        by_step.setdefault(s["step"], []).append(s["loss"])
    again = {k: v for k, v in by_step.items() if len(v) > 1}
    assert set(again) >= {11, 12} and all(k > 10 for k in again), sorted(again)
    assert all(v[0] == v[1] for v in again.values()), again
    assert max(by_step) == 24
