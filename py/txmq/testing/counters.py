"""Counters that do not depend on the machine: flushes, Python-level calls,
allocated blocks. What a change costs in these is the same on a laptop, a
loaded CI runner and a server, so a gate on them can be exact.

- :class:`FlushCounter` counts every flush txmq makes in this process:
  ``os.fsync`` and ``os.fdatasync`` (wrapped on the ``os`` module, which the
  Python layers and the Cython core both call through) and the ``msync``
  calls of ``txmq._mapping.Mapping.sync`` (a C call, counted in the core by
  ``txmq._mapping.msync_count``).
- :func:`count_calls` counts the Python function calls one call of ``fn``
  makes, with ``sys.setprofile`` (frames of compiled code are not counted:
  moving work into Cython is what lowers the count).
- :func:`count_blocks` counts the memory blocks ``fn`` allocates and keeps
  alive (``tracemalloc``), e.g. what each received message holds;
  :func:`net_blocks` what repeated calls leave behind (a leak).

Each works as a context manager or around a callable, and reports only the
thread that runs it: txmq's own background threads (timeouts, retention)
are left out, so the count is the caller's. A count is what txmq costs
without ``TXMQ_DEBUG``: the debug check of a subscription's lanes
(:mod:`txmq.dispatch.lane_invariant`, Python code) is off while
:func:`count_calls`, :func:`count_blocks` and :func:`net_blocks` count,
and the Cython tables' checks are compiled code, which they never see.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
import tracemalloc
from dataclasses import dataclass, field

from txmq import _mapping
from txmq.dispatch import lane_invariant


class FlushCounter:
    """``with FlushCounter() as f: ...`` then ``f.total`` (and ``f.by_kind``:
    ``fsync``, ``fdatasync``, ``msync``). Counts the calls made by the
    thread that entered it."""

    def __init__(self):
        self.by_kind = {"fsync": 0, "fdatasync": 0, "msync": 0}
        self._saved = {}
        self._thread = None
        self._msync0 = 0

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def _wrap(self, name):
        real = getattr(os, name)
        counts, thread = self.by_kind, self._thread

        def counted(fd):
            if threading.get_ident() == thread:
                counts[name] += 1
            return real(fd)

        self._saved[name] = real
        setattr(os, name, counted)

    def __enter__(self):
        self._thread = threading.get_ident()
        for name in ("fsync", "fdatasync"):
            self._wrap(name)
        self._msync0 = _mapping.msync_count()
        return self

    def __exit__(self, *exc):
        for name, real in self._saved.items():
            setattr(os, name, real)
        self._saved.clear()
        # msync_count is process-wide: the caller must keep other threads
        # from syncing meanwhile (txmq's background threads do not msync).
        self.by_kind["msync"] += _mapping.msync_count() - self._msync0
        return False


@contextlib.contextmanager
def _lane_check_off():
    """The lane check of TXMQ_DEBUG off for a count (module docstring)."""
    was = lane_invariant.set_debug(False)
    try:
        yield
    finally:
        lane_invariant.set_debug(was)


def count_calls(fn, *args, **kwargs) -> int:
    """Python function calls (profile ``call`` events, the outermost ``fn``
    itself not included when it is compiled) made by ``fn(*args,
    **kwargs)`` in this thread."""
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        if event == "call":
            calls += 1

    previous = sys.getprofile()
    # Garbage of earlier work, collected inside ``fn``, would run its
    # finalizers (Python calls) there: collect it first and keep the
    # collector off while counting, so a count depends on ``fn`` alone.
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with _lane_check_off():
            sys.setprofile(profile)
            try:
                fn(*args, **kwargs)
            finally:
                sys.setprofile(previous)
    finally:
        if was_enabled:
            gc.enable()
    # setprofile's own return into this frame is not a call; nothing to undo.
    return calls


@dataclass
class Blocks:
    """Memory blocks left allocated by a call, and where (``file:line`` of
    the Python frame that allocated them -> blocks)."""

    count: int
    where: dict = field(default_factory=dict)

    def top(self, n: int = 5) -> str:
        items = sorted(self.where.items(), key=lambda kv: -kv[1])[:n]
        return ", ".join(f"{k} +{v}" for k, v in items)


def count_blocks(fn, *args, **kwargs) -> tuple[object, Blocks]:
    """``(fn(*args, **kwargs), Blocks)``: the memory blocks the call
    allocated that are still allocated after it (while its result is
    referenced), e.g. what each received message holds.

    ``tracemalloc`` is started for the call alone, so blocks that existed
    before it are not traced at all: freeing them does not offset what the
    call allocated. Garbage is collected before and after. tracemalloc
    sees every thread: run it where no other thread allocates (or read
    ``Blocks.where`` for the lines that matter)."""
    if tracemalloc.is_tracing():
        raise RuntimeError("count_blocks starts tracemalloc itself: stop it first")
    gc.collect()
    with _lane_check_off():
        tracemalloc.start(1)
        try:
            before = tracemalloc.take_snapshot()
            result = fn(*args, **kwargs)
            gc.collect()
            after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
    # The snapshots' own blocks are tracemalloc's, not the call's.
    own = [tracemalloc.Filter(False, tracemalloc.__file__)]
    where = {}
    total = 0
    for stat in after.filter_traces(own).compare_to(before.filter_traces(own), "lineno"):
        if stat.count_diff:
            frame = stat.traceback[0]
            where[f"{os.path.basename(frame.filename)}:{frame.lineno}"] = stat.count_diff
            total += stat.count_diff
    return result, Blocks(total, where)


def net_blocks(fn, repeat: int) -> float:
    """Blocks the interpreter holds more after ``repeat`` calls of ``fn``
    than before, per call (``sys.getallocatedblocks``, after a collection):
    0 unless the calls leave something behind."""
    with _lane_check_off():
        fn()
        gc.collect()
        start = sys.getallocatedblocks()
        for _ in range(repeat):
            fn()
        gc.collect()
        return (sys.getallocatedblocks() - start) / repeat
