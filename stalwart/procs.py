"""Process plumbing shared by training workers and serving replicas."""

from __future__ import annotations

import contextlib
import os
import signal
import sys


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send this process ``sig`` when its parent exits, however the parent exits."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, sig, 0, 0, 0)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
