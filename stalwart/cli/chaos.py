"""`stalwart chaos [options] -- TRAIN_ARGS`: a clean run and the same run under faults from outside.

    stalwart chaos --faults 20 --seed 1 -- --config debug --nproc-per-node 2 --run.dir runs/chaos \\
        --training.steps 600 --checkpoint.memory_interval 2 --launch.max_restarts 20

Trains the reference run (``--reference``, default ``<run.dir>-reference``; a finished one is taken as
it is), then runs ``stalwart train TRAIN_ARGS`` and sends it ``--faults`` faults from another process:
kill -9 of a worker, SIGSTOP of a worker, a slowed worker (stopped and continued in a duty cycle), a
full disk during a save (the checkpoints on a small tmpfs filled from outside), a partition of one
worker's connections (in the job's own network namespace) and a corrupted memory snapshot (bytes
flipped in /dev/shm, then a kill: the restart must refuse it by its checksum and resume from disk).
The full disk and the partition need root (a private mount and network namespace for the job); where
a kind cannot run it says why in one line and is skipped, or exits 2 when asked for by --kinds.

Against a job of replica groups (``--fault.group_recovery true``) the faults are aimed across every
group's ranks, and two more kinds run: ``group_kill`` (kill -9 of every rank of one group) and
``all_groups`` (kill -9 of one rank in every group: the whole-job fallback); a corrupted snapshot is
then one in every group's memory, with one rank of every group killed. Each fault's line also says how
often the groups it did not hit were restarted (must be 0) and how long they stalled.

Writes the fault log to <run.dir>/chaos.jsonl (one line per fault: time, kind, target, the run's
detection of it and its recovery; then the verdict) and prints a summary and the comparison of every
step's state fingerprint with the reference (what `stalwart compare` prints).

Exit status: 0 when every fault was sent, the run finished, its fingerprints equal the reference's
and no replica group was restarted by a fault that did not hit it; 1 otherwise; 2 for a mistake in
the command.
"""

from __future__ import annotations

import sys
from pathlib import Path

from stalwart.config.arguments import ArgumentParser
from stalwart.errors import UserError


def _range(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in text.split("-"))
    except ValueError:
        raise UserError(f"--gap {text!r}: give seconds as LO-HI, e.g. 1-3") from None
    if not 0 <= lo <= hi:
        raise UserError(f"--gap {text!r}: needs 0 <= LO <= HI")
    return lo, hi


def main(argv: list[str]) -> int:
    from stalwart.chaos.faults import KINDS
    from stalwart.chaos.groups import GROUP_KINDS

    p = ArgumentParser(prog="stalwart chaos", description=__doc__.split("\n\n")[0],
                       epilog="Everything else (or everything after --) is the `stalwart train` command line.")
    p.add_argument("--faults", type=int, default=20, help="faults to send (default 20)")
    p.add_argument("--kinds", default="", help=f"comma-separated kinds (default all that can run: {','.join(KINDS)}; "
                   f"against replica groups also {','.join(GROUP_KINDS)})")
    p.add_argument("--gap", default="1-3", help="seconds between one fault's end and the next, LO-HI (default 1-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the schedule: kinds, order, targets, gaps")
    p.add_argument("--hold", type=float, default=15.0,
                   help="longest a full disk or a partition lasts, seconds (default 15)")
    p.add_argument("--slow", type=float, default=5.0, help="how long a slowed worker is slowed, seconds (default 5)")
    p.add_argument("--timeout", type=float, default=1800.0, help="bound on the whole drill, seconds (default 1800)")
    p.add_argument("--disk-mb", type=int, default=256, help="size of the tmpfs that holds the checkpoints (default 256)")
    p.add_argument("--reference", default="", help="the clean run: trained here first unless it has finished")
    args, train = p.parse_known_args(argv)
    train = [a for a in train if a != "--"]
    if args.faults < 1:
        raise UserError("--faults must be at least 1")
    if args.hold <= 0 or args.slow <= 0 or args.timeout <= 0 or args.disk_mb < 1:
        raise UserError("--hold, --slow, --timeout and --disk-mb must be positive")
    from stalwart.chaos.drill import DrillOptions, run_drill

    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    opts = DrillOptions(faults=args.faults, kinds=kinds, explicit_kinds=bool(args.kinds), gap_s=_range(args.gap),
                        seed=args.seed, hold_s=args.hold, slow_s=args.slow, timeout_s=args.timeout, disk_mb=args.disk_mb,
                        reference=Path(args.reference) if args.reference else None)
    return run_drill(train, opts)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
