"""`stalwart` commands for the tests, each forked from one interpreter that has already imported torch and
the trainer, instead of a fresh one importing them again (about 4.5 s of CPU per command on the 2-core
development machine, and the suite runs a few hundred commands).

Each xdist worker starts one server (``python tests/preloaded_cli.py SOCKET``) at its first command. The
server imports what ``stalwart.launch.fork.preload`` names (torch, its compiler stack, the trainer) and
the command-line modules, and nothing else: it runs no torch operation and starts no thread, so a fork
of it is a clean process, as the training launcher's forked workers are. For each command it forks a
handler, which forks the command's process (so the server never waits) and reports its pid and exit
status. The command's process is what ``python -m stalwart ARGS`` would be after its imports: standard
input from /dev/null, standard output and error on the caller's files, the caller's environment and
working directory, ``sys.argv`` and ``__main__`` as under ``-m``, non-daemon threads joined and atexit
handlers run before it exits with the command's status.

What a fresh process would see differently: modules already imported (``tests/test_cli_startup.py``,
which checks that a refusal happens before torch is imported, starts its own interpreters), and
settings read when a module is imported (the server's environment is ``cli_env()``, the environment of
every command). Tests that signal or watch a command while it runs start it with ``subprocess`` and are
not affected. ``STALWART_TEST_FRESH_CLI=1`` turns this off: every command is a new interpreter.
"""

from __future__ import annotations

import atexit
import json
import locale
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MAX_MESSAGE = 1 << 20


class PreloadedCli:
    """The client: one server per process that uses it, started on first use."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self.dir = tempfile.mkdtemp(prefix="stalwart-cli-")
        self.path = os.path.join(self.dir, "socket")
        self.server = subprocess.Popen([sys.executable, __file__, self.path], env=env, cwd=cwd,
                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                       stderr=open(os.path.join(self.dir, "server.log"), "wb"),
                                       start_new_session=True)
        atexit.register(self.close)

    def ready(self, timeout_s: float = 120.0) -> bool:
        """Whether the server is up (it is once it has imported everything and listens)."""
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self.path):
            if self.server.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def run(self, cmd: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        """``subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)`` for
        ``cmd = [python, -m, stalwart, ARGS...]``."""
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
                socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.connect(self.path)
            request = json.dumps({"argv": cmd[3:], "env": env, "cwd": str(cwd)}).encode()
            socket.send_fds(conn, [request], [out.fileno(), err.fileno()])
            pid = json.loads(conn.recv(MAX_MESSAGE))["pid"]
            conn.settimeout(timeout)
            try:
                returncode = json.loads(conn.recv(MAX_MESSAGE))["returncode"]
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)  # as subprocess.run does: the command's process, not its children
                conn.settimeout(None)
                conn.recv(MAX_MESSAGE)
                raise subprocess.TimeoutExpired(cmd, timeout, _text(out), _text(err)) from None
            return subprocess.CompletedProcess(cmd, returncode, _text(out), _text(err))

    def close(self) -> None:
        if self.server.poll() is None:
            os.killpg(self.server.pid, signal.SIGKILL)
            self.server.wait()
        for name in ("socket", "server.log"):
            with _quiet():
                os.unlink(os.path.join(self.dir, name))
        with _quiet():
            os.rmdir(self.dir)


def _quiet():
    import contextlib

    return contextlib.suppress(OSError)


def _text(f) -> str:
    """A captured stream as ``text=True`` decodes it (the locale's encoding, universal newlines)."""
    f.seek(0)
    return f.read().decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


# The server side: runs in its own interpreter (this file as a script).

def _serve(path: str) -> None:
    from stalwart.launch.fork import preload

    preload()
    import stalwart.cli  # noqa: F401  (the dispatcher; each command imports its own module when run)

    if len(os.listdir("/proc/self/task")) != 1:
        sys.exit("preloaded_cli: importing started a thread; forking this process would not be safe")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the client waits for this name: the server is ready
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # handlers are reaped by the kernel
    parent = os.getppid()
    listener.settimeout(1.0)
    while os.getppid() == parent:  # the test worker that started it is alive
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                _handle(conn)
            finally:
                os._exit(0)
        conn.close()


def _handle(conn: socket.socket) -> None:
    """Fork the command's process, tell the client its pid, wait for it and send its exit status."""
    conn.settimeout(None)
    message, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 2)
    request = json.loads(message)
    pid = os.fork()
    if pid == 0:
        conn.close()
        _become_the_command(request, fds)
    for fd in fds:
        os.close(fd)
    conn.send(json.dumps({"pid": pid}).encode())
    _, status = os.waitpid(pid, 0)
    conn.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())


def _become_the_command(request: dict, fds: list[int]) -> None:
    import runpy
    import threading

    stdin = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((stdin, 0), (fds[0], 1), (fds[1], 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]  # as `python -m` puts it
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["-m", *request["argv"]]  # run_module puts the module's file first, as `python -m` does
    code = 0
    try:
        runpy.run_module("stalwart", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = _exit_status(e.code)
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        threading._shutdown()  # as an interpreter does on exit: wait for non-daemon threads
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with _quiet():
                stream.flush()
    os._exit(code)


def _exit_status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # not this file's directory: as `python -m` puts it
    _serve(sys.argv[1])
