"""What a command line checks before anything imports torch: the device names a ``device`` setting takes,
whether a launcher (torchrun, or Stalwart's elastic agent) started this process, and a free port for a
store that a process started later will serve.

Nothing here imports torch, so a command refuses a bad flag in a fraction of a second
(``tests/test_cli_startup.py``); ``stalwart.runtime.device`` and ``stalwart.runtime.group`` re-export them.
"""

from __future__ import annotations

import os
import random
import socket

DEVICES = ("auto", "cpu", "cuda")
LOOPBACK = "127.0.0.1"  # where a single-host job's stores and sockets listen


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


EPHEMERAL_PORTS = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_PORT = 10000  # below it: the well-known and registered services a machine may start later


def _lowest_ephemeral_port() -> int:
    try:
        with open(EPHEMERAL_PORTS) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "") -> int:
    """A port nothing listens on at ``host`` (every interface when empty), for a store that a process
    started later binds (rank 0 of a job, seconds later, once torch has loaded).

    The port is drawn at random below the kernel's ephemeral range: the port of every connection any
    process opens meanwhile, and of every ``bind(host, 0)``, comes from that range, so none of them can
    take it in between (a port from ``bind(0)`` is in it, and under load one was taken: rank 0 then
    failed with "address already in use"). Only the ephemeral range is left where the range below is
    too small."""
    low = _lowest_ephemeral_port()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    rng = random.SystemRandom()
    candidates = [rng.randrange(LOWEST_PORT, low) for _ in range(64)] if low - LOWEST_PORT >= 1024 else []
    for port in [*candidates, 0]:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError(f"no free port on {host or 'any interface'}")
