"""Run an untrusted program against test cases: bubblewrap for isolation, rlimits for resources.

Each run is one `bwrap` sandbox: new user, PID, network, IPC, UTS and cgroup namespaces (no network
at all, no other process visible), the root file system made of read-only `/usr` (and its `/lib`,
`/bin` links) only, a fresh tmpfs as the working directory, the program bound read-only, a cleared
environment, and `--die-with-parent`. `prlimit` caps CPU time, address space, processes, file size
(which also caps stdout: it goes to a file) and open files; a wall-clock timer kills the sandbox.
Run as root, the sandbox drops to the unprivileged user `nobody` first, so the process limit binds
(the kernel does not count processes against root's limit).

What it does not stop: it shares the host kernel (a kernel exploit escapes it); CPU and memory
bandwidth are shared (a program can slow its neighbours within its CPU-time limit); and the process
limit counts every process of the sandbox user, so it is set to that user's current count plus
`sandbox.processes`.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from stalwart.config.rl import SandboxConfig
from stalwart.errors import UserError

NOBODY = 65534
PROGRAM = "/sandbox/program.py"
STDERR_TAIL = 400
MAX_SOURCE = 64 * 1024


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

    def to_json(self) -> str:
        return json.dumps({"reward": self.reward, "passed": self.passed, "total": self.total,
                           "reason": self.reason})


def parse_cases(text: str, where: str) -> list[Case]:
    """A JSON list of {"input": str, "output": str}; anything else is refused by name."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise SandboxError(f"{where}: not JSON ({e.msg} at line {e.lineno}); expected a list of "
                           '{"input": ..., "output": ...} cases') from None
    if not isinstance(data, list) or not data:
        raise SandboxError(f'{where}: expected a non-empty JSON list of {{"input": ..., "output": ...}} cases')
    cases = []
    for i, item in enumerate(data):
        if not (isinstance(item, dict) and isinstance(item.get("input"), str)
                and isinstance(item.get("output"), str)):
            raise SandboxError(f'{where}: case {i} must be an object with string fields "input" and "output"')
        cases.append(Case(item["input"], item["output"]))
    return cases


def syntax_error(source: str) -> str:
    """Why `source` cannot be a Python program, or '' if it parses (nothing of it is executed)."""
    if len(source) > MAX_SOURCE:
        return f"program longer than {MAX_SOURCE} characters"
    try:
        with warnings.catch_warnings():  # e.g. "invalid decimal literal": the verdict says enough
            warnings.simplefilter("ignore", SyntaxWarning)
            ast.parse(source)
    except SyntaxError as e:
        return f"syntax error: {e.msg} (line {e.lineno})"
    except (ValueError, RecursionError, MemoryError) as e:  # null bytes; nesting too deep to parse
        return f"cannot parse: {type(e).__name__}"
    return ""


def find_python(configured: str) -> str:
    """An interpreter visible inside the sandbox: it must live under /usr, the only tree bound in."""
    if configured != "auto":
        candidates = [configured]
    else:
        candidates = ["/usr/bin/python3", "/usr/local/bin/python3"]
    for c in candidates:
        real = os.path.realpath(c)
        if real.startswith("/usr/") and os.access(real, os.X_OK):
            return real
    raise SandboxError(f"sandbox.python: no interpreter under /usr among {candidates} (the sandbox binds only "
                       "/usr); install python3 from the system's packages or set sandbox.python")


def _user_processes(uid: int) -> int:
    count = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        count += int(line.split()[1]) == uid
                        break
        except OSError:
            continue  # the process ended while we looked
    return count


class Sandbox:
    """Runs programs under the limits of one `SandboxConfig`; safe to share between threads."""

    def __init__(self, cfg: SandboxConfig) -> None:
        self.cfg = cfg
        self.bwrap = shutil.which("bwrap")
        self.prlimit = shutil.which("prlimit")
        if not self.bwrap:
            raise SandboxError("bubblewrap is not installed (no 'bwrap' on PATH): apt-get install bubblewrap")
        if not self.prlimit:
            raise SandboxError("prlimit is not installed (util-linux): apt-get install util-linux")
        self.python = find_python(cfg.python)
        self.uid = NOBODY if os.geteuid() == 0 else os.geteuid()

    def _command(self, program: Path) -> list[str]:
        c = self.cfg
        nproc = _user_processes(self.uid) + c.processes
        limits = [f"--cpu={c.cpu_seconds}:{c.cpu_seconds + 1}", f"--as={c.memory_mb << 20}", f"--nproc={nproc}",
                  f"--fsize={int(c.file_size_mb * (1 << 20))}", f"--nofile={c.open_files}", "--core=0"]
        root = ["--ro-bind", "/usr", "/usr"]
        for link in ("bin", "lib", "lib64", "sbin"):
            if os.path.islink(f"/{link}"):
                root += ["--symlink", os.readlink(f"/{link}"), f"/{link}"]
            elif os.path.isdir(f"/{link}"):
                root += ["--ro-bind", f"/{link}", f"/{link}"]
        return [self.prlimit, *limits, "--", self.bwrap, *root,
                "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--dir", "/tmp/work", "--chdir", "/tmp/work",
                "--ro-bind", str(program), PROGRAM,
                "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
                "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp/work",
                "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONHASHSEED", "0",
                "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
                self.python, "-I", PROGRAM]

    def run(self, source: str, stdin: str) -> Run:
        with tempfile.TemporaryDirectory(prefix="stalwart-sandbox-") as tmp:
            os.chmod(tmp, 0o755)
            program = Path(tmp) / "program.py"
            program.write_text(source)
            program.chmod(0o644)
            with open(Path(tmp) / "stdout", "w+b") as out, open(Path(tmp) / "stderr", "w+b") as err:
                ids = {"user": self.uid, "group": self.uid, "extra_groups": []} if os.geteuid() == 0 else {}
                start = time.monotonic()
                proc = subprocess.Popen(self._command(program), stdin=subprocess.PIPE, stdout=out, stderr=err,
                                        start_new_session=True, **ids)
                try:
                    proc.communicate(stdin.encode(), timeout=self.cfg.wall_seconds)
                    code: int | None = proc.returncode
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    code = None
                except BrokenPipeError:  # exited before reading its input
                    code = proc.wait(timeout=self.cfg.wall_seconds)
                seconds = time.monotonic() - start
                out.seek(0)
                err.seek(max(0, os.fstat(err.fileno()).st_size - STDERR_TAIL))
                return Run(out.read().decode(errors="replace"), code, seconds,
                           err.read().decode(errors="replace"))

    def score(self, source: str, cases: list[Case]) -> Verdict:
        """reward = passed / total; a case passes when stdout, stripped, equals its output stripped.
        After a program runs out of time the remaining cases are not run (they count as failed).
        A program that does not parse fails every case without starting a sandbox: the host only
        parses its text (capped in length), it never runs any of it."""
        bad = syntax_error(source)
        if bad:
            return Verdict(0.0, 0, len(cases), bad)
        passed, first_failure = 0, ""
        for i, case in enumerate(cases):
            run = self.run(source, case.input)
            if run.returncode == 0 and run.stdout.strip() == case.output.strip():
                passed += 1
                continue
            if not first_failure:
                why = run.reason if run.reason != "ok" else "wrong answer"
                first_failure = f"case {i}: {why}"
            if run.out_of_time:
                first_failure += f" (cases {i + 1}-{len(cases) - 1} not run)" if i + 1 < len(cases) else ""
                break
        reason = "passed" if passed == len(cases) else first_failure
        return Verdict(passed / len(cases), passed, len(cases), reason)
