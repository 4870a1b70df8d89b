"""Workers forked from the launcher (``launch.fork_workers``): the trainer is imported once, here.

torch's agent starts a function entrypoint with ``start_method = fork``: each worker, first or
restarted, is a copy of the launcher that already holds the trainer's modules, instead of a fresh
interpreter importing them again (about 3 s of CPU per worker on the development machine). The
launcher must not have initialised an accelerator or run parallel CPU work before it forks; it
imports modules only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys


def forked_worker(*argv: str) -> None:
    """A training worker forked from the launcher (``launch.fork_workers``): the launcher imported the
    trainer before its first start, so no worker, first or restarted, imports it again. Runs
    ``stalwart.train`` with ``argv``; a failure leaves with its exit code, success returns to torch's
    wrapper (which hands the launcher the result)."""
    _as_a_new_process()
    from stalwart.train.__main__ import main

    code = main(list(argv))
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _as_a_new_process() -> None:
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


def preload() -> None:
    """Import, once, what a training worker imports before its first step, so that every worker forked
    from this process has it: the trainer, and torch's compiler stack, which the first call of
    ``torch.use_deterministic_algorithms`` imports (1.5 s of CPU per worker otherwise)."""
    import torch._inductor  # noqa: F401

    import stalwart.train.trainer  # noqa: F401


def forkable(cmd, cmd_args: list[str]) -> list[str] | None:
    """The ``stalwart.train`` arguments of a worker command line torchrun's parser built, else None."""
    if cmd != sys.executable or "-m" not in cmd_args:
        return None
    i = cmd_args.index("-m")
    return list(cmd_args[i + 2:]) if cmd_args[i + 1:i + 2] == ["stalwart.train"] else None
