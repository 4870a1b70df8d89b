"""One replica's supervisor: ``python -m stalwart.serve.launcher N -- <replica options>``.

`stalwart serve` runs one for a replica of N tensor/pipeline-parallel processes, and for every replica
behind the router. It outlives the replica's processes, so that losing one costs seconds, not a start:

- it reads the weights once (the command line's source, or those last applied: serve/applied.py) and
  keeps them in memory; each rank, first or started again, is a fork of this process and takes its
  shard from that memory (copy-on-write) instead of importing torch and reading the checkpoint again;
- it holds the HTTP socket: rank 0 serves on it, and whenever no rank 0 does (start-up, rank 0 being
  started again) its keeper process answers on it, 503 with ``Retry-After`` (serve/standby.py). The
  keeper also serves the group's store, on loopback, where the ranks form their process group attempt
  after attempt (serve/heal.py; gloo's sockets on loopback too). Only the HTTP server follows ``--host``.
  Both need threads, so they live in the keeper: this process, which forks the ranks, runs none;
- a rank that exits unasked (killed, crashed, or rank 0 finding its engine dead or stuck) is started
  again alone under the next attempt; the others keep their weights, and rank 0 its requests, and rejoin.
  A rank that fails on its own (an exit status, not a signal: a kill from outside is no crash loop)
  ``CrashLoop.limit`` times within ``QUICK_FAILURE_S`` of starting gives the replica up (exit 1, every
  rank stopped): `stalwart serve` or the router starts it whole again;
- the first SIGINT/SIGTERM asks rank 0 to stop (it stops serving, tells the other ranks to stop, and
  every process exits 0); a second one sends every rank SIGTERM, and a third, or ``STOP_GRACE_S``
  (``FORCED_GRACE_S`` after the second) without an end, kills every rank. A stop asked for is exit
  status 0 and prints nothing here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

from stalwart.errors import UserError
from stalwart.runtime.settings import LOOPBACK

USER_ERROR = 2
REPLICA = "stalwart.serve.replica"  # the module whose imports every rank needs (imported here, once)
QUICK_FAILURE_S = 60.0  # a rank that fails this soon after starting counts toward a crash loop
STOP_GRACE_S = 30.0  # a stop asked for that has not ended after this kills every rank
FORCED_GRACE_S = 5.0  # the same after a second stop signal (every rank was sent SIGTERM)


@dataclass
class CrashLoop:
    """Failures soon after a start, counted per process: ``limit`` in a row gives up (pure: the clock is
    passed in). `stalwart serve` counts its replica's launcher the same way."""

    limit: int = 3
    quick_s: float = QUICK_FAILURE_S
    counts: dict[int, int] = field(default_factory=dict)

    def failed(self, who: int, started: float, now: float) -> bool:
        """Record a failure of ``who`` (started at ``started``); whether to give up."""
        self.counts[who] = self.counts.get(who, 0) + 1 if now - started < self.quick_s else 0
        return self.counts[who] >= self.limit


def describe_exit(code: int) -> str:
    """'exited with code 3' / 'was killed by SIGKILL', from ``os.waitstatus_to_exitcode``'s value."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class ReplicaLauncher:
    def __init__(self, nproc: int, argv: list[str]) -> None:
        from stalwart.serve.options import device_setting, parse

        self.nproc, self.argv = nproc, argv
        self.cfg, self.source, self.port_file, self.weights_file = parse(argv)
        self.setting = device_setting(argv)
        self.pids: dict[int, int] = {}  # pid -> rank
        self.started: dict[int, float] = {}  # rank -> when it was last started
        self.crashes = CrashLoop()
        self.stops = 0
        self.attempt = 0

    # -- set-up, in this process -------------------------------------------------------------------

    def prepare(self) -> None:
        import torch

        from stalwart.asgi import bind
        from stalwart.launch.fork import preload
        from stalwart.runtime.group import listen_on
        from stalwart.runtime.standalone import connect_store
        from stalwart.serve.heal import ATTEMPT, SETUP_S

        listen_on(LOOPBACK)
        # The ranks are forks of this process: it must not start OpenMP's threads (a fork cannot use them),
        # so it reads the weights on one thread; each rank takes the threads asked for.
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)
        self.sock = bind(self.cfg.server.host, self.cfg.server.port)
        self.sock.listen(2048)
        self.control_read, self.control_write = os.pipe()  # to the keeper: rank 0 down / serving
        ports_read, ports_write = os.pipe()
        self.keeper = os.fork()
        if self.keeper == 0:
            self._keeper_main(ports_write)  # never returns
        os.close(self.control_read)
        os.close(ports_write)
        with os.fdopen(ports_read) as ports:
            store_port = int(ports.readline() or 0)
        if not store_port:
            raise RuntimeError("the replica's keeper process could not start its store")
        self.store = connect_store(store_port, SETUP_S)  # a client: this process runs no thread of its own
        self.store.set(ATTEMPT, str(self.attempt))
        preload(REPLICA)
        self.loaded, self.version = self._read_weights()

    def _read_weights(self):
        """The weights every rank starts from: those last applied if a record names them, else the
        command line's; with their version."""
        from stalwart.infer.load import read_source
        from stalwart.serve.applied import AppliedWeights

        last = AppliedWeights(self.weights_file).read() if self.weights_file is not None else None
        source, version = last if last is not None else (self.source, 0)
        return read_source(source), version

    def _keeper_main(self, ports_write: int) -> None:
        """The keeper: the process that serves the group's store and answers on the HTTP socket while no
        rank 0 serves (serve/standby.py), told which by the pipe (``down`` from this launcher, ``serving``
        from rank 0). Both need threads, and the launcher must have none: a fork copies a lock another
        thread holds (the store's, a stream's) into the child, held for good."""
        code = 1
        try:
            from stalwart.launch.fork import as_a_new_process
            from stalwart.procs import die_with_parent, name_process
            from stalwart.runtime.group import controller_store
            from stalwart.serve.heal import SETUP_S
            from stalwart.serve.standby import Standby

            as_a_new_process()
            die_with_parent(signal.SIGKILL)
            name_process("stalwart-keeper")
            for sig in (signal.SIGINT, signal.SIGTERM):  # a stop is the launcher's; the pipe's end ends this
                signal.signal(sig, signal.SIG_IGN)
            os.close(self.control_write)
            store = controller_store(self.nproc, SETUP_S)
            os.write(ports_write, f"{store.port}\n".encode())
            os.close(ports_write)
            standby = Standby(self.sock, self.cfg.server.model_name or self.source.name)
            standby.start("starting", "the replica is starting")
            with os.fdopen(self.control_read) as control:
                for line in control:
                    if line.startswith("down"):
                        standby.start("recovering", "rank 0 of this replica is being started again")
                    elif line.startswith("serving"):
                        standby.stop()
            code = 0
        except BaseException:  # noqa: BLE001 - this process ends here whatever happened; say why
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)

    # -- the ranks ---------------------------------------------------------------------------------

    def fork(self, rank: int) -> None:
        from stalwart.serve.heal import GroupPlace

        place = GroupPlace(rank, self.nproc, self.store.port, self.loaded, self.version,
                           self.sock if rank == 0 else None, self.control_write if rank == 0 else None)
        pid = os.fork()
        if pid == 0:
            self._rank_main(place)  # never returns
        self.pids[pid] = rank
        self.started[rank] = time.monotonic()

    def _rank_main(self, place) -> None:
        code = 1
        try:
            import torch

            from stalwart.launch.fork import as_a_new_process
            from stalwart.procs import die_with_parent, name_process
            from stalwart.serve.replica import run_replica

            as_a_new_process()
            # A rank outlives no launcher: a replica whose launcher is gone is gone (the router starts a new one
            # on its port); a rank left draining on the socket would answer for a replica that no longer exists.
            die_with_parent(signal.SIGKILL)
            name_process(f"stalwart-rank{place.rank}")
            if place.rank != 0:  # this process's copies only
                self.sock.close()
                os.close(self.control_write)
            torch.set_num_threads(self.threads)
            os.environ.update(RANK=str(place.rank), LOCAL_RANK=str(place.rank), WORLD_SIZE=str(self.nproc),
                              LOCAL_WORLD_SIZE=str(self.nproc))
            code = run_replica(self.cfg, self.source, self.port_file, self.setting, self.weights_file, place)
        except UserError as e:
            print(f"stalwart serve: error: {e}", file=sys.stderr, flush=True)
            code = USER_ERROR
        except BaseException:  # noqa: BLE001 - this process ends here whatever happened; say why
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def restart(self, rank: int, code: int) -> None:
        """Start ``rank`` again alone, under the next attempt; the others rejoin it there."""
        from stalwart.runtime.group import abandon_attempt
        from stalwart.serve.heal import ATTEMPT

        abandon_attempt(self.store, self.attempt)  # members still forming it move on to the next
        self.attempt += 1
        self.store.set(ATTEMPT, str(self.attempt))
        print(f"stalwart serve: replica process rank {rank} {describe_exit(code)}; starting it again (the "
              f"other ranks keep their state)", file=sys.stderr, flush=True)
        if rank == 0:
            os.write(self.control_write, b"down\n")
        self.fork(rank)

    def run(self) -> int:
        """Start every rank and supervise them; the exit status."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_stop_signal)
        for rank in range(self.nproc):
            self.fork(rank)
        result = 0
        while self.pids:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                break
            if pid == self.keeper and not self.stops:
                print(f"stalwart serve: the replica's keeper process {describe_exit(os.waitstatus_to_exitcode(status))}"
                      "; stopping the replica", file=sys.stderr, flush=True)
                result = 1
                self._stop_all()
            rank = self.pids.pop(pid, None)
            if rank is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            if self.stops:
                continue
            if code == USER_ERROR:  # the rank said what to fix, in one line
                result = USER_ERROR
                self._stop_all()
            elif rank == 0 and code == 0:  # rank 0 stopped, as asked of it directly, and told the others to
                self.stops += 1
                self._kill_later(STOP_GRACE_S)
            elif code > 0 and self.crashes.failed(rank, self.started[rank], time.monotonic()):
                print(f"stalwart serve: replica process rank {rank} {describe_exit(code)}, failing "
                      f"{self.crashes.limit} times within {self.crashes.quick_s:.0f} s of starting; stopping the "
                      "replica", file=sys.stderr, flush=True)
                result = 1
                self._stop_all()
            else:
                self.restart(rank, code)
        os.close(self.control_write)  # the keeper's pipe ends: it exits
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.keeper, 0)
        return result

    # -- stopping ----------------------------------------------------------------------------------

    def _on_stop_signal(self, sig: int, _frame) -> None:
        self.stops += 1
        rank0 = next((pid for pid, rank in list(self.pids.items()) if rank == 0), None)
        if self.stops == 1 and rank0 is not None:
            with contextlib.suppress(ProcessLookupError):  # it may have ended this instant
                os.kill(rank0, signal.SIGTERM)  # rank 0 stops serving and tells the other ranks to stop
            self._kill_later(STOP_GRACE_S)
        elif self.stops == 2:  # a stop asked twice (the terminal and `stalwart serve` both signal): forced
            self._kill_all(signal.SIGTERM)
            self._kill_later(FORCED_GRACE_S)
        else:
            self._kill_all()

    def _stop_all(self) -> None:
        self.stops += 1
        self._kill_all()

    def _kill_later(self, after_s: float) -> None:
        timer = threading.Timer(after_s, self._kill_all)
        timer.daemon = True
        timer.start()

    def _kill_all(self, sig: int = signal.SIGKILL) -> None:
        for pid in list(self.pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


def main(argv: list[str]) -> int:
    """Started by `stalwart serve` (which makes it die with its parent)."""
    from stalwart.procs import die_with_parent

    die_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM):  # a stop before any rank runs: nothing to stop in order
        signal.signal(sig, lambda *_: os._exit(0))
    nproc, rest = int(argv[0]), argv[1:]
    try:
        launcher = ReplicaLauncher(nproc, rest[1:] if rest[:1] == ["--"] else rest)
        launcher.prepare()
    except UserError as e:
        print(f"stalwart serve: error: {e}", file=sys.stderr, flush=True)
        return USER_ERROR
    return launcher.run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
