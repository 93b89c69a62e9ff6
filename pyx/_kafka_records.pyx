# cython: boundscheck=False, wraparound=False, cdivision=True
"""Kafka's record batch v2, to and from txmq's batches.

Kafka's side is big-endian; what this module builds for txmq (record
columns) and reads from txmq (stored batches, ``_batch_layout.pxd``) is
little-endian, as txmq's formats are. Bytes are written into
:class:`txmq._kafka.Writer` (the protocol codec's output buffer).

**Record batch v2** (Kafka's ``RecordBatch``, magic 2)::

    0  baseOffset i64         8  batchLength i32 (bytes after this field)
    12 partitionLeaderEpoch i32  16 magic i8 (2)
    17 crc u32 (CRC-32C of bytes 21 .. end)
    21 attributes i16  (bits 0-2 compression, 3 timestamp type,
                        4 transactional, 5 control)
    23 lastOffsetDelta i32    27 baseTimestamp i64   35 maxTimestamp i64
    43 producerId i64         51 producerEpoch i16   53 baseSequence i32
    57 recordsCount i32       61 records (compressed as a whole if bit 0-2)

    record: length varint, attributes i8, timestampDelta varlong,
            offsetDelta varint, keyLength varint (-1 null), key,
            valueLength varint (-1 null), value, headerCount varint,
            headers: keyLength varint, key (UTF-8), valueLength varint, value

A control record (COMMIT / ABORT marker) has key ``version i16 = 0, type
i16`` (0 abort, 1 commit) and value ``version i16 = 0, coordinatorEpoch
i32``.

**Between the two**: :func:`decode_records` turns a produced batch's
records into :class:`RecordColumns`, the columns of a txmq batch (layout
below, above the function), in one pass with no Python object per record;
:func:`encode_stored_batch` turns a stored txmq batch back into one record
batch v2 the same way, for Fetch.

Every read is checked against the bytes there (the record reader's own
checks raise :class:`txmq.errors.KafkaProtocolError`); so Cython's bounds
checks are off here.
"""
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize, PyByteArray_Resize
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int16_t, int32_t, int64_t
from libc.string cimport memcpy, memset

from txmq.errors import CorruptLogError, KafkaProtocolError

from _bytes cimport (be16, be32, be64, crc32c, put16, put32, put64, store_i32, store_u16, store_u32, load_i16,
                     load_i32, load_i64, load_u16, load_u32, NOGIL_THRESHOLD)
cimport _batch_layout as layout
from txmq._kafka cimport Writer


# Record batch v2 layout, each offset chained from the one before.
BASE_OFFSET_OFFSET = 0
BATCH_LENGTH_OFFSET = BASE_OFFSET_OFFSET + 8
LEADER_EPOCH_OFFSET = BATCH_LENGTH_OFFSET + 4
MAGIC_OFFSET = LEADER_EPOCH_OFFSET + 4
CRC_OFFSET = MAGIC_OFFSET + 1
ATTRIBUTES_OFFSET = CRC_OFFSET + 4
LAST_OFFSET_DELTA_OFFSET = ATTRIBUTES_OFFSET + 2
BASE_TIMESTAMP_OFFSET = LAST_OFFSET_DELTA_OFFSET + 4
MAX_TIMESTAMP_OFFSET = BASE_TIMESTAMP_OFFSET + 8
PRODUCER_ID_OFFSET = MAX_TIMESTAMP_OFFSET + 8
PRODUCER_EPOCH_OFFSET = PRODUCER_ID_OFFSET + 8
BASE_SEQUENCE_OFFSET = PRODUCER_EPOCH_OFFSET + 2
RECORDS_COUNT_OFFSET = BASE_SEQUENCE_OFFSET + 4
RECORDS_OFFSET = RECORDS_COUNT_OFFSET + 4
BATCH_OVERHEAD = RECORDS_OFFSET
LOG_OVERHEAD = BATCH_LENGTH_OFFSET + 4       # bytes before batchLength counts
assert RECORDS_OFFSET == 61, RECORDS_OFFSET

cdef enum:
    C_RECORDS_OFFSET = 61
    C_ATTRIBUTES_OFFSET = 21
    C_ATTR_TRANSACTIONAL = 0x10

ATTR_COMPRESSION_MASK = 0x07
ATTR_LOG_APPEND_TIME = 0x08
ATTR_TRANSACTIONAL = 0x10
ATTR_CONTROL = 0x20
MAGIC_V2 = 2


# -- record batch v2 ------------------------------------------------------------------------

def decode_batches(data, str what="record batch"):
    """Split Produce ``records`` (any bytes-like object) into record
    batches v2 and check each (magic, length, CRC-32C over
    attributes..end, records count, last offset delta). Returns a list of
    ``(base_offset, attributes, last_offset_delta, base_timestamp,
    max_timestamp, producer_id, producer_epoch, base_sequence, count,
    records)`` where ``records`` is a memoryview of the records section as
    sent (compressed when ``attributes & 7``), not a copy. Raises
    :class:`KafkaProtocolError` on anything else, a partial batch
    included."""
    cdef const unsigned char[::1] view = data
    cdef Py_ssize_t size = view.shape[0], pos = 0, blen, end
    cdef const char *p = <const char *>&view[0] if size else <const char *>b""
    cdef uint32_t crc
    cdef int32_t count, last_delta
    cdef list out = []
    whole = memoryview(data)
    while pos < size:
        if size - pos < C_RECORDS_OFFSET:
            raise KafkaProtocolError(what, pos, f"{size - pos} bytes: shorter than a batch header")
        blen = <int32_t>be32(p + pos + 8)
        if blen < C_RECORDS_OFFSET - 12 or pos + 12 + blen > size:
            raise KafkaProtocolError(what, pos, f"batch length {blen} with {size - pos - 12} bytes left")
        end = pos + 12 + blen
        if p[pos + 16] != MAGIC_V2:
            raise KafkaProtocolError(what, pos, f"magic {p[pos + 16]} (only record batch v2 is supported)")
        if end - pos >= NOGIL_THRESHOLD:
            with nogil:
                crc = crc32c(p + pos + C_ATTRIBUTES_OFFSET, end - pos - C_ATTRIBUTES_OFFSET)
        else:
            crc = crc32c(p + pos + C_ATTRIBUTES_OFFSET, end - pos - C_ATTRIBUTES_OFFSET)
        if crc != be32(p + pos + 17):
            raise KafkaProtocolError(what, pos, f"CRC-32C {be32(p + pos + 17):#010x}, computed {crc:#010x}")
        count = <int32_t>be32(p + pos + 57)
        last_delta = <int32_t>be32(p + pos + 23)
        if count < 0 or count > end - pos - C_RECORDS_OFFSET + 1 or (count > 0 and last_delta != count - 1):
            raise KafkaProtocolError(what, pos, f"records count {count}, last offset delta {last_delta}")
        out.append((<int64_t>be64(p + pos), <int16_t>be16(p + pos + 21), last_delta,
                    <int64_t>be64(p + pos + 27), <int64_t>be64(p + pos + 35), <int64_t>be64(p + pos + 43),
                    <int16_t>be16(p + pos + 51), <int32_t>be32(p + pos + 53), count,
                    whole[pos + C_RECORDS_OFFSET:end]))
        pos = end
    return out


cdef inline int64_t _varlong(const char *p, Py_ssize_t size, Py_ssize_t *pos) except? -1:
    cdef uint64_t v = 0
    cdef int shift = 0
    cdef uint8_t b
    while True:
        if pos[0] >= size or shift > 63:
            raise KafkaProtocolError("record", pos[0], "truncated or overlong varint")
        b = <uint8_t>p[pos[0]]
        pos[0] += 1
        v |= <uint64_t>(b & 0x7F) << shift
        if not (b & 0x80):
            break
        shift += 7
    return <int64_t>(v >> 1) ^ -<int64_t>(v & 1)


# -- records as columns ----------------------------------------------------------------------
#
# A Produce batch's records become txmq's columns in one pass, with no Python
# object per record. Columns are little-endian, as txmq's batch layout and
# Arrow are:
#
#   values        value bytes back to back (a null value is empty)
#   value_offsets i32[count + 1], value i is values[off[i]:off[i + 1]]
#   keys          key bytes back to back; key_offsets i32[count + 1]
#   key_validity  bit i (LSB first) set when record i has a key; None when
#                 every record has one, and all three None when none has
#   headers       every record's headers in txmq's encoding, back to back:
#                 per header u16 key length, key (UTF-8), u32 value length,
#                 value (a null value: length 0xFFFFFFFF, no bytes); header_offsets i32[count + 1];
#                 both None when no record has headers
#   event_deltas  i32[count]: timestamp - first_timestamp (a batch spans at
#                 most 2**31 ms, as txmq's does)

cdef enum:
    HEADER_KEY_MAX = 0xFFFF         # txmq's header key length is a u16
# Keeps base timestamp + delta clear of int64 overflow.
cdef int64_t TIMESTAMP_DELTA_MAX = (<int64_t>1) << 62


cdef class RecordColumns:
    """The records of one record batch v2 as txmq's columns (the layout
    above): what ``txmq._batch.BatchSpec.from_columns`` takes. Built by
    :func:`decode_records`."""
    cdef readonly int32_t count
    cdef readonly object values, value_offsets
    cdef readonly object keys, key_offsets, key_validity
    cdef readonly object headers, header_offsets
    cdef readonly object event_deltas
    cdef readonly int64_t first_timestamp, max_timestamp

    def to_lists(self):
        """``(values, keys, headers, timestamps)`` as Python lists: keys
        None when every key is null (else None entries for null keys),
        headers None when no record has any (else None entries or lists of
        (str, bytes) pairs). For tests and tools, not the produce path."""
        cdef Py_ssize_t i, n = self.count
        voff = memoryview(self.value_offsets).cast("i")
        vals = bytes(self.values)
        values = [vals[voff[i]:voff[i + 1]] for i in range(n)]
        keys = None
        if self.keys is not None:
            koff = memoryview(self.key_offsets).cast("i")
            kb = bytes(self.keys)
            valid = self.key_validity
            keys = [kb[koff[i]:koff[i + 1]]
                    if valid is None or valid[i >> 3] & (1 << (i & 7)) else None for i in range(n)]
        headers = None
        if self.headers is not None:
            hoff = memoryview(self.header_offsets).cast("i")
            hb = bytes(self.headers)
            headers = [_header_pairs(hb[hoff[i]:hoff[i + 1]]) or None for i in range(n)]
        deltas = memoryview(self.event_deltas).cast("i")
        return values, keys, headers, [self.first_timestamp + deltas[i] for i in range(n)]


def _header_pairs(bytes blob):
    """One message's txmq-encoded headers as (str, bytes | None) pairs,
    through ``next_header`` (the one parser of that encoding)."""
    cdef const char *p = PyBytes_AS_STRING(blob)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(blob), pos = 0
    cdef layout.HeaderSpan span
    out = []
    while pos < n:
        pos = layout.next_header(p, n, pos, &span)
        if pos < 0:
            raise ValueError(f"headers: {span.short_need} bytes needed at byte {span.short_at} of {n}")
        out.append(((p + span.key)[:span.key_len].decode("utf-8"),
                    None if span.value_len < 0 else PyBytes_FromStringAndSize(p + span.value, span.value_len)))
    return out


cdef inline int64_t _length(const char *p, Py_ssize_t end, Py_ssize_t *pos, bint nullable) except? -2:
    """A record field's length: -1 for null (when ``nullable``), else a
    length that fits before ``end``."""
    cdef int64_t n = _varlong(p, end, pos)
    if n < 0:
        if n == -1 and nullable:
            return -1
        raise KafkaProtocolError("record", pos[0], f"length {n}")
    if n > end - pos[0]:
        raise KafkaProtocolError("record", pos[0], f"length {n} with {end - pos[0]} bytes left")
    return n


cdef bint _utf8_valid(const uint8_t *s, Py_ssize_t n) noexcept nogil:
    """Strict UTF-8, as Python's decoder reads it (no overlong forms, no
    surrogates, nothing past U+10FFFF)."""
    cdef Py_ssize_t i = 0, j
    cdef int need
    cdef uint32_t cp
    cdef uint8_t c
    while i < n:
        c = s[i]
        if c < 0x80:
            i += 1
            continue
        if 0xC2 <= c <= 0xDF:
            need, cp = 1, c & 0x1F
        elif 0xE0 <= c <= 0xEF:
            need, cp = 2, c & 0x0F
        elif 0xF0 <= c <= 0xF4:
            need, cp = 3, c & 0x07
        else:
            return False
        if n - i - 1 < need:
            return False
        for j in range(1, need + 1):
            if (s[i + j] & 0xC0) != 0x80:
                return False
            cp = (cp << 6) | (s[i + j] & 0x3F)
        if need == 2 and (cp < 0x800 or 0xD800 <= cp <= 0xDFFF):
            return False
        if need == 3 and (cp < 0x10000 or cp > 0x10FFFF):
            return False
        i += need + 1
    return True


cdef inline char *_bytearray_ptr(object b) noexcept:
    return PyByteArray_AS_STRING(b)


def decode_records(records, int32_t count, int64_t base_timestamp):
    """The ``count`` records of an uncompressed records section (any
    bytes-like object) as a :class:`RecordColumns`, in one pass with no
    Python object per record. Offset deltas must run 0..count-1, header
    keys must be UTF-8 of at most 65535 bytes, and the timestamps of a
    batch must lie within 2**31 ms of the first; anything else raises
    :class:`KafkaProtocolError`."""
    cdef const unsigned char[::1] view = records
    cdef Py_ssize_t size = view.shape[0], pos = 0, end, vpos = 0, kpos = 0, j
    cdef const char *p = <const char *>&view[0] if size else <const char *>b""
    cdef int64_t rlen, ts_delta, off_delta, nh, kl, vl, ts, first = 0, delta
    cdef int32_t i
    cdef RecordColumns c = RecordColumns.__new__(RecordColumns)
    cdef char *vals
    cdef char *voff
    cdef char *keys = NULL
    cdef char *koff
    cdef char *kvalid
    cdef char *deltas
    cdef char *hoff = NULL
    cdef Writer hw = None
    cdef bint any_null_key = False
    if count < 0 or count > size:                  # every record takes at least 7 bytes
        raise KafkaProtocolError("record", 0, f"records count {count} in {size} bytes")
    c.count = count
    c.values = PyByteArray_FromStringAndSize(NULL, size)          # shrunk to fit below
    c.value_offsets = PyByteArray_FromStringAndSize(NULL, 4 * (<Py_ssize_t>count + 1))
    c.key_offsets = PyByteArray_FromStringAndSize(NULL, 4 * (<Py_ssize_t>count + 1))
    c.key_validity = PyByteArray_FromStringAndSize(NULL, (<Py_ssize_t>count + 7) // 8)
    c.event_deltas = PyByteArray_FromStringAndSize(NULL, 4 * <Py_ssize_t>count)
    vals, voff = _bytearray_ptr(c.values), _bytearray_ptr(c.value_offsets)
    koff, kvalid = _bytearray_ptr(c.key_offsets), _bytearray_ptr(c.key_validity)
    deltas = _bytearray_ptr(c.event_deltas)
    memset(kvalid, 0, (<Py_ssize_t>count + 7) // 8)
    store_i32(voff, 0)
    store_i32(koff, 0)
    c.max_timestamp = base_timestamp
    for i in range(count):
        rlen = _varlong(p, size, &pos)
        if rlen < 1 or rlen > size - pos:
            raise KafkaProtocolError("record", pos, f"record length {rlen} with {size - pos} bytes left")
        end = pos + rlen
        pos += 1                                         # record attributes: unused
        ts_delta = _varlong(p, end, &pos)
        if ts_delta > TIMESTAMP_DELTA_MAX or ts_delta < -TIMESTAMP_DELTA_MAX:
            raise KafkaProtocolError("record", pos, f"timestamp delta {ts_delta}")
        off_delta = _varlong(p, end, &pos)
        if off_delta != i:
            raise KafkaProtocolError("record", pos, f"offset delta {off_delta} for record {i}")
        kl = _length(p, end, &pos, True)
        if kl >= 0:
            if keys == NULL:
                c.keys = PyByteArray_FromStringAndSize(NULL, size)
                keys = _bytearray_ptr(c.keys)
            memcpy(keys + kpos, p + pos, kl)
            kpos += kl
            pos += kl
            kvalid[i >> 3] = <char>(<uint8_t>kvalid[i >> 3] | (1 << (i & 7)))
        else:
            any_null_key = True
        store_i32(koff + 4 * (i + 1), <int32_t>kpos)
        vl = _length(p, end, &pos, True)
        if vl > 0:
            memcpy(vals + vpos, p + pos, vl)
            vpos += vl
            pos += vl
        store_i32(voff + 4 * (i + 1), <int32_t>vpos)
        nh = _varlong(p, end, &pos)
        if nh < 0 or nh > end - pos:
            raise KafkaProtocolError("record", pos, f"header count {nh}")
        if nh and hw is None:
            hw = Writer(256)
            c.header_offsets = PyByteArray_FromStringAndSize(NULL, 4 * (<Py_ssize_t>count + 1))
            hoff = _bytearray_ptr(c.header_offsets)
            memset(hoff, 0, 4 * (i + 1))
        for j in range(nh):
            kl = _length(p, end, &pos, False)
            if kl > HEADER_KEY_MAX or not _utf8_valid(<const uint8_t *>p + pos, kl):
                raise KafkaProtocolError("record", pos, "header key is not UTF-8 of at most 65535 bytes")
            hw.reserve(layout.HEADER_FIXED_BYTES + kl)
            store_u16(hw.buf + hw.size, <uint16_t>kl)
            memcpy(hw.buf + hw.size + layout.HEADER_KEY_LENGTH_BYTES, p + pos, kl)
            hw.size += layout.HEADER_KEY_LENGTH_BYTES + kl
            pos += kl
            vl = _length(p, end, &pos, True)
            if vl < 0:                                   # null: txmq's null header value
                store_u32(hw.buf + hw.size, <uint32_t>0xFFFFFFFF)
                hw.size += layout.HEADER_VALUE_LENGTH_BYTES
                continue
            store_u32(hw.buf + hw.size, <uint32_t>vl)
            hw.size += layout.HEADER_VALUE_LENGTH_BYTES
            hw.raw(p + pos, vl)
            pos += vl
        if hoff != NULL:
            store_i32(hoff + 4 * (i + 1), <int32_t>hw.size)
        if pos != end:
            raise KafkaProtocolError("record", pos, f"record {i} has {end - pos} bytes past its fields")
        ts = base_timestamp + ts_delta
        if i == 0:
            first = ts
            c.max_timestamp = ts
        delta = ts - first
        if delta < -0x80000000 or delta > 0x7FFFFFFF:
            raise KafkaProtocolError("record", pos, "timestamps of one batch span more than 2**31 ms")
        store_i32(deltas + 4 * i, <int32_t>delta)
        if ts > c.max_timestamp:
            c.max_timestamp = ts
    if pos != size:
        raise KafkaProtocolError("record", pos, f"{size - pos} bytes after {count} records")
    c.first_timestamp = first
    PyByteArray_Resize(c.values, vpos)
    if keys == NULL:
        c.key_offsets = c.key_validity = None
    else:
        PyByteArray_Resize(c.keys, kpos)
        if not any_null_key:
            c.key_validity = None
    if hw is not None:
        c.headers = hw.getvalue()
    return c


cdef int _write_record_bytes(Writer w, object b) except -1:
    if b is None:
        return w.varlong(-1)
    w.varlong(len(b))
    return w.data(b)


def encode_records(list messages, int64_t base_offset, int64_t base_timestamp):
    """The records section for ``messages``: tuples whose items 0-4 are
    (offset, key, value, headers, timestamp ms) as txmq's segments yield
    them; ``headers`` is None or a list of (str, bytes) pairs."""
    cdef Writer w = Writer(64 * len(messages) + 64)
    cdef Writer rec = Writer(256)
    cdef tuple m
    cdef object headers, hk
    cdef bytes kb
    for m in messages:
        rec.size = 0
        rec.i8(0)
        rec.varlong(<int64_t>m[4] - base_timestamp)
        rec.varlong(<int64_t>m[0] - base_offset)
        _write_record_bytes(rec, m[1])
        _write_record_bytes(rec, m[2])
        headers = m[3]
        if headers:
            rec.varlong(len(headers))
            for hk, hv in headers:
                kb = hk.encode("utf-8") if type(hk) is str else bytes(hk)
                _write_record_bytes(rec, kb)
                _write_record_bytes(rec, hv)
        else:
            rec.varlong(0)
        w.varlong(rec.size)
        w.raw(rec.buf, rec.size)
    return w.getvalue()


def encode_batch(int64_t base_offset, int16_t attributes, int32_t last_offset_delta,
                 int64_t base_timestamp, int64_t max_timestamp, int64_t producer_id,
                 int16_t producer_epoch, int32_t base_sequence, int32_t count, bytes records,
                 int32_t leader_epoch=0):
    """One record batch v2 around an encoded (and, if ``attributes`` say
    so, compressed) records section, its CRC-32C computed."""
    cdef Py_ssize_t n = PyBytes_GET_SIZE(records)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, C_RECORDS_OFFSET + n)
    cdef char *p = PyBytes_AS_STRING(out)
    put64(p, <uint64_t>base_offset)
    put32(p + 8, <uint32_t>(C_RECORDS_OFFSET - 12 + n))
    put32(p + 12, <uint32_t>leader_epoch)
    p[16] = MAGIC_V2
    put16(p + 21, <uint16_t>attributes)
    put32(p + 23, <uint32_t>last_offset_delta)
    put64(p + 27, <uint64_t>base_timestamp)
    put64(p + 35, <uint64_t>max_timestamp)
    put64(p + 43, <uint64_t>producer_id)
    put16(p + 51, <uint16_t>producer_epoch)
    put32(p + 53, <uint32_t>base_sequence)
    put32(p + 57, <uint32_t>count)
    memcpy(p + C_RECORDS_OFFSET, PyBytes_AS_STRING(records), n)
    put32(p + 17, crc32c(p + C_ATTRIBUTES_OFFSET, C_RECORDS_OFFSET - C_ATTRIBUTES_OFFSET + n))
    return out


cdef inline int _uvarint_size(uint64_t v) noexcept nogil:
    cdef int n = 1
    while v >= 0x80:
        v >>= 7
        n += 1
    return n


cdef inline int _varlong_size(int64_t v) noexcept nogil:
    return _uvarint_size((<uint64_t>v << 1) ^ <uint64_t>(v >> 63))


cdef inline void _put_uvarint(char **p, uint64_t v) noexcept nogil:
    while v >= 0x80:
        p[0][0] = <char>((v & 0x7F) | 0x80)
        p[0] += 1
        v >>= 7
    p[0][0] = <char>v
    p[0] += 1


cdef inline void _put_varlong(char **p, int64_t v) noexcept nogil:
    _put_uvarint(p, (<uint64_t>v << 1) ^ <uint64_t>(v >> 63))


cdef Py_ssize_t _headers_kafka_size(const char *h, Py_ssize_t n, Py_ssize_t *count) noexcept nogil:
    """Kafka bytes of one message's txmq-encoded headers (``count`` set to
    how many), or -1 when they do not parse to their end."""
    cdef Py_ssize_t pos = 0, size = 0
    cdef layout.HeaderSpan span
    count[0] = 0
    while pos < n:
        pos = layout.next_header(h, n, pos, &span)
        if pos < 0:
            return -1
        size += _varlong_size(span.key_len) + span.key_len
        size += 1 if span.value_len < 0 else _varlong_size(span.value_len) + span.value_len
        count[0] += 1
    return size


def encode_stored_batch(Writer w, batch):
    """Append one txmq data batch — its bytes as stored (``_batch_layout.pxd``),
    e.g. ``Segment.batch_bytes`` — to ``w`` as one Kafka record batch v2 with
    the same base offset, producer id, epoch, base sequence and
    transactional bit, computing its CRC-32C. Keys, values, headers and
    event times go straight from the stored columns to records, with no
    Python object per message. Returns the bytes appended; a batch whose
    offsets leave their sections raises
    :class:`txmq.errors.CorruptLogError`."""
    cdef const unsigned char[::1] view = batch
    cdef Py_ssize_t blen = view.shape[0]
    if blen < layout.HEADER_SIZE:
        raise CorruptLogError("batch", 0, f"{blen} bytes: shorter than a batch header")
    cdef const char *p = <const char *>&view[0]
    cdef int32_t count = load_i32(p + layout.COUNT_OFFSET), i
    cdef uint16_t flags = load_u16(p + layout.FLAGS_OFFSET)
    cdef uint32_t header_bytes = load_u32(p + layout.HEADER_BYTES_OFFSET)
    cdef layout.Sections s
    cdef int64_t first_et = load_i64(p + layout.FIRST_EVENT_TIME_OFFSET), base_ts, max_ts, ts
    cdef int32_t d, dmin, dmax, ks, ke, vs, ve, hs = 0, he = 0, key_bytes, value_bytes
    cdef Py_ssize_t total = 0, body, start = w.size, hsize, hcount, j, hpos
    cdef layout.HeaderSpan span
    cdef bint null_key
    cdef char *out
    cdef char *rec
    if count < 1 or flags & layout.FLAG_CONTROL:
        raise CorruptLogError("batch", 0, "not a data batch")
    s = layout.sections_of(count, flags, header_bytes, 0, 0)
    if s.keys > blen:
        raise CorruptLogError("batch", 0, "offsets past the batch end")
    key_bytes = load_i32(p + s.key_offsets + 4 * count)
    value_bytes = load_i32(p + s.value_offsets + 4 * count)
    s = layout.sections_of(count, flags, header_bytes, key_bytes, value_bytes)
    if key_bytes < 0 or value_bytes < 0 or s.end != blen:
        raise CorruptLogError("batch", 0, f"sections end at {s.end}, batch length is {blen}")
    dmin = dmax = load_i32(p + s.event_deltas)
    for i in range(1, count):
        d = load_i32(p + s.event_deltas + 4 * i)
        if d < dmin:
            dmin = d
        if d > dmax:
            dmax = d
    base_ts, max_ts = first_et + dmin, first_et + dmax
    # First pass: every record's size, so the batch is written in one go.
    for i in range(count):
        null_key = (flags & layout.FLAG_NULL_KEYS) and not (<uint8_t>p[s.validity + (i >> 3)] & (1 << (i & 7)))
        ks, ke = load_i32(p + s.key_offsets + 4 * i), load_i32(p + s.key_offsets + 4 * i + 4)
        vs, ve = load_i32(p + s.value_offsets + 4 * i), load_i32(p + s.value_offsets + 4 * i + 4)
        if not (0 <= ks <= ke <= key_bytes and 0 <= vs <= ve <= value_bytes):
            raise CorruptLogError("batch", 0, f"message {i}: offsets outside their sections")
        hcount = 0
        hsize = 0
        if flags & layout.FLAG_HEADERS:
            hs, he = load_i32(p + s.header_offsets + 4 * i), load_i32(p + s.header_offsets + 4 * i + 4)
            if not (0 <= hs <= he <= <int32_t>header_bytes):
                raise CorruptLogError("batch", 0, f"message {i}: headers outside their section")
            hsize = _headers_kafka_size(p + s.headers + hs, he - hs, &hcount)
            if hsize < 0:
                raise CorruptLogError("batch", 0, f"message {i}: headers do not parse")
        ts = first_et + load_i32(p + s.event_deltas + 4 * i)
        body = (1 + _varlong_size(ts - base_ts) + _varlong_size(i)
                + (1 if null_key else _varlong_size(ke - ks) + (ke - ks))
                + _varlong_size(ve - vs) + (ve - vs) + _varlong_size(hcount) + hsize)
        total += _varlong_size(body) + body
    w.reserve(C_RECORDS_OFFSET + total)
    out = w.buf + start
    rec = out + C_RECORDS_OFFSET
    for i in range(count):
        null_key = (flags & layout.FLAG_NULL_KEYS) and not (<uint8_t>p[s.validity + (i >> 3)] & (1 << (i & 7)))
        ks, ke = load_i32(p + s.key_offsets + 4 * i), load_i32(p + s.key_offsets + 4 * i + 4)
        vs, ve = load_i32(p + s.value_offsets + 4 * i), load_i32(p + s.value_offsets + 4 * i + 4)
        hcount = 0
        hsize = 0
        if flags & layout.FLAG_HEADERS:
            hs, he = load_i32(p + s.header_offsets + 4 * i), load_i32(p + s.header_offsets + 4 * i + 4)
            hsize = _headers_kafka_size(p + s.headers + hs, he - hs, &hcount)
        ts = first_et + load_i32(p + s.event_deltas + 4 * i)
        body = (1 + _varlong_size(ts - base_ts) + _varlong_size(i)
                + (1 if null_key else _varlong_size(ke - ks) + (ke - ks))
                + _varlong_size(ve - vs) + (ve - vs) + _varlong_size(hcount) + hsize)
        _put_varlong(&rec, body)
        rec[0] = 0                                       # record attributes
        rec += 1
        _put_varlong(&rec, ts - base_ts)
        _put_varlong(&rec, i)
        if null_key:
            _put_varlong(&rec, -1)
        else:
            _put_varlong(&rec, ke - ks)
            memcpy(rec, p + s.keys + ks, ke - ks)
            rec += ke - ks
        _put_varlong(&rec, ve - vs)
        memcpy(rec, p + s.values + vs, ve - vs)
        rec += ve - vs
        _put_varlong(&rec, hcount)
        hpos = 0
        for j in range(hcount):
            hpos = layout.next_header(p + s.headers + hs, he - hs, hpos, &span)
            _put_varlong(&rec, span.key_len)
            memcpy(rec, p + s.headers + hs + span.key, span.key_len)
            rec += span.key_len
            _put_varlong(&rec, span.value_len)               # -1: null
            if span.value_len > 0:
                memcpy(rec, p + s.headers + hs + span.value, span.value_len)
                rec += span.value_len
    put64(out, <uint64_t>load_i64(p + layout.BASE_OFFSET_OFFSET))
    put32(out + 8, <uint32_t>(C_RECORDS_OFFSET - 12 + total))
    put32(out + 12, 0)
    out[16] = MAGIC_V2
    put16(out + 21, <uint16_t>(C_ATTR_TRANSACTIONAL if flags & layout.FLAG_TRANSACTIONAL else 0))
    put32(out + 23, <uint32_t>(count - 1))
    put64(out + 27, <uint64_t>base_ts)
    put64(out + 35, <uint64_t>max_ts)
    put64(out + 43, <uint64_t>load_i64(p + layout.PRODUCER_ID_OFFSET))
    put16(out + 51, <uint16_t>load_i16(p + layout.PRODUCER_EPOCH_OFFSET))
    put32(out + 53, <uint32_t>load_i32(p + layout.BASE_SEQUENCE_OFFSET))
    put32(out + 57, <uint32_t>count)
    if total >= NOGIL_THRESHOLD:
        with nogil:
            put32(out + 17, crc32c(out + C_ATTRIBUTES_OFFSET, C_RECORDS_OFFSET - C_ATTRIBUTES_OFFSET + total))
    else:
        put32(out + 17, crc32c(out + C_ATTRIBUTES_OFFSET, C_RECORDS_OFFSET - C_ATTRIBUTES_OFFSET + total))
    w.size = start + C_RECORDS_OFFSET + total
    return C_RECORDS_OFFSET + total


def encode_control_batch(int64_t offset, int64_t producer_id, int16_t producer_epoch, bint commit,
                         int64_t timestamp):
    """A transaction marker as Kafka writes it: a transactional control
    batch of one control record (type 1 commit, 0 abort)."""
    cdef Writer rec = Writer(32)
    cdef Writer w = Writer(32)
    cdef char key[4]
    cdef char value[6]
    put16(key, 0)
    put16(key + 2, 1 if commit else 0)
    put16(value, 0)
    put32(value + 2, 0)
    rec.i8(0)
    rec.varlong(0)
    rec.varlong(0)
    rec.varlong(4)
    rec.raw(key, 4)
    rec.varlong(6)
    rec.raw(value, 6)
    rec.varlong(0)
    w.varlong(rec.size)
    w.raw(rec.buf, rec.size)
    return encode_batch(offset, ATTR_TRANSACTIONAL | ATTR_CONTROL, 0, timestamp, timestamp, producer_id,
                        producer_epoch, -1, 1, w.getvalue())
