"""Process plumbing shared by training workers and serving replicas."""

from __future__ import annotations

import contextlib
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
