"""``stalwart train`` with ``fault.group_recovery`` (replica groups that fail and recover on their own) or
``parallelism.islands`` (islands that train alone and meet in an outer sync: ``train/islands.py``).

The launcher serves the quorum store and runs the lighthouse (``launch/lighthouse.py``; groups only) on a thread,
and forks one supervised launcher per replica group (``run_supervised``, the same agent as every
multi-process run, for ``S`` processes). A group's supervisor restarts only its own workers; it tells
the lighthouse at once through the store (``failed/<g>``), and the other groups' processes keep
running. Group ``g`` trains in ``RunPaths.replica_group(g)``: group 0 in the run directory itself.
Across hosts, ``fault.replica_group = g`` runs group ``g`` alone on its host, and group 0's host serves
the lighthouse at ``fault.lighthouse``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path

from stalwart.config.job import JobConfig
from stalwart.errors import UserError
from stalwart.ft.runlock import LOCK_HOLDER_ENV, RunLock
from stalwart.launch.agent import TRAIN, run_supervised
from stalwart.launch.fork import preload
from stalwart.launch.lighthouse import Lighthouse, LighthouseThread
from stalwart.metrics.records import EventLog
from stalwart.paths import RunPaths
from stalwart.runtime.device import LOOPBACK
from stalwart.runtime.group import listen_on
from stalwart.runtime.quorum import open_store, parse_addr
from stalwart.runtime.settings import free_port


def launch_groups(argv: list[str], nproc: int, cfg: JobConfig) -> int:
    """Run the replica groups (``cfg.parallelism.dp_replicate``) of this host; return the job's exit code
    (0 when the groups that were left finished training).

    One host: every group, ``nproc / dp_replicate`` workers each, and the lighthouse on loopback (or at
    ``fault.lighthouse``). Several hosts: ``fault.replica_group = g`` runs group ``g`` alone here with
    ``nproc`` workers, and group 0's host serves the lighthouse at ``fault.lighthouse``."""
    islands = cfg.parallelism.islands > 1  # islands (train/islands.py) are launched as groups are
    groups = cfg.parallelism.islands if islands else cfg.parallelism.dp_replicate
    hosted = cfg.fault.replica_group >= 0
    here = [cfg.fault.replica_group] if hosted else list(range(groups))
    size = nproc if hosted else nproc // groups
    paths = RunPaths.of(cfg.run)
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.launch.threads(nproc)))
    addr = cfg.fault.lighthouse
    if hosted and not addr:
        raise UserError("fault.replica_group runs one replica group (or island) on this host: give the "
                        "lighthouse's address (group 0's host) with --fault.lighthouse HOST:PORT")
    if addr:
        parse_addr(addr)  # a malformed address is one line here, before any group starts
    serve = not hosted or here == [0]
    with RunLock(paths) if not hosted else contextlib.nullcontext():
        os.environ[LOCK_HOLDER_ENV] = str(os.getpid())
        if not addr:
            listen_on(LOOPBACK)
            addr = f"{LOOPBACK}:{free_port(LOOPBACK)}"
        if cfg.launch.fork_workers:
            preload(TRAIN)  # once here: every group's launcher, and every worker, is forked from this process
        children = {os.fork() or _group_main(g, size, argv, groups * size, cfg, addr, lock=hosted or g > 0): g
                    for g in here}
        # After the forks, so that no child holds a copy of the server.
        _, store = open_store(addr, cfg.fault.init_timeout_s, is_master=serve)
        events = EventLog(paths.replica_group(here[0]).events if hosted else paths.events, enabled=True)
        events("group_launch", groups=groups, processes_per_group=size, lighthouse=addr, serves_lighthouse=serve,
               group_launchers={str(g): pid for pid, g in children.items()})
        lighthouse = None
        if serve and not islands:
            lighthouse = LighthouseThread(Lighthouse(store, groups, cfg.fault.rejoin_timeout_s, events))
        try:
            with lighthouse or contextlib.nullcontext(), _forwarding(list(children)):
                codes = _wait(children, store, lighthouse)
        finally:
            events.close()
    finished = [g for g, c in codes.items() if c == 0]
    if finished:
        return 0
    return 2 if 2 in codes.values() else max(codes.values())


def _group_main(group: int, size: int, argv: list[str], nproc: int, cfg: JobConfig, addr: str, lock: bool) -> int:
    """The launcher of replica group ``group`` of ``size`` workers (``nproc`` in the job; a forked child;
    never returns). ``lock``: take the group's run directory (else the parent holds it)."""
    code = 1
    try:
        paths = RunPaths.of(cfg.run).replica_group(group)
        # An explicit checkpoint.memory_dir is shared by the job: each group keeps its snapshots in its own part.
        memory_dir = str(Path(cfg.checkpoint.memory_dir) / f"group-{group}") if cfg.checkpoint.memory_dir else ""
        snap = paths.snapshots(memory_dir) if cfg.checkpoint.memory_interval else None
        client: list = []
        # A failed group is stopped at once (SIGKILL, no grace): the other groups hold its state, and the
        # survivors' exchange waits on its last live rank until that rank is gone.
        # Its supervisor counts the steps it trained as progress (crash loops: docs/group-recovery.md).
        fault = dataclasses.replace(cfg.fault, kill_grace_s=0.0, replica_group=group)

        def failed(info: dict) -> None:  # the lighthouse hears of it before this group's workers restart
            if not client:
                client.append(open_store(addr, cfg.fault.init_timeout_s)[1])
            client[0].set(f"failure/{group}", json.dumps(info))
            client[0].add(f"failed/{group}", 1)

        with RunLock(paths) if lock else contextlib.nullcontext():
            os.environ[LOCK_HOLDER_ENV] = str(os.getpid())
            code = run_supervised(["--standalone", f"--nproc-per-node={size}", "--module", TRAIN, *argv,
                                   "--launch.nproc_per_node", str(nproc), "--fault.replica_group", str(group),
                                   "--fault.lighthouse", addr, "--run.dir", str(paths.root),
                                   *(["--checkpoint.memory_dir", memory_dir] if memory_dir else [])],
                                  fault, paths, snap, cfg.launch.restarts(), cfg.launch.fork_workers, failed)
    except BaseException as e:  # noqa: BLE001 - a forked child must not return into its parent's code
        print(f"stalwart train: replica group {group}: {e}", file=sys.stderr, flush=True)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(children: dict[int, int], store, thread: LighthouseThread | None) -> dict[int, int]:
    """Reap the group launchers; one that ended abnormally counts as its group's failure."""
    codes: dict[int, int] = {}
    while len(codes) < len(children):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if thread is not None and thread.error is not None:
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
