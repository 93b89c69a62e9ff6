# Declarations of pyx/_reader.pyx (the one bounds-checked reader of every
# framed or table decoder) for the modules that cimport it; see
# pyx/txmq/_mapping.pxd for why this file lives here.
from libc.stdint cimport uint8_t, uint16_t, int16_t, uint32_t, int32_t, int64_t, uint64_t


cdef class Reader:
    cdef object owner                 # keeps the bytes read alive
    cdef const char *p                # byte 0 of the bytes read
    cdef readonly Py_ssize_t pos      # the next byte to read, counted from p
    cdef readonly Py_ssize_t end      # one past the last byte that may be read
    cdef readonly object path         # the file the bytes are from, or None
    cdef readonly Py_ssize_t base     # the file position of p[0]
    cdef readonly str what            # what is read, for errors ("coordinator frame of type")
    cdef readonly int64_t number      # which one (a frame's type), -1: none

    cpdef reset(self, data, Py_ssize_t base=*, int64_t number=*)
    cdef int reset_ptr(self, const char *p, Py_ssize_t n, Py_ssize_t base, int64_t number,
                       object owner) except -1

    # take is every read's bounds check, so it is inlined into the modules
    # that decode through a reader (a failure is one call to _short).
    cdef inline const char *take(self, Py_ssize_t k) except NULL:
        """The next ``k`` bytes (a pointer into the data), checked."""
        cdef const char *at
        if k < 0 or k > self.end - self.pos:
            self._short(k)
            return NULL
        at = self.p + self.pos
        self.pos += k
        return at

    cdef const char *take_array(self, Py_ssize_t count, Py_ssize_t size) except NULL
    cdef Py_ssize_t enter(self, Py_ssize_t k) except -1
    cdef int leave(self, Py_ssize_t outer_end) except -1

    cpdef uint8_t u8(self) except? 0
    cpdef uint16_t u16(self) except? 0
    cpdef int16_t i16(self) except? -1
    cpdef uint32_t u32(self) except? 0
    cpdef int32_t i32(self) except? -1
    cpdef uint64_t u64(self) except? 0
    cpdef int64_t i64(self) except? -1
    cpdef bytes read(self, Py_ssize_t count, Py_ssize_t size=*)
    cpdef str text(self)
    cpdef done(self)
    cpdef fail(self, Py_ssize_t at, str reason)
    cdef int _short(self, Py_ssize_t k) except -1
