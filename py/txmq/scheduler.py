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
        :data:`MIN_INTERVAL`, finite), first after one interval: an
        :meth:`on_demand` task that never goes to sleep."""
        _check_interval(interval)
        OnDemand(self, interval, fn, periodic=True).arm()

    def on_demand(self, interval: float, fn) -> OnDemand:
        """A task that sleeps until armed: ``arm()`` of the returned
        :class:`OnDemand` runs ``fn()`` one ``interval`` later, and again
        every ``interval`` while ``fn()`` returns true. A false return puts
        it back to sleep until the next ``arm()``; one made while ``fn``
        runs is kept. For work that exists only now and then (the linger
        timer of open batches): a thread woken for nothing has to take the
        GIL back from the threads doing the work."""
        _check_interval(interval)
        return OnDemand(self, interval, fn)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (not self._heap or self._heap[0][0] > self._clock()):
                    self._cond.wait(None if not self._heap else self._heap[0][0] - self._clock())
                if self._stopped:
                    return
                due, _, task = heapq.heappop(self._heap)
                task.armed = False      # (an arm() from here on schedules it again)
            task.run(due)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()


class OnDemand:
    """A task of :meth:`Scheduler.on_demand`."""

    def __init__(self, scheduler: Scheduler, interval: float, fn, periodic: bool = False):
        self._scheduler = scheduler
        self.interval = interval
        self.fn = fn
        self.periodic = periodic   # (Scheduler.every: runs again whatever fn returns)
        self.armed = False       # scheduled (read without the lock: arm()'s fast path)

    def arm(self) -> None:
        """Run the task one interval from now, unless it is scheduled
        already (then this costs one attribute read)."""
        if self.armed:
            return
        self._schedule(None)

    def _schedule(self, due) -> None:
        s = self._scheduler
        with s._cond:
            if self.armed or s._stopped:
                return
            self.armed = True
            now = s._clock()
            at = now + self.interval if due is None else max(due + self.interval, now)
            heapq.heappush(s._heap, (at, next(s._seq), self))
            s._cond.notify()

    def run(self, due: float) -> None:
        """(The scheduler's thread.) Run the task; again one interval
        after ``due`` while it returns true."""
        try:
            again = self.fn() or self.periodic
        except Exception:   # a failing task keeps its schedule and must not stop the others
            log.exception("txmq: background task %r failed", self.fn)
            again = True
        if again:
            self._schedule(due)


def _check_interval(interval) -> None:
    if (not isinstance(interval, (int, float)) or isinstance(interval, bool)
            or not MIN_INTERVAL <= interval < math.inf):
        raise InvalidArgumentError("interval", interval, f"finite seconds >= {MIN_INTERVAL:g}")
