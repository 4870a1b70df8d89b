"""One replica over several processes: ``python -m stalwart.serve.launcher N -- <replica options>``.

torch's elastic agent runs the N processes of ``python -m stalwart.serve.replica`` (a tensor- and/or
pipeline-parallel group) in this process, with three differences from ``torchrun``:

- every socket the group listens on is on loopback: the agent's rendezvous store and the group's store
  that rank 0 serves (torch's bind every interface; both are ``runtime.group.bound_tcp_store`` on
  127.0.0.1), gloo's and NCCL's connections (their socket interface is ``lo``). Only the HTTP server
  follows ``--host``.
- a stop is in order and quiet: the first SIGINT/SIGTERM this process gets asks rank 0 to stop (it
  stops serving, tells the other ranks to stop, and every process exits 0); a second one is torch's
  forced stop (the signal to every worker, then SIGKILL after its shutdown timeout). Either way no
  launcher traceback, and a stop that was asked for is exit status 0, as with one process.
- every process is a fork of this one, which imports the replica's modules once first
  (``launch.fork``), instead of a new interpreter importing torch, the engine and the server again.
"""

from __future__ import annotations

import os
import signal
import sys
import uuid

from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException

from stalwart.runtime.device import LOOPBACK

USER_ERROR = 2
REPLICA = "stalwart.serve.replica"  # the module every process runs


class OrderedStopAgent(LocalElasticAgent):
    """torch's local agent, with stop signals handled as the module docstring says."""

    stops = 0  # stop signals received (class-wide: torch builds the one agent of this process)

    def _start_workers(self, worker_group):
        pids = super()._start_workers(worker_group)
        # torch installed its handlers (raise SignalException at once) when it started the workers.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_stop_signal)
        return pids

    def _on_stop_signal(self, sig: int, _frame) -> None:
        type(self).stops += 1
        rank0 = self._pcontext.pids().get(0) if self._pcontext is not None else None
        if type(self).stops == 1 and rank0 is not None:
            try:
                os.kill(rank0, signal.SIGTERM)
                return
            except ProcessLookupError:
                pass
        raise SignalException(f"process {os.getpid()} got signal {sig}", sigval=signal.Signals(sig))


def run_group(nproc: int, replica_args: list[str]) -> int:
    """Run ``nproc`` replica processes to the end; the exit status this launcher reports."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    # NOTE: the store patch, the log filter and the forked workers are the training launcher's (one copy of each).
    from stalwart.launch.agent import patched_agent
    from stalwart.launch.logs import quiet_process_logs
    from stalwart.launch.fork import forked_entry

    from stalwart.runtime.group import listen_on

    listen_on(LOOPBACK)
    # The agent would serve the workers a second store of its own, on every interface; instead rank 0
    # serves the group's store, on loopback (runtime.group.init_from_env).
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    args = get_args_parser().parse_args(
        ["--nnodes", "1", "--nproc-per-node", str(nproc), "--max-restarts", "0", "--local-addr", LOOPBACK,
         "--module", REPLICA, "--", *replica_args])
    args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", f"{LOOPBACK}:0", str(uuid.uuid4())
    config, cmd, cmd_args = config_from_args(args)
    # every process, first or started again, a fork of this one
    entrypoint, entry_args = forked_entry(config, cmd, cmd_args, REPLICA) or (cmd, cmd_args)

    def before_workers(sig: int, _frame) -> None:  # nothing to stop in order yet
        OrderedStopAgent.stops += 1
        raise SignalException(f"process {os.getpid()} got signal {sig}", sigval=signal.Signals(sig))

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, before_workers)
    try:
        with patched_agent(OrderedStopAgent), quiet_process_logs():
            elastic_launch(config=config, entrypoint=entrypoint)(*entry_args)
    except SignalException:  # a forced stop: torch has stopped the workers
        return 0
    except ChildFailedError as e:
        if OrderedStopAgent.stops:
            return 0  # a worker killed while stopping
        rank = min(e.failures)
        code = e.failures[rank].exitcode
        if code == USER_ERROR:
            return USER_ERROR  # the worker said what to fix, in one line
        print(f"stalwart serve: replica process rank {rank} failed with exit code {code} (see its message "
              "above)", file=sys.stderr, flush=True)
        return 1
    return 0


def main(argv: list[str]) -> int:
    """Started by `stalwart serve` (which makes it die with its parent)."""
    nproc, rest = int(argv[0]), argv[1:]
    return run_group(nproc, rest[1:] if rest[:1] == ["--"] else rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
