"""Build numbered items ahead of use on one background thread, so the consumer does not wait on I/O.

``get(i)`` returns ``build(i)``: items are produced in order from the last index asked for, at most
``depth`` ahead. Asking for an index out of order (after a resume) restarts production there. The
result does not depend on timing, only on ``build``. ``close`` stops the thread; an error raised by
``build`` is raised again by ``get``.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Prefetcher(Generic[T]):
    def __init__(self, build: Callable[[int], T], depth: int = 2) -> None:
        self.build, self.depth = build, max(1, depth)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=self.depth)
        self._next = -1  # the index the queue's head holds

    def _run(self, start: int, stop: threading.Event, out: queue.Queue) -> None:
        i = start
        while not stop.is_set():
            try:
                item = (i, self.build(i), None)
            except BaseException as e:  # handed to the consumer, which raises it
                item = (i, None, e)
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return
            i += 1

    def _restart(self, start: int) -> None:
        self.close()
        self._stop, self._queue = threading.Event(), queue.Queue(maxsize=self.depth)
        self._thread = threading.Thread(target=self._run, args=(start, self._stop, self._queue),
                                        name="stalwart-data-prefetch", daemon=True)
        self._thread.start()
        self._next = start

    def get(self, i: int) -> T:
        if self._thread is None or i != self._next:
            self._restart(i)
        index, item, error = self._queue.get()
        assert index == i, (index, i)
        self._next = i + 1
        if error is not None:
            self._thread = None  # the thread has ended; the next get starts afresh
            raise error
        return item

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
