"""Workers forked from their launcher: what they import is imported once, in the launcher.

torch's agent starts a function entrypoint with ``start_method = fork``: each worker, first or
restarted, is a copy of the launcher that already holds the worker's modules, instead of a fresh
interpreter importing them again (about 3 s of CPU per worker on the development machine). Two
launchers do it: the training launcher (``launch.fork_workers``; the worker is ``stalwart.train``) and
the launcher of a ``serve --tp/--pp`` replica's processes (``serve/launcher.py``; the worker is
``stalwart.serve.replica``). The launcher must not have initialised an accelerator or run parallel CPU
work before it forks; it imports modules only.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys

# The module a worker runs (``python -m MODULE ARGS``) -> the module whose ``main(argv) -> int`` it calls
# and the other modules it imports before its first step (the launcher imports them all once).
WORKERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "stalwart.train": ("stalwart.train.__main__", ("stalwart.train.trainer",)),
    "stalwart.serve.replica": ("stalwart.serve.replica", (
        "stalwart.infer.engine", "stalwart.infer.load", "stalwart.infer.group", "stalwart.serve.app",
        "stalwart.serve.http", "stalwart.serve.loop", "stalwart.runtime.group")),
}


def forked_worker(module: str, *argv: str) -> None:
    """A worker forked from its launcher, which imported ``module``'s modules (``preload``) before its
    first start, so no worker, first or restarted, imports them again. Runs ``python -m module`` with
    ``argv``; a failure leaves with its exit code, success returns to torch's wrapper (which hands the
    launcher the result)."""
    as_a_new_process()
    main = importlib.import_module(WORKERS[module][0]).main
    code = main(list(argv))
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def as_a_new_process() -> None:
    """Undo what a fork inherits from the launcher and an exec'd worker would not have: the launcher's
    signal handlers (torch's agent turns SIGINT and SIGTERM into its own exception; a worker's Ctrl-C
    must be a KeyboardInterrupt, its SIGTERM the default until the trainer sets its own), and buffered
    output (an exec'd worker runs as ``python -u``)."""
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=True, write_through=True)


def preload(module: str) -> None:
    """Import, once, what a worker running ``module`` imports before its first step, so that every
    worker forked from this process has it: its modules, and torch's compiler stack, which the first
    call of ``torch.use_deterministic_algorithms`` imports (1.5 s of CPU per worker otherwise)."""
    import torch._inductor  # noqa: F401

    main, others = WORKERS[module]
    for name in (main, *others):
        importlib.import_module(name)


def forkable(cmd, cmd_args: list[str], module: str) -> list[str] | None:
    """The arguments of ``module`` in a worker command line torchrun's parser built (``python [-u] -m
    module ARGS``), else None."""
    if cmd != sys.executable or "-m" not in cmd_args:
        return None
    i = cmd_args.index("-m")
    return list(cmd_args[i + 2:]) if cmd_args[i + 1:i + 2] == [module] else None


def forked_entry(config, cmd, cmd_args: list[str], module: str) -> tuple | None:
    """Where torchrun's worker command line runs ``module`` (on Linux): ``module``'s modules imported
    here, torch's launch ``config`` set to fork, and the entrypoint with its arguments; else None."""
    argv = forkable(cmd, cmd_args, module) if sys.platform.startswith("linux") else None
    if argv is None:
        return None
    preload(module)
    config.start_method = "fork"
    return forked_worker, (module, *argv)
