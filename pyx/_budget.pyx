# cython: language_level=3, boundscheck=False, wraparound=False
"""Open descriptors as a budget: at most ``limit`` items (segments, with
their mapping, or redo logs) hold one at once, across every owner that
opens them through the same :class:`Budget`.

Opening one more parks the least recently used idle item (CLOCK: each use
sets the item's ``recent`` bit; the hand clears it once before parking). An
item in use (``users`` > 0) is skipped, so a budget whose every item is in
use runs over until one is released. An item reopens itself on its next
use. Thread-safe: between the check of an item's users and its parking
nothing releases the GIL (this module is compiled), so a thread that starts
using it either saw it open (and is counted in users, so it is skipped) or
sees it parked (and reopens it).
"""

import resource
import threading
import weakref


cdef class Budgeted:
    """What a :class:`Budget` keeps: an item with a descriptor to close
    (:meth:`park`) while nothing uses it. Subclasses set ``users`` and
    ``recent`` on every use and call :meth:`Budget.admit` when they open
    (or reopen) and :meth:`Budget.leave` when they close for good."""

    def __cinit__(self, *args, **kwargs):
        self.slot = -1
        self.recent = True

    cpdef park(self):
        """Close the descriptor (the budget's call, with no use in progress)."""
        raise NotImplementedError


cdef class Budget:
    """At most ``limit`` :class:`Budgeted` items (``what``: how they are
    named in messages and stats) hold a descriptor at once."""

    def __init__(self, Py_ssize_t limit, str what="items"):
        if limit < 1:
            raise ValueError(f"a budget of {limit} open {what}")
        self.limit = limit
        self.what = what
        self.ring = []
        self.free_slots = []
        self.lock = threading.Lock()

    cpdef admit(self, Budgeted item):
        """Count ``item`` (just opened, in use) and park others if over."""
        cdef Py_ssize_t slot
        with self.lock:
            if self.free_slots:
                slot = self.free_slots.pop()
                self.ring[slot] = weakref.ref(item)
            else:
                slot = len(self.ring)
                self.ring.append(weakref.ref(item))
            item.slot = slot
            self.open_count += 1
            self.opened += 1
            self._shrink()

    cpdef leave(self, Budgeted item):
        """``item`` closed for good: its slot is free."""
        with self.lock:
            if item.slot >= 0:
                self._free(item.slot)
                item.slot = -1

    cdef void _free(self, Py_ssize_t slot):
        self.ring[slot] = None
        self.free_slots.append(slot)
        self.open_count -= 1

    cdef int _shrink(self) except -1:
        # Lock held (module docstring: why no use starts in between).
        cdef Py_ssize_t steps = 0, n = len(self.ring)
        cdef Budgeted item
        while self.open_count > self.limit and steps <= 2 * n + 1:
            steps += 1
            self.hand = (self.hand + 1) % n
            ref = self.ring[self.hand]
            if ref is None:
                continue
            obj = ref()
            if obj is None:                 # freed without closing: its descriptor went with it
                self._free(self.hand)
                continue
            item = <Budgeted>obj
            if item.users > 0:
                continue
            if item.recent:
                item.recent = False
                continue
            self._free(self.hand)
            item.slot = -1
            item.park()
            self.parked += 1
        return 0

    def stats(self) -> dict:
        return {"limit": self.limit, "open": self.open_count, "opened": self.opened, "parked": self.parked}


# -- the two budgets a process shares by default -------------------------------------

def _soft_limit():
    """The soft ``RLIMIT_NOFILE`` (an unlimited one counts as 2**20)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 20 if soft == resource.RLIM_INFINITY or soft > 1 << 20 else soft


def default_open_files():
    """The segments a process keeps open by default: half its descriptor
    limit, leaving the rest to sockets, logs and the application, and at
    most a quarter of ``vm.max_map_count`` (each open segment is one
    mapping); at least 16."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            maps = int(f.read())
    except (OSError, ValueError):
        maps = 65530
    return max(16, min(_soft_limit() // 2, maps // 4))


def default_open_logs():
    """The redo logs a process keeps open by default: a quarter of its
    descriptor limit (segments take half), at least 16."""
    return max(16, _soft_limit() // 4)


class SegmentBudget(Budget):
    """At most ``limit`` segments open at once (one descriptor and one
    mapping each), across every log that opens its segments through it."""

    def __init__(self, limit):
        super().__init__(limit, "segments")


class LogBudget(Budget):
    """At most ``limit`` redo logs hold a descriptor at once."""

    def __init__(self, limit):
        super().__init__(limit, "logs")


_shared = {}


def _shared_budget(kind, limit):
    budget = _shared.get(kind)
    if budget is None:
        budget = _shared[kind] = kind(limit())
    return budget


def default_budget():
    """The process's shared budget of :func:`default_open_files` segments."""
    return _shared_budget(SegmentBudget, default_open_files)


def default_log_budget():
    """The process's shared budget of :func:`default_open_logs` redo logs."""
    return _shared_budget(LogBudget, default_open_logs)
