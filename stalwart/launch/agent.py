"""The process layer: torch's LocalElasticAgent with Stalwart's supervisor plugged in.

``SupervisedAgent`` keeps torch's launch/rendezvous/restart machinery (so it runs across nodes like
torchrun) and adds, per monitor tick: the heartbeat/progress watchdog (kills a hung group), chaos
injection, and on every failure the restart decision (crash loop / budget, ``stalwart.ft.supervisor``).

``run_supervised`` is what ``stalwart train`` calls (``stalwart.launch.local``); ``python -m
stalwart.launch.agent <torchrun args> -m stalwart.train ...`` is the multi-node entry point (torchrun's
arguments, our agent).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import sys
import time
from pathlib import Path

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from stalwart.ft.detect import (
    EXIT_CRASH_LOOP,
    EXIT_EXCLUDE,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_RESTART_BUDGET,
    EXIT_USER_ERROR,
)
from stalwart.ft.supervisor import (
    BUDGET_EXHAUSTED,
    CRASH_LOOP,
    EXCLUDE,
    Supervisor,
    classify,
    failure_line,
)
from stalwart.atomic import write_text_atomic
from stalwart.launch.fork import forked_entry
from stalwart.launch.logs import quiet_process_logs
from stalwart.launch.workers import awaiting_cause, root_cause, stopped
from stalwart.ft.records import process_start_time, read_exit_records, record_exclusion
from stalwart.metrics.records import EventLog
from stalwart.paths import RunPaths
from stalwart.procs import pid_alive
from stalwart.runtime.device import LOOPBACK
from stalwart.runtime.group import bound_tcp_store, listen_on
from stalwart.runtime.settings import free_port
from stalwart.ft.runlock import LAUNCHER_PID_ENV, LOCK_HOLDER_ENV, RunLock

TRAIN = "stalwart.train"  # the module every training worker runs
PEER_GRACE_S = 2.0  # how long ranks that left for a peer's failure wait for that peer to exit


class SupervisedAgent(LocalElasticAgent):
    def __init__(self, *args, stalwart_supervisor: Supervisor, on_failure=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sup = stalwart_supervisor
        self.on_failure = on_failure  # told first of every failure of this group (a replica group's quorum)
        self._first_failed: dict[int, int] = {}  # ranks seen failed before anything else was stopped

    # ------------------------------------------------------------------ helpers
    def _pids(self) -> dict[int, int]:
        """global rank -> pid of this node's live workers."""
        if self._pcontext is None:
            return {}
        pids = self._pcontext.pids()
        return {w.global_rank: pids[w.local_rank] for w in self._worker_group.workers if w.local_rank in pids}

    def _exitcodes(self) -> dict[int, int | None]:
        """global rank -> its process's exit code, None while it runs (reaps an exited one; torch reads
        the same code afterwards)."""
        pc = self._pcontext
        if pc is None:
            return {}
        if hasattr(pc, "subprocess_handlers"):
            codes = {lr: h.proc.poll() for lr, h in pc.subprocess_handlers.items()}
        else:  # a multiprocessing context
            codes = {lr: p.exitcode for lr, p in enumerate(pc._pc.processes)} if getattr(pc, "_pc", None) else {}
        return {w.global_rank: codes[w.local_rank] for w in self._worker_group.workers if w.local_rank in codes}

    def _kill_group(self) -> None:
        """SIGTERM (and SIGCONT for a stopped process), a grace period, then SIGKILL."""
        pids = [pid for pid in self._pids().values() if pid_alive(pid)]
        for sig in (signal.SIGTERM, signal.SIGCONT):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        deadline = time.monotonic() + self.sup.cfg.kill_grace_s
        while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
            time.sleep(0.05)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    # ------------------------------------------------------------------ torch agent hooks
    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, *args, **kwargs) -> None:
        """Under a replica group's launcher (``on_failure`` set), a SIGTERM that reaches it twice (from the
        job's launcher and from whoever signalled every process) is one: the workers' save of their step
        is waited for instead of cut short by the second."""
        if death_sig != signal.SIGTERM or self.on_failure is None:
            return super()._shutdown(death_sig, *args, **kwargs)
        saved = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            return super()._shutdown(death_sig, *args, **kwargs)
        finally:
            signal.signal(signal.SIGTERM, saved)

    def _stop_workers(self, worker_group) -> None:
        self._kill_group()  # bounded by fault.kill_grace_s; torch's own stop waits 30 s for a stopped process
        super()._stop_workers(worker_group)

    def _monitor_workers(self, worker_group) -> RunResult:
        # First-hand, before torch's poll: a worker that exited with a failure is the failed rank (torch
        # would first stop the others, waiting up to 30 s for a stopped one, and then report them too).
        now = time.time()
        deadline = time.monotonic() + PEER_GRACE_S
        while True:
            codes = self._exitcodes()
            self._first_failed = {r: c for r, c in codes.items() if c not in (None, 0)}
            if time.monotonic() >= deadline or not awaiting_cause(self._first_failed, self.sup.paths,
                                                                   self.sup.attempt_start):
                break
            time.sleep(0.05)
        if self._first_failed:
            self._kill_group()
        result = super()._monitor_workers(worker_group)
        stall = None
        if result.state == WorkerState.HEALTHY:
            states = {r: "stopped" if stopped(pid) else "running" for r, pid in self._pids().items()
                      if codes.get(r) is None}
            stall = self.sup.poll(now, states)
            if stall is None:
                self._inject_chaos(now)
                return result
            self.sup.say(failure_line(stall.rank, f"{stall.kind}: {stall.detail}"))
            self._kill_group()
            deadline = time.monotonic() + 10
            while result.state == WorkerState.HEALTHY and time.monotonic() < deadline:
                time.sleep(0.05)
                result = super()._monitor_workers(worker_group)
            if result.state == WorkerState.HEALTHY:
                result = RunResult(state=WorkerState.FAILED)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            if stall is not None:
                kind, rank, code = stall.kind, stall.rank, None
            else:
                seen = self._first_failed or {r: f.exitcode for r, f in result.failures.items()}
                rank = root_cause(seen, self.sup.paths, self.sup.attempt_start,
                                   self.sup.injected_since(self.sup.attempt_start))
                code = seen.get(rank)
                kind = classify(code)
            if self.on_failure is not None:
                self.on_failure({"kind": kind, "rank": rank, "exitcode": code, "time": now})
            decision = self.sup.on_failure(now, kind, rank, code, stall)
            if decision in (CRASH_LOOP, BUDGET_EXHAUSTED, EXCLUDE, "user_error", "preempted"):
                self._remaining_restarts = 0  # torch's loop then stops the group and returns the failure
                if decision == CRASH_LOOP:
                    print(f"stalwart supervisor: crash loop: {self.sup.cfg.crash_loop_restarts} failures in a row "
                          f"without progress (newest saved step {self.sup.policy.progress}); giving up, exit "
                          f"{EXIT_CRASH_LOOP} (do not requeue)", file=sys.stderr, flush=True)
        return result

    def _initialize_workers(self, worker_group) -> None:
        super()._initialize_workers(worker_group)
        self.sup.ranks = [w.global_rank for w in worker_group.workers]  # known after rendezvous

    def _start_workers(self, worker_group):
        sys.stdout.flush()  # a forked worker must not write the launcher's buffered output again
        sys.stderr.flush()
        return super()._start_workers(worker_group)

    def _restart_workers(self, worker_group) -> None:
        t0 = time.time()
        super()._restart_workers(worker_group)
        self.sup.restarted(time.time(), time.time() - t0)

    def _inject_chaos(self, now: float) -> None:
        pids = self._pids()
        for _, kind, index in self.sup.chaos_due(now):
            rank = sorted(pids)[index % len(pids)]
            sig = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP, "exception": signal.SIGUSR2}[kind]
            self.sup.chaos_injected(now, kind, rank, pids[rank])
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[rank], sig)


@contextlib.contextmanager
def patched_agent(factory):
    """torch's launch_agent builds a LocalElasticAgent; make it build ours (same arguments), the
    rendezvous store listen on its endpoint's address only, and the port of the store rank 0 serves
    be one no connection can take before rank 0 binds it (``runtime.settings.free_port``)."""
    from torch.distributed.launcher import api

    from torch.distributed.elastic.rendezvous import api as rdzv_api
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as rdzv

    # NOTE: the rendezvous store is built by torch's c10d backend, which binds every interface; ours
    # binds only the endpoint's address (the same arguments otherwise). torch's port for the workers'
    # store is any free one (bind to port 0), from the range every outgoing connection draws from, and
    # the seconds until rank 0 binds it (torch loading) are enough for one to take it.
    saved = api.LocalElasticAgent, rdzv.TCPStore, rdzv_api.get_free_port
    api.LocalElasticAgent, rdzv.TCPStore, rdzv_api.get_free_port = factory, bound_tcp_store, free_port
    try:
        yield
    finally:
        api.LocalElasticAgent, rdzv.TCPStore, rdzv_api.get_free_port = saved


def run_supervised(torchrun_argv: list[str], fault_cfg, paths: RunPaths, snapshot_dir: Path | None,
                   max_restarts: int, fork_workers: bool = True, on_failure=None) -> int:
    """Run torch.distributed.run with our agent; return the documented exit code. ``fork_workers``:
    start ``stalwart.train`` workers by forking this process, which imports the trainer once first.
    ``on_failure(info)``: called when the agent sees its workers fail (``kind``, ``rank``, ``exitcode``,
    ``time``), before it decides what to do."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import config_from_args, get_args_parser

    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # workers check it is their parent, and die with it
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # a restarted gloo group must not reuse the old store
    args = get_args_parser().parse_args(torchrun_argv)
    if args.standalone or str(args.nnodes) in ("1", "1:1"):
        # One host: nothing listens beyond loopback (the stores, gloo's and NCCL's sockets).
        args.local_addr = args.local_addr or "127.0.0.1"
        listen_on(LOOPBACK)
    if args.standalone:
        args.rdzv_backend, args.rdzv_endpoint = "c10d", "127.0.0.1:0"
        import uuid

        args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, cmd, cmd_args = config_from_args(args)
    config.monitor_interval = fault_cfg.monitor_interval_s
    config.max_restarts = max_restarts
    entrypoint, entry_args = cmd, cmd_args
    t0 = time.perf_counter()
    forked = forked_entry(config, cmd, cmd_args, TRAIN) if fork_workers else None
    launcher = {"command_start": process_start_time(os.getpid()), "fork_workers": forked is not None}
    if forked is not None:
        launcher["preload_s"] = round(time.perf_counter() - t0, 3)
        entrypoint, entry_args = forked
    usage = resource.getrusage(resource.RUSAGE_SELF)  # what the launcher's start cost, whatever the load
    launcher["launcher_cpu_s"] = round(usage.ru_utime + usage.ru_stime, 3)
    paths.root.mkdir(parents=True, exist_ok=True)
    events = EventLog(paths.events, enabled=True)
    holder: dict = {}

    def factory(spec, *a, **kw):
        node = int(os.environ.get("GROUP_RANK", "0"))  # unknown before rendezvous: assume a regular grid
        ranks = [node * spec.local_world_size + i for i in range(spec.local_world_size)]
        sup = Supervisor(fault_cfg, paths.root, snapshot_dir, max_restarts, ranks, events,
                         host_size=fault_cfg.host_size or spec.local_world_size,
                         steps_are_progress=fault_cfg.replica_group >= 0)
        if fault_cfg.replica_group >= 0:  # its lines name the replica group its ranks belong to
            sup.say = lambda line, g=fault_cfg.replica_group: print(
                line.replace("stalwart supervisor:", f"stalwart supervisor: replica group {g}:", 1),
                file=sys.stderr, flush=True)
        sup.launched(time.time(), nproc_per_node=spec.local_world_size, **launcher)
        holder["sup"] = sup
        return SupervisedAgent(spec, *a, stalwart_supervisor=sup, on_failure=on_failure, **kw)

    from torch.distributed.launcher.api import elastic_launch

    code = EXIT_OK
    try:
        with patched_agent(factory), quiet_process_logs():
            elastic_launch(config=config, entrypoint=entrypoint)(*entry_args)
    except ChildFailedError as e:
        sup = holder.get("sup")
        since = sup.attempt_start if sup else 0.0
        rank = root_cause(e.failures, paths, since, sup.injected_since(since) if sup else [])
        exitcode = getattr(e.failures.get(rank), "exitcode", None)
        if sup is not None and sup.failures:  # what the supervisor saw first-hand
            rank, exitcode = sup.failures[-1]["rank"], sup.failures[-1]["exitcode"]
        verdict = sup.verdict if sup else ""
        user_errors = {r: rec for r, rec in read_exit_records(paths, since).items() if rec.get("user_error")}
        if verdict == "preempted":  # workers signalled directly saved their step (train/preempt.py)
            from stalwart.train.preempt import EXIT_REQUEUE, preempted_since

            code = EXIT_REQUEUE
            saved = preempted_since(paths.events, since) or {}
            print(f"stalwart train: SIGTERM reached the workers: saved checkpoint {saved.get('checkpoint')} (step "
                  f"{saved.get('step')}); exit {EXIT_REQUEUE} (requeue)", file=sys.stderr, flush=True)
        elif verdict == CRASH_LOOP:
            code = EXIT_CRASH_LOOP
        elif verdict == EXCLUDE:
            code = EXIT_EXCLUDE
            host, size = sup.excluded_host, sup.host_size
            record_exclusion(paths, host, size, f"{fault_cfg.exclude_after} failures",
                             restarts_used=sup.policy.restarts)
            print(f"stalwart supervisor: host {host} (ranks {host * size}-{(host + 1) * size - 1}) failed "
                  f"{fault_cfg.exclude_after} times: excluding it", file=sys.stderr, flush=True)
        elif verdict == "user_error" or user_errors or any(f.exitcode == EXIT_USER_ERROR for f in e.failures.values()):
            code = EXIT_USER_ERROR  # never restarted; the first rank's one line is the whole message
            if user_errors:
                first = min(user_errors, key=lambda r: (bool(user_errors[r].get("peer")), user_errors[r]["time"]))
                where = f" (rank {first})" if first else ""
                print(f"stalwart train: error{where}: {user_errors[first]['error']}", file=sys.stderr, flush=True)
        elif verdict == BUDGET_EXHAUSTED and max_restarts > 0:
            code = EXIT_RESTART_BUDGET
            print(f"stalwart supervisor: restart budget (launch.max_restarts = {max_restarts}) used up; last failure "
                  f"rank {rank} exit code {exitcode}; exit {EXIT_RESTART_BUDGET} (requeue to continue)",
                  file=sys.stderr, flush=True)
        else:
            code = EXIT_FAILED
            print(f"stalwart train: worker rank {rank} failed with exit code {exitcode} (see its message "
                  "above)", file=sys.stderr)
    except SignalException as e:  # Ctrl-C or a scheduler's SIGTERM: torch has stopped the workers already
        from stalwart.checkpoint.manager import newest_complete_checkpoint

        from stalwart.train.preempt import EXIT_REQUEUE, preempted_since

        code = 128 + int(e.sigval)
        newest = newest_complete_checkpoint(paths.checkpoints)
        then = f"resumes from {newest}" if newest else "starts over (no checkpoint was saved yet)"
        saved = (preempted_since(paths.events, holder["sup"].attempt_start if "sup" in holder else 0.0)
                 if e.sigval == signal.SIGTERM else None)
        if saved is not None:  # the workers finished their step and saved it (train/preempt.py)
            code = EXIT_REQUEUE
            what = (f"saved checkpoint step {saved['step']} {saved['signal_to_durable_s']:.1f} s after the signal"
                    if saved.get("checkpoint") else f"the save of step {saved['step']} failed ({saved.get('error')})")
            print(f"stalwart train: SIGTERM: {what}; exit {EXIT_REQUEUE} (requeue: the same command {then})",
                  file=sys.stderr, flush=True)
        else:
            print(f"stalwart train: stopped by {signal.Signals(e.sigval).name}; the same command {then}",
                  file=sys.stderr, flush=True)
    finally:
        if "sup" in holder:
            holder["sup"].finished(time.time(), code)
        events.close()
    if code not in (EXIT_EXCLUDE, EXIT_USER_ERROR) and holder.get("sup") is not None and (holder["sup"].failures or fault_cfg.chaos_mtbf_s):
        from stalwart.observe.goodput import account_run, format_report

        g = account_run(paths.root)
        write_text_atomic(paths.goodput, json.dumps(g, indent=1))
        print(format_report(g), flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    """Multi-node: ``python -m stalwart.launch.agent <torchrun args> -m stalwart.train --config ...``."""
    from stalwart.config.loading import parse_train_argv
    from stalwart.errors import UserError

    argv = list(sys.argv[1:] if argv is None else argv)
    if "-m" not in argv and "--module" not in argv:
        print("usage: python -m stalwart.launch.agent [torchrun options] -m stalwart.train [train options]",
              file=sys.stderr)
        return 2
    i = argv.index("-m") if "-m" in argv else argv.index("--module")
    try:
        _, cfg = parse_train_argv(argv[i + 2:])
    except UserError as e:
        print(f"stalwart train: error: {e}", file=sys.stderr)
        return 2
    paths = RunPaths.of(cfg.run)
    snap = paths.snapshots(cfg.checkpoint.memory_dir) if cfg.checkpoint.memory_interval else None
    # One host: this agent holds the run directory for its workers. Several: global rank 0 holds it
    # (the agents cannot know which of them is first before the rendezvous).
    single = "--standalone" in argv[:i] or any(a in ("--nnodes=1", "--nnodes=1:1") for a in argv[:i]) or (
        "--nnodes" in argv[:i] and argv[argv.index("--nnodes") + 1] in ("1", "1:1"))
    try:
        with RunLock(paths) if single else contextlib.nullcontext():
            if single:
                os.environ[LOCK_HOLDER_ENV] = str(os.getpid())
            return run_supervised(argv, cfg.fault, paths, snap, cfg.launch.restarts(), cfg.launch.fork_workers)
    except UserError as e:
        print(f"stalwart train: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
