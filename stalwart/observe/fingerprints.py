"""Two runs' state fingerprints side by side: where they part (``stalwart compare``, ``stalwart chaos``).

Reads the fingerprints each step's ``metrics.jsonl`` line carries (``stalwart.train.fingerprint``); a
step logged twice, after a resume, keeps its later line.
"""

from __future__ import annotations

import json
from pathlib import Path

from stalwart.errors import UserError
from stalwart.metrics.records import read_jsonl
from stalwart.paths import RunPaths


def read_fingerprints(run: Path) -> dict[int, dict]:
    """``{step: {"fingerprint", "parts", "loss", "full"}}`` from a run's metrics.jsonl (later lines win;
    ``full``: the whole state's fingerprint where the step has one, else None)."""
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
                                     "loss": rec.get("loss"), "full": rec.get("fingerprint_full")}
    if not out:
        raise UserError(f"{path} holds no state fingerprints (written by stalwart train at every logged step)")
    return out


def first_difference(a: dict[int, dict], b: dict[int, dict]) -> tuple[int | None, list[int]]:
    """(the first common step whose fingerprints differ or None, the common steps)."""
    common = sorted(set(a) & set(b))
    for step in common:
        if a[step]["fingerprint"] != b[step]["fingerprint"]:
            return step, common
        full_a, full_b = a[step].get("full"), b[step].get("full")
        if full_a and full_b and full_a != full_b:  # both summed every tensor here (a run's last step)
            return step, common
    return None, common


def compare_runs(run_a: Path, run_b: Path) -> tuple[int | None, str]:
    """(the first step whose state differs or None, one line saying so). Raises UserError when the two
    runs have no fingerprinted step in common."""
    a, b = read_fingerprints(run_a), read_fingerprints(run_b)
    step, common = first_difference(a, b)
    if not common:
        raise UserError(f"the runs have no fingerprinted step in common ({run_a}: steps {min(a)}-{max(a)}, "
                        f"{run_b}: steps {min(b)}-{max(b)})")
    if step is None:
        return None, f"identical: {len(common)} common steps ({common[0]}-{common[-1]}) have the same state fingerprint"
    parts = [k for k in sorted(set(a[step]["parts"]) | set(b[step]["parts"]))
             if a[step]["parts"].get(k) != b[step]["parts"].get(k)]
    whole_only = ("fingerprint_full: a tensor the sampled fingerprints had not reached yet"
                  if a[step]["fingerprint"] == b[step]["fingerprint"] else "fingerprint")
    loss = ("the same loss" if a[step]["loss"] == b[step]["loss"] else
            f"loss {a[step]['loss']} vs {b[step]['loss']}")
    return step, (f"differ: first at step {step} ({', '.join(parts) or whole_only}; {loss}); "
                  f"{common.index(step)} common steps before it agree")


def process_counts(run: Path) -> list[tuple[int, int]]:
    """(the step a session started from, its number of processes) for each change of the number, from
    the run's ``start`` events: ``[(0, 4), (2, 2)]`` is 4 processes, then 2 from step 2."""
    out: list[tuple[int, int]] = []
    for e in read_jsonl(RunPaths(run).events):
        if e.get("event") == "start" and isinstance(e.get("world_size"), int):
            if not out or out[-1][1] != e["world_size"]:
                out.append((int(e.get("step") or 0), e["world_size"]))
    return out


def process_note(run_a: Path, run_b: Path) -> str | None:
    """A note when the two runs trained on different numbers of processes (None when they did not, or one
    run's events do not say). The state fingerprint does not depend on it (``train/fingerprint.py``);
    the arithmetic may, which the note says where to look for."""
    a, b = process_counts(run_a), process_counts(run_b)
    if not a or not b or a == b:
        return None

    def said(counts: list[tuple[int, int]]) -> str:
        return ", then ".join(f"{n} from step {s}" if i else str(n) for i, (s, n) in enumerate(counts))

    return (f"note: the runs trained on different numbers of processes ({run_a}: {said(a)}; {run_b}: {said(b)}); "
            "the state fingerprint does not depend on it, the gradient sums do unless training.elastic_exact")
