"""The broker's background work: one thread running periodic tasks until
the broker closes. Tasks must be quick and must not raise (errors are
logged and the task keeps its schedule)."""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time

from txmq.errors import InvalidArgumentError

log = logging.getLogger("txmq.scheduler")

# The shortest period a task may have. A period of 0 (or a negative, nan or
# infinitesimal one) would make the thread run its tasks back to back and
# hold a core for the broker's whole life.
MIN_INTERVAL = 0.01


class Scheduler:
    def __init__(self, name: str = "txmq-scheduler", clock=time.monotonic):
        self._clock = clock
        self._heap: list = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def every(self, interval: float, fn) -> None:
        """Run ``fn()`` every ``interval`` seconds (at least
        :data:`MIN_INTERVAL`, finite), first after one interval."""
        if (not isinstance(interval, (int, float)) or isinstance(interval, bool)
                or not MIN_INTERVAL <= interval < math.inf):
            raise InvalidArgumentError("interval", interval, f"finite seconds >= {MIN_INTERVAL:g}")
        with self._cond:
            heapq.heappush(self._heap, (self._clock() + interval, next(self._seq), interval, fn))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (not self._heap or self._heap[0][0] > self._clock()):
                    self._cond.wait(None if not self._heap else self._heap[0][0] - self._clock())
                if self._stopped:
                    return
                due, seq, interval, fn = heapq.heappop(self._heap)
                heapq.heappush(self._heap, (max(due + interval, self._clock()), seq, interval, fn))
            try:
                fn()
            except Exception:  # a failing task must not stop the others
                log.exception("txmq: background task %r failed", fn)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()
