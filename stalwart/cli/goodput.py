"""`stalwart goodput RUN_DIR`: where a run's wall time went (productive, lost, detection, restart, ...)."""

from __future__ import annotations

import json
import sys

from stalwart.config.arguments import ArgumentParser
from stalwart.errors import UserError
from stalwart.paths import RunPaths


def main(argv: list[str]) -> int:
    ap = ArgumentParser(prog="stalwart goodput", description=(
        "Split a run's wall time into productive training, lost (recomputed) work, failure detection, "
        "restart/re-initialisation, checkpoint stalls, start-up and other; ETTR = productive / wall. "
        "Reads RUN_DIR/events.jsonl and metrics.jsonl; lists every failure with its detection latency, "
        "time to the next completed step and steps recomputed."))
    ap.add_argument("run_dir", help="the run directory")
    ap.add_argument("--json", action="store_true", help="print the accounting as JSON")
    args = ap.parse_args(argv)
    paths = RunPaths(args.run_dir)
    if not paths.events.is_file():
        raise UserError(f"{paths.root} is not a run directory (no events.jsonl)")
    from stalwart.observe.goodput import account_run, format_report

    g = account_run(paths.root)
    if g is None:
        raise UserError(f"{paths.events} holds no events to account")
    print(json.dumps(g, indent=1) if args.json else format_report(g))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
