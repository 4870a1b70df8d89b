"""`stalwart compare RUN_A RUN_B [--tensors]`: the first step where two runs' training states differ.

Reads the state fingerprints in each run's ``metrics.jsonl`` (``stalwart.train.fingerprint``) over
the steps both runs fingerprinted (a step logged twice, after a resume, keeps its later line) and
prints the first step whose fingerprint differs, with the components that differ (``params``,
``optim``, ``rng``, ``data``). ``--tensors`` also names the first tensor (sorted by name) whose sum
differs at that step, from each run's ``fingerprints.jsonl``. No component depends on the number of
processes (``data`` is the global data position), so an elastic resume onto fewer processes compares
identical; when the runs trained on different numbers of processes a ``note:`` line says so.

Exit status: 0 when the runs agree on every common step, 1 when they differ, 2 when they cannot be
compared (no run directory, no fingerprints, no step in common).
"""

from __future__ import annotations

import sys
from pathlib import Path

from stalwart.config.arguments import ArgumentParser
from stalwart.paths import RunPaths


def first_tensor(run_a: Path, run_b: Path, step: int) -> str:
    """The first tensor whose sum differs at ``step``, in words."""
    from stalwart.train.fingerprint import read_tensor_sums

    sums = []
    for run in (run_a, run_b):
        path = RunPaths(run).fingerprints
        per_step = read_tensor_sums(path) if path.is_file() else {}
        if step not in per_step:
            return f"no per-tensor sums of step {step} in {path}"
        sums.append(per_step[step])
    a, b = sums
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:  # one run summed it at this step, the other did not
            continue
        if a[name] != b[name]:
            return f"first tensor: {name} (sum {a[name]:016x} vs {b[name]:016x})"
    both = set(a) & set(b)
    if both == set(a) == set(b):
        return "every tensor's sum agrees (the difference is in the RNG state or the data position)"
    return (f"the {len(both)} tensors both runs summed at step {step} agree (the difference is in the RNG "
            f"state, the data position or a tensor not summed there: metrics.fingerprint_sample)")


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="stalwart compare", description=__doc__.split("\n\n")[0])
    p.add_argument("run_a", help="a run directory")
    p.add_argument("run_b", help="another run directory")
    p.add_argument("--tensors", action="store_true", help="also name the first tensor that differs")
    args = p.parse_args(argv)
    from stalwart.observe.fingerprints import compare_runs, process_note  # the observe package loads torch

    run_a, run_b = Path(args.run_a), Path(args.run_b)
    step, line = compare_runs(run_a, run_b)
    print(line)
    note = process_note(run_a, run_b)
    if note:
        print(note)
    if step is None:
        return 0
    if args.tensors:
        print(first_tensor(run_a, run_b, step))
    return 1

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
