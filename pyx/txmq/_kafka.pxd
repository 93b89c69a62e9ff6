# Declarations of pyx/_kafka.pyx (the Kafka protocol codec) for the modules
# that cimport it (txmq._kafka_records writes record batches into a
# Writer); see pyx/txmq/_mapping.pxd for why this file lives here.
from libc.stdint cimport uint64_t, int8_t, int16_t, int32_t, int64_t


cdef class Writer:
    cdef char *buf
    cdef Py_ssize_t size, cap

    cdef int reserve(self, Py_ssize_t n) except -1
    cdef int i8(self, int8_t v) except -1
    cdef int i16(self, int16_t v) except -1
    cdef int i32(self, int32_t v) except -1
    cdef int i64(self, int64_t v) except -1
    cdef int uvarint(self, uint64_t v) except -1
    cdef int varlong(self, int64_t v) except -1
    cdef int raw(self, const char *p, Py_ssize_t n) except -1
    cdef int data(self, object b) except -1
    cdef int length(self, Py_ssize_t n, bint compact, bint wide) except -1
