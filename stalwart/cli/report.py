"""`stalwart report RUN_DIR`: a static HTML report with PNG plots, optionally a Perfetto trace."""

from __future__ import annotations

import sys
from pathlib import Path

from stalwart.atomic import staged_output
from stalwart.config.arguments import ArgumentParser
from stalwart.errors import UserError


def _window(text: str) -> tuple[int | None, int | None]:
    a, _, b = text.partition(":")
    try:
        first, last = (int(a) if a else None, int(b) if b else None)
    except ValueError:
        raise UserError(f"--trace-steps expects FIRST:LAST (e.g. 100:120), got {text!r}") from None
    if first is not None and last is not None and first > last:
        raise UserError(f"--trace-steps: FIRST {first} is after LAST {last}; give FIRST:LAST (e.g. {last}:{first})")
    return first, last


def main(argv: list[str]) -> int:
    ap = ArgumentParser(prog="stalwart report", description=(
        "Write a self-contained HTML report (the dashboard's content, no server needed) and PNG plots of a run "
        "directory; with --trace also a merged Chrome/Perfetto trace.json of all ranks' phases."))
    ap.add_argument("run_dir", help="the run directory")
    ap.add_argument("--out", default=None, help="output directory (default RUN_DIR/report)")
    ap.add_argument("--trace", action="store_true", help="also write trace.json (open in ui.perfetto.dev)")
    ap.add_argument("--trace-steps", default="", metavar="FIRST:LAST",
                    help="steps in the trace (default: the last 20)")
    ap.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    args = ap.parse_args(argv)
    if not Path(args.run_dir).is_dir():
        raise UserError(f"no run directory at {args.run_dir}")
    window = _window(args.trace_steps)
    from stalwart.observe.report import write_report
    from stalwart.observe.profiler import list_profiles
    from stalwart.paths import RunPaths

    paths = RunPaths(args.run_dir)
    if not any(p.exists() for p in (paths.config, paths.metrics, paths.events, paths.timings_dir)):
        raise UserError(f"{args.run_dir} is not a run directory (no config.toml, metrics.jsonl, events.jsonl or "
                        "timings): nothing to report")
    out = Path(args.out) if args.out is not None else paths.report_dir
    # Written beside the output directory first and moved in whole, report.html last: a full disk
    # leaves the directory as it was.
    with staged_output(out, "--out", last=("report.html",)) as tmp:
        res = write_report(args.run_dir, tmp, trace=args.trace, trace_steps=window, plots=not args.no_plots)
    for f in res["files"]:
        print(out / Path(f).relative_to(tmp))
    for p in list_profiles(paths):
        print(f"profiler {p['kind']} (rank {p['rank']}, linked from the report): {paths.profile_dir / p['name']}")
    st = res["data"]["stragglers"]
    if st and st["suspects"]:
        print(f"suspected straggler rank(s): {st['suspects']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
