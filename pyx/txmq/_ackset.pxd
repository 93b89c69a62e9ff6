# cython: language_level=3
# Declarations of txmq._ackset (pyx/_ackset.pyx): the ranges of acked
# offsets, for the compiled modules that check and record acks with C calls
# (txmq._txn's pending-ack table).
from libc.stdint cimport int64_t

cdef class AckSet:
    cdef Py_ssize_t debug_changes, debug_next     # changes seen by the debug checks; the next checked
    cdef object _starts, _ends          # np.int64 arrays (capacity)
    cdef int64_t *s
    cdef int64_t *e
    cdef Py_ssize_t n, cap
    cdef _alloc(self, Py_ssize_t cap)
    cdef Py_ssize_t _find(self, int64_t x) noexcept nogil
    cdef _debug_changed(self)
    cpdef bint contains(self, int64_t offset)
    cpdef int64_t add_range(self, int64_t start, int64_t end) except -1


cpdef bint cut_delivery(list ranges, int64_t offset) except -1
