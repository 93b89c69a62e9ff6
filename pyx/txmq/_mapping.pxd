# Declarations of pyx/_mapping.pyx for the modules that cimport it. A .pxd
# that declares a cdef class lives under pyx/txmq/, the path of its module's
# name: a cimporting module imports txmq._mapping by that name at run time.


cdef class Mapping:
    cdef char *base
    cdef int fd                       # the mapped file's descriptor (owned by the caller)
    cdef readonly Py_ssize_t size
    cdef readonly bint writable
    cdef readonly Py_ssize_t exports
    cdef bint closing

    cdef void _unmap(self) noexcept

    # pin and unpin bracket every read of a segment, so they are inlined
    # into the modules that call them.
    cdef inline int pin(self) except -1:
        """Hold the mapping for the length of a read (as a view would)."""
        if self.base == NULL:
            raise ValueError("mapping is closed")
        self.exports += 1
        return 0

    cdef inline void unpin(self) noexcept:
        self.exports -= 1
        if self.closing and self.exports == 0:
            self._unmap()
