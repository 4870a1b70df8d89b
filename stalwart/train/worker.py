"""One training worker: what each process runs (in-process for one worker, or under torchrun).

The config is parsed once per process, by the entry point (``stalwart train`` or
``torchrun -m stalwart.train``), and handed to :func:`worker_main`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

import torch

from stalwart.config.job import JobConfig
from stalwart.errors import PeerUserError, UserError
from stalwart.ft.detect import EXIT_ROLLBACK, EXIT_USER_ERROR, PEER_LOST
from stalwart.ft.guard import RollbackRequested
from stalwart.ft.records import mark_startup, record_exit
from stalwart.paths import RunPaths
from stalwart.train.preempt import EXIT_REQUEUE, Preempted
from stalwart.ft.runlock import RunLock, drop_unowned_snapshots, held_by_parent, under_stalwart_launcher


def format_summary(s: dict) -> str:
    lines = [
        "",
        "== Stalwart run summary ==",
        f"  steps           {s['steps']}{'  (stopped early: training.stop_at_step)' if s['stopped_early'] else ''}",
        f"  layout          {s['world_size']} process(es): {s['layout']}",
        f"  throughput      {s['tokens_per_s']:.0f} tokens/s (steady state)" if s["tokens_per_s"] else
        "  throughput      - (no steps this session)",
        f"  MFU             {100 * s['mfu']:.1f}% of {s['peak_tflops_per_device']:.3f} TFLOP/s per device "
        f"({s['peak_source']})" if s["mfu"] else "  MFU             -",
        f"  final loss      {s['final_loss']:.4f}" if s.get("final_loss") is not None else "  final loss      -",
    ]
    if s.get("first_eval_loss") is not None and s.get("final_eval_loss") is not None:
        ratio = s["final_eval_loss"] / s["first_eval_loss"]
        lines.append(f"  eval loss       {s['first_eval_loss']:.4f} -> {s['final_eval_loss']:.4f} "
                     f"({100 * ratio:.0f}% of the first)")
    lines.append(f"  peak memory     {s['mem_bytes'] / 2**20:.0f} MiB per process")
    lines.append(f"  wall time       {s['elapsed_s']:.1f} s" + (
        f" over {s['attempts']} attempts, first start to finish (this one {s['session_elapsed_s']:.1f} s)"
        if s.get("attempts", 1) > 1 else ""))
    ft = s.get("fault_tolerance") or {}
    if ft.get("skipped_steps"):
        lines.append(f"  skipped steps   {ft['skipped_steps']} (non-finite or rolled-back data)")
    for st in ft.get("stragglers", []):
        lines.append(f"  straggler       rank {st['rank']}: {st['phase']} {st['ratio']:.1f}x its peers "
                     f"(median over {st['steps']} steps)")
    lines.append(f"  checkpoint      {s['checkpoint'] or '-'}")
    lines.append(f"  run directory   {s['run_dir']}  (metrics.jsonl, events.jsonl, summary.json)")
    if s.get("sample"):
        lines.append("  sample:")
        lines += ["    | " + line for line in s["sample"].splitlines()[:12]]
    return "\n".join(lines)


def _run_lock(cfg: JobConfig) -> RunLock | contextlib.nullcontext:
    """The run directory's lock, unless the launcher that started this process holds it: taken by the
    one process of a single-process run, or by global rank 0 under plain torchrun (whose restarts share
    torchrun's run id, so a restarted rank 0 waits for its predecessor instead of refusing)."""
    if held_by_parent() or int(os.environ.get("RANK", 0)) != 0:
        return contextlib.nullcontext()
    return RunLock(RunPaths.of(cfg.run), job=os.environ.get("TORCHELASTIC_RUN_ID", ""))


def worker_main(cfg: JobConfig) -> int:
    from stalwart.train.dist_env import bind_to_launcher

    bind_to_launcher()
    lock = _run_lock(cfg)
    try:
        lock.__enter__()
    except UserError as e:
        print(f"stalwart train: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    if not under_stalwart_launcher() and os.environ.get("LOCAL_RANK", "0") == "0" and \
            os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":  # else the supervisor did, or a restart
        paths = RunPaths.of(cfg.run)
        drop_unowned_snapshots(paths, paths.snapshots(cfg.checkpoint.memory_dir))
    try:
        return _worker_main(cfg)
    finally:
        lock.__exit__(None, None, None)


def _worker_main(cfg: JobConfig) -> int:
    from stalwart.runtime.group import init_from_env, leave
    from stalwart.train.dist_env import leave_together

    from stalwart.train.trainer import Trainer

    mark_startup(RunPaths.of(cfg.run), "group")  # the imports are done
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    torch.set_num_threads(cfg.launch.threads(local_world))
    try:
        env = init_from_env(cfg.training.device, cfg.fault.collective_timeout_s, "training.device")
    except UserError as e:  # a device this host lacks: every worker says it; the launcher stops the job
        print(f"stalwart train: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    mark_startup(RunPaths.of(cfg.run), "data", rank=env.rank)
    try:
        summary = Trainer(cfg, env).train()
        if env.is_main:
            print(format_summary(summary), flush=True)
        leave_together()
        return 0
    except UserError as e:
        if not env.is_distributed:
            print(f"stalwart train: error: {e}", file=sys.stderr, flush=True)
            return EXIT_USER_ERROR
        # Any rank may meet a user error (its shard of a checkpoint, say). Under Stalwart's launcher the
        # supervisor prints the first failing rank's line once; elsewhere each failing rank prints it.
        # Leave at once, like a crash: tearing the group down can block on peers still in a collective.
        recorded = record_exit(RunPaths.of(cfg.run), env.rank, e, user_error=True,
                               peer=isinstance(e, PeerUserError))
        if not (recorded and under_stalwart_launcher()) and not isinstance(e, PeerUserError):
            print(f"stalwart train: error: {e}", file=sys.stderr, flush=True)
        _leave(EXIT_USER_ERROR)
    except KeyboardInterrupt:
        if not env.is_distributed:
            raise  # one process: `stalwart train` says it was interrupted
        _leave(128 + signal.SIGINT)  # Ctrl-C reached every worker; the launcher says so once
    except Preempted as e:  # SIGTERM: every rank saved this step together; the scheduler requeues
        if env.is_main and not (env.is_distributed and under_stalwart_launcher()):  # else the launcher says it
            print(f"stalwart train: {e}", file=sys.stderr, flush=True)
        if not env.is_distributed:
            return EXIT_REQUEUE
        _leave(EXIT_REQUEUE)
    except RollbackRequested as e:
        if env.is_main:
            print(f"stalwart train: rolling back to the last good state: {e}", file=sys.stderr, flush=True)
        return EXIT_ROLLBACK
    except Exception as e:  # a bug or a failure: report it and leave at once
        if not env.is_distributed:
            raise
        # Tearing the process group down can block on a dead or hung peer; the supervisor restarts the
        # group only once this process is gone, so exit now (traceback and flight-recorder dump first).
        lost = PEER_LOST.search(str(e))
        record_exit(RunPaths.of(cfg.run), env.rank, e, peer=bool(lost))
        if lost:  # not this rank's failure: Stalwart's supervisor names the rank that left first
            if not under_stalwart_launcher():
                print(f"stalwart train: rank {env.rank} stopped: a peer left the job ({lost.group(0)})",
                      file=sys.stderr)
        else:
            sys.excepthook(type(e), e, e.__traceback__)
        _leave(1)
    finally:
        leave()




def _leave(code: int) -> None:
    """Exit this worker now, without tearing the process group down."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
