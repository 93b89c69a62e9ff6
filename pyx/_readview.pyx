# cython: boundscheck=False, wraparound=False
"""The writer's side of a partition's ``readview`` file (docs/FORMAT.md,
"Read view"): a 16-byte head and two 80-byte slots, written in turn, each
framed by its generation, so a reader in another process takes the newest
slot whose two generation words agree, never a torn one, and never waits.

A publish runs on every append, so it is a few plain 8-byte stores into the
mapping: the opening generation, a release fence, the fields, a release
fence, the closing generation. Readers load them in the opposite order
(``txmq.readonly``).

Version 2: the state word's upper 32 bits hold a CRC-32C of the slot's
other words (the state in the lower 32), so a reader that finds a slot
whole but damaged (a flipped byte: no writer rewrites it while none is
live) does not trust it and builds its view from the log instead.
"""
from libc.stdint cimport int64_t, uint64_t

import os
import struct
import time

from txmq._mapping import Mapping

from _bytes cimport crc32c, load_u64, store_u32, store_u64

cdef extern from *:
    """
    static inline void txmq_release_fence(void) { __atomic_thread_fence(__ATOMIC_RELEASE); }
    """
    void txmq_release_fence() nogil

# The layout (docs/FORMAT.md "Read view"), once: the slot's fields chained
# in C for the writer, and the structs readers unpack it with (txmq.readonly)
# checked against them at import.
cdef enum:
    HEAD = 16
    F_GEN = 0
    F_EPOCH = F_GEN + 8
    F_STATE = F_EPOCH + 8
    F_START = F_STATE + 8
    F_END = F_START + 8
    F_MAX_READ = F_END + 8
    F_ACTIVE_BASE = F_MAX_READ + 8
    F_ACTIVE_SIZE = F_ACTIVE_BASE + 8
    F_ABORTED_VERSION = F_ACTIVE_SIZE + 8
    GEN_END = F_ABORTED_VERSION + 8
    SLOT = GEN_END + 8
    SLOTS = 2
    BYTES = HEAD + SLOTS * SLOT

MAGIC = b"TXRV"
VERSION = 2
READVIEW_MAGIC, READVIEW_VERSION = MAGIC, VERSION
READVIEW_HEAD = struct.Struct("<4sB3xII")           # magic, version, slot bytes, slots
# generation, epoch, state (| CRC << 32), log start, log end,
# maxReadPosition, active segment base and size, aborted-set version,
# generation again
READVIEW_SLOT = struct.Struct("<QQQqqqqqQQ")
READVIEW_SLOTS = SLOTS
READVIEW_BYTES = BYTES
READVIEW_GEN_END = GEN_END
RV_RECOVERING, RV_LIVE, RV_CLOSED = 1, 2, 3          # slot states
assert READVIEW_HEAD.size == HEAD and READVIEW_SLOT.size == SLOT and READVIEW_BYTES == 176


cdef class ReadViewWriter:
    """Publishes one partition's readview. ``generation`` keeps growing
    across openings (a reader takes the larger one); ``epoch`` names this
    opening (nanoseconds since the epoch)."""
    cdef object mapping
    cdef unsigned char[::1] buf
    cdef char *base
    cdef readonly uint64_t generation, epoch

    def __init__(self, path):
        fd = os.open(os.fspath(path), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size < BYTES:
                os.ftruncate(fd, BYTES)
            self.mapping = Mapping(fd, BYTES, True)
        finally:
            os.close(fd)
        self.buf = self.mapping
        self.base = <char *>&self.buf[0]
        cdef Py_ssize_t i
        if bytes(self.buf[0:5]) != MAGIC + bytes([VERSION]):
            for i in range(BYTES):
                self.base[i] = 0
            for i in range(4):
                self.base[i] = MAGIC[i]
            self.base[4] = VERSION
            store_u32(self.base + 8, SLOT)
            store_u32(self.base + 12, SLOTS)
        self.generation = 0
        for i in range(SLOTS):
            self.generation = max(self.generation, load_u64(self.base + HEAD + i * SLOT),
                                  load_u64(self.base + HEAD + i * SLOT + GEN_END))
        self.epoch = time.time_ns()

    cpdef publish(self, int64_t state, int64_t start, int64_t end, int64_t max_read_position,
                  int64_t active_base, int64_t active_size, uint64_t aborted_version):
        """Write the next slot: state, log start, log end, maxReadPosition,
        the active segment's base and size, the aborted-set version."""
        if self.base == NULL:
            raise ValueError("readview is closed")
        cdef uint64_t g = self.generation + 1
        cdef char *s = self.base + HEAD + (g & 1) * SLOT
        cdef uint64_t words[10]
        words[0] = g
        words[1] = self.epoch
        words[2] = <uint64_t>state & 0xFFFFFFFF
        words[3] = <uint64_t>start
        words[4] = <uint64_t>end
        words[5] = <uint64_t>max_read_position
        words[6] = <uint64_t>active_base
        words[7] = <uint64_t>active_size
        words[8] = aborted_version
        words[2] |= <uint64_t>crc32c(<const char *>words, 9 * 8) << 32
        self.generation = g
        store_u64(s + F_GEN, g)
        txmq_release_fence()
        store_u64(s + F_EPOCH, self.epoch)
        store_u64(s + F_STATE, words[2])
        store_u64(s + F_START, <uint64_t>start)
        store_u64(s + F_END, <uint64_t>end)
        store_u64(s + F_MAX_READ, <uint64_t>max_read_position)
        store_u64(s + F_ACTIVE_BASE, <uint64_t>active_base)
        store_u64(s + F_ACTIVE_SIZE, <uint64_t>active_size)
        store_u64(s + F_ABORTED_VERSION, aborted_version)
        txmq_release_fence()
        store_u64(s + GEN_END, g)

    def close(self):
        if self.base != NULL:
            self.base = NULL
            self.buf = None
            self.mapping.close()
