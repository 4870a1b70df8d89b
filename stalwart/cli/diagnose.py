"""`stalwart diagnose RUN_DIR`: analyse flight-recorder dumps; name the ranks that never entered a
collective and say what every rank was doing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from stalwart.config.arguments import ArgumentParser
from stalwart.errors import UserError


def main(argv: list[str]) -> int:
    ap = ArgumentParser(prog="stalwart diagnose", description=(
        "Read RUN_DIR/flight/rank-*.json (written by the flight recorder on a hang, exception, SIGTERM or "
        "SIGUSR1) and report the first collective some rank never entered, mismatched collectives, and each "
        "rank's last completed op, op in flight and its age, for the newest attempt that wrote dumps (saying which, and "
        "whether the run went on after it). Exit status: 0 nothing wrong now (no dumps, dumps that agree, or a "
        "divergence the run went on after), 1 when that attempt diverged and is the run's current state, 2 when "
        "RUN_DIR is not a directory or a flag is wrong."))
    ap.add_argument("run_dir", help="the run directory")
    ap.add_argument("--json", action="store_true", help="print the analysis as JSON")
    args = ap.parse_args(argv)
    from stalwart.metrics.records import read_jsonl
    from stalwart.observe.diagnose import analyze, format_diagnosis, load_dumps, newest_attempt
    from stalwart.paths import RunPaths

    if not Path(args.run_dir).is_dir():
        raise UserError(f"no run directory at {args.run_dir}")
    skipped: list[str] = []
    dumps = load_dumps(args.run_dir, skipped)
    for what in skipped:
        print(f"warning: skipped {what}", file=sys.stderr)
    if not dumps:  # nothing hung, failed or was stopped: nothing to diagnose, which is an answer
        where = RunPaths(args.run_dir).flight_dir
        print(json.dumps({"dumps": 0, "flight_dir": str(where)}) if args.json else
              f"nothing wrong: no flight-recorder dumps in {where}, so no rank of this run hung, failed or was "
              "stopped (send SIGUSR1 to the workers of a live job to see what each rank is doing)")
        return 0
    dumps, attempt = newest_attempt(dumps, read_jsonl(RunPaths(args.run_dir).events))
    a = {**analyze(dumps), "attempt": attempt}
    current = attempt["superseded_by"] is None  # an earlier attempt's divergence is history, not a finding now
    diverged = current and bool(a["findings"] or a["mismatches"])
    print(json.dumps(a, indent=1, default=str) if args.json else format_diagnosis(a) + "\n" + (
        "verdict: the run's current state diverged (exit 1)" if diverged else "verdict: nothing wrong now (exit 0)"))
    return 1 if diverged else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
