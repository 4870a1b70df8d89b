"""A delay line for emulated links where the kernel has no ``netem``: every packet held ``delay_ms``.

``python -m stalwart.comm.delayline DEV DELAY_MS`` attaches to the TUN device ``DEV`` (created
beforehand with ``ip tuntap add DEV mode tun``) in the current network namespace and writes every
packet it reads back into the same device ``DELAY_MS`` after it arrived. The emulated cluster
(:mod:`stalwart.comm.netns`) routes every packet between two hosts through that device (policy routing
in its switch namespace: packets from a host port go to the TUN device, packets from the TUN device
to their destination port), so the one-way latency between hosts grows by ``DELAY_MS`` for every
protocol, gloo included, and the link's token buckets still shape the bandwidth.

A constant delay keeps the packets' order, so the line is one FIFO: a reader thread stamps each
packet with its release time, a writer sleeps until the head's time and writes it. It prints
``ready`` once attached, and ``<packets> <bytes>`` it carried when terminated (SIGTERM).
"""

from __future__ import annotations

import collections
import fcntl
import os
import signal
import struct
import sys
import threading
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000


def open_tun(dev: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", dev.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def run(dev: str, delay_s: float, ready: threading.Event | None = None) -> None:
    fd = open_tun(dev)
    line: collections.deque[tuple[float, bytes]] = collections.deque()
    cond = threading.Condition()
    counts = [0, 0]
    stop = threading.Event()

    def writer() -> None:
        while not stop.is_set():
            with cond:
                while not line and not stop.is_set():
                    cond.wait(0.5)
                if stop.is_set():
                    return
                due, pkt = line[0]
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            with cond:
                line.popleft()
            os.write(fd, pkt)

    threading.Thread(target=writer, daemon=True, name="delayline-writer").start()

    def finish(*_: object) -> None:
        stop.set()
        sys.stdout.write(f"{counts[0]} {counts[1]}\n")
        sys.stdout.flush()
        os._exit(0)

    signal.signal(signal.SIGTERM, finish)
    if ready is not None:
        ready.set()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        pkt = os.read(fd, 65536 + 64)
        due = time.monotonic() + delay_s
        with cond:
            line.append((due, pkt))
            counts[0] += 1
            counts[1] += len(pkt)
            cond.notify()


if __name__ == "__main__":
    run(sys.argv[1], float(sys.argv[2]) / 1000.0)
