# Declarations of pyx/_mapping.pyx for the modules that cimport it. A .pxd
# that declares a cdef class lives under pyx/txmq/, the path of its module's
# name: a cimporting module imports txmq._mapping by that name at run time.


cdef extern from "sigbus.h":
    int txmq_sigbus_count(const int *faults) nogil


cdef class Mapping:
    cdef char *base
    cdef int fd                       # the mapped file's descriptor (owned by the caller)
    cdef readonly Py_ssize_t size
    cdef readonly bint writable
    cdef readonly Py_ssize_t exports
    cdef bint closing
    cdef int slot                # its entry in csrc/sigbus.c's table (-1: none)
    cdef int *faults             # SIGBUS faults on its pages (csrc/sigbus.h)

    cdef void _unmap(self) noexcept

    cdef inline bint torn(self) noexcept:
        """Whether a page of the mapping faulted (its file shrank under it,
        or a block of it could not be allocated): its bytes read as zeros
        from there on, so whoever touched it raises instead of using them."""
        return self.faults != NULL and txmq_sigbus_count(self.faults) != 0

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
