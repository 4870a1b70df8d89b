"""`stalwart` commands for the tests, each forked from one interpreter that has already imported torch and
the trainer, instead of a fresh one importing them again (about 4.5 s of CPU per command on the 2-core
development machine, and the suite runs a few hundred commands).

Each xdist worker starts one server (``python tests/preloaded_cli.py SOCKET``) at its first command. The
server imports what ``stalwart.launch.fork.preload`` names (torch, its compiler stack, the trainer, the replica) and
the command-line modules, and nothing else: it runs no torch operation and starts no thread, so a fork
of it is a clean process, as the training launcher's forked workers are. For each command it forks a
handler, which forks the command's process (so the server never waits), tells the client its pid
and, when it ends, its exit status. The command's process is what ``python -m stalwart ARGS`` would be
after its imports: the caller's standard streams, environment, working directory, session or process
group and umask, ``sys.argv`` and ``__main__`` as under ``-m``, non-daemon threads joined and atexit
handlers run before it exits with the command's status. The client is ``subprocess.Popen`` itself
(pipes, signals, ``communicate``) with the exit status read from the handler instead of ``waitpid``.

What a fresh process would see differently: modules already imported (``tests/test_cli_startup.py``,
which checks that a refusal happens before torch is imported, starts its own interpreters), and
settings read when a module is imported (the server's environment is ``cli_env()``, the environment of
every command). Tests that signal or watch a command while it runs start it with ``subprocess`` and are
not affected. ``STALWART_TEST_FRESH_CLI=1`` turns this off: every command is a new interpreter.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MAX_MESSAGE = 1 << 20


class PreloadedCli:
    """The client: one server per process that uses it, started on first use."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self.dir = tempfile.mkdtemp(prefix="stalwart-cli-")
        self.path = os.path.join(self.dir, "socket")
        with open(os.path.join(self.dir, "server.log"), "wb") as log:
            self.server = subprocess.Popen([sys.executable, __file__, self.path], env=env, cwd=cwd,
                                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
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

    def popen(self, cmd: list[str], **kwargs) -> subprocess.Popen:
        """``subprocess.Popen(cmd, **kwargs)`` for ``cmd = [python, -m, stalwart, ARGS...]``."""
        return _Forked(self.path, cmd, **kwargs)

    def close(self) -> None:
        if self.server.poll() is None:
            os.killpg(self.server.pid, signal.SIGKILL)
            self.server.wait()
        for name in ("socket", "server.log"):
            with _quiet():
                os.unlink(os.path.join(self.dir, name))
        with _quiet():
            os.rmdir(self.dir)


class _Forked(subprocess.Popen):
    """A ``subprocess.Popen`` whose process the server forks: the pipes, signals, ``poll``, ``wait`` and
    ``communicate`` are Popen's own; the process is not this one's child, so its exit status comes from
    the server's handler (which waits for it) instead of ``waitpid``."""

    def __init__(self, socket_path: str, cmd: list[str], **kwargs) -> None:
        self._socket_path, self._status_lock = socket_path, threading.Lock()
        super().__init__(cmd, **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, process_group=-1):
        if preexec_fn is not None or pass_fds or shell or executable or uid is not None or gid is not None:
            raise ValueError("a preloaded stalwart command takes no preexec_fn, pass_fds, shell, user or group")
        fds = [fd if fd != -1 else std for fd, std in ((p2cread, 0), (c2pwrite, 1), (errwrite, 2))]
        request = {"argv": list(args)[3:], "env": dict(os.environ if env is None else env),
                   "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
                   "session": bool(start_new_session), "group": process_group, "umask": umask}
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._conn.connect(self._socket_path)
            socket.send_fds(self._conn, [json.dumps(request).encode()], fds)
            self.pid = json.loads(self._conn.recv(MAX_MESSAGE))["pid"]
            self._child_created = True
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)  # and a /dev/null

    def _status(self, timeout: float | None) -> int | None:
        self._conn.settimeout(timeout)
        try:
            message = self._conn.recv(MAX_MESSAGE)
        except (TimeoutError, BlockingIOError):
            return None
        self._conn.close()
        # an empty message: the handler died without an answer (the server was killed), as a SIGKILL
        return json.loads(message)["returncode"] if message else -signal.SIGKILL

    def _internal_poll(self, _deadstate=None, **_):
        if self.returncode is None and self._status_lock.acquire(False):
            try:
                if self.returncode is None:
                    self.returncode = self._status(0)
            finally:
                self._status_lock.release()
        return self.returncode

    def _wait(self, timeout):
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._status_lock:
            if self.returncode is None:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                self.returncode = self._status(left)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


def run(start, timeout: float) -> subprocess.CompletedProcess:
    """What ``subprocess.run(..., capture_output=True, text=True, timeout=timeout)`` does, for the process
    ``start(**popen_options)`` starts (``subprocess.Popen`` or a server's)."""
    with start(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            proc.kill()  # as subprocess.run does: the command's process, not its children
            e.output, e.stderr = proc.communicate()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _quiet():
    import contextlib

    return contextlib.suppress(OSError)


# The server side: runs in its own interpreter (this file as a script).

def _serve(path: str) -> None:
    from stalwart.launch.fork import WORKERS, preload

    for module in WORKERS:  # what a training launcher and a replica's launcher import before they fork
        preload(module)
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
    message, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
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

    for target, fd in enumerate(fds):  # standard input, output and error as the caller gave them
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    if request["session"]:
        os.setsid()
    elif request["group"] is not None and request["group"] >= 0:
        os.setpgid(0, request["group"])
    if request["umask"] >= 0:
        os.umask(request["umask"])
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
