# cython: boundscheck=False, wraparound=False, cdivision=True
"""The file under a segment (``txmq._segment``): opened, mapped at its
capacity, its descriptor and mapping within a budget, its disk reserved
ahead of the writer. What the bytes mean is the segment's.

The active segment may grow to ``segment_bytes_max`` bytes (its capacity,
the length it is mapped at). Its file is only as long as the blocks
reserved for it with ``posix_fallocate`` ahead of the writer: the
reservation starts at ``RESERVE_MIN_BYTES`` and doubles each time the
writer reaches its end, up to the capacity, so an idle partition holds
64 KiB of disk and a busy one at most twice what it wrote. On a nearly
full disk it reserves just what the batch needs; a full disk is a
``StorageFullError`` at append time, the batch not written and the log
end unchanged. Reserved bytes read as zeros, so the end of the batches is
found as before.

Open files are a budget (``txmq._budget``): an idle segment is parked
(descriptor closed, mapping dropped) and reopened by its next use; a use
in progress is never parked, and a mapping an Arrow array or a memoryview
still exports stays mapped until released (``txmq._mapping``). A reopened
segment keeps its indexes and quarantined ranges, and its new mapping is
guarded against a file truncated under it like the first one.
"""
from cpython.pyport cimport PY_SSIZE_T_MAX
from libc.errno cimport ENOSPC, EDQUOT
from posix.unistd cimport close as c_close

import os

from txmq.errors import CorruptLogError, StorageFullError

from txmq._mapping cimport Mapping
from txmq._budget cimport Budget, Budgeted
from txmq._budget import default_budget

cdef extern from "fcntl.h" nogil:
    int posix_fallocate(int fd, long offset, long length)
    int sync_file_range(int fd, long offset, long nbytes, unsigned int flags)
    unsigned int SYNC_FILE_RANGE_WRITE

# Calls of start_writeback that reached the kernel, in this process (what a
# test of when a log starts writeback counts).
cdef unsigned long long writeback_calls = 0


def writeback_count():
    """How many ranges this process's segments started writing back."""
    return writeback_calls

# Blocks are reserved ahead of the writer, so a full disk is an OSError at
# append time, not a SIGBUS: first this much, then twice what is reserved
# each time the writer reaches its end (capped by the capacity).
RESERVE_MIN_BYTES = 64 * 1024
cdef Py_ssize_t RESERVE_MIN_C = RESERVE_MIN_BYTES


class SegmentClosedError(Exception):
    """The segment was closed (deleted by retention, or the log closed);
    a reader holding a position in it must locate its offset again."""


cdef class SegmentFile(Budgeted):
    """A segment's file: mapped at ``capacity`` (``writable``: read-write,
    created if missing), its descriptor and mapping parked and reopened by
    ``budget`` (default: the process's), ``size`` bytes of it in use.
    Every method reopens what a parked file needs."""

    def __init__(self, path, Py_ssize_t capacity, bint writable, Budget budget=None):
        self.path = os.fspath(path)
        self.budget = budget if budget is not None else default_budget()
        self.writable = writable
        self.fd = -1
        flags = os.O_RDWR | os.O_CREAT if writable else os.O_RDONLY
        fd = os.open(self.path, flags, 0o644)
        try:
            file_size = os.fstat(fd).st_size
            # A new file holds no batch: recovery must not read its pages (on
            # tmpfs a read of a hole allocates one, a SIGBUS when it is full).
            self.fresh = writable and file_size == 0
            # The file grows with its reservation (_reserve), never up front.
            self.capacity = max(capacity, file_size) if writable else file_size
            self.allocated = file_size
        except BaseException:
            os.close(fd)
            raise
        self.size = 0
        self.users += 1
        try:
            self._adopt(fd)
        finally:
            self.users -= 1

    cdef int _adopt(self, int fd) except -1:
        """Map the file open at ``fd`` and count it in the budget (the
        caller holds a use, so the budget cannot park it at once)."""
        try:
            self._map = Mapping(fd, self.capacity, self.writable) if self.capacity > 0 else None
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.recent = True
        self.budget.admit(self)
        return 0

    cdef int _reopen(self) except -1:
        if self.shut:
            raise SegmentClosedError(f"{self.path}: segment is closed")
        try:
            fd = os.open(self.path, os.O_RDWR if self.writable else os.O_RDONLY)
        except FileNotFoundError:
            raise SegmentClosedError(f"{self.path} was deleted") from None
        if self.torn_before:
            os.close(fd)
            self._raise_torn(self.size)
        try:
            size = os.fstat(fd).st_size
        except BaseException:
            os.close(fd)
            raise
        if size < self.size:
            # What the mapping guard would find on the first read of the
            # lost bytes: the file shrank below its batches while parked.
            os.close(fd)
            raise CorruptLogError(self.path, size,
                                  f"the file changed while its descriptor was parked (now {size} bytes, its "
                                  f"batches end at {self.size}; truncated by another process?)")
        self._adopt(fd)
        return 0

    cdef int _use(self) except -1:
        """Hold the descriptor and mapping (reopened if parked) until
        :meth:`_unuse`."""
        self.users += 1
        self.recent = True
        if self.fd < 0:
            try:
                self._reopen()
            except BaseException:
                self.users -= 1
                raise
        return 0

    cdef void _unuse(self) noexcept:
        self.users -= 1

    cpdef park(self):
        """Close the descriptor and drop the mapping (the budget's call,
        with no use in progress). Views of the mapping keep it mapped."""
        cdef int fd = self.fd
        cdef Mapping m = self._map
        self.fd = -1
        self._map = None
        if m is not None:
            if m.torn():
                self.torn_before = True     # the next mapping must not forget it
            m.close()
        if fd >= 0:
            c_close(fd)

    @property
    def parked(self):
        """Whether the budget closed this segment's descriptor (reopened
        by its next use)."""
        return self.fd < 0 and not self.shut

    @property
    def mapping(self):
        """The mapping (reopened if parked; None for an empty read-only
        file). A view taken of it keeps it mapped after the segment is
        parked or closed."""
        if self.shut:
            return self._map
        self._use()
        try:
            return self._map
        finally:
            self._unuse()

    @property
    def file_size(self):
        if self.fd >= 0:
            return os.fstat(self.fd).st_size
        return os.stat(self.path).st_size

    def room(self):
        """Bytes still free in this segment."""
        return self.capacity - self.size

    cdef _reserve(self, Py_ssize_t end):
        """Reserve (and zero) blocks up to ``end`` at least: twice what is
        reserved, at least RESERVE_MIN_BYTES, at most the capacity. The
        file grows with it (posix_fallocate extends it)."""
        cdef Py_ssize_t want
        cdef int rc
        if end <= self.allocated:
            return
        want = min(self.capacity, max(end, 2 * self.allocated, RESERVE_MIN_C))
        with nogil:
            rc = posix_fallocate(self.fd, self.allocated, want - self.allocated)
            if (rc == ENOSPC or rc == EDQUOT) and want > end:
                # Not a chunk ahead: at least what this batch needs.
                want = end
                rc = posix_fallocate(self.fd, self.allocated, want - self.allocated)
        if rc == 95:  # EOPNOTSUPP: no reservation, so never store through the mapping
            self.unreserved = True
        elif rc == ENOSPC or rc == EDQUOT:
            raise StorageFullError(self.path, want - self.allocated, rc)
        elif rc != 0:
            raise OSError(rc, f"cannot reserve {want - self.allocated} bytes in {self.path}: {os.strerror(rc)}")
        self.allocated = want

    def sync(self, Py_ssize_t start=0, Py_ssize_t end=-1):
        """Make [start, end) durable (msync MS_SYNC); end=-1 means the log end."""
        if end < 0:
            end = self.size
        if self.capacity > 0 and end > start:
            self._pin()
            try:
                self._map.sync(start, end)
            finally:
                self._unpin()

    def start_writeback(self, Py_ssize_t start, Py_ssize_t end):
        """Start writing the dirty pages of [start, end) to disk and return
        without waiting for them (``sync_file_range`` with
        ``SYNC_FILE_RANGE_WRITE``), so that a later :meth:`sync` finds less
        to write. It promises nothing: a failure is left for that sync to
        report. A closed segment has nothing to write."""
        global writeback_calls
        cdef int fd
        if end <= start or self.shut:
            return
        self._use()
        try:
            fd = self.fd
            with nogil:
                sync_file_range(fd, start, end - start, SYNC_FILE_RANGE_WRITE)
            writeback_calls += 1
        finally:
            self._unuse()

    cdef bint _zero_from(self, Py_ssize_t pos, Py_ssize_t limit):
        """True when the bytes after a zeroed batch header are zero too, as
        far as a torn write can reach: the largest batch that fits, capped
        at 1 MiB, read with pread. Reading through the mapping instead would
        let read-ahead pull the whole preallocated segment into memory."""
        cdef Py_ssize_t n = min(limit - pos, 1 << 20)
        if n <= 0 or pos >= self.file_size:
            return True
        data = os.pread(self.fd, n, pos)
        return not data.strip(b"\0")

    cdef int _pin(self) except -1:
        """Hold the mapping for a read (reopened if parked) until :meth:`_unpin`."""
        if self.shut:
            raise SegmentClosedError("segment is closed")
        self._use()
        if self._map is None or self._map.base == NULL:
            self._unuse()
            raise SegmentClosedError(f"{self.path} is empty")
        self._map.pin()
        return 0

    cdef void _unpin(self) noexcept:
        self._map.unpin()
        self._unuse()

    cdef int _raise_torn(self, Py_ssize_t pos) except -1:
        """A page of the mapping faulted: the file lost bytes under it
        (truncated by another process) or a block of it could not be
        allocated. What was read there is zeros: stop with an error."""
        try:
            size = self.file_size
        except OSError:
            size = -1
        raise CorruptLogError(self.path, min(pos, size) if size >= 0 else pos,
                              f"the file changed under its mapping (now {size} bytes; truncated by another "
                              f"process?): its mapped bytes can no longer be read")

    def check_mapping(self):
        """Raise CorruptLogError when a page of the mapping faulted since it
        was made (``Mapping.torn``), or, while parked, when the file shrank
        below its batches (which the next use would find)."""
        if self._map is not None and self._map.torn():
            self._raise_torn(self.size)
        if self.fd < 0 and not self.shut:
            try:
                size = os.stat(self.path).st_size
            except FileNotFoundError:
                return                      # removed: see ``removed``
            if size < self.size:
                self._raise_torn(self.size)

    def close(self, bint trim=True):
        """Unmap (deferred while views live) and close for good; a writable
        segment is trimmed to its used size so a sealed file ends at its
        last batch."""
        if self.shut:
            return
        if self.writable and trim and self.file_size != self.size:   # (a no-op truncate still bumps mtime)
            self._use()
            try:
                os.ftruncate(self.fd, self.size)
            finally:
                self._unuse()
        self.shut = True
        self.budget.leave(self)
        # The closed mapping stays referenced: a read that pinned it
        # unpins it through this segment.
        if self._map is not None:
            self._map.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def sync_file(self):
        """fsync the file: its data and its size (after a trim)."""
        if self.shut:
            return
        self._use()
        try:
            os.fsync(self.fd)
        finally:
            self._unuse()

    def seal(self):
        """Trim the file to its batches (it stays mapped for readers)."""
        if self.writable and not self.shut:
            self._use()
            try:
                os.ftruncate(self.fd, self.size)
            finally:
                self._unuse()
            self.capacity = self.size
            self.allocated = self.size

    @property
    def closed(self):
        """Closed for good (a parked segment is not)."""
        return self.shut

    @property
    def removed(self):
        """Whether another process removed the file (it has no name left):
        what is written to it would be lost on close. A parked segment's
        file is looked up by its name."""
        if self.fd >= 0:
            return os.fstat(self.fd).st_nlink == 0
        return not self.shut and not os.path.exists(self.path)

    def __dealloc__(self):
        if self.fd >= 0:
            c_close(self.fd)
