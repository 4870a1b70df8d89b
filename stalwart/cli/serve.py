"""`stalwart serve`: one replica in this process, a torchrun group per tensor-parallel replica, or
several replicas behind a least-loaded router; `--plan` prints a placement and exits."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from stalwart.procs import die_with_parent
from stalwart.serve.http import bind
from stalwart.serve.options import parse, usage


def replica_command(argv: list[str], procs: int, port_file: Path | None) -> list[str]:
    """The command line of one replica: itself if it is one process, else a torchrun group on loopback."""
    from stalwart.comm.launch import free_port

    args = [*argv, "--replicas", "1"] + (["--port-file", str(port_file)] if port_file and "--port-file" not in argv
                                         else [])
    if procs == 1:
        return [sys.executable, "-m", "stalwart.serve.replica", *args]
    # "--" ends torchrun's own options (it would take --run for its --run-path).
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(procs),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "stalwart.serve.replica",
            "--", *args]


def main(argv: list[str]) -> int:
    if "--plan" in argv:
        from stalwart.cli.serve_plan import main as plan_main

        return plan_main([a for a in argv if a != "--plan"])
    if any(a in ("-h", "--help") for a in argv):
        print(usage())
        return 0
    cfg, source, port_file = parse(argv)
    layout = cfg.layout
    from stalwart.infer.load import check_layout, read_args

    check_layout(read_args(source), layout.tp, layout.pp)  # before any process starts
    # A bad host or a taken port is one line now, not a failed group of processes.
    bind(cfg.server.host, cfg.server.port).close()
    procs = layout.tp * layout.pp
    if layout.replicas == 1 and procs == 1:
        from stalwart.serve.replica import run_replica

        return run_replica(cfg, source, port_file)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if layout.replicas == 1:
        return _run_until_stopped(replica_command(argv, procs, port_file), env)
    from stalwart.serve.router import run_router

    with tempfile.TemporaryDirectory(prefix="stalwart-serve-") as tmp:
        inner = _without(argv, ("--port", "--host", "--replicas", "--port-file", "--server.port", "--server.host",
                                "--layout.replicas")) + ["--port", "0", "--host", "127.0.0.1"]
        files = [Path(tmp) / f"replica-{i}.port" for i in range(layout.replicas)]
        children = [_start(replica_command(inner, procs, f), env) for f in files]
        try:
            return run_router(cfg, source.name, children, files, port_file)
        finally:
            for p in children:
                if p.poll() is None:
                    stop_replica(p)
            for p in children:
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()


def _start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    # A process group of its own: a Ctrl-C at the terminal reaches this process only, which stops the
    # replica in order (below) instead of every process of it at once.
    return subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent, process_group=0)


def stop_replica(proc: subprocess.Popen, force: bool = False) -> None:
    """Ask a replica to stop gracefully with SIGTERM.

    A one-process replica gets it itself. In a torchrun group rank 0 gets it: it stops serving, tells
    the other ranks to stop, and torchrun ends when they have, quietly (torchrun itself answers a
    signal with a traceback). ``force``, or no rank 0 found (yet): torchrun gets it.
    """
    target = None if force else _rank0_of(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(target if target is not None else proc.pid, signal.SIGTERM)


def _rank0_of(pid: int) -> int | None:
    """The child of process ``pid`` that torchrun started as rank 0, if it runs (Linux /proc)."""
    try:
        children = [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                    for c in (task / "children").read_text().split()]
    except (OSError, ValueError):
        return None
    for child in children:
        try:
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"RANK=0" in environ and any(e.startswith(b"TORCHELASTIC_RUN_ID=") for e in environ):
            return child
    return None


def _run_until_stopped(cmd: list[str], env: dict[str, str]) -> int:
    """Run a torchrun group; SIGINT/SIGTERM here stops it in order (a second one forcibly), and a stop
    asked for is exit 0."""
    child = _start(cmd, env)
    asked: list[int] = []

    def forward(sig, _frame) -> None:
        asked.append(sig)
        stop_replica(child, force=len(asked) > 1)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0 if asked else code


def _without(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """``argv`` without the flags ``names`` (``--flag VALUE`` or ``--flag=VALUE``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a.split("=")[0] in names:
            skip = "=" not in a
        else:
            out.append(a)
    return out
