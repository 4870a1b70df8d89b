"""``stalwart train`` with ``fault.group_recovery``: replica groups that fail and recover on their own.

The launcher serves the quorum store and runs the lighthouse (``launch/lighthouse.py``) on a thread,
and forks one supervised launcher per replica group (``run_supervised``, the same agent as every
multi-process run, for ``S`` processes). A group's supervisor restarts only its own workers; it tells
the lighthouse at once through the store (``failed/<g>``), and the other groups' processes keep
running. Group ``g`` trains in ``RunPaths.replica_group(g)``: group 0 in the run directory itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import time

from stalwart.config.job import JobConfig
from stalwart.ft.runlock import LOCK_HOLDER_ENV, RunLock
from stalwart.launch.agent import TRAIN, run_supervised
from stalwart.launch.fork import preload
from stalwart.launch.lighthouse import Lighthouse, LighthouseThread
from stalwart.metrics.records import EventLog
from stalwart.paths import RunPaths
from stalwart.runtime.device import LOOPBACK
from stalwart.runtime.group import listen_on
from stalwart.runtime.quorum import open_store
from stalwart.runtime.settings import free_port


def launch_groups(argv: list[str], nproc: int, cfg: JobConfig) -> int:
    """Run ``cfg.parallelism.dp_replicate`` replica groups of ``nproc / dp_replicate`` workers each; return
    the job's exit code (0 when the groups that were left finished training)."""
    groups = cfg.parallelism.dp_replicate
    paths = RunPaths.of(cfg.run)
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.launch.threads(nproc)))
    with RunLock(paths):
        os.environ[LOCK_HOLDER_ENV] = str(os.getpid())
        addr = cfg.fault.lighthouse
        if not addr:
            listen_on(LOOPBACK)
            addr = f"{LOOPBACK}:{free_port(LOOPBACK)}"
        if cfg.launch.fork_workers:
            preload(TRAIN)  # once here: every group's launcher, and every worker, is forked from this process
        children = {os.fork() or _group_main(g, argv, nproc, cfg, addr): g for g in range(groups)}
        _, store = open_store(addr, cfg.fault.init_timeout_s, is_master=True)  # after the forks: no copy of it
        events = EventLog(paths.events, enabled=True)
        events("group_launch", groups=groups, processes_per_group=nproc // groups, lighthouse=addr,
               group_launchers={str(g): pid for pid, g in children.items()})
        try:
            with LighthouseThread(Lighthouse(store, groups, cfg.fault.rejoin_timeout_s, events)) as thread, \
                    _forwarding(list(children)):
                codes = _wait(children, store, thread)
        finally:
            events.close()
    finished = [g for g, c in codes.items() if c == 0]
    if finished:
        return 0
    return 2 if 2 in codes.values() else max(codes.values())


def _group_main(group: int, argv: list[str], nproc: int, cfg: JobConfig, addr: str) -> int:
    """The launcher of replica group ``group`` (a forked child; never returns)."""
    code = 1
    try:
        size = nproc // cfg.parallelism.dp_replicate
        paths = RunPaths.of(cfg.run).replica_group(group)
        snap = paths.snapshots(cfg.checkpoint.memory_dir) if cfg.checkpoint.memory_interval else None
        client: list = []
        # A failed group is stopped at once (SIGKILL, no grace): the other groups hold its state, and the
        # survivors' exchange waits on its last live rank until that rank is gone.
        fault = dataclasses.replace(cfg.fault, kill_grace_s=0.0)

        def failed(info: dict) -> None:  # the lighthouse hears of it before this group's workers restart
            if not client:
                client.append(open_store(addr, cfg.fault.init_timeout_s)[1])
            client[0].set(f"failure/{group}", json.dumps(info))
            client[0].add(f"failed/{group}", 1)

        with RunLock(paths) if group else contextlib.nullcontext():  # the run directory's is the launcher's
            os.environ[LOCK_HOLDER_ENV] = str(os.getpid())
            code = run_supervised(["--standalone", f"--nproc-per-node={size}", "--module", TRAIN, *argv,
                                   "--launch.nproc_per_node", str(nproc), "--fault.replica_group", str(group),
                                   "--fault.lighthouse", addr, "--run.dir", str(paths.root)],
                                  fault, paths, snap, cfg.launch.restarts(), cfg.launch.fork_workers, failed)
    except BaseException as e:  # noqa: BLE001 - a forked child must not return into its parent's code
        print(f"stalwart train: replica group {group}: {e}", file=sys.stderr, flush=True)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(children: dict[int, int], store, thread: LighthouseThread) -> dict[int, int]:
    """Reap the group launchers; one that ended abnormally counts as its group's failure."""
    codes: dict[int, int] = {}
    while len(codes) < len(children):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if thread.error is not None:
                raise thread.error
            time.sleep(0.05)
            continue
        if pid in children:
            code = os.waitstatus_to_exitcode(status)
            codes[children[pid]] = code
            store.set(f"gone/{children[pid]}", str(code))  # no start waits for this group again
            if code != 0:
                store.add(f"failed/{children[pid]}", 1)
    return codes


@contextlib.contextmanager
def _forwarding(pids: list[int]):
    """SIGTERM and SIGINT to this launcher reach every group's launcher; restored on exit."""
    def forward(sig, _frame) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    saved = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
