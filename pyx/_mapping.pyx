# cython: boundscheck=False, wraparound=False, cdivision=True
"""A shared memory mapping of a file that counts the views it hands out.

Segments, the half-message table and the read view map their files through
``Mapping``. It owns no byte layout: what lies in the mapped bytes is the
business of the module that mapped them.

A mapping exports the buffer protocol (Arrow arrays and memoryviews wrap its
bytes without copying) and counts every export and every pin (a read in
progress). ``close()`` with any alive defers the unmap until the last one is
released, so a reader never faults on an unmapped page.

Every mapping is registered with the SIGBUS handler of ``csrc/sigbus.c``:
a page that faults (its file was truncated by another process, or a full
file system could not allocate it) reads as zeros and is counted
(:meth:`Mapping.torn`, :attr:`Mapping.faulted`), and the module that
touched the bytes raises a typed error, instead of the process dying.
"""
from cpython.buffer cimport PyBUF_WRITABLE
from libc.errno cimport errno
from libc.stdint cimport uint64_t
from posix.mman cimport (mmap, munmap, msync, posix_madvise, PROT_READ, PROT_WRITE, MAP_SHARED,
                         MAP_FAILED, MS_SYNC, POSIX_MADV_RANDOM)

import os

PAGE = 4096


# Every msync this module makes, counted so that a test or a benchmark gate
# can count flushes per durable commit in process (txmq.testing.counters):
# the Python-level fsync/fdatasync calls can be wrapped there, this one is a
# C call. One increment per flush, next to a syscall of ~100 us, costs nothing.
cdef uint64_t msync_calls = 0


def msync_count():
    """How many msync calls this process has made through a Mapping."""
    return msync_calls


cdef extern from "sigbus.h":
    int txmq_sigbus_install()
    int txmq_sigbus_register(void *base, size_t size, int **faults)
    void txmq_sigbus_unregister(int slot)


# A test-only observer of every msync (txmq.testing.power_loss): called with
# (fd, start, end) after the range is synced. None in production, so the
# cost is one pointer test per msync.
cdef object sync_hook = None


def set_sync_hook(hook):
    """Install ``hook(fd, start, end)``, called after each msync of a
    mapping (its file descriptor and the synced byte range); None removes
    it. For the power-loss simulation of the tests only."""
    global sync_hook
    sync_hook = hook


cdef class Mapping:
    """A shared memory mapping of a file, exporting the buffer protocol.

    ``close()`` with views alive (Arrow arrays, memoryviews) defers the
    unmap until the last view is released, so a reader never faults.
    """

    def __cinit__(self, int fd, Py_ssize_t size, bint writable):
        cdef int prot = PROT_READ | (PROT_WRITE if writable else 0)
        cdef void *p
        if size <= 0:
            raise ValueError(f"cannot map {size} bytes")
        p = mmap(NULL, size, prot, MAP_SHARED, fd, 0)
        if p == MAP_FAILED:
            raise OSError(errno, os.strerror(errno))
        self.base = <char *>p
        self.fd = fd
        self.size = size
        self.writable = writable
        # Again at every mapping: a handler installed since (faulthandler)
        # would otherwise take SIGBUS for itself.
        txmq_sigbus_install()
        self.slot = txmq_sigbus_register(p, size, &self.faults)
        if writable:
            # The active segment: its pages past the log end are reserved
            # zeros that read-ahead must not pull in a window at a time on
            # each write fault.
            posix_madvise(p, size, POSIX_MADV_RANDOM)

    def __getbuffer__(self, Py_buffer *buf, int flags):
        if self.base == NULL:
            raise ValueError("mapping is closed")
        if (flags & PyBUF_WRITABLE) and not self.writable:
            raise BufferError("mapping is read-only")
        buf.buf = self.base
        buf.obj = self
        buf.len = self.size
        buf.readonly = not self.writable
        buf.itemsize = 1
        buf.format = "B"
        buf.ndim = 1
        buf.shape = &self.size
        buf.strides = &buf.itemsize
        buf.suboffsets = NULL
        buf.internal = NULL
        self.exports += 1

    def __releasebuffer__(self, Py_buffer *buf):
        self.exports -= 1
        if self.closing and self.exports == 0:
            self._unmap()

    cdef void _unmap(self) noexcept:
        if self.base != NULL:
            txmq_sigbus_unregister(self.slot)
            self.slot = -1
            munmap(self.base, self.size)
            self.base = NULL

    @property
    def faulted(self):
        """Whether a page of the mapping faulted (:meth:`torn`)."""
        return self.torn()

    def close(self):
        """Unmap now, or as soon as the last exported view is released."""
        if self.exports:
            self.closing = True
        else:
            self._unmap()

    @property
    def closed(self):
        return self.base == NULL

    def sync(self, Py_ssize_t start, Py_ssize_t end):
        """msync(MS_SYNC) the pages covering [start, end)."""
        cdef Py_ssize_t s = start - (start % PAGE)
        cdef int rc
        if self.base == NULL or end <= start:
            return
        global msync_calls
        with nogil:
            rc = msync(self.base + s, end - s, MS_SYNC)
        msync_calls += 1
        if rc != 0:
            raise OSError(errno, os.strerror(errno))
        if sync_hook is not None:
            sync_hook(self.fd, s, end)

    def __dealloc__(self):
        self._unmap()
