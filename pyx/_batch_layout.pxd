# The on-disk batch layout (docs/FORMAT.md), version 1. Little-endian; every
# section starts 8-byte aligned so Arrow can wrap a mapped segment's bytes
# without copying. docs/FORMAT.md documents the same table.
#
#   off  size  field
#     0     4  magic "TXMB" (0x424D5854 little-endian)
#     4     1  version (1)
#     5     1  reserved, 0
#     6     2  flags (FLAG_*)
#     8     4  crc32c of bytes [4, 8) then [12, length): all but magic, crc, length
#    12     4  length: whole batch in bytes, header to padding, multiple of 8
#    16     8  base offset (i64)
#    24     4  count (i32, >= 1)
#    28     4  base sequence (i32, -1 = none)
#    32    16  txn id: u64 high word, u64 low word (0, 0 = none)
#    48     8  producer id (i64, -1 = none)
#    56     2  producer epoch (i16, -1 = none)
#    58     2  reserved, 0
#    60     4  header bytes: length of the encoded-headers area (u32)
#    64     8  first event time (ms, i64)
#    72     8  max event time (ms, i64)
#    80     8  publish time (ms, i64)
#    88        sections:
#              i32 key_offsets[count+1]       padded to 8
#              i32 value_offsets[count+1]     padded to 8
#              u8  key validity[ceil(count/8)] padded to 8   (FLAG_NULL_KEYS only)
#              i32 header_offsets[count+1]    padded to 8   (FLAG_HEADERS only)
#              u8  encoded headers[header bytes] padded to 8 (FLAG_HEADERS only)
#              i32 event_time_delta[count]    padded to 8
#              key bytes                      padded to 8
#              value bytes                    padded to 8
#
# One message's encoded headers, back to back, each:
#   u16 key length, key (UTF-8), u32 value length (0xFFFFFFFF: null value), value
from libc.stdint cimport uint16_t, int32_t, int64_t, uint32_t
from libc.string cimport memcpy
from _bytes cimport align8

cdef enum:
    BATCH_MAGIC = 0x424D5854
    BATCH_VERSION = 1

    MAGIC_OFFSET = 0
    VERSION_OFFSET = MAGIC_OFFSET + 4
    FLAGS_OFFSET = VERSION_OFFSET + 2
    CRC_OFFSET = FLAGS_OFFSET + 2
    LENGTH_OFFSET = CRC_OFFSET + 4
    BASE_OFFSET_OFFSET = LENGTH_OFFSET + 4
    COUNT_OFFSET = BASE_OFFSET_OFFSET + 8
    BASE_SEQUENCE_OFFSET = COUNT_OFFSET + 4
    TXN_ID_OFFSET = BASE_SEQUENCE_OFFSET + 4
    PRODUCER_ID_OFFSET = TXN_ID_OFFSET + 16
    PRODUCER_EPOCH_OFFSET = PRODUCER_ID_OFFSET + 8
    HEADER_BYTES_OFFSET = PRODUCER_EPOCH_OFFSET + 4
    FIRST_EVENT_TIME_OFFSET = HEADER_BYTES_OFFSET + 4
    MAX_EVENT_TIME_OFFSET = FIRST_EVENT_TIME_OFFSET + 8
    PUBLISH_TIME_OFFSET = MAX_EVENT_TIME_OFFSET + 8
    HEADER_SIZE = PUBLISH_TIME_OFFSET + 8
    CRC_START = CRC_OFFSET + 4
    # The CRC also covers version, reserved byte and flags (bytes 4..7), so
    # a flipped flag cannot turn data into a marker unnoticed.
    CRC_PREFIX_OFFSET = VERSION_OFFSET
    CRC_PREFIX_SIZE = CRC_OFFSET - VERSION_OFFSET

    FLAG_TRANSACTIONAL = 0x01
    FLAG_CONTROL = 0x02
    FLAG_MARKER_COMMIT = 0x04
    FLAG_MARKER_ABORT = 0x08
    FLAG_NULL_KEYS = 0x10
    FLAG_HEADERS = 0x20
    FLAGS_KNOWN = 0x3F


cdef struct Sections:
    Py_ssize_t key_offsets
    Py_ssize_t value_offsets
    Py_ssize_t validity
    Py_ssize_t header_offsets
    Py_ssize_t headers
    Py_ssize_t event_deltas
    Py_ssize_t keys
    Py_ssize_t values
    Py_ssize_t end


cdef inline Sections sections_of(int32_t count, uint16_t flags, Py_ssize_t header_bytes,
                                 Py_ssize_t key_bytes, Py_ssize_t value_bytes) noexcept nogil:
    """Where each section of a batch starts, relative to the batch."""
    cdef Sections s
    cdef Py_ssize_t offsets_size = align8(4 * (<Py_ssize_t>count + 1))
    s.key_offsets = HEADER_SIZE
    s.value_offsets = s.key_offsets + offsets_size
    s.validity = s.value_offsets + offsets_size
    s.header_offsets = s.validity
    if flags & FLAG_NULL_KEYS:
        s.header_offsets = s.validity + align8((count + 7) // 8)
    s.headers = s.header_offsets
    s.event_deltas = s.header_offsets
    if flags & FLAG_HEADERS:
        s.headers = s.header_offsets + offsets_size
        s.event_deltas = s.headers + align8(header_bytes)
    s.keys = s.event_deltas + align8(4 * <Py_ssize_t>count)
    s.values = s.keys + align8(key_bytes)
    s.end = s.values + align8(value_bytes)
    return s


cdef enum:
    HEADER_KEY_LENGTH_BYTES = 2
    HEADER_VALUE_LENGTH_BYTES = 4
    HEADER_FIXED_BYTES = HEADER_KEY_LENGTH_BYTES + HEADER_VALUE_LENGTH_BYTES


cdef struct HeaderSpan:
    # What next_header read, as offsets into one message's encoded headers.
    Py_ssize_t key          # the key's first byte
    Py_ssize_t key_len
    Py_ssize_t value        # the value's first byte
    Py_ssize_t value_len    # -1: a null value
    # When next_header fails: the field that does not fit in the bytes
    # given (its first byte, and the bytes it needs), which is where a
    # decoder reports the damage (txmq._reader.Reader does the same).
    Py_ssize_t short_at
    Py_ssize_t short_need


cdef inline Py_ssize_t _header_short(HeaderSpan *h, Py_ssize_t at, Py_ssize_t need) noexcept nogil:
    h.short_at = at
    h.short_need = need
    return -1


cdef inline Py_ssize_t next_header(const char *p, Py_ssize_t n, Py_ssize_t pos, HeaderSpan *h) noexcept nogil:
    """Read the header at ``pos`` of one message's encoded headers (``n``
    bytes at ``p``) into ``h``; the position after it, or -1 when a field
    does not fit in the ``n`` bytes (``h.short_at`` / ``h.short_need`` say
    which). The only parser of this encoding: the batch decoder (which
    reports a failure through its Reader), BatchSpec.from_columns' check
    and the Kafka Fetch encoder all read headers through it."""
    cdef uint16_t kl
    cdef uint32_t vl
    if n - pos < HEADER_KEY_LENGTH_BYTES:
        return _header_short(h, pos, HEADER_KEY_LENGTH_BYTES)
    memcpy(&kl, p + pos, HEADER_KEY_LENGTH_BYTES)
    pos += HEADER_KEY_LENGTH_BYTES
    if n - pos < kl:
        return _header_short(h, pos, kl)
    h.key = pos
    h.key_len = kl
    pos += kl
    if n - pos < HEADER_VALUE_LENGTH_BYTES:
        return _header_short(h, pos, HEADER_VALUE_LENGTH_BYTES)
    memcpy(&vl, p + pos, HEADER_VALUE_LENGTH_BYTES)
    pos += HEADER_VALUE_LENGTH_BYTES
    h.value = pos
    if vl == <uint32_t>0xFFFFFFFF:
        h.value_len = -1
        return pos
    if <Py_ssize_t>vl > n - pos:
        return _header_short(h, pos, vl)
    h.value_len = vl
    return pos + vl
