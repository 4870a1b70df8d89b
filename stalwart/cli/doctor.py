"""`stalwart doctor`: per-rank compute and communication health check; flags outlier ranks."""

from __future__ import annotations

import json
import sys

from stalwart.config.arguments import ArgumentParser, at_least


def main(argv: list[str]) -> int:
    ap = ArgumentParser(prog="stalwart doctor", description=(
        "Spawn N local processes (gloo) and measure per rank: matmul GFLOP/s, all-reduce latency and bus "
        "bandwidth, ring exchange with the neighbours. Ranks worse than the median by more than --tolerance are "
        "flagged. Exit status 1 when a rank is flagged or the check fails."))
    ap.add_argument("--nproc", type=at_least(1), default=2, help="processes to spawn (default 2)")
    ap.add_argument("--matmul-n", type=at_least(1), default=512, help="matmul size n (n x n @ n x n; default 512)")
    ap.add_argument("--mb", type=at_least(1), default=4, help="all-reduce payload in MB (default 4)")
    ap.add_argument("--iters", type=at_least(1), default=10, help="timed iterations per measurement (default 10)")
    ap.add_argument("--threads", type=at_least(1), default=1, help="intra-op threads per process (default 1)")
    ap.add_argument("--tolerance", type=float, default=0.3, help="allowed fraction worse than the median")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    if not args.tolerance >= 0:
        ap.error(f"--tolerance is a fraction worse than the median, at least 0 (got {args.tolerance})")
    from stalwart.observe.doctor import format_report, health_check

    rep = health_check(args.nproc, args.matmul_n, args.mb, args.iters, args.threads, args.tolerance)
    if args.json:
        print(json.dumps({"ok": rep.ok, "bad_ranks": rep.bad_ranks, "ranks": rep.ranks, "flags": rep.flags,
                          "errors": rep.errors}, indent=1))
    else:
        print(format_report(rep))
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
