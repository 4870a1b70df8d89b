"""Run an untrusted program against test cases: bubblewrap for isolation, rlimits for resources.

Each program gets one `bwrap` sandbox for all its cases: new user, PID, network, IPC, UTS and cgroup
namespaces (no network at all, no other process visible, no further user namespace), the root file
system made of read-only `/usr` (and its `/lib`, `/bin` links) only, the program and the trusted
runner (`sandbox_runner.py`) bound read-only, and `--die-with-parent`. The only writable places are
`/tmp` (the working directory is in it) and `/dev/shm`, each a fresh tmpfs of `sandbox.memory_mb`:
files live in memory the address-space limit does not see, so the mounts' size bounds them (the root
and `/dev` are remounted read-only). Bubblewrap itself starts with `ENV` as its whole environment,
not the host's: it is the sandbox's PID 1, whose /proc/1/environ any program may read. `prlimit` caps
CPU time, address space, file size (which also caps stdout: it goes to a file) and open files; the
runner caps processes. Run as root, the sandbox drops to the unprivileged user `nobody` first, so the
process limit binds (the kernel does not count processes against root's limit).

The host sends the runner only the cases' inputs. The runner runs each case in a forked child with
its own wall-clock bound and CPU clock, kills every other process of the sandbox after it, and
reports stdout, exit status and time per case; the host compares with the expected outputs. The
runner is non-dumpable and no child holds its report pipe, so a program cannot forge another case's
result; killing the runner only fails the cases not yet reported.

What it does not stop: it shares the host kernel (a kernel exploit escapes it); CPU and memory
bandwidth are shared (a program can slow its neighbours within its CPU-time limit); a program sees
the inputs of its other cases (never their expected outputs); System V shared memory of the sandbox's
IPC namespace is not bounded by `sandbox.memory_mb`; and on kernels before 5.14 the process
limit counts every process of the sandbox user, so there it is that user's current count plus
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
import warnings
from dataclasses import dataclass
from pathlib import Path

from stalwart.config.rl import SandboxConfig
from stalwart.errors import UserError

NOBODY = 65534
RUNNER = "/sandbox/runner.py"
RUNNER_SOURCE = Path(__file__).with_name("sandbox_runner.py")
WORK = "/tmp/work"
STDERR_TAIL = 400
MAX_SOURCE = 64 * 1024
# The environment of everything the sandbox starts, bubblewrap included, and of the programs.
ENV = {"PATH": "/usr/bin:/bin", "HOME": WORK, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
       "PYTHONDONTWRITEBYTECODE": "1"}
BWRAP_SIZE = (0, 8)  # the first bubblewrap with `--size` for a tmpfs


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


def _bwrap_version(bwrap: str) -> tuple[int, ...]:
    """bubblewrap's version, e.g. (0, 8, 0); () if it does not say."""
    try:
        out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, env=ENV, timeout=10).stdout
        return tuple(int(x) for x in out.split()[-1].split("."))
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return ()


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


def _namespaced_nproc() -> bool:
    """Since Linux 5.14 RLIMIT_NPROC counts a user's processes per user namespace (and checks the
    namespace's creator against its own limit): a limit set inside the sandbox bounds the sandbox
    alone, whatever else that user runs on the host."""
    release = os.uname().release.split("-")[0].split(".")
    try:
        return (int(release[0]), int(release[1])) >= (5, 14)
    except (IndexError, ValueError):
        return False


def parse_reports(data: bytes, total: int, max_output: int) -> tuple[list[Run], bool]:
    """The runner's records (see sandbox_runner.py), in case order, up to the first one that is
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


def _runner_failure(code: int | None, parsed_ok: bool, stderr: str) -> str:
    """Why the runner reported no more cases."""
    if code is None:
        return "sandbox wall-clock limit (the whole run)"
    if code < 0 or 128 < code < 128 + 65:
        return f"sandbox runner killed by {signal.Signals(-code if code < 0 else code - 128).name}"
    if code != 0:
        last = stderr.strip().splitlines()[-1:] or [""]
        return f"sandbox runner failed (exit status {code}{': ' + last[0][:160] if last[0] else ''})"
    return "sandbox runner output ended early" if parsed_ok else "malformed sandbox runner output"


class Sandbox:
    """Runs programs under the limits of one `SandboxConfig`; safe to share between threads."""

    def __init__(self, cfg: SandboxConfig) -> None:
        self.cfg = cfg
        self.bwrap = shutil.which("bwrap")
        self.prlimit = shutil.which("prlimit")
        if not self.bwrap:
            raise SandboxError("bubblewrap is not installed (no 'bwrap' on PATH): apt-get install bubblewrap")
        version = _bwrap_version(self.bwrap)
        if version < BWRAP_SIZE:
            found = ".".join(map(str, version)) or "an unknown version"
            raise SandboxError(f"{self.bwrap} is {found}; the sandbox needs bubblewrap 0.8.0 or later, whose "
                               "--size bounds the memory its /tmp and /dev/shm hold")
        self.setpriv = shutil.which("setpriv") if os.geteuid() == 0 else ""
        if not self.prlimit or self.setpriv is None:
            raise SandboxError("prlimit or setpriv is not installed (util-linux): apt-get install util-linux")
        self.python = find_python(cfg.python)
        self.uid = NOBODY if os.geteuid() == 0 else os.geteuid()
        self.runner = RUNNER_SOURCE.read_bytes()
        self.namespaced_nproc = _namespaced_nproc()
        root = ["--ro-bind", "/usr", "/usr"]
        for link in ("bin", "lib", "lib64", "sbin"):
            if os.path.islink(f"/{link}"):
                root += ["--symlink", os.readlink(f"/{link}"), f"/{link}"]
            elif os.path.isdir(f"/{link}"):
                root += ["--ro-bind", f"/{link}", f"/{link}"]
        self._root = root

    def _command(self, folder: Path, nproc: int) -> list[str]:
        c = self.cfg
        limits = [f"--cpu={c.cpu_seconds}:{c.cpu_seconds + 1}", f"--as={c.memory_mb << 20}",
                  f"--fsize={int(c.file_size_mb * (1 << 20))}", f"--nofile={c.open_files}", "--core=0"]
        if not self.namespaced_nproc:
            limits.append(f"--nproc={nproc}")
        # Root drops to `nobody` through setpriv rather than Popen(user=...), which would rule out vfork
        # and copy the page tables of the (large) reward worker for every program.
        drop = [self.setpriv, f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups"] if self.setpriv else []
        tmpfs = str(c.memory_mb << 20)
        # Bubblewrap applies these in order: the read-only remounts come after every mount beneath.
        return [*drop, self.prlimit, *limits, "--", self.bwrap, *self._root,
                "--dev", "/dev", "--size", tmpfs, "--tmpfs", "/dev/shm", "--proc", "/proc",
                "--size", tmpfs, "--tmpfs", "/tmp", "--dir", WORK, "--chdir", WORK,
                "--ro-bind", str(folder), "/sandbox", "--remount-ro", "/dev", "--remount-ro", "/",
                "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
                "--clearenv", *(a for name, value in ENV.items() for a in ("--setenv", name, value)),
                self.python, "-I", RUNNER]

    def execute(self, source: str, inputs: list[str]) -> tuple[list[Run], str]:
        """Run `source` on each input in one sandbox: the runs the runner reported, in order, and why
        it reported no more ('' when it reported every case or stopped after one ran out of time)."""
        c = self.cfg
        # The runner's own limit counts bubblewrap's init and itself besides the program's processes.
        nproc = c.processes + 2 if self.namespaced_nproc else _user_processes(self.uid) + c.processes
        request = [f"{len(inputs)} {c.wall_seconds!r} {nproc}\n".encode()]
        for text in inputs:
            data = text.encode()
            request += [f"{len(data)}\n".encode(), data]
        with tempfile.TemporaryDirectory(prefix="stalwart-sandbox-") as tmp:
            os.chmod(tmp, 0o711)  # the sandbox user reaches only the folder bound in
            folder = Path(tmp) / "sandbox"
            folder.mkdir(mode=0o755)
            (folder / "program.py").write_text(source)
            (folder / "runner.py").write_bytes(self.runner)
            for f in folder.iterdir():
                f.chmod(0o644)
            with open(Path(tmp) / "stderr", "w+b") as err:
                proc = subprocess.Popen(self._command(folder, nproc), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=err, env=ENV, start_new_session=True)
                try:
                    out, _ = proc.communicate(b"".join(request), timeout=c.wall_seconds * len(inputs) + 2.0)
                    code: int | None = proc.returncode
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    out, _ = proc.communicate()
                    code = None
                err.seek(max(0, os.fstat(err.fileno()).st_size - STDERR_TAIL))
                stderr = err.read().decode(errors="replace")
        runs, ok = parse_reports(out, len(inputs), int(c.file_size_mb * (1 << 20)))
        done = len(runs) == len(inputs) or (runs and runs[-1].out_of_time)
        return runs, "" if ok and done else _runner_failure(code, ok, stderr)

    def run(self, source: str, stdin: str) -> Run:
        """One execution of `source` on `stdin` (a sandbox of its own)."""
        runs, failure = self.execute(source, [stdin])
        return runs[0] if runs else Run("", None, 0.0, "", failure)

    def score(self, source: str, cases: list[Case]) -> Verdict:
        """reward = passed / total; a case passes when stdout, stripped, equals its output stripped.
        All cases run in one sandbox, one after another; after a program runs out of time the
        remaining cases are not run (they count as failed), and so are those the runner did not
        report (killed, or the whole sandbox out of time). A program that does not parse fails every
        case without starting a sandbox: the host only parses its text (capped in length), it never
        runs any of it. Expected outputs never enter the sandbox."""
        bad = syntax_error(source)
        if bad:
            return Verdict(0.0, 0, len(cases), bad)
        runs, failure = self.execute(source, [c.input for c in cases])
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
