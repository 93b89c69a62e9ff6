# cython: language_level=3
# Declarations of txmq._sparse_index: a segment's offset and time indexes.
from libc.stdint cimport int64_t

cdef class SparseIndex:
    cdef readonly Py_ssize_t interval    # bytes of batches between offset-index entries
    cdef Py_ssize_t last_pos             # position of the last batch indexed
    cdef object off, pos, ok             # offset index: np.int64 offset, position; np.uint8 checked whole
    cdef object ts, toff                 # time index: np.int64 publish time, offset
    cdef readonly Py_ssize_t n, tn       # entries in use of each
    cdef int add(self, Py_ssize_t pos, int64_t base, int64_t publish_time) except -1
    cdef void clear(self)
    cdef void truncate(self, Py_ssize_t pos, int64_t next_offset)
    cdef Py_ssize_t at_or_below(self, int64_t offset) except -2
    cdef Py_ssize_t time_before(self, int64_t timestamp) except -2
    cdef int64_t offset_at(self, Py_ssize_t i) except? -1
    cdef Py_ssize_t position_at(self, Py_ssize_t i) except? -1
    cdef bint checked(self, Py_ssize_t i) except -1
    cdef int mark_checked(self, Py_ssize_t i) except -1
    cdef int64_t time_at(self, Py_ssize_t i) except? -1
    cdef int64_t time_offset_at(self, Py_ssize_t i) except? -1
