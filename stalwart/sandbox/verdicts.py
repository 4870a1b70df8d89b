"""What the reward sandbox takes and gives: cases, the runner's per-case reports (parsed strictly: a
program's output is untrusted), runs, and verdicts. Pure logic; `local.py` runs the programs."""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass

from stalwart.errors import UserError

STDERR_TAIL = 400


class SandboxError(UserError):
    """The sandbox cannot run here (no bubblewrap, no interpreter) or its input is malformed."""


@dataclass(frozen=True)
class Case:
    input: str
    output: str


@dataclass(frozen=True)
class Run:
    """One execution: what the program printed and how it ended."""
    stdout: str
    returncode: int | None  # None: killed by the wall-clock timer
    seconds: float
    stderr_tail: str = ""
    failure: str = ""  # why the sandbox reported nothing for this run (its runner died or timed out)

    @property
    def killed_by(self) -> int:
        """The signal that ended the program (bubblewrap reports it as exit status 128 + n), or 0."""
        code = self.returncode or 0
        return -code if code < 0 else code - 128 if 128 < code < 128 + 65 else 0

    @property
    def out_of_time(self) -> bool:
        return self.returncode is None or self.killed_by == signal.SIGXCPU

    @property
    def reason(self) -> str:
        if self.failure:
            return self.failure
        if self.returncode is None:
            return "wall-clock timeout"
        if self.killed_by:
            name = signal.Signals(self.killed_by).name
            return {"SIGXCPU": "CPU-time limit", "SIGXFSZ": "output or file-size limit",
                    "SIGKILL": "killed (CPU-time or memory limit)"}.get(name, f"killed by {name}")
        if self.returncode != 0:
            last = self.stderr_tail.strip().splitlines()[-1:] or [""]
            return f"exit status {self.returncode}" + (f": {last[0][:160]}" if last[0] else "")
        return "ok"


@dataclass(frozen=True)
class Verdict:
    reward: float
    passed: int
    total: int
    reason: str

    def as_dict(self) -> dict[str, float | int | str]:
        return {"reward": self.reward, "passed": self.passed, "total": self.total, "reason": self.reason}

    def to_json(self) -> str:
        return json.dumps(self.as_dict())

    @classmethod
    def from_dict(cls, data: object, where: str) -> Verdict:
        """A verdict as `as_dict` wrote it, checked field by field (it came over the network)."""
        if not (isinstance(data, dict) and set(data) == {"reward", "passed", "total", "reason"}
                and isinstance(data["reward"], (int, float)) and not isinstance(data["reward"], bool)
                and all(type(data[k]) is int for k in ("passed", "total")) and isinstance(data["reason"], str)
                and 0 <= data["passed"] <= data["total"]):
            raise SandboxError(f"{where}: not a verdict ({str(data)[:200]})")
        return cls(float(data["reward"]), data["passed"], data["total"], data["reason"])


def parse_cases(text: str, where: str) -> list[Case]:
    """A JSON list of {"input": str, "output": str}; anything else is refused by name."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise SandboxError(f"{where}: not JSON ({e.msg} at line {e.lineno}); expected a list of "
                           '{"input": ..., "output": ...} cases') from None
    return cases_from(data, where)


def cases_from(data: object, where: str) -> list[Case]:
    """Cases from parsed JSON (a list of {"input": str, "output": str}); anything else is refused by name."""
    if not isinstance(data, list) or not data:
        raise SandboxError(f'{where}: expected a non-empty JSON list of {{"input": ..., "output": ...}} cases')
    cases = []
    for i, item in enumerate(data):
        if not (isinstance(item, dict) and isinstance(item.get("input"), str)
                and isinstance(item.get("output"), str)):
            raise SandboxError(f'{where}: case {i} must be an object with string fields "input" and "output"')
        cases.append(Case(item["input"], item["output"]))
    return cases


def parse_reports(data: bytes, total: int, max_output: int) -> tuple[list[Run], bool]:
    """The runner's records (see runner.py), in case order, up to the first one that is
    missing, truncated or malformed; and whether everything was well formed. Sizes are checked
    before anything is sliced: no record may claim more than `max_output` bytes of stdout or
    STDERR_TAIL of stderr, nor more cases than `total`."""
    runs: list[Run] = []
    pos = 0
    while pos < len(data):
        end = data.find(b"\n", pos, pos + 200)
        fields = data[pos:end].split(b" ") if end >= 0 else []
        if len(fields) != 7 or fields[0] != b"case" or fields[1] != str(len(runs)).encode() \
                or fields[2] not in (b"exit", b"signal", b"timeout") or len(runs) >= total:
            return runs, False
        try:
            number, seconds = int(fields[3]), float(fields[4])
            n_out, n_err = int(fields[5]), int(fields[6])
        except ValueError:
            return runs, False
        if not (0 <= number < 256 and 0 <= n_out <= max_output and 0 <= n_err <= STDERR_TAIL
                and 0 <= seconds < 1e6) or end + 1 + n_out + n_err > len(data):
            return runs, False
        out = data[end + 1:end + 1 + n_out].decode(errors="replace")
        err = data[end + 1 + n_out:end + 1 + n_out + n_err].decode(errors="replace")
        code = {b"exit": number, b"signal": -number, b"timeout": None}[fields[2]]
        runs.append(Run(out, code, seconds, err))
        pos = end + 1 + n_out + n_err
    return runs, True


def runner_failure(code: int | None, parsed_ok: bool, stderr: str) -> str:
    """Why the runner reported no more cases."""
    if code is None:
        return "sandbox wall-clock limit (the whole run)"
    if code < 0 or 128 < code < 128 + 65:
        return f"sandbox runner killed by {signal.Signals(-code if code < 0 else code - 128).name}"
    if code != 0:
        last = stderr.strip().splitlines()[-1:] or [""]
        return f"sandbox runner failed (exit status {code}{': ' + last[0][:160] if last[0] else ''})"
    return "sandbox runner output ended early" if parsed_ok else "malformed sandbox runner output"


def verdict_of(cases: list[Case], runs: list[Run], failure: str) -> Verdict:
    passed, first_failure = 0, ""
    for i, case in enumerate(cases):
        if i >= len(runs):
            first_failure = first_failure or f"case {i}: {failure}" + _not_run(i, len(cases))
            break
        run = runs[i]
        if run.returncode == 0 and run.stdout.strip() == case.output.strip():
            passed += 1
            continue
        if not first_failure:
            why = run.reason if run.reason != "ok" else "wrong answer"
            first_failure = f"case {i}: {why}"
        if run.out_of_time:
            first_failure += _not_run(i, len(cases))
            break
    reason = "passed" if passed == len(cases) else first_failure
    return Verdict(passed / len(cases), passed, len(cases), reason)


def _not_run(i: int, total: int) -> str:
    return f" (cases {i + 1}-{total - 1} not run)" if i + 1 < total else ""
