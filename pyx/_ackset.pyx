# cython: boundscheck=False, wraparound=False
"""The set of individually acknowledged offsets above a cursor's mark-delete.

Stored as sorted, disjoint, non-adjacent half-open ranges ``[start, end)``
in two int64 arrays. Lookups are binary searches (O(log n) in the number of
ranges); an insert that creates or removes a range shifts the arrays' tail
with one memmove. Acks tend to arrive near mark-delete and merge, so the
range count stays small in practice.

Serialised form (``to_bytes``): u32 range count, then (i64 start, i64 end)
per range, little-endian.
"""
from libc.stdint cimport int64_t, uint32_t
from libc.string cimport memmove
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING
from cpython.tuple cimport PyTuple_Check, PyTuple_GET_ITEM, PyTuple_GET_SIZE
from cpython.long cimport PyLong_CheckExact

import os

import numpy as np

from txmq._batch cimport Message
from _debug cimport check_due
from _bytes cimport load_i64, store_u32, store_i64
from txmq._reader cimport Reader


# With TXMQ_DEBUG=1 in the environment at import (the test suite sets it),
# every change re-checks the set's invariant and raises AssertionError on a
# broken one; otherwise the cost is one C flag test per change.
cdef bint DEBUG = os.environ.get("TXMQ_DEBUG") == "1"


def set_debug(bint on):
    """Turn the invariant checks of this module on or off (tests)."""
    global DEBUG
    DEBUG = on


cdef class AckSet:
    # (the fields are declared in pyx/txmq/_ackset.pxd, for txmq._txn)

    def __cinit__(self):
        self.cap = 16
        self._alloc(self.cap)

    cdef _alloc(self, Py_ssize_t cap):
        cdef int64_t[::1] sv, ev
        starts = np.empty(cap, np.int64)
        ends = np.empty(cap, np.int64)
        if self.n:
            starts[:self.n] = self._starts[:self.n]
            ends[:self.n] = self._ends[:self.n]
        self._starts, self._ends = starts, ends
        sv = starts
        ev = ends
        self.s = &sv[0]
        self.e = &ev[0]
        self.cap = cap

    cdef Py_ssize_t _find(self, int64_t x) noexcept nogil:
        """Index of the last range with start <= x, or -1."""
        cdef Py_ssize_t lo = 0, hi = self.n, mid
        while lo < hi:
            mid = (lo + hi) >> 1
            if self.s[mid] <= x:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    def __len__(self):
        return self.n

    cpdef bint contains(self, int64_t offset):
        cdef Py_ssize_t i = self._find(offset)
        return i >= 0 and offset < self.e[i]

    def __contains__(self, offset):
        return self.contains(offset)

    def add(self, int64_t offset):
        """Add one offset; True when it was not in the set."""
        return self.add_range(offset, offset + 1) > 0

    cpdef int64_t add_range(self, int64_t start, int64_t end) except -1:
        """Add [start, end); return how many offsets were new."""
        cdef Py_ssize_t i, j, k
        cdef int64_t new_start, new_end, covered = 0
        if end <= start:
            return 0
        # Ranges i..j-1 touch or overlap [start, end): merge them.
        i = self._find(start)
        if i < 0 or self.e[i] < start:
            i += 1
        j = self._find(end) + 1   # first range with start > end
        new_start = start
        new_end = end
        for k in range(i, j):
            covered += min(self.e[k], end) - max(self.s[k], start) if self.e[k] > start and self.s[k] < end else 0
            if self.s[k] < new_start:
                new_start = self.s[k]
            if self.e[k] > new_end:
                new_end = self.e[k]
        if j - i == 1:
            self.s[i] = new_start
            self.e[i] = new_end
        elif j == i:
            if self.n == self.cap:
                self._alloc(2 * self.cap)
            memmove(self.s + i + 1, self.s + i, (self.n - i) * 8)
            memmove(self.e + i + 1, self.e + i, (self.n - i) * 8)
            self.s[i] = new_start
            self.e[i] = new_end
            self.n += 1
        else:
            self.s[i] = new_start
            self.e[i] = new_end
            memmove(self.s + i + 1, self.s + j, (self.n - j) * 8)
            memmove(self.e + i + 1, self.e + j, (self.n - j) * 8)
            self.n -= j - i - 1
        if DEBUG:
            self._debug_changed()
        return (end - start) - covered

    def remove(self, int64_t offset):
        """Remove one offset; True when it was in the set."""
        cdef Py_ssize_t i = self._find(offset)
        if i < 0 or offset >= self.e[i]:
            return False
        if self.s[i] == offset and self.e[i] == offset + 1:
            memmove(self.s + i, self.s + i + 1, (self.n - i - 1) * 8)
            memmove(self.e + i, self.e + i + 1, (self.n - i - 1) * 8)
            self.n -= 1
        elif self.s[i] == offset:
            self.s[i] += 1
        elif self.e[i] == offset + 1:
            self.e[i] -= 1
        else:
            if self.n == self.cap:
                self._alloc(2 * self.cap)
            memmove(self.s + i + 2, self.s + i + 1, (self.n - i - 1) * 8)
            memmove(self.e + i + 2, self.e + i + 1, (self.n - i - 1) * 8)
            self.s[i + 1] = offset + 1
            self.e[i + 1] = self.e[i]
            self.e[i] = offset
            self.n += 1
        if DEBUG:
            self._debug_changed()
        return True

    def remove_range(self, int64_t start, int64_t end):
        """Remove [start, end); return how many offsets were in the set."""
        cdef Py_ssize_t i, j, k, keep_left, keep_right
        cdef int64_t removed = 0, left_end, right_start
        if end <= start or self.n == 0:
            return 0
        i = self._find(start)
        if i < 0 or self.e[i] <= start:
            i += 1
        j = self._find(end - 1) + 1      # ranges i..j-1 overlap [start, end)
        if j <= i:
            return 0
        for k in range(i, j):
            removed += min(self.e[k], end) - max(self.s[k], start)
        keep_left = self.s[i] < start
        keep_right = self.e[j - 1] > end
        left_end = start
        right_start = end
        cdef int64_t first_start = self.s[i], last_end = self.e[j - 1]
        cdef Py_ssize_t new_count = keep_left + keep_right
        if new_count > j - i and self.n == self.cap:
            self._alloc(2 * self.cap)
        # The ranges i..j-1 become the pieces kept on either side.
        memmove(self.s + i + new_count, self.s + j, (self.n - j) * 8)
        memmove(self.e + i + new_count, self.e + j, (self.n - j) * 8)
        k = i
        if keep_left:
            self.s[k] = first_start
            self.e[k] = left_end
            k += 1
        if keep_right:
            self.s[k] = right_start
            self.e[k] = last_end
        self.n += new_count - (j - i)
        if DEBUG:
            self._debug_changed()
        return removed

    def first_unacked(self, int64_t from_offset):
        """The smallest offset >= ``from_offset`` that is not in the set."""
        cdef Py_ssize_t i = self._find(from_offset)
        if i >= 0 and from_offset < self.e[i]:
            return self.e[i]
        return from_offset

    def next_acked(self, int64_t from_offset):
        """(start, end) of the first range ending after ``from_offset``, or None."""
        cdef Py_ssize_t i = self._find(from_offset)
        if i >= 0 and from_offset < self.e[i]:
            return (self.s[i], self.e[i])
        if i + 1 < self.n:
            return (self.s[i + 1], self.e[i + 1])
        return None

    def trim_below(self, int64_t offset):
        """Forget every offset below ``offset`` (mark-delete moved there)."""
        cdef Py_ssize_t k = 0
        while k < self.n and self.e[k] <= offset:
            k += 1
        if k:
            memmove(self.s, self.s + k, (self.n - k) * 8)
            memmove(self.e, self.e + k, (self.n - k) * 8)
            self.n -= k
        if self.n and self.s[0] < offset:
            self.s[0] = offset
        if DEBUG:
            self._debug_changed()


    cdef _debug_changed(self):
        """After a change (TXMQ_DEBUG): the full check when it is due (_debug.pxd)."""
        if check_due(&self.debug_changes, &self.debug_next, self.n):
            self.check_invariants()

    def check_invariants(self):
        """Raise AssertionError unless the ranges are non-empty, sorted,
        disjoint and non-adjacent, within the arrays' capacity."""
        cdef Py_ssize_t k
        if not 0 <= self.n <= self.cap:
            raise AssertionError(f"AckSet: {self.n} ranges in a capacity of {self.cap}")
        for k in range(self.n):
            if self.s[k] >= self.e[k]:
                raise AssertionError(f"AckSet: range {k} [{self.s[k]}, {self.e[k]}) is empty")
            if k and self.e[k - 1] >= self.s[k]:
                raise AssertionError(f"AckSet: ranges {k - 1} [{self.s[k - 1]}, {self.e[k - 1]}) and {k} "
                                     f"[{self.s[k]}, {self.e[k]}) overlap or touch")

    def count(self):
        """How many offsets the set holds."""
        cdef int64_t c = 0
        cdef Py_ssize_t k
        for k in range(self.n):
            c += self.e[k] - self.s[k]
        return c

    def count_in(self, int64_t start, int64_t end):
        """How many offsets of [start, end) the set holds."""
        cdef int64_t c = 0
        cdef Py_ssize_t k = max(0, self._find(start))
        if end <= start:
            return 0
        while k < self.n and self.s[k] < end:
            if self.e[k] > start:
                c += min(self.e[k], end) - max(self.s[k], start)
            k += 1
        return c

    def ranges(self):
        return [(self.s[k], self.e[k]) for k in range(self.n)]

    def clear(self):
        self.n = 0

    def to_bytes(self):
        cdef Py_ssize_t k
        out = PyBytes_FromStringAndSize(NULL, 4 + 16 * self.n)
        cdef char *p = PyBytes_AS_STRING(out)
        store_u32(p, <uint32_t>self.n)
        for k in range(self.n):
            store_i64(p + 4 + 16 * k, self.s[k])
            store_i64(p + 12 + 16 * k, self.e[k])
        return out

    @staticmethod
    def from_bytes(data, path=None, Py_ssize_t base=0):
        """Inverse of to_bytes: ``data`` holds the ack set and nothing else.
        ``data`` is byte ``base`` of file ``path`` onwards: bytes that do not
        parse raise CorruptLogError there (ValueError without a path)."""
        cdef Reader r = Reader(path, "ack set").reset(data, base)
        out = AckSet.read(r)
        r.done()
        return out

    @staticmethod
    def read(Reader r):
        """The ack set ``r`` reads next (u32 count, then the ranges); the
        reader's error at the first bad byte when they do not parse."""
        cdef Py_ssize_t n = r.u32(), k, at = r.pos
        cdef const char *p = r.take_array(n, 16)
        cdef int64_t a, b
        out = AckSet()
        for k in range(n):
            a = load_i64(p + 16 * k)
            b = load_i64(p + 16 * k + 8)
            if b <= a:
                r.fail(at + 16 * k, f"empty range [{a}, {b})")
            out.add_range(a, b)
        return out

    def __repr__(self):
        return f"AckSet({self.ranges()!r})"


def add_many(AckSet acks, offsets):
    """Add every offset of a sequence; return how many were new. Sorts and
    merges runs first, so n consecutive offsets cost one range insert."""
    arr = np.ascontiguousarray(offsets, dtype=np.int64)
    cdef Py_ssize_t size = arr.shape[0]
    if size > 1 and not (arr[1:] > arr[:size - 1]).all():     # (no negative index: wraparound=False)
        arr = np.unique(arr)
    cdef const int64_t[::1] a = arr
    cdef Py_ssize_t i = 0, j, n = a.shape[0]
    cdef int64_t added = 0
    while i < n:
        j = i + 1
        while j < n and a[j] == a[j - 1] + 1:
            j += 1
        added += acks.add_range(a[i], a[j - 1] + 1)
        i = j
    return added


cpdef bint cut_delivery(list ranges, int64_t offset) except -1:
    """Take ``offset`` out of the batch deliveries ``[[start, end,
    consumer id], ...]`` holding it (a subscription's lane), splitting the
    one it lies in; False when none held it. The per-message transactional
    ack's step, compiled (a subscription's ``_cut_from_ranges`` does it for
    many offsets)."""
    cdef Py_ssize_t i
    cdef list r
    cdef int64_t s, e
    for i in range(len(ranges)):
        r = ranges[i]
        s = r[0]
        e = r[1]
        if s <= offset < e:
            if e - s == 1:
                del ranges[i]
            elif offset == s:
                r[0] = offset + 1
            elif offset == e - 1:
                r[1] = offset
            else:
                ranges.insert(i + 1, [offset + 1, e, r[2]])
                r[1] = offset
            return True
    return False


def all_received(list messages):
    """Whether every item is a received Message (an ack's common case)."""
    for m in messages:
        if type(m) is not Message:
            return False
    return True


def received_or(messages, fallback):
    """``messages`` itself when it is a list of received Messages (the ack
    path reads their ids in compiled code), else ``fallback(messages)``:
    an ack's argument, with no Python call in the common case."""
    if type(messages) is list and all_received(<list>messages):
        return messages
    return fallback(messages)


def group_offsets(list message_ids):
    """``{(topic, partition): offsets}`` of a list of ``(topic, partition,
    offset)`` ids or received Messages, in input order: the ack path's
    bookkeeping, compiled. A partition's offsets are a ``range`` when they
    are consecutive and ascending (a received run acked whole: no int per
    offset), else a list."""
    cdef dict groups = {}
    cdef dict runs = {}              # key -> (start, next) of a run while another key is current
    cdef list g = None
    cdef object key = None
    cdef object last_topic = None, last_partition = None
    cdef Py_ssize_t i
    cdef int64_t off, run_start = 0, run_next = 0
    cdef bint in_run = False         # the current key's offsets are run_start .. run_next - 1
    cdef Message m
    for i in range(len(message_ids)):
        mid = message_ids[i]
        if type(mid) is Message:
            m = <Message>mid
            topic = m._topic
            partition = m._partition
            off = m.offset
            offset = None
        else:
            if PyTuple_Check(mid) and PyTuple_GET_SIZE(mid) == 3:
                topic = <object>PyTuple_GET_ITEM(mid, 0)
                partition = <object>PyTuple_GET_ITEM(mid, 1)
                offset = <object>PyTuple_GET_ITEM(mid, 2)
            else:
                topic, partition, offset = mid[0], mid[1], mid[2]
            if not PyLong_CheckExact(offset):
                raise TypeError(f"offset {offset!r} is not an int")
            off = offset
        if key is None or topic is not last_topic or (
                partition is not last_partition and partition != last_partition):
            if in_run:
                runs[key] = (run_start, run_next)
            key = (topic, partition)
            last_topic = topic
            last_partition = partition
            if key not in groups:    # a new key: a run of one so far
                groups[key] = None
                in_run = True
                run_start = run_next = off
                g = None
            else:
                saved = runs.pop(key, None)
                in_run = saved is not None
                if in_run:
                    run_start, run_next = saved
                else:
                    g = groups[key]
        if in_run:
            if off == run_next:
                run_next = off + 1
                continue
            # The run breaks: its offsets become a list from here on.
            g = list(range(run_start, run_next))
            groups[key] = g
            in_run = False
        g.append(offset if offset is not None else off)
    if in_run:
        runs[key] = (run_start, run_next)
    for key, run in runs.items():
        groups[key] = range(run[0], run[1])
    return groups
