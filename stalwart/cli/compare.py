"""`stalwart compare RUN_A RUN_B [--tensors]`: the first step where two runs' training states differ.

Reads the state fingerprints in each run's ``metrics.jsonl`` (``stalwart.train.fingerprint``) over
the steps both runs fingerprinted (a step logged twice, after a resume, keeps its later line) and
prints the first step whose fingerprint differs, with the components that differ (``params``,
``optim``, ``rng``, ``data``). ``--tensors`` also names the first tensor (sorted by name) whose sum
differs at that step, from each run's ``fingerprints.jsonl``.

Exit status: 0 when the runs agree on every common step, 1 when they differ, 2 when they cannot be
compared (no run directory, no fingerprints, no step in common).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from stalwart.config.arguments import ArgumentParser
from stalwart.errors import UserError
from stalwart.paths import RunPaths


def read_fingerprints(run: Path) -> dict[int, dict]:
    """``{step: {"fingerprint", "parts", "loss"}}`` from a run's metrics.jsonl (later lines win)."""
    path = RunPaths(run).metrics
    if not Path(run).is_dir():
        raise UserError(f"no run directory at {run}")
    if not path.is_file():
        raise UserError(f"{run} has no metrics.jsonl (has it trained?)")
    out: dict[int, dict] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn last line of a killed run
        if isinstance(rec, dict) and "fingerprint" in rec and "step" in rec:
            out[int(rec["step"])] = {"fingerprint": rec["fingerprint"], "parts": rec.get("fingerprint_parts") or {},
                                     "loss": rec.get("loss")}
    if not out:
        raise UserError(f"{path} holds no state fingerprints (written by stalwart train at every logged step)")
    return out


def first_difference(a: dict[int, dict], b: dict[int, dict]) -> tuple[int | None, list[int]]:
    """(the first common step whose fingerprints differ or None, the common steps)."""
    common = sorted(set(a) & set(b))
    for step in common:
        if a[step]["fingerprint"] != b[step]["fingerprint"]:
            return step, common
    return None, common


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
        if name not in a or name not in b:
            return f"first tensor: {name} (only in {run_a if name in a else run_b})"
        if a[name] != b[name]:
            return f"first tensor: {name} (sum {a[name]:08x} vs {b[name]:08x})"
    return "every tensor's sum agrees (the difference is in the RNG state or the data position)"


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="stalwart compare", description=__doc__.split("\n\n")[0])
    p.add_argument("run_a", help="a run directory")
    p.add_argument("run_b", help="another run directory")
    p.add_argument("--tensors", action="store_true", help="also name the first tensor that differs")
    args = p.parse_args(argv)
    run_a, run_b = Path(args.run_a), Path(args.run_b)
    a, b = read_fingerprints(run_a), read_fingerprints(run_b)
    step, common = first_difference(a, b)
    if not common:
        raise UserError(f"the runs have no fingerprinted step in common ({run_a}: steps {min(a)}-{max(a)}, "
                        f"{run_b}: steps {min(b)}-{max(b)})")
    if step is None:
        print(f"identical: {len(common)} common steps ({common[0]}-{common[-1]}) have the same state fingerprint")
        return 0
    parts = [k for k in sorted(set(a[step]["parts"]) | set(b[step]["parts"]))
             if a[step]["parts"].get(k) != b[step]["parts"].get(k)]
    loss = ("the same loss" if a[step]["loss"] == b[step]["loss"] else
            f"loss {a[step]['loss']} vs {b[step]['loss']}")
    print(f"differ: first at step {step} ({', '.join(parts) or 'fingerprint'}; {loss}); "
          f"{common.index(step)} common steps before it agree")
    if args.tensors:
        print(first_tensor(run_a, run_b, step))
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
