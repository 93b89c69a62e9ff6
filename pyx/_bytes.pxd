# Shared low-level primitives for every txmq Cython module: little-endian
# loads and stores, bounds checks that raise CorruptLogError, CRC-32C and
# 8-byte alignment. Modules `cimport` these; nothing here is duplicated.
from libc.stdint cimport uint8_t, uint16_t, uint32_t, int16_t, int32_t, int64_t, uint64_t
from libc.string cimport memcpy


cdef extern from "crc32c.h" nogil:
    uint32_t txmq_crc32c_update(uint32_t crc, const void *data, size_t length)
    uint32_t txmq_crc32c_software(uint32_t crc, const void *data, size_t length)
    int txmq_crc32c_hardware()


# Every txmq format is little-endian; these compile to single moves on
# x86-64 and AArch64 (memcpy sidesteps alignment and aliasing rules).
cdef inline uint16_t load_u16(const char *p) noexcept nogil:
    cdef uint16_t v
    memcpy(&v, p, 2)
    return v

cdef inline uint32_t load_u32(const char *p) noexcept nogil:
    cdef uint32_t v
    memcpy(&v, p, 4)
    return v

cdef inline int32_t load_i32(const char *p) noexcept nogil:
    cdef int32_t v
    memcpy(&v, p, 4)
    return v

cdef inline int16_t load_i16(const char *p) noexcept nogil:
    cdef int16_t v
    memcpy(&v, p, 2)
    return v

cdef inline int64_t load_i64(const char *p) noexcept nogil:
    cdef int64_t v
    memcpy(&v, p, 8)
    return v

cdef inline uint64_t load_u64(const char *p) noexcept nogil:
    cdef uint64_t v
    memcpy(&v, p, 8)
    return v

cdef inline void store_u16(char *p, uint16_t v) noexcept nogil:
    memcpy(p, &v, 2)

cdef inline void store_u32(char *p, uint32_t v) noexcept nogil:
    memcpy(p, &v, 4)

cdef inline void store_i32(char *p, int32_t v) noexcept nogil:
    memcpy(p, &v, 4)

cdef inline void store_i16(char *p, int16_t v) noexcept nogil:
    memcpy(p, &v, 2)

cdef inline void store_i64(char *p, int64_t v) noexcept nogil:
    memcpy(p, &v, 8)

cdef inline void store_u64(char *p, uint64_t v) noexcept nogil:
    memcpy(p, &v, 8)


cdef inline Py_ssize_t align8(Py_ssize_t n) noexcept nogil:
    return (n + 7) & ~(<Py_ssize_t>7)


cdef inline uint32_t crc32c(const char *p, size_t n) noexcept nogil:
    return txmq_crc32c_update(0, p, n)


# Below this many bytes, releasing and re-taking the GIL costs more than
# the work it frees other threads for.
cdef enum:
    NOGIL_THRESHOLD = 64 * 1024


# Kafka's wire format is big-endian (txmq._kafka, txmq._kafka_records).

cdef inline uint16_t be16(const char *p) noexcept nogil:
    cdef const uint8_t *u = <const uint8_t *>p
    return (<uint16_t>u[0] << 8) | u[1]

cdef inline uint32_t be32(const char *p) noexcept nogil:
    cdef const uint8_t *u = <const uint8_t *>p
    return (<uint32_t>u[0] << 24) | (<uint32_t>u[1] << 16) | (<uint32_t>u[2] << 8) | u[3]

cdef inline uint64_t be64(const char *p) noexcept nogil:
    return (<uint64_t>be32(p) << 32) | be32(p + 4)

cdef inline void put16(char *p, uint16_t v) noexcept nogil:
    p[0] = <char>(v >> 8); p[1] = <char>v

cdef inline void put32(char *p, uint32_t v) noexcept nogil:
    p[0] = <char>(v >> 24); p[1] = <char>(v >> 16); p[2] = <char>(v >> 8); p[3] = <char>v

cdef inline void put64(char *p, uint64_t v) noexcept nogil:
    put32(p, <uint32_t>(v >> 32)); put32(p + 4, <uint32_t>v)

# New bytes objects of one little-endian field (the frames of the redo logs).
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING

cdef inline bytes packed_u32(uint32_t v):
    out = PyBytes_FromStringAndSize(NULL, 4)
    store_u32(PyBytes_AS_STRING(out), v)
    return out

cdef inline bytes packed_i64(int64_t v):
    out = PyBytes_FromStringAndSize(NULL, 8)
    store_i64(PyBytes_AS_STRING(out), v)
    return out

cdef inline bytes packed_txn(uint64_t hi, uint64_t lo):
    """A transaction id as every log stores it: u64 hi, u64 lo."""
    out = PyBytes_FromStringAndSize(NULL, 16)
    store_u64(PyBytes_AS_STRING(out), hi)
    store_u64(PyBytes_AS_STRING(out) + 8, lo)
    return out


# Writing every byte of a file write, across short writes and EINTR: the one
# loop of the segments' pwritev and the redo logs' frames.
from libc.errno cimport errno, EINTR
from posix.uio cimport iovec, pwritev

cdef enum:
    IOV_MAX_PIECES = 1024   # POSIX IOV_MAX on Linux

cdef inline ssize_t pwritev_all(int fd, iovec *iov, Py_ssize_t n, Py_ssize_t pos) noexcept nogil:
    """pwritev every piece at ``pos``, IOV_MAX at a time, across short
    writes and EINTR; -1 with errno set on failure. (``iov`` is consumed.)"""
    cdef ssize_t r
    cdef int batch
    while n > 0:
        batch = <int>(n if n < IOV_MAX_PIECES else IOV_MAX_PIECES)
        r = pwritev(fd, iov, batch, pos)
        if r < 0:
            if errno == EINTR:
                continue
            return -1
        pos += r
        while n > 0 and <size_t>r >= iov[0].iov_len:
            r -= iov[0].iov_len
            iov += 1
            n -= 1
        if n > 0 and r > 0:
            iov[0].iov_base = <char *>iov[0].iov_base + r
            iov[0].iov_len -= r
    return 0
