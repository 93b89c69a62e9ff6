# cython: boundscheck=False, wraparound=False, cdivision=True
"""The batch codec: one append's messages to the bytes of a batch, and a
batch's bytes back to messages (docs/FORMAT.md).

The batch layout is the table in ``_batch_layout.pxd`` (docs/FORMAT.md
documents the same): an 88-byte header, then i32 offsets arrays, optional
key validity bits, header offsets and encoded headers, event-time deltas,
key bytes and value bytes, each section 8-byte aligned. This module also
owns the encoding of one message's headers inside the encoded-headers
section, repeated per header (little-endian)::

    u16 key length, key (UTF-8), u32 value length, value
    (value length 0xFFFFFFFF: a null value, no value bytes follow)

Encoding leaves the key and value bytes where the caller has them: a batch
is encoded as ``Pieces`` (the header and small sections in one buffer, then
the caller's buffers), sealed with its CRC, and a sink (the segment) copies
the pieces once. Decoding works on a pointer into a mapped segment and a
``Sections`` that ``check_batch`` returned for it.

Bounds: every batch is checked by ``check_batch`` before it is decoded, and
every slice a decoder takes is checked against its section (a message's
encoded headers are parsed by ``next_header`` of ``_batch_layout.pxd``, the
one parser of that encoding, over the bytes a ``_reader.Reader`` holds; a
header field that runs past them is reported by the reader at its file
position), so this module turns off Cython's own checks.
"""
cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE, PyBytes_Check, PyBytes_CheckExact
from cpython.list cimport PyList_GET_ITEM
from cpython.mem cimport PyMem_Malloc, PyMem_Calloc, PyMem_Free
from libc.stdint cimport uint8_t, uint16_t, uint32_t, int16_t, int32_t, int64_t, uint64_t
from libc.string cimport memcpy
from posix.uio cimport iovec

import numpy as np

from txmq.errors import CorruptLogError

from _bytes cimport (load_u16, load_u32, load_i32, load_i16, load_i64, load_u64, store_u16,
                     store_u32, store_i32, store_i16, store_i64, store_u64, align8,
                     txmq_crc32c_update, NOGIL_THRESHOLD)
from _batch_layout cimport *
from txmq._reader cimport Reader

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


# --------------------------------------------------------------------------
# BatchSpec: the messages of one append, checked and measured once.

cdef inline Py_ssize_t _arrow_offset(const char *offsets, bint large, Py_ssize_t i) noexcept nogil:
    """Entry ``i`` of an Arrow offsets buffer (int64 for the large types)."""
    if large:
        return <Py_ssize_t>load_i64(offsets + 8 * i)
    return <Py_ssize_t>load_i32(offsets + 4 * i)


cdef Py_ssize_t _arrow_max_len(const char *offsets, bint large, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i, m = 0, prev = _arrow_offset(offsets, large, 0), cur
    for i in range(1, n + 1):
        cur = _arrow_offset(offsets, large, i)
        if cur - prev > m:
            m = cur - prev
        prev = cur
    return m


cdef class BatchSpec:
    """One append's messages, validated, with every size known up front.

    ``values`` is a list of bytes-like objects or a pyarrow binary /
    large_binary / string array; ``keys`` is None, a list whose entries are
    bytes or None, or a pyarrow array (nulls allowed); ``headers`` is None or
    a list (one entry per message) of None / dict / list of (str, bytes)
    pairs; ``event_times`` is None or a sequence of int64 milliseconds.
    """
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
            self.v_base = _arrow_offset(self.v_offsets, large, 0)
            self.value_bytes = _arrow_offset(self.v_offsets, large, n) - self.v_base
            self.max_message_bytes = _arrow_max_len(self.v_offsets, large, n)
        else:
            if n != self.count:
                raise InvalidMessageError(f"keys (expected {self.count} entries)", n)
            self.key_arrow = arr
            self.k_data = data
            self.k_offsets = <const char *>&offsets[0] + off * width
            self.k_large = large
            self.k_base = _arrow_offset(self.k_offsets, large, 0)
            self.key_bytes = _arrow_offset(self.k_offsets, large, n) - self.k_base
            if arr.null_count:
                self.content_flags |= FLAG_NULL_KEYS
                self.k_valid = np.frombuffer(bufs[0], np.uint8)
                self.k_bit_offset = off
        return n

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
        if not isinstance(headers, (list, tuple)):
            raise InvalidMessageError("headers (expected a list with one entry per message)", headers)
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

    cdef int encode(self, Pieces *out, uint16_t flags, int64_t base_offset, uint64_t txn_hi,
                    uint64_t txn_lo, int64_t producer_id, int16_t producer_epoch,
                    int32_t base_sequence, int64_t publish_time) except -1:
        """Encode the batch into ``out``, CRC not yet computed (``seal``).

        The header and the small sections before the key bytes are built in
        a scratch buffer; the key and value bytes stay in the caller's
        objects (or Arrow buffers), so a sink copies each byte once. The
        caller frees ``out`` with ``free_pieces``, also when this raises.
        """
        out.meta = NULL
        out.iov = NULL
        out.n = 0
        flags |= self.content_flags
        cdef Sections s = sections_of(self.count, flags, self.header_bytes,
                                      self.key_bytes, self.value_bytes)
        cdef Py_ssize_t cap
        out.length = s.end
        out.meta = <char *>PyMem_Calloc(s.keys, 1)
        if out.meta == NULL:
            raise MemoryError()
        self._write_meta(out.meta, s, flags, base_offset, txn_hi, txn_lo, producer_id,
                         producer_epoch, base_sequence, publish_time)
        cap = 4 + (self.count if self.key_list is not None else 1) \
            + (self.count if self.value_list is not None else 1)
        out.iov = <iovec *>PyMem_Malloc(cap * sizeof(iovec))
        if out.iov == NULL:
            raise MemoryError()
        _iov_add(out.iov, &out.n, out.meta, s.keys)
        if self.key_list is not None:
            _iov_add_list(out.iov, &out.n, self.key_list, self.count)
        elif self.key_arrow is not None:
            _iov_add(out.iov, &out.n, <const char *>&self.k_data[0] + self.k_base, self.key_bytes)
        _iov_add(out.iov, &out.n, ZEROS, align8(self.key_bytes) - self.key_bytes)
        if self.value_list is not None:
            _iov_add_list(out.iov, &out.n, self.value_list, self.count)
        else:
            _iov_add(out.iov, &out.n, <const char *>&self.v_data[0] + self.v_base, self.value_bytes)
        _iov_add(out.iov, &out.n, ZEROS, align8(self.value_bytes) - self.value_bytes)
        return 0

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
        cdef Py_ssize_t n = self.count
        if 4 * n < NOGIL_THRESHOLD:     # (a small loop costs less than handing the GIL over)
            _rebase_offsets(out_off, offsets, large, base, n)
        else:
            with nogil:
                _rebase_offsets(out_off, offsets, large, base, n)


cdef inline void _rebase_offsets(int32_t *out_off, const char *offsets, bint large, Py_ssize_t base,
                                 Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n + 1):
        out_off[i] = <int32_t>(_arrow_offset(offsets, large, i) - base)


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


cdef void seal(Pieces *pieces) noexcept nogil:
    """Compute the batch's CRC over its pieces and store it in the header:
    bytes [4, 8) (version, reserved, flags), then [12, length)."""
    cdef char *meta = pieces.meta
    cdef Py_ssize_t i
    cdef uint32_t crc = txmq_crc32c_update(0, meta + CRC_PREFIX_OFFSET, CRC_PREFIX_SIZE)
    crc = txmq_crc32c_update(crc, meta + CRC_START, pieces.iov[0].iov_len - CRC_START)
    for i in range(1, pieces.n):
        crc = txmq_crc32c_update(crc, pieces.iov[i].iov_base, pieces.iov[i].iov_len)
    store_u32(meta + CRC_OFFSET, crc)


cdef void free_pieces(Pieces *pieces) noexcept:
    PyMem_Free(pieces.meta)
    PyMem_Free(pieces.iov)
    pieces.meta = NULL
    pieces.iov = NULL
    pieces.n = 0


# --------------------------------------------------------------------------
# Headers of one message, inside the encoded-headers section.

def encode_headers(h):
    """Encode one message's headers: repeated [u16 key len][key][u32 value len][value].

    ``h`` is a dict or a list of (str, bytes | str | None) pairs; a value of
    None is stored with length 0xFFFFFFFF (Kafka's null header value).
    """
    from txmq.errors import InvalidMessageError
    if isinstance(h, dict):
        items = h.items()
    elif isinstance(h, (list, tuple)):
        items = h
    else:
        raise InvalidMessageError("headers (expected a dict or a list of (str, bytes) pairs)", h)
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


cdef list _decode_headers(Reader r):
    """Inverse of encode_headers, over the bytes ``r`` reads (one message's
    headers), parsed by ``next_header`` (``_batch_layout.pxd``, the one
    parser of the encoding); a field that does not fit raises the reader's
    error at that field's first byte."""
    cdef HeaderSpan h
    cdef Py_ssize_t nxt
    out = []
    while r.pos < r.end:
        nxt = next_header(r.p, r.end, r.pos, &h)
        if nxt < 0:
            r.pos = h.short_at
            r._short(h.short_need)
        k = (r.p + h.key)[:h.key_len].decode("utf-8", "replace")
        out.append((k, None if h.value_len < 0 else PyBytes_FromStringAndSize(r.p + h.value, h.value_len)))
        r.pos = nxt
    return out


# --------------------------------------------------------------------------
# Messages as consumers see them, built straight from a mapped batch.

_tuple_new = tuple.__new__


@cython.no_gc
cdef class Message:
    """One delivered message.

    ``value`` and ``key`` are bytes (``key`` may be None); ``headers`` is the
    ordered list of ``(str, bytes | None)`` pairs as sent (empty when none);
    ``properties`` the same as a dict of str, for Pulsar-style use;
    ``message_id`` is ``(topic, partition, offset)``; times are milliseconds
    since the epoch; ``txn_id`` is None outside transactions.

    The ``message_id`` tuple is built when it is first read: a message
    received and acknowledged whole (``ack(list)`` reads the fields in
    compiled code) never needs one.

    Not tracked by the cyclic garbage collector (``no_gc``): a thousand
    received messages trigger no collection. Reference counting frees a
    message; only a cycle through one (a message stored in its own
    ``value``, ``key`` or ``txn_id``) would never be freed.
    """
    # (the fields are declared in pyx/txmq/_batch.pxd, for the ack path)

    def __init__(self, value, key, headers, message_id, int64_t event_time, int64_t publish_time,
                 int redelivery_count=0, txn_id=None):
        self.value = value
        self.key = key
        self._headers = headers or None
        self.message_id = message_id
        self.event_time = event_time
        self.publish_time = publish_time
        self.redelivery_count = redelivery_count
        self.txn_id = txn_id

    @property
    def message_id(self):
        if self._mid is None:
            self._mid = _tuple_new(self._id_type, (self._topic, self._partition, self.offset))
        return self._mid

    @message_id.setter
    def message_id(self, mid):
        self._mid = mid
        self._topic = mid[0]
        self._partition = mid[1]
        self.offset = mid[2]
        self._id_type = type(mid)

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
        return self._topic

    @property
    def partition(self):
        return self._partition

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


# --------------------------------------------------------------------------
# Checks of a batch read back: every decoder runs on a checked batch.

cdef inline uint32_t batch_crc(const char *batch, Py_ssize_t length) noexcept:
    """CRC of a batch: bytes [4, 8) (version, reserved, flags), then
    [12, length) (everything after the CRC field)."""
    cdef uint32_t c = txmq_crc32c_update(0, batch + CRC_PREFIX_OFFSET, CRC_PREFIX_SIZE)
    if length - CRC_START >= NOGIL_THRESHOLD:
        with nogil:
            c = txmq_crc32c_update(c, batch + CRC_START, length - CRC_START)
        return c
    return txmq_crc32c_update(c, batch + CRC_START, length - CRC_START)


cdef bint offsets_sound(const char *offsets, int32_t count, Py_ssize_t total) noexcept nogil:
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


cdef str check_batch(const char *p, Py_ssize_t avail, int64_t expected_offset, bint verify_crc,
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
        if not (offsets_sound(p + s.key_offsets, count, key_bytes)
                and offsets_sound(p + s.value_offsets, count, value_bytes)):
            return "offsets out of order"
        if (flags & FLAG_HEADERS) and not offsets_sound(p + s.header_offsets, count, header_bytes):
            return "header offsets out of order"
    if out != NULL:
        out[0] = s
    return None


# --------------------------------------------------------------------------
# Decoders, on a batch that check_batch passed (``s`` is its Sections).

cdef object batch_info(const char *p, Py_ssize_t pos):
    """The header of the batch at ``p``, found at byte ``pos`` of its file."""
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


cdef list decode_batch(const char *p, Sections s, object path, Py_ssize_t pos, int64_t from_offset,
                       Py_ssize_t limit, object id_type, str topic, int partition, object txn_id,
                       bint as_messages):
    """The messages of the batch at ``p`` (byte ``pos`` of ``path``, for
    errors), from ``from_offset`` on, at most ``limit``: :class:`Message`
    objects whose ``message_id`` is ``id_type((topic, partition, offset))``,
    or with ``as_messages`` false ``(offset, key, value, headers,
    event_time)`` tuples."""
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
    cdef Reader hr = Reader(path, "headers of offset") if flags & FLAG_HEADERS else None
    for i in range(i, end):
        if (flags & FLAG_NULL_KEYS) and not (<uint8_t>p[s.validity + (i >> 3)] & (1 << (i & 7))):
            key = None
        else:
            ks = load_i32(p + s.key_offsets + 4 * i)
            ke = load_i32(p + s.key_offsets + 4 * i + 4)
            if not 0 <= ks <= ke <= key_bytes:
                raise CorruptLogError(path, pos, f"key {i} spans [{ks}, {ke}) of {key_bytes} bytes")
            key = PyBytes_FromStringAndSize(p + s.keys + ks, ke - ks)
        vs = load_i32(p + s.value_offsets + 4 * i)
        ve = load_i32(p + s.value_offsets + 4 * i + 4)
        if not 0 <= vs <= ve <= value_bytes:
            raise CorruptLogError(path, pos, f"value {i} spans [{vs}, {ve}) of {value_bytes} bytes")
        value = PyBytes_FromStringAndSize(p + s.values + vs, ve - vs)
        headers = None
        if flags & FLAG_HEADERS:
            hs = load_i32(p + s.header_offsets + 4 * i)
            he = load_i32(p + s.header_offsets + 4 * i + 4)
            if hs < 0 or he > header_bytes or he < hs:
                raise CorruptLogError(path, pos, f"headers {i} span [{hs}, {he}) of {header_bytes} bytes")
            if he > hs:
                # The mapping is pinned for the whole decode: the reader
                # needs no owner.
                hr.reset_ptr(p + s.headers + hs, he - hs, pos + s.headers + hs, base + i, None)
                headers = _decode_headers(hr)
        if not as_messages:
            out.append((base + i, key, value, headers, first_et + load_i32(p + s.event_deltas + 4 * i)))
            continue
        m = Message.__new__(Message)
        m.value = value
        m.key = key
        m._headers = headers
        m._topic = topic
        m._partition = partition
        m._id_type = id_type
        m.offset = base + i
        m.event_time = first_et + load_i32(p + s.event_deltas + 4 * i)
        m.publish_time = publish_time
        m.redelivery_count = 0
        m.txn_id = txn_id
        out.append(m)
    return out
