# cython: boundscheck=False, wraparound=False
"""Transaction data structures of the Cython core (docs/API.md, "Transaction").

- :class:`OngoingQueue`: the open transactions of one partition in order of
  their first offset; its head is maxReadPosition (Kafka's last stable
  offset). First offsets are appended in increasing order, so it is a FIFO
  with lazy removal: ending any transaction is O(1) and advancing the head
  is amortised O(1).
- :class:`AbortSet`: the aborted transactions of one partition that still
  have data in retained segments, as one bitmap per coordinator over the
  sequence numbers, with vectorised lookups and trimming by offset.
- :class:`PendingAckTable`: the acknowledgements held by open transactions
  on one subscription partition, with the conflict rules of §3.

The frames of the logs that hold them (coordinator, producer registry,
pending acks) and a commit's decision record are ``txmq._txnlog``.

Frames and tables are decoded through ``_reader.Reader``: a frame or table
that does not parse raises ``CorruptLogError`` at its first bad byte.

A transaction id travels here as its two 64-bit words ``(hi, lo)``: the
coordinator id is the top 16 bits of ``hi``, the sequence the other 112
bits. No policy and no threads: callers hold their own locks.
"""
from libc.stdint cimport int16_t, int64_t, uint64_t, uint8_t, uint32_t, uint16_t
from libc.string cimport memmove
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING

import os

import numpy as np

from txmq._ackset import add_many
from txmq._ackset cimport AckSet, cut_delivery
from txmq._batch cimport Message

from _debug cimport check_due
from _bytes cimport load_i64, load_u64, store_u32, store_i64, store_u64, packed_i64, packed_txn, packed_u32
from _redo_layout cimport payload_position
from txmq._reader cimport Reader

cdef uint64_t SEQ_HI_MASK = (<uint64_t>1 << 48) - 1


def txn_words(coordinator, sequence):
    """The (hi, lo) words of transaction ``(coordinator, sequence)``."""
    if not 0 <= coordinator < (1 << 16) or not 0 <= sequence < (1 << 112):
        raise ValueError(f"transaction id ({coordinator},{sequence}) out of range")
    return (coordinator << 48) | (sequence >> 64), sequence & 0xFFFFFFFFFFFFFFFF


def txn_parts(uint64_t hi, uint64_t lo):
    """(coordinator, sequence) of the words ``(hi, lo)``."""
    return int(hi >> 48), (int(hi & SEQ_HI_MASK) << 64) | int(lo)


# With TXMQ_DEBUG=1 in the environment at import (the test suite sets it),
# every change to an OngoingQueue, AbortSet or PendingAckTable re-checks its
# invariants and raises AssertionError on a broken one; otherwise the cost
# is one C flag test per change.
cdef bint DEBUG = os.environ.get("TXMQ_DEBUG") == "1"


def set_debug(bint on):
    """Turn the invariant checks of this module on or off (tests)."""
    global DEBUG
    DEBUG = on


# -- the ongoing-transaction FIFO ------------------------------------------------

cdef class OngoingQueue:
    """Open transactions of one partition, oldest first offset first."""

    cdef Py_ssize_t debug_changes, debug_next     # changes seen by the debug checks; the next checked
    cdef object _hi, _lo, _first, _since, _alive     # numpy columns (capacity)
    cdef uint64_t *hi
    cdef uint64_t *lo
    cdef int64_t *first
    cdef int64_t *since
    cdef uint8_t *alive
    cdef Py_ssize_t head, tail, cap
    cdef int64_t origin           # absolute position of column index 0
    cdef dict slot                # (hi, lo) -> absolute position

    def __cinit__(self):
        self.slot = {}
        self._grow(64)

    cdef _grow(self, Py_ssize_t cap):
        cdef uint64_t[::1] h, l
        cdef int64_t[::1] f, s
        cdef uint8_t[::1] a
        cols = [np.zeros(cap, np.uint64), np.zeros(cap, np.uint64), np.zeros(cap, np.int64),
                np.zeros(cap, np.int64), np.zeros(cap, np.uint8)]
        n = self.tail - self.head
        if self.cap:
            for new, old in zip(cols, (self._hi, self._lo, self._first, self._since, self._alive)):
                new[:n] = old[self.head:self.tail]
        h, l, f, s, a = cols
        # Pointers first, then drop the old columns: nothing in between may
        # run code that reads through a stale pointer.
        self.hi, self.lo, self.first, self.since, self.alive = &h[0], &l[0], &f[0], &s[0], &a[0]
        self._hi, self._lo, self._first, self._since, self._alive = cols
        self.origin += self.head
        self.tail = n
        self.head = 0
        self.cap = cap

    def __len__(self):
        return len(self.slot)

    @property
    def capacity(self):
        """Entries the columns can hold (memory follows the open count)."""
        return self.cap

    def contains(self, uint64_t hi, uint64_t lo):
        return (hi, lo) in self.slot

    def add(self, uint64_t hi, uint64_t lo, int64_t first_offset, int64_t since_ms=0):
        """Record that transaction (hi, lo) has data from ``first_offset`` on
        (at or past every first offset recorded before); False when it was
        already there."""
        key = (hi, lo)
        if key in self.slot:
            return False
        if self.tail > self.head and first_offset < self.first[self.tail - 1]:
            raise ValueError(f"first offset {first_offset} is below the newest "
                             f"{self.first[self.tail - 1]}")
        if self.tail == self.cap:
            n = self.tail - self.head
            self._grow(self.cap * 2 if n * 2 > self.cap else self.cap)
        cdef Py_ssize_t i = self.tail
        self.hi[i], self.lo[i], self.first[i], self.since[i], self.alive[i] = hi, lo, first_offset, since_ms, 1
        self.tail += 1
        self.slot[key] = self.origin + i
        if DEBUG:
            self._debug_changed()
        return True

    def remove(self, uint64_t hi, uint64_t lo):
        """End transaction (hi, lo) here; its first offset, or -1 when it had
        no data here."""
        pos = self.slot.pop((hi, lo), None)
        if pos is None:
            return -1
        cdef Py_ssize_t i = pos - self.origin
        self.alive[i] = 0
        cdef int64_t first = self.first[i]
        while self.head < self.tail and not self.alive[self.head]:
            self.head += 1
        if self.head == self.tail:
            self.head = self.tail = 0
            self.origin = pos + 1
        elif self.tail - self.head > 1024 and 2 * len(self.slot) < self.tail - self.head:
            self._compact()
        if DEBUG:
            self._debug_changed()
        return first


    cdef _debug_changed(self):
        """After a change (TXMQ_DEBUG): the full check when it is due (_debug.pxd)."""
        if check_due(&self.debug_changes, &self.debug_next, self.tail - self.head):
            self.check_invariants()

    def check_invariants(self):
        """Raise AssertionError unless: every open transaction has one live
        slot and every live slot one transaction; first offsets never go
        down from head to tail; the head is live (so maxReadPosition is an
        open transaction's first offset) or the queue is empty; nothing
        outside [head, tail) is live."""
        cdef Py_ssize_t i, live = 0
        cdef int64_t last = -(1 << 62)
        if not 0 <= self.head <= self.tail <= self.cap:
            raise AssertionError(f"OngoingQueue: head {self.head}, tail {self.tail}, capacity {self.cap}")
        if self.head < self.tail and not self.alive[self.head]:
            raise AssertionError(f"OngoingQueue: the head entry {self.head} has ended")
        for i in range(self.cap):
            if self.alive[i] and not self.head <= i < self.tail:
                raise AssertionError(f"OngoingQueue: entry {i} is live outside [{self.head}, {self.tail})")
        for i in range(self.head, self.tail):
            if self.first[i] < last:
                raise AssertionError(f"OngoingQueue: first offset {self.first[i]} at {i} is below {last}")
            last = self.first[i]
            if self.alive[i]:
                live += 1
                if self.slot.get((self.hi[i], self.lo[i])) != self.origin + i:
                    raise AssertionError(f"OngoingQueue: live entry {i} ({self.hi[i]}, {self.lo[i]}) has slot "
                                         f"{self.slot.get((self.hi[i], self.lo[i]))}, not {self.origin + i}")
        if live != len(self.slot):
            raise AssertionError(f"OngoingQueue: {live} live entries for {len(self.slot)} open transactions")

    cdef _compact(self):
        """Drop the ended entries behind an old open one (more than half of
        the queue), so memory follows the open count: amortised O(1)."""
        cdef Py_ssize_t i, j = 0
        for i in range(self.head, self.tail):
            if self.alive[i]:
                self.hi[j], self.lo[j], self.first[j], self.since[j] = (
                    self.hi[i], self.lo[i], self.first[i], self.since[i])
                self.alive[j] = 1
                j += 1
        for i in range(j, self.tail):
            self.alive[i] = 0
        self.head, self.tail = 0, j
        self.origin = 0
        slot = self.slot
        for i in range(j):
            slot[(self.hi[i], self.lo[i])] = i
        if self.cap > 4 * max(j, 64):
            self._grow(2 * max(j, 64))

    def first_offset_of(self, uint64_t hi, uint64_t lo):
        pos = self.slot.get((hi, lo))
        return -1 if pos is None else self.first[pos - self.origin]

    cpdef int64_t max_read_position(self, int64_t end_offset):
        """The first offset of the oldest open transaction, or ``end_offset``."""
        if self.head < self.tail:
            return self.first[self.head]
        return end_offset

    def oldest(self):
        """(hi, lo, first offset, since ms) of the oldest open transaction, or None."""
        if self.head == self.tail:
            return None
        cdef Py_ssize_t i = self.head
        return (self.hi[i], self.lo[i], self.first[i], self.since[i])

    def entries(self):
        """[(hi, lo, first offset, since ms)] of every open transaction, oldest first."""
        cdef Py_ssize_t i
        return [(self.hi[i], self.lo[i], self.first[i], self.since[i])
                for i in range(self.head, self.tail) if self.alive[i]]

    def to_bytes(self):
        """u32 count, then (u64 hi, u64 lo, i64 first offset, i64 since ms) each."""
        cdef Py_ssize_t i, n = 0
        for i in range(self.head, self.tail):
            n += self.alive[i]
        out = PyBytes_FromStringAndSize(NULL, 4 + 32 * n)
        cdef char *p = PyBytes_AS_STRING(out)
        store_u32(p, n)
        p += 4
        for i in range(self.head, self.tail):
            if self.alive[i]:
                store_u64(p, self.hi[i]); store_u64(p + 8, self.lo[i])
                store_i64(p + 16, self.first[i]); store_i64(p + 24, self.since[i])
                p += 32
        return out

    @staticmethod
    def from_bytes(data, path=None, Py_ssize_t base=0):
        """Inverse of :meth:`to_bytes`; returns (queue, bytes consumed).
        ``data`` is byte ``base`` of file ``path`` onwards: a table that does
        not parse raises CorruptLogError there (ValueError without a path)."""
        q = OngoingQueue()
        return q, _load_table(Reader(path, "ongoing-transaction table").reset(data, base), q.add)


cdef Py_ssize_t _load_table(Reader r, add) except -1:
    """Feed each (u64, u64, i64, i64) entry of a counted table to ``add``
    (whose ValueError is the entry's fault); return the bytes the table
    took."""
    cdef uint32_t n = r.u32(), k
    cdef Py_ssize_t at
    cdef const char *p = r.take_array(n, 32)
    for k in range(n):
        at = 4 + 32 * <Py_ssize_t>k
        try:
            add(load_u64(p + 32 * k), load_u64(p + 8 + 32 * k), load_i64(p + 16 + 32 * k),
                load_i64(p + 24 + 32 * k))
        except ValueError as e:
            r.fail(at, f"entry {k}: {e}")
    return r.pos


# -- the abort set -----------------------------------------------------------------

cdef class _Bitmap:
    """Bits over sequence numbers from ``base`` (a multiple of 64) on."""
    cdef object _words
    cdef uint64_t *w
    cdef Py_ssize_t n
    cdef uint64_t base
    cdef Py_ssize_t count

    def __cinit__(self):
        self._set_words(np.zeros(4, np.uint64))
        self.base = 0

    cdef _set_words(self, arr):
        cdef uint64_t[::1] v = arr
        self._words = arr
        self.w = &v[0]
        self.n = len(arr)

    cdef bint has(self, uint64_t seq) noexcept nogil:
        if seq < self.base:
            return False
        cdef uint64_t k = (seq - self.base) >> 6
        if k >= <uint64_t>self.n:
            return False
        return (self.w[k] >> ((seq - self.base) & 63)) & 1

    cdef add(self, uint64_t seq):
        cdef uint64_t k, shift
        if self.count == 0:
            self.base = seq & ~(<uint64_t>63)
            self._words[:] = 0
        elif seq < self.base:
            shift = ((self.base - seq + 63) >> 6)
            arr = np.zeros(self.n + shift, np.uint64)
            arr[shift:] = self._words
            self._set_words(arr)
            self.base -= shift << 6
        k = (seq - self.base) >> 6
        if k >= <uint64_t>self.n:
            arr = np.zeros(max(k + 1, 2 * self.n), np.uint64)
            arr[:self.n] = self._words
            self._set_words(arr)
        if not (self.w[k] >> ((seq - self.base) & 63)) & 1:
            self.w[k] |= (<uint64_t>1) << ((seq - self.base) & 63)
            self.count += 1

    cdef discard(self, uint64_t seq):
        if not self.has(seq):
            return
        cdef uint64_t k = (seq - self.base) >> 6
        self.w[k] &= ~((<uint64_t>1) << ((seq - self.base) & 63))
        self.count -= 1
        # Drop leading empty words once they are half the map.
        cdef Py_ssize_t z = 0
        while z < self.n and self.w[z] == 0:
            z += 1
        if self.count == 0 or (z > 4 and z * 2 > self.n):
            arr = np.zeros(max(4, self.n - z), np.uint64)
            if self.count:
                arr[:self.n - z] = self._words[z:]
                self.base += <uint64_t>z << 6
            self._set_words(arr)


cdef class AbortSet:
    """Aborted transactions with data in the retained log of one partition.

    Each entry also keeps its first offset and its ABORT marker's offset:
    :meth:`trim_below` drops the transactions whose marker lies below the
    log start (none of their data is left), and :meth:`overlapping` answers
    Kafka's aborted-transactions question for an offset range.
    """
    cdef Py_ssize_t debug_changes, debug_next     # changes seen by the debug checks; the next checked
    cdef dict maps                 # coordinator -> _Bitmap
    cdef list order                # [(marker offset, first offset, hi, lo)], marker order
    cdef Py_ssize_t start          # entries before it are trimmed
    cdef public uint64_t version   # bumped on every change (readers cache by it)

    def __cinit__(self):
        self.maps = {}
        self.order = []

    def __len__(self):
        return len(self.order) - self.start

    cdef _Bitmap _map(self, uint64_t hi, bint create):
        tc = hi >> 48
        bm = self.maps.get(tc)
        if bm is None and create:
            bm = _Bitmap()
            self.maps[tc] = bm
        return bm

    def add(self, uint64_t hi, uint64_t lo, int64_t first_offset, int64_t marker_offset):
        """Record the abort of (hi, lo); its data spans [first_offset, marker_offset)."""
        if hi & SEQ_HI_MASK:
            raise ValueError("sequence numbers of 2**64 and above are not supported")
        cdef _Bitmap bm = self._map(hi, True)
        if bm.has(lo):
            return
        bm.add(lo)
        self.order.append((marker_offset, first_offset, hi, lo))
        self.version += 1
        if DEBUG:
            self._debug_changed()

    def contains(self, uint64_t hi, uint64_t lo):
        if hi & SEQ_HI_MASK:
            return False
        cdef _Bitmap bm = self._map(hi, False)
        return bm is not None and bm.has(lo)

    def contains_many(self, hi, lo):
        """Vectorised :meth:`contains` over uint64 arrays of words; a bool array."""
        cdef const uint64_t[::1] h = np.ascontiguousarray(hi, np.uint64)
        cdef const uint64_t[::1] l = np.ascontiguousarray(lo, np.uint64)
        if h.shape[0] != l.shape[0]:
            raise ValueError("hi and lo differ in length")
        out = np.zeros(h.shape[0], np.bool_)
        cdef uint8_t[::1] o = out.view(np.uint8)
        cdef Py_ssize_t i, n = h.shape[0]
        cdef _Bitmap bm
        cdef uint64_t want
        for tc, bm in self.maps.items():
            want = (<uint64_t>tc) << 48
            with nogil:
                for i in range(n):
                    if h[i] == want and bm.has(l[i]):
                        o[i] = 1
        return out

    def trim_below(self, int64_t start_offset):
        """Forget the transactions whose ABORT marker is below ``start_offset``
        (retention deleted all their data); return how many."""
        cdef Py_ssize_t k = 0
        cdef _Bitmap bm
        while self.start < len(self.order) and self.order[self.start][0] < start_offset:
            _, _, hi, lo = self.order[self.start]
            bm = self._map(hi, False)
            bm.discard(lo)
            self.start += 1
            k += 1
        if self.start > 1024 and self.start * 2 > len(self.order):
            del self.order[:self.start]
            self.start = 0
        if k:
            self.version += 1
        if DEBUG:
            self._debug_changed()
        return k


    cdef _debug_changed(self):
        """After a change (TXMQ_DEBUG): the full check when it is due (_debug.pxd)."""
        if check_due(&self.debug_changes, &self.debug_next, len(self.order) - self.start):
            self.check_invariants()

    def check_invariants(self):
        """Raise AssertionError unless every retained entry is in its
        coordinator's bitmap and the bitmaps hold nothing else, each
        transaction's data ends at or before its marker, and the entries
        are in marker order."""
        cdef _Bitmap bm
        cdef Py_ssize_t k, bits = 0
        cdef int64_t last = -(1 << 62)
        for tc, bm in self.maps.items():
            bits += bm.count
            if bm.count != int(np.unpackbits(bm._words.view(np.uint8)).sum()):
                raise AssertionError(f"AbortSet: coordinator {tc}'s bitmap counts {bm.count} bits, holds "
                                     f"{int(np.unpackbits(bm._words.view(np.uint8)).sum())}")
        if bits != len(self.order) - self.start:
            raise AssertionError(f"AbortSet: {bits} bits for {len(self.order) - self.start} entries")
        for k in range(self.start, len(self.order)):
            m, f, hi, lo = self.order[k]
            if m < last:
                raise AssertionError(f"AbortSet: marker {m} of entry {k} is below the one before ({last})")
            last = m
            if f > m:
                raise AssertionError(f"AbortSet: entry {k} starts at {f}, after its marker {m}")
            bm = self._map(hi, False)
            if bm is None or not bm.has(lo):
                raise AssertionError(f"AbortSet: entry {k} ({hi}, {lo}) is not in its bitmap")

    def overlapping(self, int64_t from_offset, int64_t to_offset):
        """[(hi, lo, first offset, marker offset)] of aborted transactions
        whose data overlaps [from_offset, to_offset)."""
        return [(hi, lo, f, m) for m, f, hi, lo in self.order[self.start:]
                if f < to_offset and m >= from_offset]

    def entries(self):
        """[(hi, lo, first offset, marker offset)] in marker order."""
        return [(hi, lo, f, m) for m, f, hi, lo in self.order[self.start:]]

    def to_bytes(self):
        """u32 count, then (u64 hi, u64 lo, i64 first offset, i64 marker offset) each."""
        entries = self.entries()
        out = PyBytes_FromStringAndSize(NULL, 4 + 32 * len(entries))
        cdef char *p = PyBytes_AS_STRING(out)
        store_u32(p, len(entries))
        p += 4
        for h, l, f, m in entries:
            store_u64(p, h); store_u64(p + 8, l); store_i64(p + 16, f); store_i64(p + 24, m)
            p += 32
        return out

    @staticmethod
    def from_bytes(data, path=None, Py_ssize_t base=0):
        """Inverse of :meth:`to_bytes`; returns (set, bytes consumed).
        ``data`` is byte ``base`` of file ``path`` onwards: a table that does
        not parse raises CorruptLogError there (ValueError without a path)."""
        s = AbortSet()
        return s, _load_table(Reader(path, "aborted-transaction table").reset(data, base), s.add)


# -- pending acknowledgements --------------------------------------------------------

cdef int64_t _NO_OFFSET = -(1 << 62)


cdef class PendingAckTable:
    """Acks held by open transactions on one subscription partition.

    ``txn`` keys are opaque hashable objects (the broker passes TxnIDs).
    Each transaction's individually acked offsets are an ``AckSet`` of
    ranges, and ``held`` is their union, so a conflict check is a binary
    search and a transaction's acks are a few ranges however many messages
    it acked. Conflict checks return ``(offset, reason, other txn)`` or None
    and change nothing; :meth:`add_one` checks and records one offset in a
    single call (the per-message ``ack(m, txn=)`` path).

    Offsets recorded since the caller last took them (:meth:`take_unlogged`)
    are *unlogged*: held in memory, not yet in the pending-ack log. The
    caller frames them when a prepare or a flush asks (a commit's decision
    record names them instead); :meth:`framed` says whether any ack of a
    transaction is in the log.
    """
    cdef Py_ssize_t debug_changes, debug_next     # changes seen by the debug checks; the next checked
    cdef dict sets           # txn -> AckSet of its individual acks
    cdef dict cumulative     # txn -> offset (everything at or below it)
    cdef dict unlogged       # txn -> [offset, ...] recorded, not yet taken for the log
    cdef set framed_txns     # transactions with acks in the log (taken for it, replayed or cumulative)
    cdef AckSet held         # every individual offset held
    cdef Py_ssize_t n_held   # offsets in ``held``
    cdef object last_txn     # a one-entry cache of sets: the transaction acking now ...
    cdef object last_set     # ... and its AckSet
    cdef list last_unlogged  # ... and its unlogged list

    def __cinit__(self):
        self.held = AckSet()
        self.sets = {}
        self.cumulative = {}
        self.unlogged = {}
        self.framed_txns = set()

    def __len__(self):
        return self.n_held + len(self.cumulative)

    def txns(self):
        return set(self.sets) | set(self.cumulative)

    def owner_of(self, int64_t offset):
        """The transaction holding ``offset``, or None."""
        if self.n_held and self.held.contains(offset):
            for t, s in self.sets.items():
                if s.contains(offset):
                    return t
        for t, c in self.cumulative.items():
            if offset <= c:
                return t
        return None

    def is_pending(self, int64_t offset):
        if self.n_held and self.held.contains(offset):
            return True
        for c in self.cumulative.values():
            if offset <= c:
                return True
        return False

    def next_pending(self, int64_t start):
        """The lowest pending offset at or above ``start``, or -1 (a binary
        search in the held ranges)."""
        for c in self.cumulative.values():
            if c >= start:
                return start
        if not self.n_held:
            return -1
        r = self.held.next_acked(start)
        if r is None:
            return -1
        return max(r[0], start)

    def holder(self, offsets):
        """The first of ``offsets`` an open transaction holds, as
        ``(offset, txn)``, or None: what a plain ack must not touch."""
        cdef int64_t o
        cums = list(self.cumulative.items())
        for o in offsets:
            if self.n_held and self.held.contains(o):
                return (o, self.owner_of(o))
            for t, c in cums:
                if o <= c:
                    return (o, t)
        return None

    def holder_in(self, int64_t start, int64_t end):
        """The lowest offset in [start, end) an open transaction holds, as
        ``(offset, txn)``, or None."""
        cdef int64_t o = self.next_pending(start)
        if o < 0 or o >= end:
            return None
        return (o, self.owner_of(o))

    def conflict_individual(self, txn, offsets, int64_t mark_delete, acked):
        """Why acking ``offsets`` in ``txn`` conflicts, or None."""
        cdef int64_t o
        cdef bint check_acked = len(acked) > 0
        mine = self.sets.get(txn)
        others = [(t, c) for t, c in self.cumulative.items() if t != txn]
        for o in offsets:
            if o < mark_delete or (check_acked and acked.contains(o)):
                return (o, "already acknowledged", None)
            if self.n_held and self.held.contains(o) and (mine is None or not mine.contains(o)):
                return (o, "pending in another transaction", self.owner_of(o))
            for t, c in others:
                if o <= c:
                    return (o, "covered by another transaction's cumulative ack", t)
        return None

    def conflict_cumulative(self, txn, int64_t offset, int64_t mark_delete):
        """Why a cumulative ack at ``offset`` in ``txn`` conflicts, or None."""
        if offset < mark_delete:
            return (offset, "already acknowledged", None)
        for t, s in self.sets.items():
            if t != txn:
                first = s.next_acked(_NO_OFFSET)
                if first is not None and first[0] <= offset:
                    return (first[0], "pending in another transaction", t)
        for t in self.cumulative:
            if t != txn:
                return (self.cumulative[t], "another transaction holds a cumulative ack", t)
        return None

    cdef object _set_of(self, txn, bint create):
        """The AckSet of ``txn`` (created when ``create``), or None."""
        if txn is self.last_txn:
            return self.last_set
        s = self.sets.get(txn)
        if s is None:
            if not create:
                return None
            s = self.sets[txn] = AckSet()
        u = self.unlogged.get(txn)
        if u is None:
            u = self.unlogged[txn] = []
        self.last_txn, self.last_set, self.last_unlogged = txn, s, u
        return s

    cpdef int add_one(self, txn, int64_t offset, int64_t mark_delete, acked) except -2:
        """Check and record one individual ack of ``offset`` in ``txn``: 1
        when it is newly held, 0 when ``txn`` held it already, -1 on a
        conflict (nothing changed; :meth:`conflict_individual` says why)."""
        if offset < mark_delete:
            return -1
        if self.cumulative:
            for t, c in self.cumulative.items():
                if t != txn and offset <= c:
                    return -1
        cdef AckSet s
        if self.n_held and self.held.contains(offset):
            s = self._set_of(txn, False)
            return 0 if s is not None and s.contains(offset) else -1
        if type(acked) is AckSet:          # (a cursor's; C calls)
            if (<AckSet>acked).n and (<AckSet>acked).contains(offset):
                return -1
        elif acked is not None and len(acked) and acked.contains(offset):
            return -1
        s = self._set_of(txn, True)
        s.add_range(offset, offset + 1)
        self.held.add_range(offset, offset + 1)
        self.last_unlogged.append(offset)
        self.n_held += 1
        if DEBUG:
            self._debug_changed()
        return 1

    def add(self, txn, offsets):
        """Hold ``offsets`` in ``txn``; return those that were new to it
        (held by no transaction before)."""
        cdef int64_t o
        new = []
        seen = set()
        for o in offsets:
            if (self.n_held and self.held.contains(o)) or o in seen:
                continue
            seen.add(o)
            new.append(o)
        if new:
            arr = np.asarray(new, np.int64)
            s = self._set_of(txn, True)
            add_many(s, arr)
            add_many(self.held, arr)
            self.last_unlogged.extend(new)
            self.n_held += len(new)
        if DEBUG:
            self._debug_changed()
        return new

    def conflict_range(self, txn, int64_t start, int64_t end, int64_t mark_delete, acked):
        """:meth:`conflict_individual` of the offsets [start, end), by
        ranges: the same answer (its lowest conflicting offset)."""
        cdef int64_t o, a, b
        if end <= start:
            return None
        if start < mark_delete:
            return (start, "already acknowledged", None)
        found = []                   # (offset, rank as conflict_individual checks them, answer)
        if len(acked):
            r = acked.next_acked(start)
            if r is not None and r[0] < end:
                o = max(r[0], start)
                found.append((o, 0, (o, "already acknowledged", None)))
        if self.n_held:
            mine = self.sets.get(txn)
            r = self.held.next_acked(start)
            while r is not None and r[0] < end:
                a = max(r[0], start)
                b = min(r[1], end)
                if mine is None or mine.count_in(a, b) != b - a:
                    for o in range(a, b):
                        if mine is None or not mine.contains(o):
                            found.append((o, 1, (o, "pending in another transaction", self.owner_of(o))))
                            break
                    break
                if r[1] >= end:
                    break
                r = self.held.next_acked(r[1])
        for t, c in self.cumulative.items():
            if t != txn and start <= c:
                found.append((start, 2, (start, "covered by another transaction's cumulative ack", t)))
                break
        if not found:
            return None
        return min(found, key=lambda f: (f[0], f[1]))[2]

    def add_range(self, txn, int64_t start, int64_t end):
        """Hold [start, end) in ``txn`` (checked by :meth:`conflict_range`:
        any offset of it already held is ``txn``'s); return how many were new."""
        if end <= start:
            return 0
        held = self.held
        if self.n_held and held.count_in(start, end):
            new = [o for o in range(start, end) if not held.contains(o)]
        else:
            new = range(start, end)
        s = self._set_of(txn, True)
        s.add_range(start, end)
        cdef Py_ssize_t n = held.add_range(start, end)
        self.last_unlogged.extend(new)
        self.n_held += n
        if DEBUG:
            self._debug_changed()
        return n

    def add_cumulative(self, txn, int64_t offset):
        """Hold everything up to and including ``offset`` in ``txn`` (framed
        in the log by the caller before)."""
        self.framed_txns.add(txn)
        if offset > self.cumulative.get(txn, -1):
            self.cumulative[txn] = offset
        if DEBUG:
            self._debug_changed()

    def ranges_of(self, txn):
        """``[(start, end)]`` of the offsets ``txn`` acked individually here."""
        s = self.sets.get(txn)
        return [] if s is None else s.ranges()

    def peek_cumulative(self, txn):
        """The cumulative ack ``txn`` holds here, or -1."""
        return self.cumulative.get(txn, -1)

    def peek(self, txn):
        """(individual offsets, cumulative offset or -1) of ``txn``, kept."""
        return _expand(self.ranges_of(txn)), self.cumulative.get(txn, -1)

    def take(self, txn):
        """Remove and return (individual offsets, cumulative offset or -1) of ``txn``."""
        ranges = self.ranges_of(txn)
        result = (_expand(ranges), self.cumulative.get(txn, -1))
        self.drop(txn, ranges)
        return result

    def drop(self, txn, list ranges=None):
        """Remove what ``txn`` holds here, as :meth:`take` does, without
        listing its offsets (a commit applied them as ranges). ``ranges``
        is its :meth:`ranges_of` when the caller has it already."""
        if ranges is None:
            ranges = self.ranges_of(txn)
        s = self.sets.pop(txn, None)
        self.unlogged.pop(txn, None)
        self.framed_txns.discard(txn)
        if txn is self.last_txn or txn == self.last_txn:
            self.last_txn = self.last_set = self.last_unlogged = None
        if s is not None:
            remove = self.held.remove_range
            for a, b in ranges:
                self.n_held -= remove(a, b)
        self.cumulative.pop(txn, None)
        if DEBUG:
            self._debug_changed()

    def take_unlogged(self, txn):
        """The offsets ``txn`` recorded since they were last taken (an int64
        array, in ack order), or None; they count as logged from now on."""
        u = self.unlogged.get(txn)
        if not u:
            return None
        self.unlogged[txn] = []
        self.framed_txns.add(txn)
        if txn is self.last_txn:
            self.last_unlogged = self.unlogged[txn]
        return np.asarray(u, np.int64)

    def framed(self, txn):
        """Whether some ack of ``txn`` is in the pending-ack log (its end
        then needs a COMMIT or ABORT frame there)."""
        return txn in self.framed_txns

    def has_unlogged(self, txn):
        """Whether ``txn`` recorded offsets not yet taken for the log."""
        return bool(self.unlogged.get(txn))

    def unlogged_txns(self):
        """The transactions with offsets not yet taken for the log."""
        return [t for t, u in self.unlogged.items() if u]

    def mark_logged(self):
        """Everything held is in the log (replayed from it, or compacted
        into a snapshot of it)."""
        for t in list(self.unlogged):
            self.unlogged[t] = []
        self.framed_txns.update(self.sets)
        self.framed_txns.update(self.cumulative)
        self.last_txn = self.last_set = self.last_unlogged = None


    cdef _debug_changed(self):
        """After a change (TXMQ_DEBUG): the full check when it is due (_debug.pxd)."""
        if check_due(&self.debug_changes, &self.debug_next, self.n_held + len(self.cumulative)):
            self.check_invariants()

    def check_invariants(self):
        """Raise AssertionError unless the transactions' ack sets are
        disjoint, non-empty, and together exactly the held set; the held
        count is right; every unlogged offset is held by its transaction."""
        cdef Py_ssize_t total = 0
        union = AckSet()
        for t, s in self.sets.items():
            if not len(s):
                raise AssertionError(f"PendingAckTable: {t} keeps an empty ack set")
            for a, b in s.ranges():
                if union.count_in(a, b):
                    raise AssertionError(f"PendingAckTable: [{a}, {b}) of {t} is held by another transaction too")
                union.add_range(a, b)
            total += s.count()
        if total != self.n_held or self.held.count() != total:
            raise AssertionError(f"PendingAckTable: {total} offsets in the transactions' sets, count "
                                 f"{self.n_held}, held set {self.held.count()}")
        if union.ranges() != self.held.ranges():
            raise AssertionError("PendingAckTable: the held set is not the union of the transactions' sets")
        for t, u in self.unlogged.items():
            s = self.sets.get(t)
            if u and (s is None or any(not s.contains(o) for o in u)):
                raise AssertionError(f"PendingAckTable: an unlogged offset of {t} is not held by it")

    def to_bytes(self):
        """u32 txn count, then per txn: u64 hi, u64 lo, i64 cumulative (-1:
        none), u32 n, n i64 offsets. ``txn`` objects must have ``.words``."""
        parts = [b""]
        txns = self.txns()
        count = 0
        for t in txns:
            hi, lo = t.words
            offs = self.peek(t)[0]
            parts.append(packed_txn(hi, lo) + packed_i64(self.cumulative.get(t, -1))
                         + packed_u32(len(offs)) + np.asarray(offs, "<i8").tobytes())
            count += 1
        parts[0] = packed_u32(count)
        return b"".join(parts)


cdef list _expand(list ranges):
    """The offsets of ``[(start, end)]`` ranges, in order."""
    cdef list out = []
    cdef int64_t a, b, o
    for r in ranges:
        a, b = r
        for o in range(a, b):
            out.append(o)
    return out


# What ``consumer_ack`` needs of the client layer, given by it at import
# (``bind_consumer_ack``): imports point down, so this module names none of it.
cdef object _Transaction = None      # txmq.client.transaction.Transaction
cdef object _OPEN = None             # TxnState.OPEN
cdef object _invariant = None        # the txmq.dispatch.lane_invariant module (its DEBUG switch)


def bind_consumer_ack(transaction_type, open_state, invariant_module):
    """Give :func:`consumer_ack` the Transaction class, the OPEN state and
    the lane-invariant module (txmq.client.consumer does, at import)."""
    global _Transaction, _OPEN, _invariant
    _Transaction, _OPEN, _invariant = transaction_type, open_state, invariant_module


def consumer_ack(self, messages, txn=None):
    """Acknowledge a Message, a MessageId, a list of them, or a
    ``pyarrow.RecordBatch`` from :meth:`receive_batch`.

    With ``txn`` the ack is pending in that transaction: it takes effect
    when the transaction commits, and is dropped (the messages come
    again) when it aborts. Acking a message that another open
    transaction holds, or that is already acknowledged, raises
    :class:`~txmq.errors.TransactionConflictError` and changes nothing.

    Without ``txn``, acking a message that an open transaction holds as
    a pending ack raises :class:`~txmq.errors.TransactionConflictError`
    (``other`` is that transaction) and acknowledges none of
    ``messages``: the transaction decides that message's fate.
    """
    # ``Consumer.ack``: ``ack(m, txn=)`` of one received message, the
    # README's loop, in this one compiled call; every other ack is the
    # general ``Consumer._ack``'s, which checks and raises the same way.
    cdef Message m
    if (txn is not None and type(messages) is Message and type(txn) is _Transaction and not self.closed
            and txn._broker is self._broker):
        meta = txn._meta
        if meta.owner is not None:
            meta.check_owner()
        m = <Message>messages
        pending_acks = self._sub.pending_acks
        if _invariant.DEBUG or not _ack_in(pending_acks, meta, m._topic, m._partition, m.offset, _OPEN):
            pending_acks.ack_one(meta, m._topic, m._partition, m.offset)    # (registers, raises; checks the lane)
        return
    self._ack(messages, txn)


def ack_in(pending_acks, meta, topic, partition, offset, open_state):
    """Record one individual ack of ``(topic, partition, offset)`` in the
    transaction ``meta`` on the pending acks ``pending_acks`` of a
    subscription (txmq.dispatch.pending_acks): the one place ``ack(m,
    txn=)`` records, compiled, since the README's per-message loop calls it
    100 times per transaction. True when the ack is recorded (or was
    already held by ``meta``); False, with nothing changed, in every other
    case (an id of another topic, no such partition or offset, a
    transaction not registered with the subscription yet or no longer
    ``open_state``, a conflict): ``PendingAcks.ack_one`` then raises what
    is wrong, or registers and records."""
    return _ack_in(pending_acks, meta, topic, partition, offset, open_state)


cdef bint _ack_in(pending_acks, meta, topic, partition, offset, open_state) except -1:
    cdef int64_t off
    cdef Py_ssize_t index
    cdef list lanes
    cdef int r
    cdef PendingAckTable table
    # (topic name, subscription, its lanes, the coordinator's key of it,
    # its lock): fixed for the life of the pending acks
    cdef tuple route = <tuple?>pending_acks.route
    name = route[0]
    if topic is not name and topic != name:
        return False
    if type(partition) is not int or type(offset) is not int:
        return False
    lanes = <list?>route[2]
    if not 0 <= partition < len(lanes):      # (compared as Python ints: any int is refused, none overflows)
        return False
    index = partition
    lane = lanes[index]
    segments = lane.partition._segments
    if not segments or not 0 <= offset < segments[len(segments) - 1].next_offset:
        return False
    off = offset
    if meta.subscriptions.get(route[3]) is not pending_acks:
        return False
    lock = route[4]
    lock.acquire()           # (not ``with``: its __enter__ and __exit__ cost twice the calls)
    try:
        if meta.state is not open_state:
            return False
        cursor = lane.cursor
        table = <PendingAckTable?>lane.pending
        r = table.add_one(meta.id, off, cursor.mark_delete, cursor.acked)
        if r < 0:
            return False
        if r > 0:            # (Subscription._hold of one offset)
            if lane.outstanding.pop(off, None) is None:
                ranges = lane.ranges
                if ranges:
                    cut_delivery(ranges, off)
        return True
    finally:
        lock.release()
