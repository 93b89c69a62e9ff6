# cython: boundscheck=False, wraparound=False
"""Kafka's default partitioner: murmur2 of the key bytes, made positive,
modulo the partition count (org.apache.kafka.common.utils.Utils.murmur2),
so a key lands on the partition a Kafka client would pick."""
from libc.stdint cimport int32_t, uint32_t, uint8_t
import numpy as np

from txmq.errors import InvalidMessageError

cdef inline uint32_t _murmur2(const uint8_t *data, Py_ssize_t length) noexcept nogil:
    cdef uint32_t seed = 0x9747b28c, m = 0x5bd1e995, h, k
    cdef int r = 24
    cdef Py_ssize_t i, i4, n4 = length // 4, rest
    h = seed ^ <uint32_t>length
    for i in range(n4):
        i4 = i * 4
        k = data[i4] | (<uint32_t>data[i4 + 1] << 8) | (<uint32_t>data[i4 + 2] << 16) | (<uint32_t>data[i4 + 3] << 24)
        k *= m
        k ^= k >> r
        k *= m
        h *= m
        h ^= k
    rest = length & ~3
    if length % 4 == 3:
        h ^= <uint32_t>data[rest + 2] << 16
    if length % 4 >= 2:
        h ^= <uint32_t>data[rest + 1] << 8
    if length % 4 >= 1:
        h ^= data[rest]
        h *= m
    h ^= h >> 13
    h *= m
    h ^= h >> 15
    return h


def murmur2(key):
    """Kafka's murmur2 of ``key`` as a signed 32-bit int (Java's value)."""
    cdef const uint8_t[::1] v = key if len(key) else b"\0"
    cdef uint32_t h = _murmur2(&v[0], len(key))
    return <int32_t>h


def partition_for(key, int num_partitions):
    """The partition Kafka's default partitioner picks for ``key``."""
    cdef const uint8_t[::1] v = key if len(key) else b"\0"
    return (_murmur2(&v[0], len(key)) & 0x7fffffff) % num_partitions


def partitions_for_arrow(keys, int num_partitions):
    """Partition per key of a pyarrow binary array (nulls get -1), no
    per-key Python work."""
    import pyarrow as pa
    if keys.type not in (pa.binary(), pa.string()):
        keys = keys.cast(pa.binary())
    bufs = keys.buffers()
    cdef const int32_t[::1] offs = np.frombuffer(bufs[1], np.int32)[keys.offset:keys.offset + len(keys) + 1]
    cdef const uint8_t[::1] data = np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None and bufs[2].size else b"\0"
    out = np.empty(len(keys), np.int32)
    cdef int32_t[::1] o = out
    cdef Py_ssize_t i, n = len(keys)
    with nogil:
        for i in range(n):
            o[i] = (_murmur2(&data[0] + offs[i], offs[i + 1] - offs[i]) & 0x7fffffff) % num_partitions
    if keys.null_count:
        out[np.asarray(keys.is_null())] = -1
    return out


def partitions_for_list(list keys, int num_partitions):
    """Partition per key of a list of bytes / str / None (None gets -1)."""
    cdef Py_ssize_t i, n = len(keys)
    out = np.empty(n, np.int32)
    cdef int32_t[::1] o = out
    cdef const uint8_t[::1] v
    for i in range(n):
        k = keys[i]
        if k is None:
            o[i] = -1
            continue
        if isinstance(k, str):
            k = (<str>k).encode()
        elif not isinstance(k, (bytes, bytearray, memoryview)):
            raise InvalidMessageError(f"key at index {i} (expected bytes, str or None)", k)   # (as BatchSpec's)
        v = k if len(k) else b"\0"
        o[i] = (_murmur2(&v[0], len(k)) & 0x7fffffff) % num_partitions
    return out
