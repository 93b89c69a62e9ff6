# cython: boundscheck=False, wraparound=False
"""The sparse indexes of one segment, in memory (the files they are saved
to are ``txmq.storage.index``; docs/FORMAT.md, "Indexes"):

- the offset index: one entry (base offset, byte position) per
  ``interval`` bytes of batches, each with a flag saying whether the batch
  it names was checked whole in this process (an entry made here from a
  checked batch was; one loaded from disk is checked at its first use);
- the time index: one entry (publish time, base offset) per offset-index
  entry whose publish time is past the last one's.

Both grow by doubling. An index is derived data: the segment that owns it
checks an entry before it trusts it (``txmq._segment``).
"""
from libc.stdint cimport int64_t

import numpy as np


cdef class SparseIndex:

    def __init__(self, Py_ssize_t interval):
        self.interval = interval
        self.last_pos = -interval
        self.off = np.empty(64, np.int64)
        self.pos = np.empty(64, np.int64)
        self.ok = np.zeros(64, np.uint8)
        self.ts = np.empty(64, np.int64)
        self.toff = np.empty(64, np.int64)

    cdef int add(self, Py_ssize_t pos, int64_t base, int64_t publish_time) except -1:
        """Index the checked batch at ``pos`` if it is ``interval`` bytes
        past the last entry."""
        if pos - self.last_pos < self.interval:
            return 0
        self.last_pos = pos
        # Each index grows on its own count: loaded from disk, the time
        # index may hold more entries than the offset index.
        if self.n == len(self.off):
            self.off = np.resize(self.off, 2 * self.n)
            self.pos = np.resize(self.pos, 2 * self.n)
            self.ok = np.resize(self.ok, 2 * self.n)
        self.off[self.n] = base
        self.pos[self.n] = pos
        self.ok[self.n] = 1             # made here from a checked batch
        self.n += 1
        if self.tn == 0 or publish_time > self.ts[self.tn - 1]:
            if self.tn == len(self.ts):
                self.ts = np.resize(self.ts, 2 * self.tn)
                self.toff = np.resize(self.toff, 2 * self.tn)
            self.ts[self.tn] = publish_time
            self.toff[self.tn] = base
            self.tn += 1
        return 0

    cdef void clear(self):
        self.n = 0
        self.tn = 0
        self.last_pos = -self.interval

    cdef void truncate(self, Py_ssize_t pos, int64_t next_offset):
        """Forget the entries of batches at or past ``pos`` / ``next_offset``."""
        cdef const int64_t[::1] p = self.pos
        cdef const int64_t[::1] t = self.toff
        while self.n and p[self.n - 1] >= pos:
            self.n -= 1
        while self.tn and t[self.tn - 1] >= next_offset:
            self.tn -= 1
        self.last_pos = p[self.n - 1] if self.n else -self.interval

    cdef Py_ssize_t at_or_below(self, int64_t offset) except -2:
        """The last offset-index entry whose offset is <= ``offset``, or -1
        (a binary search, no Python call: every read locates its batch
        through it)."""
        cdef const int64_t[::1] a = self.off
        cdef Py_ssize_t lo = 0, hi = self.n, mid
        while lo < hi:
            mid = (lo + hi) >> 1
            if a[mid] <= offset:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    cdef Py_ssize_t time_before(self, int64_t timestamp) except -2:
        """The last time-index entry published before ``timestamp``, or -1."""
        cdef const int64_t[::1] a = self.ts
        cdef Py_ssize_t lo = 0, hi = self.tn, mid
        while lo < hi:
            mid = (lo + hi) >> 1
            if a[mid] < timestamp:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    cdef int64_t offset_at(self, Py_ssize_t i) except? -1:
        return self.off[i]

    cdef Py_ssize_t position_at(self, Py_ssize_t i) except? -1:
        return self.pos[i]

    cdef bint checked(self, Py_ssize_t i) except -1:
        """Whether the batch entry ``i`` names was checked whole here."""
        return self.ok[i] != 0

    cdef int mark_checked(self, Py_ssize_t i) except -1:
        self.ok[i] = 1
        return 0

    cdef int64_t time_at(self, Py_ssize_t i) except? -1:
        return self.ts[i]

    cdef int64_t time_offset_at(self, Py_ssize_t i) except? -1:
        return self.toff[i]

    def entries(self):
        """(offsets, positions, timestamps, time_offsets) as numpy views."""
        return self.off[:self.n], self.pos[:self.n], self.ts[:self.tn], self.toff[:self.tn]

    def load(self, offsets, positions, timestamps, time_offsets):
        """Adopt entries read from disk (none of them checked yet)."""
        self.n = len(offsets)
        self.tn = len(timestamps)
        cap = max(64, self.n, self.tn)
        self.off = np.resize(np.array(offsets, np.int64), cap) if self.n else np.empty(cap, np.int64)
        self.pos = np.resize(np.array(positions, np.int64), cap) if self.n else np.empty(cap, np.int64)
        self.ok = np.zeros(cap, np.uint8)
        self.ts = np.resize(np.array(timestamps, np.int64), cap) if self.tn else np.empty(cap, np.int64)
        self.toff = np.resize(np.array(time_offsets, np.int64), cap) if self.tn else np.empty(cap, np.int64)
        self.last_pos = self.pos[self.n - 1] if self.n else -self.interval
