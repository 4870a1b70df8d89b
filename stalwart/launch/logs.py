"""torch's elastic logs, quieted while Stalwart's launchers run: the supervisor reports a failure's root
cause itself, in one line."""

from __future__ import annotations

import contextlib


class _DropMessage:
    """A logging filter that drops records whose message contains ``text``."""

    def __init__(self, text: str) -> None:
        self.text = text

    def filter(self, record) -> bool:
        return self.text not in record.getMessage()


@contextlib.contextmanager
def quiet_process_logs():
    """torch logs every worker it stops and every failed exit with a traceback-like block; the
    supervisor reports the root cause itself, in one line."""
    import logging

    log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")  # forked workers: "Terminating process ..."
    saved, spawn_saved = log.level, spawn_log.level
    log.setLevel(logging.CRITICAL)
    spawn_log.setLevel(logging.ERROR)
    agent_log = logging.getLogger("torch.distributed.elastic.agent.server.api")
    signalled = _DropMessage("death signal")  # a stop by signal is said once, by run_supervised
    agent_log.addFilter(signalled)
    try:
        yield
    finally:
        log.setLevel(saved)
        spawn_log.setLevel(spawn_saved)
        agent_log.removeFilter(signalled)
