"""Run untrusted programs against test cases: bubblewrap for isolation, rlimits for resources.

A `bwrap` sandbox runs a batch of up to BATCH programs, one after another, each against all its cases:
new user, PID, network, IPC, UTS and cgroup namespaces (no network at all, no other process visible,
no further user namespace), the root file system made of read-only `/usr` (and its `/lib`, `/bin`
links) only, the programs and the trusted runner (`runner.py`) bound read-only, and
`--die-with-parent`. The only writable places are `/tmp` (the working directory is in it) and
`/dev/shm`, each a tmpfs of `sandbox.memory_mb`: files live in memory the address-space limit does not
see, so the mounts' size bounds them (the root and `/dev` are remounted read-only). Bubblewrap itself
starts with `ENV` as its whole environment, not the host's. `prlimit` caps CPU time, address space,
file size (which also caps stdout: it goes to a file) and open files; the runner caps processes. Run
as root, the sandbox drops to the unprivileged user `nobody` first, so the process limit binds (the
kernel does not count processes against root's limit).

The host sends the runner only the cases' inputs. The runner is the sandbox's PID 1 (no process in the
sandbox can signal it); it forks a program runner per program, which runs each case in a forked child
with its own wall-clock bound and CPU clock, and after each case every other process of the sandbox is
killed, /tmp and /dev/shm emptied and System V IPC objects removed, so a program finds nothing of
another case or of an earlier program. A seccomp filter (``KEYRING_FILTER``) refuses the kernel keyring
calls (``add_key``, ``request_key``, ``keyctl``: the user keyring is shared by every process of the
sandbox's user namespace, so one program could leave a key for the next) and every system call of another
ABI (i386, x32), which would reach them by other numbers. The runners report stdout, exit status and time per case; the
host compares with the expected outputs. The runners are non-dumpable and no child holds a report
pipe, so a program cannot forge another case's result; killing its program runner fails only its own
cases not yet reported. Starting a sandbox (namespaces, mounts, an interpreter) costs about twice
what running a short program's three cases does, so batching is most of the throughput.

What it does not stop: it shares the host kernel (a kernel exploit escapes it); CPU and memory
bandwidth are shared (a program can slow its neighbours within its CPU-time limit); a program sees
the inputs of its other cases and those of the other programs in its batch (never an expected
output); System V shared memory within a case is not bounded by `sandbox.memory_mb`; and on kernels
before 5.14 the process limit counts every process of the sandbox user, so there it is that user's
current count plus `sandbox.processes`.
"""

from __future__ import annotations

import ast
import os
import platform
import select
import shutil
import struct
import subprocess
import tempfile
import time
import warnings
import weakref
from pathlib import Path

from stalwart.config.sandbox import SandboxConfig
from stalwart.sandbox.warm import SandboxFull, WarmPool, WarmSandbox  # noqa: F401
from stalwart.sandbox.verdicts import (  # noqa: F401  (re-exported: the sandbox's API)
    STDERR_TAIL,
    Case,
    Run,
    SandboxError,
    Verdict,
    cases_from,
    parse_cases,
    parse_reports,
    runner_failure,
    verdict_of,
)

NOBODY = 65534
RUNNER = "/sandbox/runner.py"
RUNNER_SOURCE = Path(__file__).with_name("runner.py")
WORK = "/tmp/work"
MAX_SOURCE = 64 * 1024
# The environment of everything the sandbox starts, bubblewrap included, and of the programs.
ENV = {"PATH": "/usr/bin:/bin", "HOME": WORK, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
       "PYTHONDONTWRITEBYTECODE": "1"}
BWRAP_SIZE = (0, 8)  # the first bubblewrap with `--size` for a tmpfs
BATCH = 32  # programs one sandbox runs, one after another
BATCH_CPU_S = 60  # CPU-time limit of a batch's runner itself (each program runner gets sandbox.cpu_seconds)


def _dispose(pool: WarmPool, folder: Path) -> None:
    pool.close()
    shutil.rmtree(folder, ignore_errors=True)


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


def keyring_filter(machine: str) -> bytes | None:
    """A classic-BPF seccomp program (what ``bwrap --add-seccomp-fd`` reads) that fails ``add_key``,
    ``request_key`` and ``keyctl`` with EPERM, and every system call made through another ABI (i386's
    ``int 0x80``, x32's numbers) the same way; None on an architecture it does not know."""
    known = {"x86_64": (0xC000003E, (248, 249, 250), 0x40000000), "aarch64": (0xC00000B7, (217, 218, 219), None)}
    if machine not in known:
        return None
    arch, calls, x32 = known[machine]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, deny = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ALLOW; SECCOMP_RET_ERRNO | EPERM
    checks = ([(jge, x32)] if x32 else []) + [(jeq, n) for n in calls]
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, deny), (ld, 0, 0, 0)]  # seccomp_data.arch, .nr
    prog += [(op, len(checks) - i, 0, k) for i, (op, k) in enumerate(checks)]  # each jumps to the deny
    prog += [(ret, 0, 0, allow), (ret, 0, 0, deny)]
    return b"".join(struct.pack("<HBBI", *ins) for ins in prog)


KEYRING_FILTER = keyring_filter(platform.machine())


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
        self.choom = shutil.which("choom")  # util-linux too, but newer: without it the OOM score stays as it is
        # One folder for every sandbox of this object: the runner and the seccomp filter (programs come on stdin).
        self._folder = Path(tempfile.mkdtemp(prefix="stalwart-sandbox-"))
        os.chmod(self._folder, 0o711)  # the sandbox user reaches only the folder bound in
        (self._folder / "sandbox").mkdir(mode=0o755)
        (self._folder / "sandbox" / "runner.py").write_bytes(self.runner)
        (self._folder / "sandbox" / "runner.py").chmod(0o644)
        (self._folder / "seccomp").write_bytes(KEYRING_FILTER or b"")
        self.pool = WarmPool(self._launch, cfg.warm, cfg.reuse, cfg.max_sandboxes, cfg.memory_reserve_mb)
        weakref.finalize(self, _dispose, self.pool, self._folder)

    def close(self) -> None:
        """Stop the warm sandboxes (they also end with this process: --die-with-parent)."""
        _dispose(self.pool, self._folder)

    def _launch(self) -> tuple[list[str], dict[str, str], tuple[int, ...], object]:
        """A sandbox's command line, environment and descriptors (the pool starts it), and what closes them."""
        c = self.cfg
        # The runner's limit counts itself and the program runner besides the program's processes.
        nproc = c.processes + 2 if self.namespaced_nproc else _user_processes(self.uid) + c.processes
        if not KEYRING_FILTER:
            return self._command(self._folder / "sandbox", nproc), ENV, (), lambda: None
        fd = os.open(self._folder / "seccomp", os.O_RDONLY)  # one per start: bubblewrap reads it from its offset
        return self._command(self._folder / "sandbox", nproc, fd), ENV, (fd,), lambda: os.close(fd)

    def _command(self, folder: Path, nproc: int, seccomp_fd: int | None = None) -> list[str]:
        c = self.cfg
        # The runner's own CPU budget covers a batch; it gives each program runner c.cpu_seconds.
        limits = [f"--cpu={BATCH_CPU_S}:{BATCH_CPU_S + 1}", f"--as={c.memory_mb << 20}",
                  f"--fsize={int(c.file_size_mb * (1 << 20))}", f"--nofile={c.open_files}", "--core=0"]
        if not self.namespaced_nproc:
            limits.append(f"--nproc={nproc}")
        # Root drops to `nobody` through setpriv rather than Popen(user=...), which would rule out vfork
        # and copy the page tables of the (large) reward worker for every program.
        drop = [self.setpriv, f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups"] if self.setpriv else []
        # The OOM killer's first choice, before anything else of the host (set while still root: it only rises).
        drop = [self.choom, "-n", "1000", "--", *drop] if self.choom else drop
        tmpfs = str(c.memory_mb << 20)
        # Bubblewrap applies these in order: the read-only remounts come after every mount beneath.
        return [*drop, self.prlimit, *limits, "--", self.bwrap, *self._root,
                "--dev", "/dev", "--size", tmpfs, "--tmpfs", "/dev/shm", "--proc", "/proc",
                "--size", tmpfs, "--tmpfs", "/tmp", "--dir", WORK, "--chdir", WORK,
                "--ro-bind", str(folder), "/sandbox", "--remount-ro", "/dev", "--remount-ro", "/",
                "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
                "--as-pid-1", *(["--add-seccomp-fd", str(seccomp_fd)] if seccomp_fd is not None else []),
                "--clearenv", *(a for name, value in ENV.items() for a in ("--setenv", name, value)),
                self.python, "-I", RUNNER, str(nproc), str(c.cpu_seconds)]

    def execute_many(self, jobs: list[tuple[str, list[str]]]) -> list[tuple[list[Run], str]]:
        """Run each job (source, its cases' inputs), up to BATCH programs one after another in a
        sandbox. Per job: the runs its program runner reported, in order, and why it reported no more
        ('' when it reported every case or stopped after one ran out of time). If a sandbox ends early,
        the job in progress gets that failure and the jobs after it run in a fresh sandbox."""
        results: list[tuple[list[Run], str]] = []
        while len(results) < len(jobs):
            results += self._batch(jobs[len(results):len(results) + BATCH])
        return results

    def execute(self, source: str, inputs: list[str]) -> tuple[list[Run], str]:
        """Run `source` on each input in a sandbox of its own (see `execute_many`)."""
        return self.execute_many([(source, inputs)])[0]

    def _batch(self, jobs: list[tuple[str, list[str]]]) -> list[tuple[list[Run], str]]:
        """One warm sandbox for `jobs`: the result of each job its runner finished, and of the one in
        progress when it ended early (at least one result). SandboxFull if no sandbox may start."""
        c = self.cfg
        request = []
        for source, inputs in jobs:
            code = source.encode()
            request += [f"{len(inputs)} {c.wall_seconds!r} {len(code)}\n".encode(), code]
            for text in inputs:
                data = text.encode()
                request += [f"{len(data)}\n".encode(), data]
        body = b"".join(request)
        box = self.pool.take()
        clean, status = False, None
        try:
            data, ends, stop, status = self._collect(box.proc, f"{len(jobs)} {len(body)}\n".encode() + body,
                                                     [len(inputs) for _, inputs in jobs])
            clean = stop == "done"  # PID 1 killed and cleaned up after the request: the sandbox serves the next
        finally:
            if not clean:
                box.close()
            self.pool.give_back(box, clean)
        stderr = box.stderr_tail(STDERR_TAIL)
        results = []
        max_output = int(c.file_size_mb * (1 << 20))
        for i in range(min(len(ends) + 1, len(jobs))):
            n = len(jobs[i][1])
            runs, ok = parse_reports(bytes(data[i]), n, max_output)
            done = len(runs) == n or bool(runs and runs[-1].out_of_time)
            if i < len(ends):
                failure = "" if ok and done else runner_failure(ends[i], ok, stderr)
            elif stop == "malformed":
                failure = "malformed sandbox runner output"
            elif stop == "done":  # the request runner ended before this program did (a program killed it)
                failure = runner_failure(status, ok, stderr)
            else:  # the runner ended, or this program is past its allowance (None: a timeout)
                failure = runner_failure(None if stop == "timeout" else box.proc.returncode, ok, stderr)
            results.append((runs, failure))
        return results

    def _collect(self, proc: subprocess.Popen, request: bytes,
                 cases: list[int]) -> tuple[list[bytearray], list, str, int | None]:
        """Send the request and read the runner's frames until its `done` line ('done', with the request
        runner's exit status: every program ended, or the request runner was killed), the runner's output
        ends ('ended'), the program in progress is past its wall-clock allowance ('timeout') or a frame is
        malformed ('malformed'): each program's records, how each program runner that ended did (exit
        status, -signal, None: out of time), why the reading stopped, and the status `done` gave."""
        try:
            proc.stdin.write(request)
            proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            return [bytearray() for _ in cases], [], "ended", None
        limit = int(self.cfg.file_size_mb * (1 << 20)) + STDERR_TAIL + 200
        data = [bytearray() for _ in cases]
        ends: list[int | None] = []
        buf = bytearray()
        fd = proc.stdout.fileno()
        poll = select.poll()  # not select(): a host running a thousand sandboxes holds descriptors past 1024
        poll.register(fd, select.POLLIN)
        deadline = time.monotonic() + self.cfg.wall_seconds * cases[0] + 2.0
        while True:
            while True:  # every whole frame in buf
                nl = buf.find(b"\n", 0, 100)
                fields = bytes(buf[:nl]).split(b" ") if nl >= 0 else []
                i = len(ends)
                if fields[:1] == [b"done"] and len(fields) == 2 and fields[1].lstrip(b"-").isdigit():
                    return data, ends, "done", int(fields[1])
                if i < len(cases) and fields[:2] == [b"data", str(i).encode()] and len(fields) == 3 \
                        and fields[2].isdigit():
                    n = int(fields[2])
                    if len(data[i]) + n > limit * cases[i]:
                        return data, ends, "malformed", None
                    if len(buf) < nl + 1 + n:
                        break
                    data[i] += buf[nl + 1:nl + 1 + n]
                    del buf[:nl + 1 + n]
                elif i < len(cases) and fields[:2] == [b"end", str(i).encode()] and len(fields) == 4 \
                        and fields[2] in (b"exit", b"signal", b"timeout") and fields[3].isdigit():
                    number = int(fields[3])
                    ends.append({b"exit": number, b"signal": -number, b"timeout": None}[fields[2]])
                    del buf[:nl + 1]
                    # the next program's allowance; after the last, the runners' clean-up (kills, files)
                    left = self.cfg.wall_seconds * cases[len(ends)] if len(ends) < len(cases) else 0.0
                    deadline = time.monotonic() + left + 2.0
                elif nl >= 0 or len(buf) >= 100:
                    return data, ends, "malformed", None
                else:
                    break
            left = deadline - time.monotonic()
            if left <= 0:
                return data, ends, "timeout", None
            if not poll.poll(left * 1000):
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return data, ends, "ended", None
            buf += chunk

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
        return self.score_many([(source, cases)])[0]

    def score_many(self, jobs: list[tuple[str, list[Case]]]) -> list[Verdict]:
        """`score` of each (source, cases) job, in order, up to BATCH programs per sandbox (each
        program's cases as isolated from the other programs' as from each other)."""
        verdicts = [Verdict(0.0, 0, len(cases), syntax_error(source)) for source, cases in jobs]
        run = [i for i, v in enumerate(verdicts) if not v.reason]
        results = self.execute_many([(jobs[i][0], [c.input for c in jobs[i][1]]) for i in run])
        for i, (runs, failure) in zip(run, results):
            verdicts[i] = verdict_of(jobs[i][1], runs, failure)
        return verdicts


def score_spread(scorer, pool, jobs: list[tuple[str, list[Case]]], ways: int) -> list[Verdict]:
    """`scorer.score_many` of `jobs` dealt round-robin into `ways` parts run on `pool` (a local
    sandbox then starts one sandbox per part, not per program): the verdicts in the jobs' order."""
    parts = [jobs[k::ways] for k in range(ways) if jobs[k::ways]]
    verdicts: list[Verdict] = [None] * len(jobs)  # type: ignore[list-item]
    for k, got in enumerate(pool.map(scorer.score_many, parts)):
        verdicts[k::ways] = got
    return verdicts


