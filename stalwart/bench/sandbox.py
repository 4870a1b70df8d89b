"""`stalwart bench sandbox`: reward-sandbox throughput, programs scored per second.

Each program is a code-task family's reference solution (cycling through every family), scored by
`Sandbox.score` against `--cases` of its hidden test cases under the default sandbox limits, the way
a reward worker scores a rollout. Each repeat times the same programs serially and then with each
`--threads` count sharing one `Sandbox`, each time both with a sandbox per program and batched (the
programs dealt into one share per thread, each share run in one sandbox, as a reward worker does), and prints one JSON line per measurement with the machine's
load average at the time (the sandbox is CPU-bound: other work on the machine slows it). With `--url`
(a running `stalwart sandbox serve`, its own limits), each repeat then times the same programs
through the service with the reward workers' client (`via`: local or service). `--startup K` and
`--concurrent N` measure a sandbox's start-up and memory, and how many programs fit at once
(``bench/sandbox_density.py``); `--fleet K` floods K services on emulated hosts and kills one
(``bench/sandbox_fleet.py``).
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

from stalwart.bench.sandbox_density import load as _load
from stalwart.config.arguments import ArgumentParser, at_least, listed


def _workload(programs: int, cases: int) -> list:
    from stalwart.rl.tasks import FAMILIES, Instance

    items = []
    for i in range(programs):
        fam = FAMILIES[i % len(FAMILIES)]
        inst = Instance(fam.name, fam.params[(i // len(FAMILIES)) % len(fam.params)])
        items.append((inst.solution, inst.cases(cases, seed=i)))
    return items


def measure(sandbox, items: list, threads: int, batched: bool) -> dict:
    """Programs/s of scoring every item with `threads` threads, a sandbox per program or the items
    dealt into one share per thread (`score_spread`, as a reward worker does); every reference must
    pass."""
    from stalwart.sandbox.local import score_spread

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        if batched:
            verdicts = score_spread(sandbox, pool, items, threads)
        else:
            verdicts = list(pool.map(lambda item: sandbox.score(*item), items))
    seconds = time.perf_counter() - start
    failed = [v.reason for v in verdicts if v.reward != 1.0]
    return {"threads": threads, "batched": batched, "programs": len(items), "seconds": round(seconds, 3),
            "programs_per_s": round(len(items) / seconds, 2), "failed": len(failed),
            "first_failure": failed[0] if failed else "", **_load()}


def _fleet(p, args, cfg) -> int:
    from stalwart.bench.sandbox_fleet import fleet
    from stalwart.comm.netns import unavailable_reason

    kill = args.kill_at if args.kill_at >= 0 else None
    restart = args.restart_at if args.restart_at >= 0 else None
    if kill is not None and not 1.0 <= kill < args.flood_s:
        p.error(f"--kill-at must lie inside the flood (1 to {args.flood_s} s), or be negative for none")
    if restart is not None and (kill is None or not kill < restart < args.flood_s):
        p.error("--restart-at must lie after --kill-at and inside the flood")
    if not 1 <= args.batch <= 32 or not 0.1 <= args.window_s <= args.flood_s / 4:
        p.error("--batch must be 1-32 and --window-s 0.1 s to a quarter of the flood")
    why = unavailable_reason()
    if why:
        p.error(f"--fleet needs emulated hosts: {why}")
    print(json.dumps({**fleet(cfg, args.fleet, args.flood_s, kill, restart, args.flood_threads, args.batch,
                               jobs=64, cases=args.cases, window=args.window_s), **_load()}), flush=True)
    return 0


def main(argv: list[str]) -> int:
    from stalwart.config.sandbox import SandboxConfig
    from stalwart.sandbox.local import Sandbox

    p = ArgumentParser(prog="stalwart bench sandbox", description=__doc__.split("\n\n")[0])
    p.add_argument("--programs", type=at_least(1), default=60, help="programs scored per measurement")
    p.add_argument("--cases", type=at_least(1), default=3, help="test cases per program")
    p.add_argument("--threads", type=listed(at_least(1)), default="2", help="comma-separated thread counts timed after the serial run")
    p.add_argument("--repeats", type=at_least(1), default=3, help="repeats of the whole measurement")
    p.add_argument("--url", default="", help="also time a sandbox service (comma-separated addresses: "
                                             "`stalwart sandbox serve` prints its own)")
    p.add_argument("--startup", type=at_least(0), default=0, help="time this many programs' start-up (request to "
                   "first line), warm and cold, and an idle sandbox's memory; then stop")
    p.add_argument("--concurrent", type=at_least(0), default=0, help="hold this many programs alive at once, each in "
                   "its own sandbox (1 MiB each, sleeping); report how many fit and what refused more; then stop")
    p.add_argument("--hold", type=at_least(1), default=60, help="--concurrent: seconds from the first request to "
                   "the deadline every program sleeps until")
    p.add_argument("--fleet", type=at_least(0), default=0, help="run this many sandbox services on emulated hosts "
                   "(network namespaces; root) and flood them from another; then stop")
    p.add_argument("--flood-s", type=at_least(1), default=60, help="--fleet: seconds of the flood")
    p.add_argument("--kill-at", type=float, default=20.0, help="--fleet: seconds into the flood at which the first "
                   "service is killed (SIGKILL); negative: none")
    p.add_argument("--restart-at", type=float, default=-1.0, help="--fleet: seconds into the flood at which the "
                   "killed service starts again (negative: never)")
    p.add_argument("--flood-threads", type=at_least(1), default=12, help="--fleet: batches kept in flight")
    p.add_argument("--batch", type=at_least(1), default=8, help="--fleet: programs per batch (at most 32)")
    p.add_argument("--window-s", type=float, default=1.0, help="--fleet: window of the recovery's programs/s")
    p.add_argument("--max-sandboxes", type=at_least(0), default=0, help="sandbox.max_sandboxes (0: memory decides)")
    p.add_argument("--memory-reserve-mb", type=at_least(0), default=1024, help="sandbox.memory_reserve_mb")
    args = p.parse_args(argv)
    cfg = SandboxConfig(max_sandboxes=args.max_sandboxes, memory_reserve_mb=args.memory_reserve_mb)
    if args.fleet:
        return _fleet(p, args, cfg)
    if args.startup or args.concurrent:
        from stalwart.bench import sandbox_density

        return sandbox_density.main(args, cfg)
    threads = args.threads
    scorers = {"local": Sandbox(cfg)}
    if args.url:
        from stalwart.sandbox.client import SandboxClient

        scorers["service"] = SandboxClient([u for u in args.url.split(",") if u], retry_s=60.0)
    items = _workload(args.programs, args.cases)
    for scorer in scorers.values():
        scorer.score(*items[0])  # warm the page cache: the first sandbox start reads the interpreter
    for r in range(args.repeats):
        for via, scorer in scorers.items():
            for t in [1, *threads]:
                for batched in (False, True):
                    print(json.dumps({"repeat": r, "via": via, "cases": args.cases,
                                      **measure(scorer, items, t, batched)}), flush=True)
    return 0
