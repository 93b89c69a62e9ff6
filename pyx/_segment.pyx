# cython: boundscheck=False, wraparound=False, cdivision=True
"""A partition log's segment: one file of batches, mapped, with its sparse
indexes (docs/FORMAT.md).

Segment file ``<base>.log``::

    batch 0 | batch 1 | ... | batch n-1 | zeros to the capacity

Whole batches lie back to back from byte 0, each in the layout of
``_batch_layout.pxd`` (encoded and decoded by ``_batch.pyx``); batch i+1's
base offset is batch i's base offset plus its count. Bytes past the last
batch are zero: a zero magic is the clean end of a segment; anything else
that fails a check is a torn or corrupt tail. A sealed segment ends at its
last batch.

Its file, mapping, descriptor budget and disk reservation are
``txmq._segment_file`` (:class:`SegmentFile`, which :class:`Segment`
extends with the batches).

Each message byte is copied once, from the caller's buffers into the page
cache behind the mapping, by one of two sinks. A fresh page of a shared
file mapping costs a zero-fill fault on its first store (about 2.8 us per
4 KiB on a virtual machine, ~70 us per 100 KB batch), which ``write(2)``
does not pay; a syscall costs about 1 us. So a batch above
``SMALL_BATCH_BYTES`` is written with one ``pwritev`` whose pieces are the
encoded header and offsets and the caller's key and value buffers, and a
smaller one is copied into the writable mapping, where many batches share
one fault, unless it is the first to start in the page a large batch's
``pwritev`` ended in (that page is in the page cache but not in the
process's page tables: a store would take a write fault, about 3 us, for
a transaction's marker after its data; the small batches after it share
one fault again). Readers see either through the mapping as soon as the
append returns.

The indexes (offset to position, publish time to offset) are sparse, one
entry per ``index_interval`` bytes, and derived: an entry is trusted only
once the batch it names passed a full check.

Quarantine (``txmq._quarantine``): bad bytes in the middle of a segment
are skipped by every walk, their offsets lost, the batches around them
kept; :meth:`Segment.find_batch` finds where the sound batches resume.

Bounds: every position read from a file goes through ``check_batch`` before
it is dereferenced, so this module turns off Cython's own checks.
"""
from cpython.pyport cimport PY_SSIZE_T_MAX
from libc.errno cimport errno, EINTR, ENOSPC, EDQUOT
from libc.stdint cimport uint16_t, uint32_t, int16_t, int32_t, int64_t, uint64_t
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.string cimport memcpy
from posix.uio cimport iovec
from posix.unistd cimport pread

import os
import time


from txmq.errors import CorruptLogError, StorageFullError

from _bytes cimport load_u16, load_u32, load_i32, load_i64, load_u64, NOGIL_THRESHOLD, pwritev_all
from _batch_layout cimport *
from txmq._budget cimport Budget
from txmq._segment_file cimport SegmentFile
from txmq._segment_file import SegmentClosedError
from txmq._sparse_index cimport SparseIndex
from txmq._quarantine cimport QuarantineRanges
from txmq._batch cimport (BatchSpec, Pieces, seal, free_pieces, check_batch, batch_info,
                          decode_batch)
from txmq._arrow_batch cimport arrow_views, arrow_record_batch

cdef enum:
    # Below this a batch is copied into the mapping, above it written with
    # pwritev: the crossover of a per-page fault and a per-batch syscall.
    SMALL_BATCH_BYTES = 2048
    PAGE_BYTES = 4096

# Batches this module wrote with pwritev rather than into the mapping, in
# this process (what a test of the choice counts; one increment per syscall).
cdef uint64_t pwritev_batches = 0


def pwritev_count():
    """How many batches this process's segments wrote with pwritev."""
    return pwritev_batches


cdef ssize_t _store(Pieces *pieces, char *dst, int fd, Py_ssize_t start) noexcept nogil:
    """Seal the encoded batch ``pieces`` and copy it once: into ``dst``
    (the writable mapping at ``start``) when it is not NULL, else with
    ``pwritev`` at ``start`` of ``fd``; -1 (errno set) when that fails."""
    cdef Py_ssize_t i
    global pwritev_batches
    seal(pieces)
    if dst == NULL:
        pwritev_batches += 1
        return pwritev_all(fd, pieces.iov, pieces.n, start)
    for i in range(pieces.n):
        memcpy(dst, pieces.iov[i].iov_base, pieces.iov[i].iov_len)
        dst += pieces.iov[i].iov_len
    return 0


def now_ms():
    """Wall-clock milliseconds since the epoch: the default clock of a
    partition, which stamps publish times with it (compiled: every append
    reads it)."""
    return time.time_ns() // 1_000_000



cdef class Segment(SegmentFile):
    """One segment file of a partition log, mapped, with its sparse indexes.
    Its descriptor and mapping come and go with its ``budget`` (default:
    :func:`default_budget`); every method reopens them as needed."""
    cdef readonly int64_t base_offset
    cdef readonly int64_t next_offset
    cdef readonly int64_t last_publish_time
    cdef readonly uint32_t last_crc                 # CRC field of the last batch append() wrote
    cdef Py_ssize_t written_to                      # end of the last large batch's pwritev, up to
                                                    # its page's end (0: a small batch took it)
    cdef Py_ssize_t last_start                      # where the batch append() wrote last starts (-1: none)
    cdef bint last_by_pwritev                       # ... and whether it went by pwritev
    # CRC is checked once per batch per process. Verified: the prefix
    # [0, verified_end) read in order, and the tail [verified_from, size)
    # that recovery scanned or this process appended.
    cdef Py_ssize_t verified_end
    cdef Py_ssize_t verified_from
    cdef SparseIndex index                          # offset and time indexes, in memory
    cdef public Py_ssize_t index_faults             # index entries found wrong and bypassed
    cdef QuarantineRanges quarantine               # quarantined byte ranges (txmq._quarantine)

    def __init__(self, path, int64_t base_offset, Py_ssize_t capacity, bint writable,
                 Py_ssize_t index_interval=4096, Budget budget=None):
        self.base_offset = base_offset
        self.next_offset = base_offset
        self.index = SparseIndex(index_interval)
        self.quarantine = QuarantineRanges()
        self.verified_end = 0
        self.verified_from = PY_SSIZE_T_MAX
        self.last_start = -1
        SegmentFile.__init__(self, path, capacity, writable, budget)

    # -- appending ---------------------------------------------------------

    cpdef int64_t append(self, BatchSpec spec, uint16_t flags=0, uint64_t txn_hi=0,
                         uint64_t txn_lo=0, int64_t producer_id=-1, int16_t producer_epoch=-1,
                         int32_t base_sequence=-1, int64_t publish_time=0) except -2:
        """Write one batch at the end; return its base offset, or -1 if full."""
        cdef Py_ssize_t need = spec.encoded_size()
        cdef Py_ssize_t start = self.size
        cdef int64_t base = self.next_offset
        if not self.writable:
            raise PermissionError(f"{self.path} is open read-only")
        if start + need > self.capacity:
            return -1
        self._use()
        try:
            self._append(spec, need, start, base, flags, txn_hi, txn_lo, producer_id, producer_epoch,
                         base_sequence, publish_time)
        finally:
            self._unuse()
        return base

    cdef int _append(self, BatchSpec spec, Py_ssize_t need, Py_ssize_t start, int64_t base, uint16_t flags,
                     uint64_t txn_hi, uint64_t txn_lo, int64_t producer_id, int16_t producer_epoch,
                     int32_t base_sequence, int64_t publish_time) except -1:
        if self._map is not None and self._map.torn():
            self._raise_torn(start)
        self._reserve(start + need)
        # Small batches are stored through the mapping (a page's zero-fill
        # fault is shared by many of them); large ones skip the faults with
        # pwritev (one syscall per batch). Either way, one copy.
        # A store into an unreserved page of a full disk is a SIGBUS, so
        # without a reservation every batch goes through pwritev.
        # A small batch that starts in the page the last pwritev ended in
        # goes by pwritev too: that page is in the page cache but not in
        # this process's page tables, and a store would take a write fault
        # (a transaction's marker after its data).
        cdef bint store = need <= SMALL_BATCH_BYTES and not self.unreserved and start >= self.written_to
        self._write(spec, self._map.base + start if store else NULL, start, base, flags, txn_hi, txn_lo,
                    producer_id, producer_epoch, base_sequence, publish_time)
        if store:
            pass
        elif need > SMALL_BATCH_BYTES:
            self.written_to = (start + need + PAGE_BYTES - 1) & ~(<Py_ssize_t>PAGE_BYTES - 1)
        else:      # (the one small batch after it: the next ones share a fault of that page)
            self.written_to = 0
        if self._map.torn():             # the store went to a page the file no longer has
            self._raise_torn(start)
        self.last_start = start
        self.last_by_pwritev = not store
        self.index.add(start, base, publish_time)
        if self.verified_from > start:      # a segment never recovered: all of it is ours
            self.verified_from = start
        self.size = start + need
        self.next_offset = base + spec.count
        self.last_publish_time = publish_time
        return 0

    def last_batch(self):
        """A copy of the batch :meth:`append` wrote last (None when it wrote
        none): read with ``pread`` when it went by pwritev (its pages are in
        the page cache but not in this process's page tables, so reading
        them through the mapping would take a fault per page), else from
        the mapping it was just stored into. The GIL is kept: the caller
        holds its partition's lock, and a thread that let the GIL go there
        would make every other appender wait behind it."""
        cdef Py_ssize_t start = self.last_start, n = self.size - self.last_start, got = 0
        cdef ssize_t rc
        cdef char *dst
        if start < 0 or n <= 0:
            return None
        self._use()
        try:
            if not self.last_by_pwritev:
                return PyBytes_FromStringAndSize(self._map.base + start, n)
            data = PyBytes_FromStringAndSize(NULL, n)
            dst = <char *>data
            while got < n:
                rc = pread(self.fd, dst + got, n - got, start + got)
                if rc < 0 and errno == EINTR:
                    continue
                if rc <= 0:
                    raise OSError(errno if rc < 0 else 0,
                                  f"{self.path}: {got} of the last batch's {n} bytes read back")
                got += rc
            return data
        finally:
            self._unuse()

    def append_encoded(self, data):
        """Write one already-encoded batch ``data`` at the end; return its
        base offset, or -1 if full. Its header must name ``next_offset``
        and pass every check (CRC included), else ValueError. Recovery uses
        it to put back a transaction's batch from the copy in a
        coordinator's decision record (docs/FORMAT.md)."""
        cdef const unsigned char[::1] view = data
        cdef Py_ssize_t need = len(data)
        cdef Py_ssize_t start = self.size
        cdef int64_t base = self.next_offset
        cdef str reason
        if not self.writable:
            raise PermissionError(f"{self.path} is open read-only")
        if need == 0:
            raise ValueError("an empty batch")
        reason = check_batch(<const char *>&view[0], need, base, True, NULL)
        if reason is not None or load_u32(<const char *>&view[0] + LENGTH_OFFSET) != need:
            raise ValueError(f"not a batch at offset {base}: {reason or 'length mismatch'}")
        if start + need > self.capacity:
            return -1
        self._use()
        try:
            self._reserve(start + need)
            n = os.pwrite(self.fd, data, start)
            while n < need:
                n += os.pwrite(self.fd, memoryview(data)[n:], start + n)
        finally:
            self._unuse()
        publish_time = load_i64(<const char *>&view[0] + PUBLISH_TIME_OFFSET)
        self.index.add(start, base, publish_time)
        if self.verified_from > start:
            self.verified_from = start
        self.last_start = start
        self.last_by_pwritev = True
        self.size = start + need
        self.next_offset = base + load_i32(<const char *>&view[0] + COUNT_OFFSET)
        self.last_publish_time = publish_time
        return base

    cdef int _write(self, BatchSpec spec, char *dst, Py_ssize_t start, int64_t base,
                    uint16_t flags, uint64_t txn_hi, uint64_t txn_lo, int64_t producer_id,
                    int16_t producer_epoch, int32_t base_sequence, int64_t publish_time) except -1:
        """Encode the batch and copy its pieces once: into ``dst`` (the
        writable mapping at ``start``) when it is not NULL, else with one
        ``pwritev`` at ``start`` of the file."""
        cdef Pieces pieces
        cdef Py_ssize_t i
        cdef ssize_t rc
        pieces.meta = NULL
        pieces.iov = NULL
        try:
            spec.encode(&pieces, flags, base, txn_hi, txn_lo, producer_id, producer_epoch,
                        base_sequence, publish_time)
            # (a small batch keeps the GIL: handing it over and taking it
            # back would cost more than the copy; see _redolog.pwrite_all)
            if pieces.length >= NOGIL_THRESHOLD:
                with nogil:
                    rc = _store(&pieces, dst, self.fd, start)
            else:
                rc = _store(&pieces, dst, self.fd, start)
            if rc < 0:
                if errno == ENOSPC or errno == EDQUOT:
                    raise StorageFullError(self.path, pieces.length, errno)
                raise OSError(errno, f"cannot append {pieces.length} bytes: {os.strerror(errno)}")
            self.last_crc = load_u32(pieces.meta + CRC_OFFSET)      # (sealed by _store)
            return 0
        finally:
            free_pieces(&pieces)

    # -- recovery ----------------------------------------------------------

    def recover(self, Py_ssize_t start_pos, int64_t start_offset, bint quarantine=False,
                bint holes_end=False, Py_ssize_t cut_from=-1):
        """Scan and index batches from ``start_pos``; cut a torn tail.

        Returns ``None`` when the scan reached a clean end (zeroed bytes or
        the file end), else ``(position, reason)`` of the first batch that
        failed; bytes from there on are discarded (zeroed or truncated).
        With ``quarantine``, a batch that fails but is followed by a sound
        one (:meth:`find_batch`) is quarantined instead and the scan goes on
        there, unless (``holes_end``) the bad bytes start with a zeroed
        header: the hole a power loss leaves where write-back had not
        reached, which ends the log. A bad batch at or past ``cut_from``
        (when not -1) ends the log too: bytes there were never flushed.
        """
        self._use()
        try:
            return self._recover(start_pos, start_offset, quarantine, holes_end, cut_from)
        finally:
            self._unuse()

    cdef _recover(self, Py_ssize_t start_pos, int64_t start_offset, bint quarantine, bint holes_end,
                  Py_ssize_t cut_from):
        cdef Py_ssize_t pos = start_pos, limit
        cdef int64_t expected = start_offset
        cdef const char *base
        cdef str reason = None
        if self._map is None or (self.fresh and start_pos == 0):
            self.size = 0
            self.next_offset = start_offset
            self.allocated = 0
            return None if start_pos == 0 else (start_pos, "segment is empty")
        base = self._map.base
        # Past the file's end the mapping has no pages (the file grows with
        # its reservation): the scan stops there.
        limit = min(self._map.size, os.fstat(self.fd).st_size)
        while pos < limit:
            if self.quarantine.n:
                pos = self._hop(pos, &expected)
                if pos >= limit:
                    break
            if limit - pos >= 8 and load_u64(base + pos) == 0:
                if self._zero_from(pos, limit):
                    break
                reason = "non-zero bytes after a zeroed batch header"
                if holes_end:
                    break
            else:
                reason = check_batch(base + pos, limit - pos, expected, True, NULL)
            if reason is not None:
                found = self._find_batch(pos + 8, expected + 1, limit) \
                    if quarantine and (cut_from < 0 or pos < cut_from) else None
                if found is None:
                    break
                self.quarantine.add(pos, found[0], expected, found[1], reason)
                expected = found[1]
                pos = found[0]
                reason = None
                continue
            self.index.add(pos, expected, load_i64(base + pos + PUBLISH_TIME_OFFSET))
            self.last_publish_time = load_i64(base + pos + PUBLISH_TIME_OFFSET)
            expected += load_i32(base + pos + COUNT_OFFSET)
            pos += load_u32(base + pos + LENGTH_OFFSET)
        if self._map.torn():
            self._raise_torn(pos)
        self.size = pos
        self.verified_from = start_pos      # [0, start_pos) was trusted, not checked
        self.verified_end = 0
        self.next_offset = expected
        # Whatever lies past the log end may be an unreserved hole (a sparse
        # file left at full capacity by a crash): reserve again from here.
        self.allocated = pos
        if reason is not None:
            if self.writable:
                self.truncate_at(pos, expected)
            return (pos, reason)
        return None

    # -- quarantine -----------------------------------------------------------

    def find_batch(self, Py_ssize_t pos, int64_t min_offset, Py_ssize_t limit=-1):
        """``(position, base offset)`` of the first batch at or after
        ``pos`` (8-byte aligned) and below ``limit`` (default: the log end)
        whose header and CRC check and whose base offset is at least
        ``min_offset``; None when there is none. A length read from a bad
        header is never followed: each candidate is checked against the
        bytes left below ``limit``, so no byte pattern makes the scan read
        outside the mapping."""
        if self.shut:
            return None
        self._use()
        try:
            return self._find_batch(pos, min_offset, limit)
        finally:
            self._unuse()

    cdef _find_batch(self, Py_ssize_t pos, int64_t min_offset, Py_ssize_t limit):
        cdef Py_ssize_t q
        cdef const char *p
        cdef uint64_t head = <uint64_t>BATCH_MAGIC | (<uint64_t>BATCH_VERSION << 32)
        if self._map is None or self._map.base == NULL:
            return None
        if limit < 0:
            limit = self.size
        limit = min(limit, self._map.size)
        q = (pos + 7) & ~(<Py_ssize_t>7)
        p = self._map.base
        while q + HEADER_SIZE <= limit:
            if (load_u64(p + q) & 0xFF_FFFF_FFFF) == head and load_i64(p + q + BASE_OFFSET_OFFSET) >= min_offset:
                if check_batch(p + q, limit - q, -1, True, NULL) is None:
                    return (q, load_i64(p + q + BASE_OFFSET_OFFSET))
            q += 8
        if self._map.torn():
            self._raise_torn(pos)
        return None

    def check_at(self, Py_ssize_t pos, int64_t expected=-1):
        """None when a sound batch (CRC checked) whose base offset is
        ``expected`` (-1: any) starts at ``pos`` of the mapped file, else
        why not. Only the file's bytes are read: an active segment is
        mapped past its file's end, where a read would fault."""
        cdef Py_ssize_t limit
        if self.shut:
            return "segment is closed"
        self._use()
        try:
            if self._map is None or self._map.base == NULL:
                return "segment is empty"
            limit = min(self._map.size, os.fstat(self.fd).st_size)
            if pos < 0 or pos % 8 or pos >= limit:
                return "position outside the segment"
            return check_batch(self._map.base + pos, limit - pos, expected, True, NULL)
        finally:
            self._unuse()

    def quarantine_add(self, Py_ssize_t pos, Py_ssize_t end_pos, int64_t first, int64_t end, str reason):
        """Quarantine bytes [pos, end_pos) holding offsets [first, end):
        a range found before (the partition's quarantine file) or one that
        ends the segment (its batches stop short of the next segment)."""
        if not (0 <= pos <= end_pos and first <= end):
            raise ValueError(f"bad quarantine range {pos}..{end_pos}, offsets {first}..{end}")
        self.quarantine.add(pos, end_pos, first, end, reason)
        if end_pos > self.size:
            self.size = end_pos
        if end > self.next_offset:
            self.next_offset = end

    def quarantined(self):
        """The quarantined ranges, by position: (position, end position,
        first offset, end offset, reason)."""
        return self.quarantine.list()

    cdef Py_ssize_t _hop(self, Py_ssize_t pos, int64_t *expected):
        """``pos``, or the end of the quarantined range(s) starting there
        (``expected`` moves to the offset after them)."""
        return self.quarantine.hop(pos, expected, &self.verified_end)

    cdef Py_ssize_t _good_from(self, Py_ssize_t pos, int64_t expected) except -2:
        """The position of the first sound batch at or after ``pos``, which
        should hold ``expected``: past quarantined ranges, and past bad
        bytes met now, which are quarantined (to the next sound batch, or
        the segment's end). ``self.size`` at the end."""
        cdef str reason
        cdef bint verify
        while True:
            if self.quarantine.n:
                pos = self._hop(pos, &expected)
            if pos >= self.size:
                return self.size
            verify = self.verified_end <= pos < self.verified_from
            reason = check_batch(self._map.base + pos, self.size - pos, expected, verify, NULL)
            if self._map.torn():         # zeros of a file that shrank: not damage to quarantine
                self._raise_torn(pos)
            if reason is None:
                if verify and pos == self.verified_end:
                    self.verified_end = pos + load_u32(self._map.base + pos + LENGTH_OFFSET)
                    if self.verified_end >= self.verified_from:
                        self.verified_from = 0
                return pos
            found = self._find_batch(pos + 8, expected + 1, self.size)
            if found is None or found[1] >= self.next_offset:
                self.quarantine.add(pos, self.size, expected, self.next_offset, reason)
                return self.size
            self.quarantine.add(pos, found[0], expected, found[1], reason)

    def first_position(self):
        """The position of the segment's first sound batch, past quarantined
        bytes (a bad first batch met now is quarantined); the log end when
        there is none."""
        if self.size == 0:
            return 0
        self._pin()
        try:
            return self._good_from(0, self.base_offset)
        finally:
            self._unpin()

    def next_position(self, Py_ssize_t pos):
        """The position of the batch after the one at ``pos`` (a checked
        one), past quarantined bytes; the log end when there is none."""
        cdef Sections s
        self._pin()
        try:
            s = self._checked(pos)
            return self._good_from(pos + load_u32(self._map.base + pos + LENGTH_OFFSET),
                                   load_i64(self._map.base + pos + BASE_OFFSET_OFFSET)
                                   + load_i32(self._map.base + pos + COUNT_OFFSET))
        finally:
            self._unpin()

    def reindex(self):
        """Rebuild the sparse indexes from the batches (an index found wrong)."""
        cdef Py_ssize_t pos = 0
        self._pin()
        try:
            self.index.clear()
            while pos < self.size:
                if self.quarantine.n:
                    pos = self._hop(pos, NULL)
                    if pos >= self.size:
                        break
                self._checked(pos)
                self.index.add(pos, load_i64(self._map.base + pos + BASE_OFFSET_OFFSET),
                              load_i64(self._map.base + pos + PUBLISH_TIME_OFFSET))
                pos += load_u32(self._map.base + pos + LENGTH_OFFSET)
            self.index_faults = 0
        finally:
            self._unpin()

    def verify(self):
        """O(n) check of every batch (magic, length, CRC, offsets, dense
        base offsets): None when sound, else ``(position, reason)``."""
        cdef Py_ssize_t pos = 0
        cdef int64_t expected = self.base_offset
        cdef str reason
        if self.size == 0:
            return None
        self._pin()
        try:
            while pos < self.size:
                if self.quarantine.n:
                    pos = self._hop(pos, &expected)
                    if pos >= self.size:
                        break
                reason = check_batch(self._map.base + pos, self.size - pos, expected, True, NULL)
                if reason is not None:
                    return (pos, reason)
                expected += load_i32(self._map.base + pos + COUNT_OFFSET)
                pos += load_u32(self._map.base + pos + LENGTH_OFFSET)
            if self.quarantine.n:
                self._hop(pos, &expected)
            if expected != self.next_offset:
                return (pos, f"batches end at offset {expected}, segment claims {self.next_offset}")
            return None
        finally:
            self._unpin()

    def truncate_at(self, Py_ssize_t pos, int64_t next_offset):
        """Drop every byte from ``pos`` on, where the batch of ``next_offset``
        started (a torn tail, or the batches after a corrupt one)."""
        if not self.writable:
            raise PermissionError(f"{self.path} is open read-only")
        self._use()
        try:
            self._truncate_at(pos, next_offset)
        finally:
            self._unuse()

    cdef _truncate_at(self, Py_ssize_t pos, int64_t next_offset):
        self.index.truncate(pos, next_offset)
        self.quarantine.drop_from(pos)
        # Shrinking the file frees the tail's blocks; the next reservation
        # brings back zeros.
        os.ftruncate(self.fd, pos)
        self.allocated = pos
        self.size = min(self.size, pos)
        self.last_start = -1
        self.verified_end = min(self.verified_end, pos)
        self.verified_from = min(self.verified_from, pos)
        self.next_offset = next_offset

    # -- indexes on disk ---------------------------------------------------

    def index_entries(self):
        """(offsets, positions, timestamps, time_offsets) as numpy views."""
        return self.index.entries()

    def load_index(self, offsets, positions, timestamps, time_offsets, Py_ssize_t size,
                   int64_t next_offset):
        """Adopt indexes read from disk for a segment known good up to ``size``."""
        self.index.load(offsets, positions, timestamps, time_offsets)
        self.size = size
        self.next_offset = next_offset
        if self._map is not None or self.fd < 0:
            self._use()
            try:
                self._walk_tail()
            finally:
                self._unuse()
        else:
            self._walk_tail()

    cdef _walk_tail(self):
        """From the last index entry to ``size``: the true last publish time
        (the time index is sparse) and the true end, should the file hold
        zeros past its last batch (a trim that a power loss undid). The walk
        starts only from an entry that passed its check (else from byte 0)
        and steps only over batches that pass the structural checks."""
        cdef Py_ssize_t pos = 0
        cdef const char *p
        cdef SparseIndex ix = self.index
        if ix.tn:
            self.last_publish_time = max(self.last_publish_time, ix.time_at(ix.tn - 1))
        if self._map is None or self.size == 0:
            return
        if ix.n and self._idx_entry_ok(ix.n - 1):
            pos = ix.position_at(ix.n - 1)
        p = self._map.base
        while True:
            if self.quarantine.n:
                pos = self._hop(pos, NULL)
            if not (pos + HEADER_SIZE <= self.size and check_batch(p + pos, self.size - pos, -1, False, NULL) is None):
                break
            self.last_publish_time = max(self.last_publish_time, load_i64(p + pos + PUBLISH_TIME_OFFSET))
            pos += load_u32(p + pos + LENGTH_OFFSET)
        if pos + 8 <= self.size and load_u64(p + pos) == 0:
            self.size = pos        # zeros past the last batch: the end is here

    # -- reading -----------------------------------------------------------

    cpdef Py_ssize_t locate(self, int64_t offset) except -2:
        self._pin()
        try:
            return self._locate(offset)
        finally:
            self._unpin()

    cdef Py_ssize_t _locate(self, int64_t offset) except -2:
        """Position of the batch holding ``offset`` (or the first batch after
        it); -1 when ``offset`` is at or past this segment's end."""
        cdef Py_ssize_t pos = 0, i
        cdef const char *p
        cdef int64_t base, expected = self.base_offset
        if offset >= self.next_offset or self.size == 0:
            return -1
        p = self._map.base
        if self.index.n:
            i = self.index.at_or_below(offset)
            if i >= 0:
                pos = self.index.position_at(i)
                expected = self.index.offset_at(i)
                # An index is derived data: trust an entry only when the
                # batch it points at is whole and starts where it says.
                if not self._idx_entry_ok(i):
                    self.index_faults += 1
                    pos = 0
                    expected = self.base_offset
        # _good_from checks each batch it stops at (its CRC once per process).
        pos = self._good_from(pos, expected)
        while pos < self.size:
            base = load_i64(p + pos + BASE_OFFSET_OFFSET)
            if base + load_i32(p + pos + COUNT_OFFSET) > offset:
                return pos
            pos = self._good_from(pos + load_u32(p + pos + LENGTH_OFFSET), base + load_i32(p + pos + COUNT_OFFSET))
        return -1

    def find_time(self, int64_t timestamp):
        self._pin()
        try:
            return self._find_time(timestamp)
        finally:
            self._unpin()

    def _find_time(self, int64_t timestamp):
        """Offset of the first batch published at or after ``timestamp``, or -1."""
        cdef Py_ssize_t pos = 0, i
        cdef int64_t off
        cdef const char *p
        if self.size == 0:
            return -1
        p = self._map.base
        i = self.index.time_before(timestamp)
        if i >= 0:
            # _locate walks to a real batch: compare it with the entry.
            off = self.index.time_offset_at(i)
            pos = self._locate(off)
            if (pos < 0 or load_i64(p + pos + BASE_OFFSET_OFFSET) != off
                    or load_i64(p + pos + PUBLISH_TIME_OFFSET) != self.index.time_at(i)):
                self.index_faults += 1
                pos = 0
        pos = self._good_from(pos, load_i64(p + pos + BASE_OFFSET_OFFSET) if pos else self.base_offset)
        while pos < self.size:
            if load_i64(p + pos + PUBLISH_TIME_OFFSET) >= timestamp:
                return load_i64(p + pos + BASE_OFFSET_OFFSET)
            pos = self._good_from(pos + load_u32(p + pos + LENGTH_OFFSET),
                                  load_i64(p + pos + BASE_OFFSET_OFFSET) + load_i32(p + pos + COUNT_OFFSET))
        return -1

    cdef bint _idx_entry_ok(self, Py_ssize_t i):
        """Whether offset-index entry ``i`` names a real batch: a full check
        (CRC and offsets) of the batch there, since bytes inside a message
        may look like a header. Entries this process made need none; each
        loaded one is checked once."""
        cdef Py_ssize_t pos = self.index.position_at(i)
        if self.index.checked(i):
            return True
        if pos < 0 or pos + HEADER_SIZE > self.size or pos % 8:
            return False
        if check_batch(self._map.base + pos, self.size - pos, self.index.offset_at(i), True, NULL) is not None:
            return False
        self.index.mark_checked(i)
        return True

    cdef Sections _checked(self, Py_ssize_t pos) except *:
        """Check the batch at ``pos`` (CRC once per process) or raise CorruptLogError."""
        cdef Sections s
        cdef bint verify = self.verified_end <= pos < self.verified_from
        if pos < 0 or pos >= self.size or self._map is None or self._map.base == NULL:
            raise CorruptLogError(self.path, pos, "position outside the segment")
        reason = check_batch(self._map.base + pos, self.size - pos, -1, verify, &s)
        if self._map.torn():
            self._raise_torn(pos)
        if reason is not None:
            raise CorruptLogError(self.path, pos, reason)
        if verify and pos == self.verified_end:
            self.verified_end = pos + load_u32(self._map.base + pos + LENGTH_OFFSET)
            if self.verified_end >= self.verified_from:
                self.verified_from = 0      # prefix met tail: everything is checked
        return s

    def batch_at(self, Py_ssize_t pos):
        self._pin()
        try:
            return self._batch_at(pos)
        finally:
            self._unpin()

    def _batch_at(self, Py_ssize_t pos):
        """The checked header of the batch at ``pos``."""
        self._checked(pos)
        return batch_info(self._map.base + pos, pos)

    def txn_batches(self, int64_t offset, uint64_t txn_hi, uint64_t txn_lo, bint copy):
        """The data batches of transaction ``(txn_hi, txn_lo)`` from the
        batch holding ``offset`` to the end, as ``(base offset, count, crc,
        length, bytes or None)`` (``copy``: with their bytes): what a
        commit's decision record names (txmq.transactions.decision)."""
        cdef Py_ssize_t end = self.size, pos
        cdef const char *p
        cdef uint32_t length
        out = []
        self._pin()
        try:
            pos = self._locate(max(offset, self.base_offset))
            if pos < 0:
                return out
            while pos < end:
                self._checked(pos)
                p = self._map.base + pos
                length = load_u32(p + LENGTH_OFFSET)
                if (load_u64(p + TXN_ID_OFFSET + 8) == txn_lo and load_u64(p + TXN_ID_OFFSET) == txn_hi
                        and not load_u16(p + FLAGS_OFFSET) & FLAG_CONTROL):
                    out.append((load_i64(p + BASE_OFFSET_OFFSET), load_i32(p + COUNT_OFFSET),
                                load_u32(p + CRC_OFFSET), length,
                                PyBytes_FromStringAndSize(p, length) if copy else None))
                pos += length
        finally:
            self._unpin()
        return out

    def crc_at(self, Py_ssize_t pos):
        """The CRC field of the checked batch at ``pos``."""
        self._pin()
        try:
            self._checked(pos)
            return load_u32(self._map.base + pos + CRC_OFFSET)
        finally:
            self._unpin()

    def messages(self, Py_ssize_t pos, int64_t from_offset=0, Py_ssize_t limit=0x7FFFFFFF):
        """Decode the batch at ``pos`` into ``(offset, key, value, headers,
        event_time)`` tuples, from ``from_offset`` on, at most ``limit``."""
        self._pin()
        try:
            return self._decode(pos, from_offset, limit, None, None, 0, None, False)
        finally:
            self._unpin()

    def read_messages(self, Py_ssize_t pos, int64_t from_offset, Py_ssize_t limit, str topic,
                      int partition, id_type, txn_id=None):
        """Decode the batch at ``pos`` into :class:`Message` objects whose
        ``message_id`` is ``id_type((topic, partition, offset))``."""
        self._pin()
        try:
            return self._decode(pos, from_offset, limit, id_type, topic, partition, txn_id, True)
        finally:
            self._unpin()

    cdef list _decode(self, Py_ssize_t pos, int64_t from_offset, Py_ssize_t limit, id_type,
                      str topic, int partition, txn_id, bint as_messages):
        cdef Sections s = self._checked(pos)
        out = decode_batch(self._map.base + pos, s, self.path, pos, from_offset, limit, id_type,
                           topic, partition, txn_id, as_messages)
        if self._map.torn():
            self._raise_torn(pos)
        return out

    def batch_bytes(self, Py_ssize_t pos):
        """The checked batch at ``pos``, all of it, as a read-only
        memoryview of the mapping (no copy): front ends that re-encode
        whole batches read it. The view holds the mapping, which is not
        unmapped while it lives."""
        self._pin()
        try:
            self._checked(pos)
            length = load_u32(self._map.base + pos + LENGTH_OFFSET)
            return memoryview(self._map)[pos:pos + length]
        finally:
            self._unpin()

    def arrow_buffers(self, Py_ssize_t pos):
        self._pin()
        try:
            return self._arrow_buffers(pos)
        finally:
            self._unpin()

    def _arrow_buffers(self, Py_ssize_t pos):
        """Zero-copy views of one batch for Arrow: a dict of memoryviews over
        the mapping (``key_offsets``, ``keys``, ``validity`` or None,
        ``value_offsets``, ``values``, ``event_deltas``) plus ``count``."""
        cdef Sections s = self._checked(pos)
        return arrow_views(self._map, self._map.base + pos, s, self.path, pos)

    def record_batch(self, Py_ssize_t pos, Py_ssize_t first, Py_ssize_t n, str topic, int partition):
        """Messages ``first`` .. ``first + n - 1`` of the batch at ``pos`` as
        a ``pyarrow.RecordBatch`` (key, value, offset, event_time,
        publish_time; ``topic`` and ``partition`` in the schema's metadata:
        ``txmq._arrow_batch.record_batch_schema``), its key and value columns
        views of the mapping (``txmq._arrow_batch.arrow_record_batch``)."""
        cdef Sections s
        self._pin()
        try:
            s = self._checked(pos)
            return arrow_record_batch(self._map, self._map.base + pos, s, self.path, pos, first, n, topic,
                                      partition)
        finally:
            self._unpin()

    # -- lifetime ----------------------------------------------------------
