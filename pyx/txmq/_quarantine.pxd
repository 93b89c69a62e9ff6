# cython: language_level=3
# Declarations of txmq._quarantine: a segment's quarantined byte ranges.
from libc.stdint cimport int64_t

cdef class QuarantineRanges:
    cdef list ranges                     # (pos, end pos, first offset, end offset, reason), by pos
    cdef readonly Py_ssize_t n           # len(ranges): walks test it first (0 for a sound segment)
    cdef int add(self, Py_ssize_t pos, Py_ssize_t end_pos, int64_t first, int64_t end, str reason) except -1
    cdef Py_ssize_t hop(self, Py_ssize_t pos, int64_t *expected, Py_ssize_t *follow) except -2
    cdef int drop_from(self, Py_ssize_t pos) except -1
