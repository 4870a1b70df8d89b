"""`stalwart serve`: one replica in this process, a process group per tensor/pipeline-parallel replica
(serve/launcher.py: torch's elastic agent, every socket on loopback), or several replicas behind a
least-loaded router; `--plan` prints a placement and exits."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stalwart.procs import die_with_parent
from stalwart.serve.launcher import CrashLoop
from stalwart.serve.options import device_setting, parse, usage


def replica_command(argv: list[str], procs: int, port_file: Path | None, weights_file: Path) -> list[str]:
    """The command line of one supervised replica: its launcher (serve/launcher.py), which runs its
    ``procs`` processes and starts a lost one again from the weights it holds in memory.
    ``weights_file``: where it records the weights it applies, to start again with them (serve/applied.py)."""
    args = [*argv, "--replicas", "1"] + (["--port-file", str(port_file)] if port_file and "--port-file" not in argv
                                         else []) + ["--weights-file", str(weights_file)]
    return [sys.executable, "-m", "stalwart.serve.launcher", str(procs), "--", *args]


def main(argv: list[str]) -> int:
    if "--plan" in argv:
        from stalwart.cli.serve_plan import main as plan_main

        return plan_main([a for a in argv if a != "--plan"])
    if any(a in ("-h", "--help") for a in argv):
        print(usage())
        return 0
    argv = join_repeated(argv, "--retrieval.index")
    cfg, source, port_file, weights_file = parse(argv)
    layout = cfg.layout
    # torch and the web server (seconds to import) only once the command line and config are valid
    from stalwart.infer.load import check_layout, read_args
    from stalwart.runtime.device import check_device, is_accelerator
    from stalwart.serve.http import bind

    args = read_args(source)
    if args.embed_dim:  # an embeddings model: /v1/embeddings, one process (serve/embeddings.py)
        from stalwart.serve.embeddings import check_embeddings_layout, run_embeddings

        check_embeddings_layout(cfg)
        bind(cfg.server.host, cfg.server.port).close()
        return run_embeddings(cfg, source, port_file)
    if cfg.retrieval.index:  # the embedder, indexes and keys file: one line now, not a failed replica
        from stalwart.serve.rag import check_retrieval

        check_retrieval(cfg.retrieval)
    check_layout(args, layout.tp, layout.pp)  # before any process starts
    if cfg.engine.speculative == "draft":  # a draft with another vocabulary is one line now (its tokenizer: on load)
        from stalwart.infer.load import source_from
        from stalwart.infer.speculative import check_draft_vocabulary

        where = cfg.engine.draft_model
        check_draft_vocabulary(read_args(source).vocab_size, None, read_args(source_from(where)).vocab_size, None,
                               f"engine.draft_model {where}")
    from stalwart.serve.chat import ChatFormat

    ChatFormat.of_dir(source.hf)  # a chat template that does not parse is one line now, too
    procs = layout.tp * layout.pp
    # A device the machine lacks (or too few GPUs: one per process) is one line now, not a failed group.
    kind = check_device(cfg.engine.device, procs * layout.replicas, device_setting(argv))
    if is_accelerator(kind):  # 'auto' too: one GPU per process, or one line now rather than a failed rank
        check_device(kind, procs * layout.replicas, device_setting(argv))
    # A bad host or a taken port is one line now, not a failed group of processes.
    bind(cfg.server.host, cfg.server.port).close()
    if layout.replicas == 1 and procs == 1 and not layout.router:
        from stalwart.serve.replica import run_replica

        return run_replica(cfg, source, port_file, device_setting(argv), weights_file)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    with tempfile.TemporaryDirectory(prefix="stalwart-serve-") as tmp:
        if layout.replicas == 1 and not layout.router:
            inner = _without(argv, ("--weights-file",))
            return _run_until_stopped(replica_command(inner, procs, port_file, Path(tmp) / "weights.json"), env)
        return _run_replicas(argv, cfg, source, procs, kind, env, port_file, Path(tmp))


def _run_replicas(argv: list[str], cfg, source, procs: int, kind: str, env: dict[str, str], port_file: Path | None,
                  tmp: Path) -> int:
    """Replicas behind the router, each on a loopback port, started again when they fail."""
    from stalwart.serve.resume import SECRET_ENV, new_secret
    from stalwart.serve.fleet import Fleet
    from stalwart.serve.router import run_router

    layout = cfg.layout
    inner = _without(argv, ("--port", "--host", "--replicas", "--port-file", "--server.port", "--server.host",
                            "--layout.replicas", "--layout.router", "--weights-file", "--prefill-replicas",
                            "--decode-replicas", "--layout.prefill_replicas", "--layout.decode_replicas")
                     ) + ["--port", "0", "--host", "127.0.0.1"]
    files = [tmp / f"replica-{i}.port" for i in range(layout.replicas)]
    weights = [tmp / f"replica-{i}.weights.json" for i in range(layout.replicas)]
    # The replicas take the router's resume extension from the router alone (serve/resume.py).
    secret = new_secret()
    routed_env = dict(env, **{SECRET_ENV: secret})
    kv_dir = None
    if layout.prefill_replicas:  # hand-offs between prefill and decode replicas (serve/disagg.py)
        from stalwart.serve.disagg import KV_DIR_ENV, make_kv_dir

        kv_dir = make_kv_dir(tmp)
        routed_env[KV_DIR_ENV] = str(kv_dir)
    prompts = None
    if layout.routing == "cache-aware":  # the router hashes prompts as the replicas tokenize them
        from stalwart.serve.prefix import Prompts, tokenizer_file

        prompts = Prompts(tokenizer_file(source.run, source.hf), source.hf)

    def start(i: int) -> subprocess.Popen:
        return _start(replica_command(inner, procs, files[i], weights[i]), replica_env(routed_env, kind, i, procs))

    children = [start(i) for i in range(layout.replicas)]
    try:
        return run_router(cfg, source.name, Fleet(children, files, start, weights, kv_dir), port_file, secret, prompts)
    finally:
        if kv_dir is not None:
            shutil.rmtree(kv_dir, ignore_errors=True)
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


def replica_env(env: dict[str, str], kind: str, index: int, procs: int) -> dict[str, str]:
    """Replica ``index``'s environment: on an accelerator, its own ``procs`` GPUs of those visible (the
    preflight checked there are enough), so each replica's local ranks 0.. are different GPUs."""
    from stalwart.runtime.device import is_accelerator

    if not is_accelerator(kind):
        return env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range((index + 1) * procs)]
    return dict(env, CUDA_VISIBLE_DEVICES=",".join(ids[index * procs:(index + 1) * procs]))


def stop_replica(proc: subprocess.Popen) -> None:
    """Ask a replica to stop with SIGTERM: a one-process replica stops serving gracefully; a group's
    launcher has rank 0 stop serving and tell the other ranks to stop (serve/launcher.py), and takes a
    second SIGTERM as a forced stop. Either ends quietly, with exit status 0."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGTERM)


USER_ERROR = 2  # a replica that said what to fix (one line) is not started again


def _run_until_stopped(cmd: list[str], env: dict[str, str]) -> int:
    """Run a replica's launcher, started again whenever it fails (it starts a lost rank again itself and
    exits only when a rank keeps failing: serve/launcher.py); SIGINT/SIGTERM here stops it in order (a
    second one forcibly), and a stop asked for is exit 0."""
    asked: list[int] = []
    child: subprocess.Popen | None = None

    def forward(sig, _frame) -> None:
        asked.append(sig)
        if child is not None:
            stop_replica(child)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    crashes = CrashLoop()
    try:
        while True:
            started = time.monotonic()
            child = _start(cmd, env)
            code = child.wait()
            if asked or code in (0, USER_ERROR):
                break
            if crashes.failed(0, started, time.monotonic()):
                print(f"stalwart serve: the replica failed {crashes.limit} times within {crashes.quick_s:.0f} s "
                      "of starting; giving up", file=sys.stderr, flush=True)
                break
            print(f"stalwart serve: the replica exited with code {code}; starting it again", file=sys.stderr,
                  flush=True)
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


def join_repeated(argv: list[str], flag: str) -> list[str]:
    """``flag`` given several times (``--retrieval.index a=X --retrieval.index b=Y``) -> once, with the values as
    a JSON list (what the config takes for a list); once or not at all: ``argv`` unchanged."""
    import json

    values, rest, i = [], [], 0
    while i < len(argv):
        name, eq, inline = argv[i].partition("=")
        if name == flag:
            if eq:
                values.append(inline)
            elif i + 1 < len(argv):
                values.append(argv[i + 1])
                i += 1
            else:  # no value: the config's own error says so
                rest.append(argv[i])
        else:
            rest.append(argv[i])
        i += 1
    return argv if len(values) < 2 else [*rest, flag, json.dumps(values)]
