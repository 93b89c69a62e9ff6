# cython: language_level=3
# Declarations of txmq._segment_file: the file under a segment.
from txmq._mapping cimport Mapping
from txmq._budget cimport Budget, Budgeted

cdef class SegmentFile(Budgeted):
    cdef readonly object path
    cdef readonly Py_ssize_t size        # bytes in use (a segment's batches)
    cdef readonly Py_ssize_t capacity    # the length it is mapped at
    cdef readonly bint writable
    cdef Mapping _map
    cdef int fd
    cdef Budget budget                   # (slot, recent, users: txmq._budget.Budgeted)
    cdef bint shut                       # closed for good
    cdef bint torn_before                # a page of a mapping parked since had faulted
    cdef Py_ssize_t allocated            # bytes reserved (the file's length)
    cdef bint unreserved                 # the file system refused posix_fallocate
    cdef bint fresh                      # created empty here: nothing to scan
    cdef int _adopt(self, int fd) except -1
    cdef int _reopen(self) except -1
    cdef int _use(self) except -1
    cdef void _unuse(self) noexcept
    cpdef park(self)
    cdef _reserve(self, Py_ssize_t end)
    cdef bint _zero_from(self, Py_ssize_t pos, Py_ssize_t limit)
    cdef int _pin(self) except -1
    cdef void _unpin(self) noexcept
    cdef int _raise_torn(self, Py_ssize_t pos) except -1
