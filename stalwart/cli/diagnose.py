"""`stalwart diagnose RUN_DIR`: analyse flight-recorder dumps; name the ranks that never entered a
collective and say what every rank was doing."""

from __future__ import annotations

import argparse
import json
import sys

from stalwart.errors import UserError


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="stalwart diagnose", description=(
        "Read RUN_DIR/flight/rank-*.json (written by the flight recorder on a hang, exception, SIGTERM or "
        "SIGUSR1) and report the first collective some rank never entered, mismatched collectives, and each "
        "rank's last completed op, op in flight and its age. Exit status 1 when a divergence is found."))
    ap.add_argument("run_dir", help="the run directory")
    ap.add_argument("--json", action="store_true", help="print the analysis as JSON")
    args = ap.parse_args(argv)
    from stalwart.observe.diagnose import analyze, format_diagnosis, load_dumps
    from stalwart.paths import RunPaths

    dumps = load_dumps(args.run_dir)
    if not dumps:
        raise UserError(f"no flight-recorder dumps in {RunPaths(args.run_dir).flight_dir} (send SIGUSR1 to the "
                        "workers of a live job to get some)")
    a = analyze(dumps)
    print(json.dumps(a, indent=1, default=str) if args.json else format_diagnosis(a))
    return 1 if a["findings"] or a["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
