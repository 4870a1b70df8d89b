"""The trusted runner inside the reward sandbox: runs one program against each case's input, in order.

It is started by `stalwart.rl.sandbox` as `python3 -I /sandbox/runner.py` inside bubblewrap and uses
only the standard library (the sandbox holds no Stalwart). It never sees an expected output: the host
sends only the inputs, on stdin, framed as

    <n cases> <wall seconds> <process limit>\\n   then, per case:   <bytes>\\n<input bytes>

and it answers, on stdout, one record per case it ran, in order:

    case <i> exit|signal|timeout <code or signal number> <seconds> <stdout bytes> <stderr bytes>\\n
    <stdout><stderr tail>

For each case it forks a child that takes the input on fd 0 (a pipe), a fresh unnamed file in
/tmp/work as fd 1 (RLIMIT_FSIZE caps it) and another as fd 2, closes every other descriptor (so no
child holds the report pipe) and runs the program as `__main__` in that forked interpreter (see
`_run_program`). The child's wall clock is bounded; then every other process in the sandbox is
killed (`kill(-1)` in the PID namespace spares only this runner and bubblewrap's init), /tmp and
/dev/shm are emptied, and only then is the child's output read and the next case started. The runner
makes itself non-dumpable first, so no program can reach its memory or descriptors through /proc or
ptrace. After a case that ran out of time (wall clock or CPU) it stops: the host counts the rest as
not run.
"""

import ctypes
import fcntl
import os
import resource
import select
import sys
import time
from _signal import SIGKILL, SIGXCPU  # `signal` itself imports enum: slow

PROGRAM = "/sandbox/program.py"
WORK = "/tmp/work"
STDERR_TAIL = 400
PR_SET_DUMPABLE = 4
PIPE_MAX = 1 << 20


def _read_exactly(fd: int, n: int) -> bytes:
    parts, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("input ended early")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _read_line(fd: int) -> bytes:
    line = b""
    while not line.endswith(b"\n"):
        c = os.read(fd, 1)
        if not c:
            raise EOFError("input ended early")
        line += c
    return line


def read_request(fd: int) -> tuple[float, int, list[bytes]]:
    n, wall, nproc = _read_line(fd).split()
    inputs = [_read_exactly(fd, int(_read_line(fd))) for _ in range(int(n))]
    return float(wall), int(nproc), inputs


def _exit_status(code) -> int:
    """What `python3 program.py` exits with after `raise SystemExit(code)`."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except Exception:  # noqa: BLE001, S110  (the interpreter too ignores a failure to print it)
        pass
    return 1


def _run_program(code) -> int:
    """The program as `python3 -I program.py` would run it, in this forked interpreter: a fresh
    `__main__` module, sys.argv and the std streams on fds 0-2, SystemExit's status, an uncaught
    exception's traceback on stderr with status 1, then (as interpreter shutdown does) a join of
    non-daemon threads, atexit callbacks, and a flush of stdout (status 120 if that fails)."""
    import builtins

    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        old = getattr(sys, "__" + name + "__")  # as this interpreter set it up: encoding, error handler
        stream = open(fd, "r" if fd == 0 else "w", encoding=old.encoding, errors=old.errors,  # noqa: SIM115
                      closefd=False, newline=None if fd == 0 else "\n", buffering=-1)
        if fd == 2:
            stream.reconfigure(line_buffering=True)
        setattr(sys, name, stream)
        setattr(sys, "__" + name + "__", stream)
    main = type(sys)("__main__")
    main.__file__ = PROGRAM
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    sys.argv = [PROGRAM]
    try:
        if isinstance(code, BaseException):
            raise code
        exec(code, main.__dict__)  # noqa: S102  (the untrusted program, inside the sandbox)
        status = 0
    except SystemExit as e:
        status = _exit_status(e.code)
    except BaseException:  # noqa: BLE001  (what the interpreter does with an uncaught exception)
        sys.excepthook(*sys.exc_info())
        status = 1
    try:
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()
        import atexit
        atexit._run_exitfuncs()
    except SystemExit as e:
        status = _exit_status(e.code)
    except BaseException:  # noqa: BLE001
        sys.excepthook(*sys.exc_info())
    try:
        sys.stdout.flush()
    except BaseException:  # noqa: BLE001
        status = status or 120
    try:
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001, S110
        pass
    return status


def _child(fds: tuple[int, int, int], code) -> None:
    status = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        status = _run_program(code)
    finally:
        os._exit(status)


def kill_others(deadline: float) -> None:
    """SIGKILL every process this runner may signal but itself and init, until none is left (killed
    ones stay listed until init reaps them). One pass already dooms every process: a fork racing it
    either finishes first and its child is signalled too, or is abandoned by the killed parent."""
    while True:
        try:
            os.kill(-1, SIGKILL)
        except ProcessLookupError:
            return
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        if time.monotonic() > deadline:
            return
        time.sleep(0.001)


def _empty(path: str) -> None:
    try:
        entries = list(os.scandir(path))
    except OSError:
        return
    for e in entries:
        try:
            if e.is_dir(follow_symlinks=False):
                os.chmod(e.path, 0o700)
                _empty(e.path)
                os.rmdir(e.path)
            else:
                os.unlink(e.path)
        except OSError:
            pass


def _tail(fd: int, limit: int) -> bytes:
    size = os.fstat(fd).st_size
    return os.pread(fd, min(size, limit), max(0, size - limit))


def run_case(code, data: bytes, wall: float) -> tuple[str, int, float, bytes, bytes]:
    out = os.open(WORK, os.O_TMPFILE | os.O_RDWR, 0o600)
    err = os.open(WORK, os.O_TMPFILE | os.O_RDWR, 0o600)
    r, w = os.pipe()
    if data:
        try:
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, min(PIPE_MAX, max(4096, len(data))))
        except OSError:
            pass
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child((r, out, err), code)
    os.close(r)
    os.set_blocking(w, False)
    pidfd = os.pidfd_open(pid)
    poll = select.poll()
    poll.register(pidfd, select.POLLIN)
    sent = 0
    if data:
        poll.register(w, select.POLLOUT)
    else:
        os.close(w)
        w = -1
    deadline = start + wall
    status = None
    while status is None:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        for fd, _ in poll.poll(left * 1000):
            if fd == w:
                try:
                    sent += os.write(w, data[sent:sent + PIPE_MAX])
                except BlockingIOError:
                    continue
                except OSError:  # the program closed its stdin
                    sent = len(data)
                if sent >= len(data):
                    poll.unregister(w)
                    os.close(w)
                    w = -1
            elif fd == pidfd:
                status = os.waitpid(pid, 0)[1]
    seconds = time.monotonic() - start
    kill_others(time.monotonic() + 1.0)
    if status is None:  # out of time: killed above, and often reaped there too (it reaps what it can)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    for fd in (w, pidfd):
        if fd >= 0:
            os.close(fd)
    _empty("/tmp")
    _empty("/dev/shm")
    os.makedirs(WORK, exist_ok=True)
    stdout = os.pread(out, os.fstat(out).st_size, 0)
    stderr = _tail(err, STDERR_TAIL)
    os.close(out)
    os.close(err)
    if status is None:
        return "timeout", 0, seconds, stdout, stderr
    if os.WIFSIGNALED(status):
        return "signal", os.WTERMSIG(status), seconds, stdout, stderr
    return "exit", os.WEXITSTATUS(status), seconds, stdout, stderr


def main() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        os.write(2, b"runner: cannot make itself non-dumpable\n")
        return 3
    wall, nproc, inputs = read_request(0)
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    with open(PROGRAM, "rb") as f:
        source = f.read()
    try:
        code = compile(source, PROGRAM, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as e:
        code = e  # raised in each case's child, reported on its stderr like the interpreter would
    for i, data in enumerate(inputs):
        kind, number, seconds, stdout, stderr = run_case(code, data, wall)
        head = f"case {i} {kind} {number} {seconds:.6f} {len(stdout)} {len(stderr)}\n".encode()
        _write_all(1, head + stdout + stderr)
        if kind == "timeout" or (kind == "signal" and number == SIGXCPU):
            break
    return 0


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


if __name__ == "__main__":
    sys.exit(main())
