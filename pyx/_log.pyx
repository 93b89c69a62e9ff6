# cython: boundscheck=False, wraparound=False, cdivision=True
"""Partition log core: memory-mapped segments of batches (DESIGN.md §2).

A ``Segment`` is one file ``<base>.log`` holding whole batches back to back
from byte 0, in the layout of ``_batch_layout.pxd``. The active segment is
a file of ``segment_bytes_max`` bytes whose blocks are reserved with
``posix_fallocate`` a chunk ahead of the writer (a full disk is an
``OSError`` at append time), mapped read-only at its full capacity.

Each message byte is copied once, from the caller's buffers into the page
cache behind the mapping, by one of two sinks. A fresh page of a shared
file mapping costs a zero-fill fault on its first store (about 2.8 us per
4 KiB on a virtual machine, ~70 us per 100 KB batch), which ``write(2)``
does not pay; a syscall costs about 1 us. So a batch above
``SMALL_BATCH_BYTES`` is written with one ``pwritev`` whose pieces are the
encoded header and offsets and the caller's key and value buffers, and a
smaller one is copied into the writable mapping, where many batches share
one fault. Readers see either through the mapping as soon as the append
returns.

Bytes past the last batch are zero: a zero magic is the clean end of a
segment; anything else that fails a check is a torn or corrupt tail.

Bounds: every position read from a file goes through ``_check_batch`` before
it is dereferenced, so this module turns off Cython's own checks.
"""
from cpython.bytes cimport (PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE, PyBytes_Check,
                            PyBytes_CheckExact)
from cpython.list cimport PyList_GET_ITEM
from cpython.buffer cimport PyBUF_WRITABLE
from cpython.mem cimport PyMem_Malloc, PyMem_Calloc, PyMem_Free
from posix.uio cimport iovec, pwritev
from libc.errno cimport EINTR
from cpython.pyport cimport PY_SSIZE_T_MAX
from libc.stdint cimport uint8_t, uint16_t, uint32_t, int16_t, int32_t, int64_t, uint64_t
from libc.string cimport memcpy, memset
from libc.errno cimport errno
from posix.mman cimport (mmap, munmap, msync, posix_madvise, PROT_READ, PROT_WRITE, MAP_SHARED,
                         MAP_FAILED, MS_SYNC, POSIX_MADV_RANDOM)
from posix.unistd cimport close as c_close, ftruncate
from posix.fcntl cimport open as c_open, O_RDWR, O_RDONLY, O_CREAT

import os

import numpy as np
cimport numpy as cnp

from txmq.errors import CorruptLogError

from _bytes cimport (load_u16, load_u32, load_i32, load_i16, load_i64, load_u64, store_u16,
                     store_u32, store_i32, store_i16, store_i64, store_u64, align8, crc32c,
                     txmq_crc32c_update, txmq_crc32c_software, txmq_crc32c_hardware,
                     NOGIL_THRESHOLD)
from _batch_layout cimport *

cnp.import_array()

cdef extern from "fcntl.h" nogil:
    int posix_fallocate(int fd, long offset, long length)

cdef enum:
    IOV_MAX_PIECES = 1024   # POSIX IOV_MAX on Linux
    # Below this a batch is copied into the mapping, above it written with
    # pwritev: the crossover of a per-page fault and a per-batch syscall.
    SMALL_BATCH_BYTES = 2048

cdef extern from "sys/stat.h" nogil:
    int S_IRUSR, S_IWUSR, S_IRGRP, S_IROTH

# Blocks are reserved this far ahead of the writer, so a full disk is an
# OSError at append time, not a SIGBUS.
cdef Py_ssize_t FALLOCATE_CHUNK_C = 8 * 1024 * 1024
PAGE = 4096

# Exported for the Python layers and the tests.
HEADER_SIZE_BYTES = HEADER_SIZE
MAGIC = BATCH_MAGIC
VERSION = BATCH_VERSION
FLAG = {
    "transactional": FLAG_TRANSACTIONAL,
    "control": FLAG_CONTROL,
    "marker_commit": FLAG_MARKER_COMMIT,
    "marker_abort": FLAG_MARKER_ABORT,
    "null_keys": FLAG_NULL_KEYS,
    "headers": FLAG_HEADERS,
}
FIELD_OFFSETS = {
    "magic": MAGIC_OFFSET, "version": VERSION_OFFSET, "flags": FLAGS_OFFSET,
    "crc": CRC_OFFSET, "length": LENGTH_OFFSET, "base_offset": BASE_OFFSET_OFFSET,
    "count": COUNT_OFFSET, "base_sequence": BASE_SEQUENCE_OFFSET, "txn_id": TXN_ID_OFFSET,
    "producer_id": PRODUCER_ID_OFFSET, "producer_epoch": PRODUCER_EPOCH_OFFSET,
    "header_bytes": HEADER_BYTES_OFFSET, "first_event_time": FIRST_EVENT_TIME_OFFSET,
    "max_event_time": MAX_EVENT_TIME_OFFSET, "publish_time": PUBLISH_TIME_OFFSET,
}
# The layout is a contract with files on disk: fail the import, not a read.
assert HEADER_SIZE == 88 and HEADER_SIZE % 8 == 0, HEADER_SIZE
assert PUBLISH_TIME_OFFSET == 80 and TXN_ID_OFFSET == 32, (PUBLISH_TIME_OFFSET, TXN_ID_OFFSET)


class SegmentClosedError(Exception):
    """The segment was closed (deleted by retention, or the log closed);
    a reader holding a position in it must locate its offset again."""


# --------------------------------------------------------------------------
# Mapping: a mmap that counts the views it hands out.

cdef class Mapping:
    """A shared memory mapping of a file, exporting the buffer protocol.

    ``close()`` with views alive (Arrow arrays, memoryviews) defers the
    unmap until the last view is released, so a reader never faults.
    """
    cdef char *base
    cdef readonly Py_ssize_t size
    cdef readonly bint writable
    cdef readonly Py_ssize_t exports
    cdef bint closing

    def __cinit__(self, int fd, Py_ssize_t size, bint writable):
        cdef int prot = PROT_READ | (PROT_WRITE if writable else 0)
        cdef void *p
        if size <= 0:
            raise ValueError(f"cannot map {size} bytes")
        p = mmap(NULL, size, prot, MAP_SHARED, fd, 0)
        if p == MAP_FAILED:
            raise OSError(errno, os.strerror(errno))
        self.base = <char *>p
        self.size = size
        self.writable = writable
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

    cdef inline int pin(self) except -1:
        """Hold the mapping for the length of a read (as a view would)."""
        if self.base == NULL:
            raise SegmentClosedError("segment is closed")
        self.exports += 1
        return 0

    cdef inline void unpin(self) noexcept:
        self.exports -= 1
        if self.closing and self.exports == 0:
            self._unmap()

    cdef void _unmap(self) noexcept:
        if self.base != NULL:
            munmap(self.base, self.size)
            self.base = NULL

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
        with nogil:
            rc = msync(self.base + s, end - s, MS_SYNC)
        if rc != 0:
            raise OSError(errno, os.strerror(errno))

    def __dealloc__(self):
        self._unmap()


# --------------------------------------------------------------------------
# BatchSpec: the messages of one append, checked and measured once.

cdef class BatchSpec:
    """One append's messages, validated, with every size known up front.

    ``values`` is a list of bytes-like objects or a pyarrow binary /
    large_binary / string array; ``keys`` is None, a list whose entries are
    bytes or None, or a pyarrow array (nulls allowed); ``headers`` is None or
    a list (one entry per message) of None / dict / list of (str, bytes)
    pairs; ``event_times`` is None or a sequence of int64 milliseconds.
    """
    cdef readonly int32_t count
    cdef readonly Py_ssize_t key_bytes, value_bytes, header_bytes
    cdef readonly Py_ssize_t max_message_bytes
    cdef readonly uint16_t content_flags
    cdef readonly int64_t first_event_time, max_event_time
    cdef readonly bint event_time_is_publish_time
    cdef list value_list, key_list
    cdef object value_arrow, key_arrow   # pyarrow arrays (kept alive)
    cdef const uint8_t[::1] v_data, k_data, k_valid
    cdef const char *v_offsets
    cdef const char *k_offsets
    cdef bint v_large, k_large
    cdef Py_ssize_t v_base, k_base, k_bit_offset
    cdef bytes header_blob
    cdef object header_offsets   # int32 buffer (np.int32 array or a memoryview cast to "i")
    cdef object event_deltas     # the same, or None
    cdef object columns          # from_columns: the buffers the pointers above point into

    def __init__(self, values, keys=None, headers=None, event_times=None,
                 default_event_time=None):
        cdef Py_ssize_t i, n
        self.count = 0
        cdef list vl
        cdef object v
        cdef Py_ssize_t m, total = 0, biggest = 0
        if isinstance(values, list):
            vl = <list>values
            n = len(vl)
            self._check_count(n)
            # A private copy: sizes are measured now and the bytes written
            # later; a caller changing its list in between must not matter.
            vl = list(vl)
            self.value_list = vl
            for i in range(n):
                v = <object>PyList_GET_ITEM(vl, i)
                if PyBytes_CheckExact(v):
                    m = PyBytes_GET_SIZE(v)
                    total += m
                    if m > biggest:
                        biggest = m
                    continue
                if not PyBytes_Check(v):
                    if isinstance(v, (bytearray, memoryview)):
                        v = bytes(v)
                        vl[i] = v                       # our copy, not the caller's list
                    else:
                        from txmq.errors import InvalidMessageError
                        raise InvalidMessageError(f"value at index {i} (expected bytes)", v)
                m = PyBytes_GET_SIZE(v)
                total += m
                if m > biggest:
                    biggest = m
            self.value_bytes = total
            self.max_message_bytes = biggest
        else:
            n = self._from_arrow(values, True)
        self.count = <int32_t>n
        if keys is not None:
            self._set_keys(keys)
            # The size limit is on key + value, as Kafka's is on the record.
            self.max_message_bytes = self._largest_message()
        else:
            self.content_flags |= FLAG_NULL_KEYS
        if headers is not None:
            self._set_headers(headers)
        self._set_event_times(event_times, default_event_time)

    @staticmethod
    def from_columns(int32_t count, values, value_offsets, keys=None, key_offsets=None,
                     key_validity=None, headers=None, header_offsets=None, event_deltas=None,
                     int64_t first_event_time=0):
        """A batch from columns already laid out as txmq stores them, so a
        front end that decodes messages in bulk (the Kafka server) appends
        them with no Python object per message. Every buffer is bytes-like
        and little-endian, and is referenced, not copied, until the batch is
        written:

        - ``values``: the value bytes back to back; ``value_offsets``:
          int32[count + 1] from 0 to ``len(values)``, non-decreasing.
        - ``keys`` / ``key_offsets``: the same for keys, or both None when
          every key is null; ``key_validity``: a bitmap (bit i, LSB first,
          set when message i has a key) when some keys are null, else None.
        - ``headers``: every message's headers in txmq's encoding (see
          :func:`encode_headers`) back to back, with ``header_offsets``
          int32[count + 1]; both None when no message has headers.
        - ``event_deltas``: int32[count], each message's event time minus
          ``first_event_time``; None gives every message the publish time.

        Each buffer is checked (sizes, offsets, the header encoding) in one
        pass without Python objects; a malformed one raises
        :class:`~txmq.errors.InvalidMessageError`.
        """
        from txmq.errors import InvalidMessageError
        cdef BatchSpec s = BatchSpec.__new__(BatchSpec)
        cdef const int32_t[::1] voff, koff, hoff, deltas
        cdef const uint8_t[::1] hblob
        cdef Py_ssize_t i, n, biggest = 0, m
        cdef int32_t dmax = -0x7FFFFFFF - 1
        s._check_count(count)
        n = count
        s.count = count
        s.columns = (values, value_offsets, keys, key_offsets, key_validity, headers, header_offsets,
                     event_deltas)
        voff = _int32_column(value_offsets, n + 1, "value_offsets")
        s.v_data = _byte_column(values)
        s.value_arrow = values
        s.v_offsets = <const char *>&voff[0]
        s.value_bytes = _check_offsets(voff, n, len(values), "value_offsets")
        if keys is None:
            if key_offsets is not None or key_validity is not None:
                raise InvalidMessageError("key_offsets / key_validity (no keys given)", key_offsets)
            s.content_flags |= FLAG_NULL_KEYS
            for i in range(n):
                m = voff[i + 1] - voff[i]
                if m > biggest:
                    biggest = m
        else:
            koff = _int32_column(key_offsets, n + 1, "key_offsets")
            s.k_data = _byte_column(keys)
            s.key_arrow = keys
            s.k_offsets = <const char *>&koff[0]
            s.key_bytes = _check_offsets(koff, n, len(keys), "key_offsets")
            if key_validity is not None:
                s.k_valid = _byte_column(key_validity)
                if len(key_validity) < (n + 7) // 8:
                    raise InvalidMessageError(f"key_validity (expected {(n + 7) // 8} bytes)", len(key_validity))
                s.content_flags |= FLAG_NULL_KEYS
            for i in range(n):
                m = voff[i + 1] - voff[i] + koff[i + 1] - koff[i]
                if m > biggest:
                    biggest = m
        s.max_message_bytes = biggest
        if headers is not None:
            hoff = _int32_column(header_offsets, n + 1, "header_offsets")
            blob = bytes(headers)
            hblob = blob
            s.header_bytes = _check_offsets(hoff, n, len(blob), "header_offsets")
            for i in range(n):
                if not _headers_well_formed(<const char *>&hblob[0] + hoff[i], hoff[i + 1] - hoff[i]):
                    raise InvalidMessageError(f"headers of message {i} (not txmq's header encoding)", i)
            if s.header_bytes:
                s.content_flags |= FLAG_HEADERS
                s.header_blob = blob
                s.header_offsets = memoryview(header_offsets).cast("B").cast("i")
        elif header_offsets is not None:
            raise InvalidMessageError("header_offsets (no headers given)", header_offsets)
        if event_deltas is None:
            s.event_time_is_publish_time = True
        else:
            deltas = _int32_column(event_deltas, n, "event_deltas")
            for i in range(n):
                if deltas[i] > dmax:
                    dmax = deltas[i]
            s.first_event_time = first_event_time
            s.max_event_time = first_event_time + dmax
            s.event_deltas = memoryview(event_deltas).cast("B").cast("i")
        return s

    cdef _check_count(self, Py_ssize_t n):
        if n < 1:
            raise ValueError("a batch needs at least one message")
        if n > 0x7FFFFFF:
            raise ValueError(f"a batch holds at most {0x7FFFFFF} messages, not {n}")

    cdef Py_ssize_t _from_arrow(self, arr, bint is_value) except -1:
        from txmq.errors import InvalidMessageError
        try:
            import pyarrow as pa
        except ImportError:  # pragma: no cover - pyarrow is a dependency
            raise InvalidMessageError("values (expected list of bytes)", type(arr))
        if isinstance(arr, pa.ChunkedArray):
            arr = arr.combine_chunks()
        if not isinstance(arr, pa.Array):
            raise InvalidMessageError("values (expected list of bytes or a pyarrow binary array)", type(arr))
        t = arr.type
        if t == pa.binary() or t == pa.string():
            large = False
        elif t == pa.large_binary() or t == pa.large_string():
            large = True
        else:
            raise InvalidMessageError("pyarrow array type (expected binary or string)", t)
        n = len(arr)
        bufs = arr.buffers()
        cdef const uint8_t[::1] offsets = np.frombuffer(bufs[1], np.uint8)
        cdef const uint8_t[::1] data
        empty = b"\0"
        data = np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None and bufs[2].size > 0 else empty
        cdef Py_ssize_t off = arr.offset
        cdef Py_ssize_t width = 8 if large else 4
        if n == 0:
            self._check_count(0)
        if is_value:
            self._check_count(n)
            if arr.null_count:
                raise InvalidMessageError("values (null values are not allowed)", arr.null_count)
            self.value_arrow = arr
            self.v_data = data
            self.v_offsets = <const char *>&offsets[0] + off * width
            self.v_large = large
            self.v_base = self._arrow_offset(self.v_offsets, large, 0)
            self.value_bytes = self._arrow_offset(self.v_offsets, large, n) - self.v_base
            self.max_message_bytes = self._arrow_max_len(self.v_offsets, large, n)
        else:
            if n != self.count:
                raise InvalidMessageError(f"keys (expected {self.count} entries)", n)
            self.key_arrow = arr
            self.k_data = data
            self.k_offsets = <const char *>&offsets[0] + off * width
            self.k_large = large
            self.k_base = self._arrow_offset(self.k_offsets, large, 0)
            self.key_bytes = self._arrow_offset(self.k_offsets, large, n) - self.k_base
            if arr.null_count:
                self.content_flags |= FLAG_NULL_KEYS
                self.k_valid = np.frombuffer(bufs[0], np.uint8)
                self.k_bit_offset = off
        return n

    cdef inline Py_ssize_t _arrow_offset(self, const char *offsets, bint large, Py_ssize_t i) noexcept nogil:
        if large:
            return <Py_ssize_t>load_i64(offsets + 8 * i)
        return <Py_ssize_t>load_i32(offsets + 4 * i)

    cdef Py_ssize_t _arrow_max_len(self, const char *offsets, bint large, Py_ssize_t n) noexcept nogil:
        cdef Py_ssize_t i, m = 0, prev = self._arrow_offset(offsets, large, 0), cur
        for i in range(1, n + 1):
            cur = self._arrow_offset(offsets, large, i)
            if cur - prev > m:
                m = cur - prev
            prev = cur
        return m

    cdef _set_keys(self, keys):
        from txmq.errors import InvalidMessageError
        cdef Py_ssize_t i
        if not isinstance(keys, list):
            self._from_arrow(keys, False)
            return
        cdef list kl = <list>keys
        if len(kl) != self.count:
            raise InvalidMessageError(f"keys (expected {self.count} entries)", len(keys))
        kl = list(kl)   # private copy, as for values
        self.key_list = kl
        for i in range(self.count):
            k = <object>PyList_GET_ITEM(kl, i)
            if k is None:
                self.content_flags |= FLAG_NULL_KEYS
            elif PyBytes_Check(k):
                self.key_bytes += PyBytes_GET_SIZE(k)
            elif isinstance(k, (str, bytearray, memoryview)):
                k = (<str>k).encode() if isinstance(k, str) else bytes(k)
                kl[i] = k                   # our copy, not the caller's list
                self.key_bytes += PyBytes_GET_SIZE(k)
            else:
                raise InvalidMessageError(f"key at index {i} (expected bytes, str or None)", k)

    cdef _set_headers(self, headers):
        from txmq.errors import InvalidMessageError
        if len(headers) != self.count:
            raise InvalidMessageError(f"headers (expected {self.count} entries)", len(headers))
        parts = []
        offsets = np.zeros(self.count + 1, dtype=np.int32)
        cdef Py_ssize_t pos = 0, i
        any_headers = False
        for i in range(self.count):
            h = headers[i]
            if h:
                any_headers = True
                blob = encode_headers(h)
                parts.append(blob)
                pos += len(blob)
            offsets[i + 1] = pos
        if any_headers:
            self.content_flags |= FLAG_HEADERS
            self.header_blob = b"".join(parts)
            self.header_offsets = offsets
            self.header_bytes = pos

    cdef _set_event_times(self, event_times, default_event_time):
        from txmq.errors import InvalidMessageError
        if event_times is None:
            # Without event times every message takes the publish time
            # (Kafka's CreateTime default), unless a default is given.
            self.event_time_is_publish_time = default_event_time is None
            self.first_event_time = 0 if default_event_time is None else default_event_time
            self.max_event_time = self.first_event_time
            return
        try:
            ts = np.asarray(event_times, dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            raise InvalidMessageError("event times (expected int milliseconds)", event_times)
        if ts.ndim != 1 or len(ts) != self.count:
            raise InvalidMessageError(f"event times (expected {self.count} entries)", event_times)
        first = int(ts[0])
        deltas = ts - first
        if len(deltas) and (deltas.min() < -2**31 or deltas.max() >= 2**31):
            raise InvalidMessageError("event times (a batch spans at most 24 days)", (int(ts.min()), int(ts.max())))
        self.first_event_time = first
        self.max_event_time = int(ts.max())
        self.event_deltas = np.ascontiguousarray(deltas, dtype=np.int32)

    cdef Py_ssize_t _largest_message(self) except -1:
        """The largest key + value of the batch, in bytes."""
        return int((self._lengths(True) + self._lengths(False)).max())

    cdef object _lengths(self, bint keys):
        """Per-message byte lengths of the keys or the values (int64)."""
        cdef list items = self.key_list if keys else self.value_list
        cdef Py_ssize_t i, n = self.count
        cdef int64_t[::1] o
        cdef object v
        if items is not None:
            out = np.empty(n, np.int64)
            o = out
            for i in range(n):
                v = items[i]
                o[i] = PyBytes_GET_SIZE(v) if v is not None else 0
            return out
        offsets = self.k_offsets if keys else self.v_offsets
        large = self.k_large if keys else self.v_large
        width = 8 if large else 4
        raw = np.frombuffer(<bytes>PyBytes_FromStringAndSize(offsets, width * (n + 1)),
                            np.int64 if large else np.int32)
        return np.diff(raw).astype(np.int64)

    def encoded_size(self):
        """Bytes this batch takes in a segment."""
        return sections_of(self.count, self.content_flags, self.header_bytes,
                           self.key_bytes, self.value_bytes).end

    cdef Py_ssize_t write_to(self, char *dst, int fd, Py_ssize_t file_pos, int64_t base_offset,
                             uint16_t flags, uint64_t txn_hi, uint64_t txn_lo,
                             int64_t producer_id, int16_t producer_epoch,
                             int32_t base_sequence, int64_t publish_time) except -1:
        """Encode the batch; return its length.

        The header and the small sections before the key bytes are built in
        a scratch buffer; the key and value bytes stay in the caller's
        objects (or Arrow buffers). The CRC is computed over those pieces,
        then they are copied once: into ``dst`` (a writable mapping) when it
        is not NULL, else with one ``pwritev`` at ``file_pos`` of ``fd``.
        """
        flags |= self.content_flags
        cdef Sections s = sections_of(self.count, flags, self.header_bytes,
                                      self.key_bytes, self.value_bytes)
        cdef Py_ssize_t meta_len = s.keys
        cdef char *meta = <char *>PyMem_Calloc(meta_len, 1)
        cdef iovec *iov = NULL
        cdef Py_ssize_t n_iov = 0, cap, i
        cdef uint32_t crc
        cdef ssize_t rc
        if meta == NULL:
            raise MemoryError()
        try:
            self._write_meta(meta, s, flags, base_offset, txn_hi, txn_lo, producer_id,
                             producer_epoch, base_sequence, publish_time)
            cap = 4 + (self.count if self.key_list is not None else 1) \
                + (self.count if self.value_list is not None else 1)
            iov = <iovec *>PyMem_Malloc(cap * sizeof(iovec))
            if iov == NULL:
                raise MemoryError()
            _iov_add(iov, &n_iov, meta, meta_len)
            if self.key_list is not None:
                _iov_add_list(iov, &n_iov, self.key_list, self.count)
            elif self.key_arrow is not None:
                _iov_add(iov, &n_iov, <const char *>&self.k_data[0] + self.k_base, self.key_bytes)
            _iov_add(iov, &n_iov, ZEROS, align8(self.key_bytes) - self.key_bytes)
            if self.value_list is not None:
                _iov_add_list(iov, &n_iov, self.value_list, self.count)
            else:
                _iov_add(iov, &n_iov, <const char *>&self.v_data[0] + self.v_base, self.value_bytes)
            _iov_add(iov, &n_iov, ZEROS, align8(self.value_bytes) - self.value_bytes)
            with nogil:
                crc = txmq_crc32c_update(0, meta + CRC_PREFIX_OFFSET, CRC_PREFIX_SIZE)
                crc = txmq_crc32c_update(crc, meta + CRC_START, meta_len - CRC_START)
                for i in range(1, n_iov):
                    crc = txmq_crc32c_update(crc, iov[i].iov_base, iov[i].iov_len)
                store_u32(meta + CRC_OFFSET, crc)
                if dst != NULL:
                    for i in range(n_iov):
                        memcpy(dst, iov[i].iov_base, iov[i].iov_len)
                        dst += iov[i].iov_len
                    rc = 0
                else:
                    rc = _pwritev_all(fd, iov, n_iov, file_pos)
            if rc < 0:
                raise OSError(errno, f"cannot append {s.end} bytes: {os.strerror(errno)}")
            return s.end
        finally:
            PyMem_Free(meta)
            PyMem_Free(iov)

    cdef int _write_meta(self, char *dst, Sections s, uint16_t flags, int64_t base_offset,
                         uint64_t txn_hi, uint64_t txn_lo, int64_t producer_id,
                         int16_t producer_epoch, int32_t base_sequence,
                         int64_t publish_time) except -1:
        """The header and every section before the key bytes, into ``dst``
        (zeroed, ``s.keys`` bytes). The CRC field is left for the caller."""
        cdef Py_ssize_t i, n = self.count, pos, bit
        cdef int32_t *koff = <int32_t *>(dst + s.key_offsets)
        cdef int32_t *voff = <int32_t *>(dst + s.value_offsets)
        cdef uint8_t *valid = <uint8_t *>(dst + s.validity)
        cdef const int32_t[::1] hoffs
        cdef const int32_t[::1] deltas
        cdef object v
        store_u32(dst + MAGIC_OFFSET, BATCH_MAGIC)
        dst[VERSION_OFFSET] = <char>BATCH_VERSION
        store_u16(dst + FLAGS_OFFSET, flags)
        store_u32(dst + LENGTH_OFFSET, <uint32_t>s.end)
        store_i64(dst + BASE_OFFSET_OFFSET, base_offset)
        store_i32(dst + COUNT_OFFSET, self.count)
        store_i32(dst + BASE_SEQUENCE_OFFSET, base_sequence)
        store_u64(dst + TXN_ID_OFFSET, txn_hi)
        store_u64(dst + TXN_ID_OFFSET + 8, txn_lo)
        store_i64(dst + PRODUCER_ID_OFFSET, producer_id)
        store_i16(dst + PRODUCER_EPOCH_OFFSET, producer_epoch)
        store_u32(dst + HEADER_BYTES_OFFSET, <uint32_t>self.header_bytes)
        if self.event_time_is_publish_time:
            store_i64(dst + FIRST_EVENT_TIME_OFFSET, publish_time)
            store_i64(dst + MAX_EVENT_TIME_OFFSET, publish_time)
        else:
            store_i64(dst + FIRST_EVENT_TIME_OFFSET, self.first_event_time)
            store_i64(dst + MAX_EVENT_TIME_OFFSET, self.max_event_time)
        store_i64(dst + PUBLISH_TIME_OFFSET, publish_time)
        # value offsets
        if self.value_list is not None:
            pos = 0
            for i in range(n):
                pos += PyBytes_GET_SIZE(self.value_list[i])
                voff[i + 1] = <int32_t>pos
        else:
            self._rebase(voff, self.v_offsets, self.v_large, self.v_base)
        # key offsets and validity; no keys at all leaves every key null
        if self.key_list is not None:
            pos = 0
            for i in range(n):
                v = self.key_list[i]
                if v is not None:
                    if flags & FLAG_NULL_KEYS:
                        valid[i >> 3] |= <uint8_t>(1 << (i & 7))
                    pos += PyBytes_GET_SIZE(v)
                koff[i + 1] = <int32_t>pos
        elif self.key_arrow is not None:
            self._rebase(koff, self.k_offsets, self.k_large, self.k_base)
            if flags & FLAG_NULL_KEYS:
                for i in range(n):
                    bit = i + self.k_bit_offset
                    if self.k_valid[bit >> 3] & (1 << (bit & 7)):
                        valid[i >> 3] |= <uint8_t>(1 << (i & 7))
        if flags & FLAG_HEADERS:
            hoffs = self.header_offsets
            memcpy(dst + s.header_offsets, &hoffs[0], 4 * (n + 1))
            memcpy(dst + s.headers, PyBytes_AS_STRING(self.header_blob), self.header_bytes)
        if self.event_deltas is not None:
            deltas = self.event_deltas
            memcpy(dst + s.event_deltas, &deltas[0], 4 * n)
        return 0

    cdef void _rebase(self, int32_t *out_off, const char *offsets, bint large,
                      Py_ssize_t base) noexcept:
        cdef Py_ssize_t i, n = self.count
        with nogil:
            for i in range(n + 1):
                out_off[i] = <int32_t>(self._arrow_offset(offsets, large, i) - base)


cdef const char *ZEROS = b"\0\0\0\0\0\0\0\0"


cdef object _byte_column(object buf):
    """A byte view of ``buf`` that is never empty (an empty column points
    at a zero byte that nothing reads)."""
    view = memoryview(buf).cast("B")
    if view.nbytes == 0:
        return memoryview(b"\0")
    return view


cdef const int32_t[::1] _int32_column(object buf, Py_ssize_t n, str what) except *:
    from txmq.errors import InvalidMessageError
    if buf is None:
        raise InvalidMessageError(f"{what} (missing)", None)
    view = memoryview(buf).cast("B")
    if view.nbytes != 4 * n:
        raise InvalidMessageError(f"{what} (expected {4 * n} bytes)", view.nbytes)
    if n == 0:
        return memoryview(b"\0\0\0\0").cast("i")
    return view.cast("i")


cdef Py_ssize_t _check_offsets(const int32_t[::1] off, Py_ssize_t n, Py_ssize_t size, str what) except -1:
    """Offsets from 0, non-decreasing, ending at ``size``; returns ``size``."""
    from txmq.errors import InvalidMessageError
    cdef Py_ssize_t i
    if off[0] != 0 or off[n] != size:
        raise InvalidMessageError(f"{what} (expected 0 .. {size})", (off[0], off[n]))
    for i in range(n):
        if off[i + 1] < off[i]:
            raise InvalidMessageError(f"{what} (decreasing at {i})", (off[i], off[i + 1]))
    return size


cdef bint _headers_well_formed(const char *p, Py_ssize_t n) noexcept:
    """One message's encoded headers parse exactly to their end."""
    cdef Py_ssize_t pos = 0
    cdef HeaderSpan h
    while pos < n:
        pos = next_header(p, n, pos, &h)
        if pos < 0:
            return False
    return True


cdef inline void _iov_add(iovec *iov, Py_ssize_t *n, const char *p, Py_ssize_t length) noexcept:
    if length > 0:
        iov[n[0]].iov_base = <void *>p
        iov[n[0]].iov_len = length
        n[0] += 1


cdef void _iov_add_list(iovec *iov, Py_ssize_t *n, list items, Py_ssize_t count) noexcept:
    """One piece per non-empty bytes object; the list keeps each alive."""
    cdef Py_ssize_t i
    cdef object v
    for i in range(count):
        v = items[i]
        if v is not None:
            _iov_add(iov, n, PyBytes_AS_STRING(v), PyBytes_GET_SIZE(v))


cdef ssize_t _pwritev_all(int fd, iovec *iov, Py_ssize_t n, Py_ssize_t pos) noexcept nogil:
    """pwritev every piece at ``pos``, IOV_MAX at a time, across short
    writes and EINTR; -1 with errno set on failure."""
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


cdef inline uint32_t batch_crc(const char *batch, Py_ssize_t length) noexcept:
    """CRC of a batch: bytes [4, 8) (version, reserved, flags), then
    [12, length) (everything after the CRC field)."""
    cdef uint32_t c = txmq_crc32c_update(0, batch + CRC_PREFIX_OFFSET, CRC_PREFIX_SIZE)
    if length - CRC_START >= NOGIL_THRESHOLD:
        with nogil:
            c = txmq_crc32c_update(c, batch + CRC_START, length - CRC_START)
        return c
    return txmq_crc32c_update(c, batch + CRC_START, length - CRC_START)


cdef inline uint32_t _crc(const char *p, Py_ssize_t n) noexcept:
    cdef uint32_t c
    if n >= NOGIL_THRESHOLD:
        with nogil:
            c = crc32c(p, n)
        return c
    return crc32c(p, n)


def encode_headers(h):
    """Encode one message's headers: repeated [u16 key len][key][u32 value len][value].

    ``h`` is a dict or a list of (str, bytes | str | None) pairs; a value of
    None is stored with length 0xFFFFFFFF (Kafka's null header value).
    """
    from txmq.errors import InvalidMessageError
    items = h.items() if isinstance(h, dict) else h
    out = bytearray()
    for pair in items:
        try:
            k, v = pair
        except (TypeError, ValueError):
            raise InvalidMessageError("header (expected a (key, value) pair)", pair)
        if not isinstance(k, str):
            raise InvalidMessageError("header key (expected str)", k)
        kb = k.encode()
        if len(kb) > 0xFFFF:
            raise InvalidMessageError("header key (at most 65535 bytes)", k[:40])
        out += len(kb).to_bytes(2, "little") + kb
        if v is None:
            out += b"\xff\xff\xff\xff"
            continue
        if isinstance(v, str):
            v = v.encode()
        elif not isinstance(v, (bytes, bytearray, memoryview)):
            raise InvalidMessageError(f"header value of {k!r} (expected bytes, str or None)", v)
        vb = bytes(v)
        out += len(vb).to_bytes(4, "little") + vb
    return bytes(out)


cdef list decode_headers(const char *p, Py_ssize_t n):
    """Inverse of encode_headers; raises ValueError on malformed input."""
    cdef Py_ssize_t pos = 0
    cdef HeaderSpan h
    out = []
    while pos < n:
        pos = next_header(p, n, pos, &h)
        if pos < 0:
            raise ValueError("header past the end")
        k = p[h.key:h.key + h.key_len].decode("utf-8", "replace")
        out.append((k, None if h.value_len < 0 else PyBytes_FromStringAndSize(p + h.value, h.value_len)))
    return out


def crc32c_of(data, uint32_t crc=0, bint software=False):
    """CRC-32C of a bytes-like object, continuing ``crc`` (0 to start).

    ``software=True`` forces the table path, so tests can check it on a CPU
    that has the instruction.
    """
    cdef const uint8_t[::1] view = data
    cdef Py_ssize_t n = view.shape[0]
    if n == 0:
        return crc
    if software:
        return txmq_crc32c_software(crc, &view[0], n)
    if n >= NOGIL_THRESHOLD:
        with nogil:
            crc = txmq_crc32c_update(crc, &view[0], n)
        return crc
    return txmq_crc32c_update(crc, &view[0], n)


def crc32c_hardware():
    """True when CRC-32C runs on the CPU's instruction."""
    return bool(txmq_crc32c_hardware())


# --------------------------------------------------------------------------
# Messages as consumers see them, built straight from a mapped batch.

_tuple_new = tuple.__new__


cdef class Message:
    """One delivered message.

    ``value`` and ``key`` are bytes (``key`` may be None); ``headers`` is the
    ordered list of ``(str, bytes | None)`` pairs as sent (empty when none);
    ``properties`` the same as a dict of str, for Pulsar-style use;
    ``message_id`` is ``(topic, partition, offset)``; times are milliseconds
    since the epoch; ``txn_id`` is None outside transactions.
    """
    cdef public object value, key, message_id, txn_id
    cdef object _headers
    cdef readonly int64_t offset
    cdef public int64_t event_time, publish_time
    cdef public int redelivery_count

    def __init__(self, value, key, headers, message_id, int64_t event_time, int64_t publish_time,
                 int redelivery_count=0, txn_id=None):
        self.value = value
        self.key = key
        self._headers = headers or None
        self.message_id = message_id
        self.offset = message_id[2]
        self.event_time = event_time
        self.publish_time = publish_time
        self.redelivery_count = redelivery_count
        self.txn_id = txn_id

    @property
    def headers(self):
        return list(self._headers) if self._headers else []

    @property
    def properties(self):
        if not self._headers:
            return {}
        return {k: (v.decode("utf-8", "replace") if v is not None else None) for k, v in self._headers}

    @property
    def topic(self):
        return self.message_id[0]

    @property
    def partition(self):
        return self.message_id[1]

    def __reduce__(self):
        return (Message, (self.value, self.key, self._headers, self.message_id, self.event_time,
                          self.publish_time, self.redelivery_count, self.txn_id))

    def __repr__(self):
        v = self.value if len(self.value) <= 40 else self.value[:37] + b"..."
        mid = self.message_id
        return (f"Message({mid[0]}/{mid[1]}@{mid[2]}, key={self.key!r}, value={v!r}, "
                f"redelivery_count={self.redelivery_count})")


# --------------------------------------------------------------------------
# Batch headers as read back from a mapping.

cdef class BatchInfo:
    """The header of one batch in a segment, after its checks passed."""
    cdef readonly Py_ssize_t position, length
    cdef readonly int64_t base_offset, producer_id, publish_time, first_event_time, max_event_time
    cdef readonly int32_t count, base_sequence
    cdef readonly int16_t producer_epoch
    cdef readonly uint16_t flags
    cdef readonly uint64_t txn_hi, txn_lo

    @property
    def end(self):
        return self.position + self.length

    @property
    def last_offset(self):
        return self.base_offset + self.count - 1

    @property
    def next_offset(self):
        return self.base_offset + self.count

    @property
    def is_control(self):
        return bool(self.flags & FLAG_CONTROL)

    @property
    def is_transactional(self):
        return bool(self.flags & FLAG_TRANSACTIONAL)

    @property
    def txn_id(self):
        """(high, low) words of the transaction id, or None."""
        if self.txn_hi == 0 and self.txn_lo == 0:
            return None
        return (self.txn_hi, self.txn_lo)

    def __repr__(self):
        return (f"BatchInfo(position={self.position}, base_offset={self.base_offset}, "
                f"count={self.count}, length={self.length}, flags={self.flags:#x})")


cdef bint _offsets_sound(const char *offsets, int32_t count, Py_ssize_t total) noexcept nogil:
    """An offsets array runs from 0 to ``total`` without decreasing."""
    cdef int32_t i, prev = load_i32(offsets), cur
    if prev != 0 or load_i32(offsets + 4 * count) != total:
        return False
    for i in range(1, count + 1):
        cur = load_i32(offsets + 4 * i)
        if cur < prev:
            return False
        prev = cur
    return True


cdef str _check_batch(const char *p, Py_ssize_t avail, int64_t expected_offset, bint verify_crc,
                      Sections *out):
    """None when the batch at ``p`` is whole and sound; else the reason.

    ``avail`` bytes are readable from ``p``. ``expected_offset`` < 0 skips
    the continuity check.
    """
    cdef uint32_t magic, length
    cdef int32_t count
    cdef uint16_t flags
    cdef Py_ssize_t key_bytes, value_bytes, header_bytes, i
    cdef Sections s
    if avail < HEADER_SIZE:
        return "batch header past the end of the segment"
    magic = load_u32(p + MAGIC_OFFSET)
    if magic != BATCH_MAGIC:
        return f"bad magic {magic:#010x}"
    if <uint8_t>p[VERSION_OFFSET] != BATCH_VERSION:
        return f"unknown batch version {<uint8_t>p[VERSION_OFFSET]}"
    length = load_u32(p + LENGTH_OFFSET)
    if length < HEADER_SIZE or length % 8 or length > avail:
        return f"bad batch length {length}"
    flags = load_u16(p + FLAGS_OFFSET)
    if flags & ~FLAGS_KNOWN:
        return f"unknown flags {flags:#x}"
    count = load_i32(p + COUNT_OFFSET)
    if count < 1:
        return f"bad message count {count}"
    if expected_offset >= 0 and load_i64(p + BASE_OFFSET_OFFSET) != expected_offset:
        return f"base offset {load_i64(p + BASE_OFFSET_OFFSET)} where {expected_offset} was expected"
    if <uint8_t>p[VERSION_OFFSET + 1] != 0:
        return "reserved header byte is not 0"
    if verify_crc and batch_crc(p, length) != load_u32(p + CRC_OFFSET):
        return "CRC mismatch"
    # The offsets arrays sit at fixed places; read their last entries to
    # place the byte sections, then the computed end must be the length.
    s = sections_of(count, flags, 0, 0, 0)
    if s.value_offsets + 4 * (<Py_ssize_t>count + 1) > length:
        return "offsets past the batch end"
    header_bytes = load_u32(p + HEADER_BYTES_OFFSET)
    key_bytes = load_i32(p + s.key_offsets + 4 * count)
    value_bytes = load_i32(p + s.value_offsets + 4 * count)
    if key_bytes < 0 or value_bytes < 0 or header_bytes > length:
        return "negative section size"
    s = sections_of(count, flags, header_bytes, key_bytes, value_bytes)
    if s.end != length:
        return f"sections end at {s.end}, batch length is {length}"
    if verify_crc:
        # Offsets must run from 0 to their section's size without
        # decreasing, so decoders can trust them.
        if not (_offsets_sound(p + s.key_offsets, count, key_bytes)
                and _offsets_sound(p + s.value_offsets, count, value_bytes)):
            return "offsets out of order"
        if (flags & FLAG_HEADERS) and not _offsets_sound(p + s.header_offsets, count, header_bytes):
            return "header offsets out of order"
    if out != NULL:
        out[0] = s
    return None


cdef class Segment:
    """One segment file of a partition log, mapped, with its sparse indexes."""
    cdef readonly object path
    cdef readonly int64_t base_offset
    cdef readonly int64_t next_offset
    cdef readonly Py_ssize_t size
    cdef readonly Py_ssize_t capacity
    cdef readonly bint writable
    cdef readonly int64_t last_publish_time
    cdef readonly Mapping mapping
    cdef int fd
    cdef Py_ssize_t allocated
    cdef bint unreserved                 # the file system refused posix_fallocate
    # CRC is checked once per batch per process. Verified: the prefix
    # [0, verified_end) read in order, and the tail [verified_from, size)
    # that recovery scanned or this process appended.
    cdef Py_ssize_t verified_end
    cdef Py_ssize_t verified_from
    cdef Py_ssize_t index_interval
    cdef Py_ssize_t last_indexed_pos
    cdef object idx_off, idx_pos, tix_ts, tix_off   # np.int64 arrays, grown by doubling
    cdef public Py_ssize_t index_faults             # index entries found wrong and bypassed
    cdef object idx_ok                              # np.uint8 per offset-index entry: checked whole
    cdef Py_ssize_t idx_n, tix_n

    def __init__(self, path, int64_t base_offset, Py_ssize_t capacity, bint writable,
                 Py_ssize_t index_interval=4096):
        self.path = os.fspath(path)
        self.base_offset = base_offset
        self.next_offset = base_offset
        self.writable = writable
        self.index_interval = index_interval
        self.fd = -1
        self.last_indexed_pos = -index_interval
        self.idx_off = np.empty(64, np.int64)
        self.idx_pos = np.empty(64, np.int64)
        self.idx_ok = np.zeros(64, np.uint8)
        self.tix_ts = np.empty(64, np.int64)
        self.tix_off = np.empty(64, np.int64)
        flags = os.O_RDWR | os.O_CREAT if writable else os.O_RDONLY
        self.fd = os.open(self.path, flags, 0o644)
        file_size = os.fstat(self.fd).st_size
        if writable:
            self.capacity = max(capacity, file_size)
            if file_size < self.capacity:
                os.ftruncate(self.fd, self.capacity)
            self.allocated = file_size
        else:
            self.capacity = file_size
        self.size = 0
        self.verified_end = 0
        self.verified_from = PY_SSIZE_T_MAX
        if self.capacity > 0:
            self.mapping = Mapping(self.fd, self.capacity, writable)

    @property
    def file_size(self):
        return os.fstat(self.fd).st_size

    # -- appending ---------------------------------------------------------

    def room(self):
        """Bytes still free in this segment."""
        return self.capacity - self.size

    cpdef int64_t append(self, BatchSpec spec, uint16_t flags=0, uint64_t txn_hi=0,
                         uint64_t txn_lo=0, int64_t producer_id=-1, int16_t producer_epoch=-1,
                         int32_t base_sequence=-1, int64_t publish_time=0) except -2:
        """Write one batch at the end; return its base offset, or -1 if full."""
        cdef Py_ssize_t need = spec.encoded_size()
        cdef Py_ssize_t start = self.size
        cdef int64_t base = self.next_offset
        if not self.writable:
            raise PermissionError(f"{self.path} is open read-only")
        if start + need > self.capacity:
            return -1
        self._reserve(start + need)
        # Small batches are stored through the mapping (a page's zero-fill
        # fault is shared by many of them); large ones skip the faults with
        # pwritev (one syscall per batch). Either way, one copy.
        # A store into an unreserved page of a full disk is a SIGBUS, so
        # without a reservation every batch goes through pwritev.
        spec.write_to(self.mapping.base + start if need <= SMALL_BATCH_BYTES and not self.unreserved
                      else NULL, self.fd,
                      start, base, flags, txn_hi, txn_lo, producer_id, producer_epoch,
                      base_sequence, publish_time)
        self._indexed(start, base, publish_time)
        if self.verified_from > start:      # a segment never recovered: all of it is ours
            self.verified_from = start
        self.size = start + need
        self.next_offset = base + spec.count
        self.last_publish_time = publish_time
        return base

    cdef _reserve(self, Py_ssize_t end):
        cdef Py_ssize_t want
        cdef int rc
        if end <= self.allocated:
            return
        want = min(self.capacity, max(end, self.allocated + FALLOCATE_CHUNK_C))
        with nogil:
            rc = posix_fallocate(self.fd, self.allocated, want - self.allocated)
        if rc == 95:  # EOPNOTSUPP: no reservation, so never store through the mapping
            self.unreserved = True
        elif rc != 0:
            raise OSError(rc, f"cannot reserve {want - self.allocated} bytes in {self.path}: {os.strerror(rc)}")
        self.allocated = want

    cdef _indexed(self, Py_ssize_t pos, int64_t base, int64_t publish_time):
        if pos - self.last_indexed_pos < self.index_interval:
            return
        self.last_indexed_pos = pos
        # Each index grows on its own count: loaded from disk, the time
        # index may hold more entries than the offset index.
        if self.idx_n == len(self.idx_off):
            self.idx_off = np.resize(self.idx_off, 2 * self.idx_n)
            self.idx_pos = np.resize(self.idx_pos, 2 * self.idx_n)
            self.idx_ok = np.resize(self.idx_ok, 2 * self.idx_n)
        self.idx_off[self.idx_n] = base
        self.idx_pos[self.idx_n] = pos
        self.idx_ok[self.idx_n] = 1     # made here from a checked batch
        self.idx_n += 1
        if self.tix_n == 0 or publish_time > self.tix_ts[self.tix_n - 1]:
            if self.tix_n == len(self.tix_ts):
                self.tix_ts = np.resize(self.tix_ts, 2 * self.tix_n)
                self.tix_off = np.resize(self.tix_off, 2 * self.tix_n)
            self.tix_ts[self.tix_n] = publish_time
            self.tix_off[self.tix_n] = base
            self.tix_n += 1

    def sync(self, Py_ssize_t start=0, Py_ssize_t end=-1):
        """Make [start, end) durable (msync MS_SYNC); end=-1 means the log end."""
        if end < 0:
            end = self.size
        if self.mapping is not None:
            self._pin()
            try:
                self.mapping.sync(start, end)
            finally:
                self.mapping.unpin()

    # -- recovery ----------------------------------------------------------

    def recover(self, Py_ssize_t start_pos, int64_t start_offset):
        """Scan and index batches from ``start_pos``; cut a torn tail.

        Returns ``None`` when the scan reached a clean end (zeroed bytes or
        the file end), else ``(position, reason)`` of the first batch that
        failed; bytes from there on are discarded (zeroed or truncated).
        """
        cdef Py_ssize_t pos = start_pos, limit
        cdef int64_t expected = start_offset
        cdef const char *base
        cdef str reason = None
        if self.mapping is None:
            self.size = 0
            self.next_offset = start_offset
            return None if start_pos == 0 else (start_pos, "segment is empty")
        base = self.mapping.base
        limit = self.mapping.size
        while pos < limit:
            if limit - pos >= 8 and load_u64(base + pos) == 0:
                if self._zero_from(pos, limit):
                    break
                reason = "non-zero bytes after a zeroed batch header"
                break
            reason = _check_batch(base + pos, limit - pos, expected, True, NULL)
            if reason is not None:
                break
            self._indexed(pos, expected, load_i64(base + pos + PUBLISH_TIME_OFFSET))
            self.last_publish_time = load_i64(base + pos + PUBLISH_TIME_OFFSET)
            expected += load_i32(base + pos + COUNT_OFFSET)
            pos += load_u32(base + pos + LENGTH_OFFSET)
        self.size = pos
        self.verified_from = start_pos      # [0, start_pos) was trusted, not checked
        self.verified_end = 0
        self.next_offset = expected
        # Whatever lies past the log end may be an unreserved hole (a sparse
        # file left at full capacity by a crash): reserve again from here.
        self.allocated = pos
        if reason is not None:
            if self.writable:
                self.truncate_at(pos, expected)
            return (pos, reason)
        return None

    def reindex(self):
        """Rebuild the sparse indexes from the batches (an index found wrong)."""
        cdef Py_ssize_t pos = 0
        self._pin()
        try:
            self.idx_n = 0
            self.tix_n = 0
            self.last_indexed_pos = -self.index_interval
            while pos < self.size:
                self._checked(pos)
                self._indexed(pos, load_i64(self.mapping.base + pos + BASE_OFFSET_OFFSET),
                              load_i64(self.mapping.base + pos + PUBLISH_TIME_OFFSET))
                pos += load_u32(self.mapping.base + pos + LENGTH_OFFSET)
            self.index_faults = 0
        finally:
            self.mapping.unpin()

    def verify(self):
        """O(n) check of every batch (magic, length, CRC, offsets, dense
        base offsets): None when sound, else ``(position, reason)``."""
        cdef Py_ssize_t pos = 0
        cdef int64_t expected = self.base_offset
        cdef str reason
        if self.size == 0:
            return None
        self._pin()
        try:
            while pos < self.size:
                reason = _check_batch(self.mapping.base + pos, self.size - pos, expected, True, NULL)
                if reason is not None:
                    return (pos, reason)
                expected += load_i32(self.mapping.base + pos + COUNT_OFFSET)
                pos += load_u32(self.mapping.base + pos + LENGTH_OFFSET)
            if expected != self.next_offset:
                return (pos, f"batches end at offset {expected}, segment claims {self.next_offset}")
            return None
        finally:
            self.mapping.unpin()

    cdef bint _zero_from(self, Py_ssize_t pos, Py_ssize_t limit):
        """True when the bytes after a zeroed batch header are zero too, as
        far as a torn write can reach: the largest batch that fits, capped
        at 1 MiB, read with pread. Reading through the mapping instead would
        let read-ahead pull the whole preallocated segment into memory."""
        cdef Py_ssize_t n = min(limit - pos, 1 << 20)
        if n <= 0 or pos >= self.file_size:
            return True
        data = os.pread(self.fd, n, pos)
        return not data.strip(b"\0")

    def truncate_at(self, Py_ssize_t pos, int64_t next_offset):
        """Drop every byte from ``pos`` on, where the batch of ``next_offset``
        started (a torn tail, or the batches after a corrupt one)."""
        if not self.writable:
            raise PermissionError(f"{self.path} is open read-only")
        while self.idx_n and self.idx_pos[self.idx_n - 1] >= pos:
            self.idx_n -= 1
        while self.tix_n and self.tix_off[self.tix_n - 1] >= next_offset:
            self.tix_n -= 1
        self.last_indexed_pos = self.idx_pos[self.idx_n - 1] if self.idx_n else -self.index_interval
        # Shrinking and re-growing the file zeroes the tail and frees its blocks.
        os.ftruncate(self.fd, pos)
        os.ftruncate(self.fd, self.capacity)
        self.allocated = pos
        self.size = min(self.size, pos)
        self.verified_end = min(self.verified_end, pos)
        self.verified_from = min(self.verified_from, pos)
        self.next_offset = next_offset

    # -- indexes on disk ---------------------------------------------------

    def index_entries(self):
        """(offsets, positions, timestamps, time_offsets) as numpy views."""
        return (self.idx_off[:self.idx_n], self.idx_pos[:self.idx_n],
                self.tix_ts[:self.tix_n], self.tix_off[:self.tix_n])

    def load_index(self, offsets, positions, timestamps, time_offsets, Py_ssize_t size,
                   int64_t next_offset):
        """Adopt indexes read from disk for a segment known good up to ``size``."""
        self.idx_n = len(offsets)
        self.idx_off = np.array(offsets, np.int64) if self.idx_n else np.empty(64, np.int64)
        self.idx_pos = np.array(positions, np.int64) if self.idx_n else np.empty(64, np.int64)
        self.tix_n = len(timestamps)
        self.tix_ts = np.array(timestamps, np.int64) if self.tix_n else np.empty(64, np.int64)
        self.tix_off = np.array(time_offsets, np.int64) if self.tix_n else np.empty(64, np.int64)
        cap = max(64, self.idx_n, self.tix_n)
        self.idx_off = np.resize(self.idx_off, max(cap, len(self.idx_off)))
        self.idx_pos = np.resize(self.idx_pos, max(cap, len(self.idx_pos)))
        self.idx_ok = np.zeros(len(self.idx_off), np.uint8)   # loaded: not checked yet
        self.tix_ts = np.resize(self.tix_ts, max(cap, len(self.tix_ts)))
        self.tix_off = np.resize(self.tix_off, max(cap, len(self.tix_off)))
        self.last_indexed_pos = self.idx_pos[self.idx_n - 1] if self.idx_n else -self.index_interval
        self.size = size
        self.next_offset = next_offset
        self._walk_tail()

    cdef _walk_tail(self):
        """From the last index entry to ``size``: the true last publish time
        (the time index is sparse) and the true end, should the file hold
        zeros past its last batch (a trim that a power loss undid). The walk
        starts only from an entry that passed its check (else from byte 0)
        and steps only over batches that pass the structural checks."""
        cdef Py_ssize_t pos = 0
        cdef const char *p
        if self.tix_n:
            self.last_publish_time = max(self.last_publish_time, self.tix_ts[self.tix_n - 1])
        if self.mapping is None or self.size == 0:
            return
        if self.idx_n and self._idx_entry_ok(self.idx_n - 1):
            pos = self.idx_pos[self.idx_n - 1]
        p = self.mapping.base
        while pos + HEADER_SIZE <= self.size and _check_batch(p + pos, self.size - pos, -1, False, NULL) is None:
            self.last_publish_time = max(self.last_publish_time, load_i64(p + pos + PUBLISH_TIME_OFFSET))
            pos += load_u32(p + pos + LENGTH_OFFSET)
        if pos + 8 <= self.size and load_u64(p + pos) == 0:
            self.size = pos        # zeros past the last batch: the end is here

    # -- reading -----------------------------------------------------------

    cpdef Py_ssize_t locate(self, int64_t offset) except -2:
        self._pin()
        try:
            return self._locate(offset)
        finally:
            self.mapping.unpin()

    cdef Py_ssize_t _locate(self, int64_t offset) except -2:
        """Position of the batch holding ``offset`` (or the first batch after
        it); -1 when ``offset`` is at or past this segment's end."""
        cdef Py_ssize_t pos = 0, i
        cdef const char *p
        cdef int64_t base
        if offset >= self.next_offset or self.size == 0:
            return -1
        p = self.mapping.base
        if self.idx_n:
            i = np.searchsorted(self.idx_off[:self.idx_n], offset, side="right") - 1
            if i >= 0:
                pos = self.idx_pos[i]
                # An index is derived data: trust an entry only when the
                # batch it points at is whole and starts where it says.
                if not self._idx_entry_ok(i):
                    self.index_faults += 1
                    pos = 0
        while pos < self.size:
            self._checked(pos)
            base = load_i64(p + pos + BASE_OFFSET_OFFSET)
            if base + load_i32(p + pos + COUNT_OFFSET) > offset:
                return pos
            pos += load_u32(p + pos + LENGTH_OFFSET)
        return -1

    def find_time(self, int64_t timestamp):
        self._pin()
        try:
            return self._find_time(timestamp)
        finally:
            self.mapping.unpin()

    def _find_time(self, int64_t timestamp):
        """Offset of the first batch published at or after ``timestamp``, or -1."""
        cdef Py_ssize_t pos = 0, i
        cdef const char *p
        if self.size == 0:
            return -1
        p = self.mapping.base
        if self.tix_n:
            i = np.searchsorted(self.tix_ts[:self.tix_n], timestamp, side="left") - 1
            if i >= 0:
                # _locate walks to a real batch: compare it with the entry.
                pos = self._locate(self.tix_off[i])
                if (pos < 0 or load_i64(p + pos + BASE_OFFSET_OFFSET) != self.tix_off[i]
                        or load_i64(p + pos + PUBLISH_TIME_OFFSET) != self.tix_ts[i]):
                    self.index_faults += 1
                    pos = 0
        while pos < self.size:
            self._checked(pos)
            if load_i64(p + pos + PUBLISH_TIME_OFFSET) >= timestamp:
                return load_i64(p + pos + BASE_OFFSET_OFFSET)
            pos += load_u32(p + pos + LENGTH_OFFSET)
        return -1

    cdef bint _idx_entry_ok(self, Py_ssize_t i):
        """Whether offset-index entry ``i`` names a real batch: a full check
        (CRC and offsets) of the batch there, since bytes inside a message
        may look like a header. Entries this process made need none; each
        loaded one is checked once."""
        cdef Py_ssize_t pos = self.idx_pos[i]
        cdef unsigned char[::1] ok = self.idx_ok
        if ok[i]:
            return True
        if pos < 0 or pos + HEADER_SIZE > self.size or pos % 8:
            return False
        if _check_batch(self.mapping.base + pos, self.size - pos, self.idx_off[i], True, NULL) is not None:
            return False
        ok[i] = 1
        return True

    cdef int _pin(self) except -1:
        if self.mapping is None:
            raise SegmentClosedError(f"{self.path} is empty")
        return self.mapping.pin()

    cdef Sections _checked(self, Py_ssize_t pos) except *:
        """Check the batch at ``pos`` (CRC once per process) or raise CorruptLogError."""
        cdef Sections s
        cdef bint verify = self.verified_end <= pos < self.verified_from
        if pos < 0 or pos >= self.size or self.mapping is None or self.mapping.base == NULL:
            raise CorruptLogError(self.path, pos, "position outside the segment")
        reason = _check_batch(self.mapping.base + pos, self.size - pos, -1, verify, &s)
        if reason is not None:
            raise CorruptLogError(self.path, pos, reason)
        if verify and pos == self.verified_end:
            self.verified_end = pos + load_u32(self.mapping.base + pos + LENGTH_OFFSET)
            if self.verified_end >= self.verified_from:
                self.verified_from = 0      # prefix met tail: everything is checked
        return s

    def batch_at(self, Py_ssize_t pos):
        self._pin()
        try:
            return self._batch_at(pos)
        finally:
            self.mapping.unpin()

    def _batch_at(self, Py_ssize_t pos):
        """The checked header of the batch at ``pos``."""
        self._checked(pos)
        cdef const char *p = self.mapping.base + pos
        cdef BatchInfo b = BatchInfo.__new__(BatchInfo)
        b.position = pos
        b.length = load_u32(p + LENGTH_OFFSET)
        b.base_offset = load_i64(p + BASE_OFFSET_OFFSET)
        b.count = load_i32(p + COUNT_OFFSET)
        b.flags = load_u16(p + FLAGS_OFFSET)
        b.base_sequence = load_i32(p + BASE_SEQUENCE_OFFSET)
        b.txn_hi = load_u64(p + TXN_ID_OFFSET)
        b.txn_lo = load_u64(p + TXN_ID_OFFSET + 8)
        b.producer_id = load_i64(p + PRODUCER_ID_OFFSET)
        b.producer_epoch = load_i16(p + PRODUCER_EPOCH_OFFSET)
        b.first_event_time = load_i64(p + FIRST_EVENT_TIME_OFFSET)
        b.max_event_time = load_i64(p + MAX_EVENT_TIME_OFFSET)
        b.publish_time = load_i64(p + PUBLISH_TIME_OFFSET)
        return b

    def messages(self, Py_ssize_t pos, int64_t from_offset=0, Py_ssize_t limit=0x7FFFFFFF):
        """Decode the batch at ``pos`` into ``(offset, key, value, headers,
        event_time)`` tuples, from ``from_offset`` on, at most ``limit``."""
        self._pin()
        try:
            return self._decode(pos, from_offset, limit, None, None, 0, None, None)
        finally:
            self.mapping.unpin()

    def read_messages(self, Py_ssize_t pos, int64_t from_offset, Py_ssize_t limit, str topic,
                      int partition, id_type, txn_id=None):
        """Decode the batch at ``pos`` into :class:`Message` objects whose
        ``message_id`` is ``id_type((topic, partition, offset))``."""
        self._pin()
        try:
            return self._decode(pos, from_offset, limit, id_type, topic, partition, txn_id, Message)
        finally:
            self.mapping.unpin()

    cdef list _decode(self, Py_ssize_t pos, int64_t from_offset, Py_ssize_t limit, id_type,
                      str topic, int partition, txn_id, message_type):
        cdef Sections s = self._checked(pos)
        cdef const char *p = self.mapping.base + pos
        cdef int32_t count = load_i32(p + COUNT_OFFSET)
        cdef uint16_t flags = load_u16(p + FLAGS_OFFSET)
        cdef int64_t base = load_i64(p + BASE_OFFSET_OFFSET)
        cdef int64_t first_et = load_i64(p + FIRST_EVENT_TIME_OFFSET)
        cdef int64_t publish_time = load_i64(p + PUBLISH_TIME_OFFSET)
        cdef Py_ssize_t i = max(0, from_offset - base), end = min(<Py_ssize_t>count, i + limit)
        cdef int32_t ks, ke, vs, ve, hs, he
        # Every slice is bounds-checked against its section, so no byte
        # pattern in a file (and no index entry) can make a read leave the
        # batch; the CRC check guards the content, this guards memory.
        cdef int32_t key_bytes = load_i32(p + s.key_offsets + 4 * count)
        cdef int32_t value_bytes = load_i32(p + s.value_offsets + 4 * count)
        cdef int32_t header_bytes = <int32_t>load_u32(p + HEADER_BYTES_OFFSET)
        cdef Message m
        cdef list out = []
        for i in range(i, end):
            if (flags & FLAG_NULL_KEYS) and not (<uint8_t>p[s.validity + (i >> 3)] & (1 << (i & 7))):
                key = None
            else:
                ks = load_i32(p + s.key_offsets + 4 * i)
                ke = load_i32(p + s.key_offsets + 4 * i + 4)
                if not 0 <= ks <= ke <= key_bytes:
                    raise CorruptLogError(self.path, pos, f"key {i} spans [{ks}, {ke}) of {key_bytes} bytes")
                key = PyBytes_FromStringAndSize(p + s.keys + ks, ke - ks)
            vs = load_i32(p + s.value_offsets + 4 * i)
            ve = load_i32(p + s.value_offsets + 4 * i + 4)
            if not 0 <= vs <= ve <= value_bytes:
                raise CorruptLogError(self.path, pos, f"value {i} spans [{vs}, {ve}) of {value_bytes} bytes")
            value = PyBytes_FromStringAndSize(p + s.values + vs, ve - vs)
            headers = None
            if flags & FLAG_HEADERS:
                hs = load_i32(p + s.header_offsets + 4 * i)
                he = load_i32(p + s.header_offsets + 4 * i + 4)
                if hs < 0 or he > header_bytes or he < hs:
                    raise CorruptLogError(self.path, pos, f"headers {i} span [{hs}, {he}) of {header_bytes} bytes")
                if he > hs:
                    try:
                        headers = decode_headers(p + s.headers + hs, he - hs)
                    except ValueError as e:
                        raise CorruptLogError(self.path, pos, f"headers of offset {base + i}: {e}")
            if message_type is None:
                out.append((base + i, key, value, headers, first_et + load_i32(p + s.event_deltas + 4 * i)))
                continue
            m = Message.__new__(Message)
            m.value = value
            m.key = key
            m._headers = headers
            m.message_id = _tuple_new(id_type, (topic, partition, base + i))
            m.offset = base + i
            m.event_time = first_et + load_i32(p + s.event_deltas + 4 * i)
            m.publish_time = publish_time
            m.redelivery_count = 0
            m.txn_id = txn_id
            out.append(m)
        return out

    def batch_bytes(self, Py_ssize_t pos):
        """The checked batch at ``pos``, all of it, as a read-only
        memoryview of the mapping (no copy): front ends that re-encode
        whole batches read it. The view holds the mapping, which is not
        unmapped while it lives."""
        self._pin()
        try:
            self._checked(pos)
            length = load_u32(self.mapping.base + pos + LENGTH_OFFSET)
            return memoryview(self.mapping)[pos:pos + length]
        finally:
            self.mapping.unpin()

    def arrow_buffers(self, Py_ssize_t pos):
        self._pin()
        try:
            return self._arrow_buffers(pos)
        finally:
            self.mapping.unpin()

    def _arrow_buffers(self, Py_ssize_t pos):
        """Zero-copy views of one batch for Arrow: a dict of memoryviews over
        the mapping (``key_offsets``, ``keys``, ``validity`` or None,
        ``value_offsets``, ``values``, ``event_deltas``) plus ``count``."""
        cdef Sections s = self._checked(pos)
        cdef const char *p = self.mapping.base + pos
        cdef int32_t count = load_i32(p + COUNT_OFFSET)
        cdef uint16_t flags = load_u16(p + FLAGS_OFFSET)
        cdef Py_ssize_t kb = load_i32(p + s.key_offsets + 4 * count)
        cdef Py_ssize_t vb = load_i32(p + s.value_offsets + 4 * count)
        # Arrow trusts offsets without checking them: check them here.
        if not (_offsets_sound(p + s.key_offsets, count, kb)
                and _offsets_sound(p + s.value_offsets, count, vb)):
            raise CorruptLogError(self.path, pos, "offsets out of order")
        view = memoryview(self.mapping)
        return {
            "count": count,
            "key_offsets": view[pos + s.key_offsets: pos + s.key_offsets + 4 * (count + 1)],
            "keys": view[pos + s.keys: pos + s.keys + kb],
            "validity": view[pos + s.validity: pos + s.validity + (count + 7) // 8] if flags & FLAG_NULL_KEYS else None,
            "value_offsets": view[pos + s.value_offsets: pos + s.value_offsets + 4 * (count + 1)],
            "values": view[pos + s.values: pos + s.values + vb],
            "event_deltas": view[pos + s.event_deltas: pos + s.event_deltas + 4 * count],
        }

    # -- lifetime ----------------------------------------------------------

    def close(self, bint trim=True):
        """Unmap (deferred while views live) and close; a writable segment is
        trimmed to its used size so a sealed file ends at its last batch."""
        if self.mapping is not None:
            self.mapping.close()
        if self.fd >= 0:
            if self.writable and trim:
                os.ftruncate(self.fd, self.size)
            os.close(self.fd)
            self.fd = -1

    def sync_file(self):
        """fsync the file: its data and its size (after a trim)."""
        if self.fd >= 0:
            os.fsync(self.fd)

    def seal(self):
        """Trim the file to its batches (it stays mapped for readers)."""
        if self.writable and self.fd >= 0:
            os.ftruncate(self.fd, self.size)
            self.capacity = self.size
            self.allocated = self.size

    @property
    def closed(self):
        return self.fd < 0

    def __dealloc__(self):
        if self.fd >= 0:
            c_close(self.fd)
