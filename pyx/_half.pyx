# cython: boundscheck=False, wraparound=False
"""The half-message state table: one fixed 28-byte record per half message,
in a memory-mapped file, and the frames of its redo log.

Record (little-endian, packed, at ``HEADER_SIZE + (index - base) * 28``)::

    off size
      0    8  offset       i64  the half message's offset in the half log (= its index)
      8    4  size         i32  bytes of its batch in the half log
     12    4  store_time   i32  seconds since the epoch it was stored
     16    4  group_hash   i32  crc32c of its producer group's name
     20    4  state        i32  EMPTY 0 | PREPARED 1 | COMMITTING 2 | COMMITTED 3 |
                                ROLLED_BACK 4 | DISCARDING 5 | DISCARDED 6
     24    4  check_count  i32  checks sent so far

The table is derived data: the half log and the redo log rebuild it
exactly (``replay``), so opening never trusts the file's bytes. Frames of
the redo log (the shared framed format of ``_redolog``)::

    RECORD  2  i64 index, the 28-byte record, i32 partition, i32 sequence
               (the intent of a COMMITTING / DISCARDING record: where the
               message goes and the idempotent sequence it goes with; -1, -1
               otherwise), i32 check immunity in ms (-1: the broker's, or
               the one given before). A record's own immunity lasts until
               it is resolved (COMMITTED, ROLLED_BACK, DISCARDED).
    UPDATE  3  n x (i64 index, i32 state, i32 check_count)
    GROUP   4  i64 producer id, u16 + topic, u16 + group (UTF-8)
    SNAPSHOT 1 u8 version 1, i64 base, i64 end, the records [base, end),
               u32 n x (i64 index, i32 partition, i32 sequence, i32 immunity ms),
               u32 n x GROUP payloads (u32 length + payload)

Frames are decoded through ``_reader.Reader``: a frame that does not parse
raises ``CorruptLogError`` at its first bad byte.

Nothing here takes a lock or knows a policy: ``txmq.half`` does.
"""
from cpython.bytearray cimport PyByteArray_AS_STRING
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t

cdef extern from *:
    int __builtin_ctzll(unsigned long long) nogil
    int __builtin_popcountll(unsigned long long) nogil
from libc.stdlib cimport free, realloc
from libc.string cimport memcpy, memcmp, memset

import errno
import os

import numpy as np

from txmq._mapping import Mapping
from txmq.errors import StorageFullError

from cpython.pyport cimport PY_SSIZE_T_MAX

from _bytes cimport load_i32, load_i64, store_i32, store_i64
from _redo_layout cimport payload_position
from txmq._reader cimport Reader

cdef packed struct StateRecord:
    int64_t offset
    int32_t size
    int32_t store_time
    int32_t group_hash
    int32_t state
    int32_t check_count

cdef enum:
    REC = 28          # sizeof(StateRecord), checked below
    HEADER = 64

RECORD_SIZE = sizeof(StateRecord)
HEADER_SIZE = HEADER
TABLE_MAGIC = b"TXHT"
TABLE_VERSION = 1

cdef enum:
    S_PREPARED = 1

EMPTY, PREPARED, COMMITTING, COMMITTED, ROLLED_BACK, DISCARDING, DISCARDED = range(7)
assert PREPARED == S_PREPARED
STATE_NAMES = ("empty", "prepared", "committing", "committed", "rolled_back", "discarding", "discarded")
RESOLVED = (COMMITTED, ROLLED_BACK, DISCARDED)

F_RECORD, F_UPDATE, F_GROUP = 2, 3, 4
SNAPSHOT_VERSION = 1

RECORD_DTYPE = np.dtype({"names": ["offset", "size", "store_time", "group_hash", "state", "check_count"],
                         "formats": ["<i8", "<i4", "<i4", "<i4", "<i4", "<i4"],
                         "offsets": [0, 8, 12, 16, 20, 24], "itemsize": 28})

# The layout is the contract of docs/FORMAT.md: fail at import, not on disk.
assert RECORD_SIZE == REC, RECORD_SIZE
assert RECORD_DTYPE.itemsize == RECORD_SIZE
assert [RECORD_DTYPE.fields[n][1] for n in RECORD_DTYPE.names] == [
    <Py_ssize_t>&(<StateRecord *>NULL).offset, <Py_ssize_t>&(<StateRecord *>NULL).size,
    <Py_ssize_t>&(<StateRecord *>NULL).store_time, <Py_ssize_t>&(<StateRecord *>NULL).group_hash,
    <Py_ssize_t>&(<StateRecord *>NULL).state, <Py_ssize_t>&(<StateRecord *>NULL).check_count]

cdef inline void fill(StateRecord *r, int64_t offset, int32_t size, int32_t store_time, int32_t group_hash,
                      int32_t state, int32_t check_count) noexcept nogil:
    r.offset = offset
    r.size = size
    r.store_time = store_time
    r.group_hash = group_hash
    r.state = state
    r.check_count = check_count


cdef inline bint is_due(const StateRecord *r, int32_t cutoff_s, int32_t max_checks) noexcept nogil:
    return r.state == S_PREPARED and r.store_time <= cutoff_s and (max_checks < 0 or r.check_count < max_checks)


cdef enum:
    RECORD_FRAME_SIZE = 8 + 28 + 12
    UPDATE_ENTRY_SIZE = 16
    GROW_RECORDS = 1 << 16


cdef class StateTable:
    """The mapped table of one data directory's half messages.

    ``base`` is the index of the first record kept (compaction moves it);
    ``end`` one past the last record. Records between are EMPTY until
    written. Views returned by :meth:`records` stay valid after the table
    grows (an older mapping is unmapped only when its last view is gone).
    """
    cdef readonly object path
    cdef readonly int64_t base, end, capacity
    cdef int fd
    cdef object mapping
    cdef unsigned char[::1] buf
    cdef char *data
    # One bit per record, set while it is PREPARED: the check scan reads
    # these words and only the records they point at (derived in memory,
    # kept by every write below).
    cdef uint64_t *prepared
    cdef int64_t prepared_words

    def __cinit__(self):
        self.fd = -1
        self.data = NULL
        self.prepared = NULL
        self.prepared_words = 0

    def __dealloc__(self):
        free(self.prepared)

    def __init__(self, path, int64_t base, int64_t end):
        """Open the table file for records [base, end); a file whose header
        is not a table's with this ``base`` is started again, all EMPTY.
        :meth:`load` makes its records what the redo log says."""
        self.path = os.fspath(path)
        self.base = base
        self.end = base
        self.capacity = 0
        keep = read_header(self.path) == base
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if not keep:
            header = bytearray(HEADER_SIZE)
            header[0:4] = TABLE_MAGIC
            header[4] = TABLE_VERSION
            header[8:12] = RECORD_SIZE.to_bytes(4, "little")
            header[16:24] = base.to_bytes(8, "little", signed=True)
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, bytes(header), 0)
        self._map(max(end - base, 1))
        self.end = end
        self._mark_all()

    cdef _mark_all(self):
        """Derive the PREPARED bits from the records."""
        cdef Py_ssize_t i
        memset(self.prepared, 0, self.prepared_words * sizeof(uint64_t))
        for i in range(self.end - self.base):
            self.mark(i, (<StateRecord *>(self.data + i * REC)).state)

    cdef _map(self, int64_t need):
        cdef int64_t cap = max(need + GROW_RECORDS, 2 * self.capacity)
        try:
            # Records are stored through the mapping: their blocks must be
            # reserved, or a store on a full disk is a SIGBUS.
            os.posix_fallocate(self.fd, 0, HEADER_SIZE + cap * RECORD_SIZE)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StorageFullError(self.path, (cap - self.capacity) * RECORD_SIZE, e.errno) from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(self.fd, HEADER_SIZE + cap * RECORD_SIZE)
        if self.mapping is not None:
            self.buf = None
            self.mapping.close()          # unmapped once the last view of it is gone
        self.mapping = Mapping(self.fd, HEADER_SIZE + cap * RECORD_SIZE, True)
        self.buf = self.mapping
        self.data = <char *>&self.buf[0] + HEADER
        cdef int64_t words = (cap + 63) // 64
        cdef uint64_t *bits = <uint64_t *>realloc(self.prepared, words * sizeof(uint64_t))
        if bits == NULL:
            raise MemoryError()
        memset(bits + self.prepared_words, 0, (words - self.prepared_words) * sizeof(uint64_t))
        self.prepared = bits
        self.prepared_words = words
        self.capacity = cap

    cdef inline StateRecord *at(self, int64_t index) except NULL:
        if self.data == NULL:
            raise ValueError(f"state table {self.path} is closed")
        if index < self.base or index >= self.end:
            raise IndexError(f"half message {index} is not in the state table [{self.base}, {self.end})")
        return <StateRecord *>(self.data + (index - self.base) * REC)

    def extend(self, int64_t end):
        """Make room for records up to ``end`` (new ones EMPTY)."""
        if self.data == NULL:
            raise ValueError(f"state table {self.path} is closed")
        if end > self.base + self.capacity:
            self._map(end - self.base)
        if end > self.end:
            self.end = end

    def put(self, int64_t index, int64_t offset, int32_t size, int32_t store_time, int32_t group_hash,
            int32_t state, int32_t check_count):
        """Write one whole record."""
        if index >= self.end:
            self.extend(index + 1)
        fill(self.at(index), offset, size, store_time, group_hash, state, check_count)
        self.mark(index - self.base, state)

    def set_state(self, int64_t index, int32_t state, int32_t check_count):
        """Update a record in place (its redo frame is written first)."""
        cdef StateRecord *r = self.at(index)
        r.state = state
        r.check_count = check_count
        self.mark(index - self.base, state)

    cdef inline void mark(self, int64_t i, int32_t state) noexcept:
        if state == S_PREPARED:
            self.prepared[i >> 6] |= (<uint64_t>1) << (i & 63)
        else:
            self.prepared[i >> 6] &= ~((<uint64_t>1) << (i & 63))

    def get(self, int64_t index):
        """``(offset, size, store_time, group_hash, state, check_count)``."""
        cdef StateRecord *r = self.at(index)
        return (r.offset, r.size, r.store_time, r.group_hash, r.state, r.check_count)

    def state_of(self, int64_t index):
        return self.at(index).state

    def due(self, int32_t cutoff_s, int32_t max_checks=-1):
        """Offsets (from ``base``) of PREPARED records stored at or before
        ``cutoff_s`` (and, with ``max_checks`` >= 0, checked fewer times),
        in order: a pass over the PREPARED bits, reading only the records
        they mark, in C without the GIL."""
        cdef Py_ssize_t n = self.end - self.base, w, words = (n + 63) // 64, k = 0, marked = 0
        cdef int64_t i
        cdef uint64_t bits
        cdef const StateRecord *r = <const StateRecord *>self.data
        if r == NULL:
            words = 0
        with nogil:
            for w in range(words):
                marked += __builtin_popcountll(self.prepared[w])
        out = np.empty(marked, np.int64)
        cdef int64_t[::1] found = out
        with nogil:
            for w in range(words):
                bits = self.prepared[w]
                while bits:
                    i = w * 64 + __builtin_ctzll(bits)
                    bits &= bits - 1
                    if i < n and is_due(&r[i], cutoff_s, max_checks):
                        found[k] = i
                        k += 1
        return out[:k]

    def records(self):
        """A numpy view (RECORD_DTYPE) of the records [base, end)."""
        if self.data == NULL:
            raise ValueError(f"state table {self.path} is closed")
        return np.frombuffer(self.mapping, RECORD_DTYPE, self.end - self.base, HEADER_SIZE)

    def raw(self, int64_t start, int64_t stop):
        """The bytes of records [start, stop)."""
        if self.data == NULL:
            raise ValueError(f"state table {self.path} is closed")
        start = max(start, self.base)
        stop = min(stop, self.end)
        if stop <= start:
            return b""
        return PyBytes_FromStringAndSize(self.data + (start - self.base) * REC, (stop - start) * REC)

    def load(self, const uint8_t[::1] records):
        """Make the records [base, base + len/28) equal ``records`` and every
        later one EMPTY; return how many records below ``end`` differed (0
        when the file already held them)."""
        cdef Py_ssize_t n = records.shape[0] // REC, i, differed = 0
        cdef char zero[REC]
        memset(zero, 0, REC)
        self.extend(self.base + n)
        for i in range(n):
            if memcmp(self.data + i * REC, &records[i * REC], REC) != 0:
                memcpy(self.data + i * REC, &records[i * REC], REC)
                differed += 1
        for i in range(n, self.capacity):     # no record yet: EMPTY
            if memcmp(self.data + i * REC, zero, REC) != 0:
                memset(self.data + i * REC, 0, REC)
                if i < self.end - self.base:
                    differed += 1
        self._mark_all()
        return differed

    def sync(self):
        os.fdatasync(self.fd)

    def close(self):
        if self.fd >= 0:
            self.data = NULL            # every call after this raises, none reads freed memory
            self.end = self.base
            self.buf = None
            self.mapping.close()
            os.close(self.fd)
            self.fd = -1


def read_header(path):
    """``base`` of a table file, or None when its header is not a table's."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_SIZE)
    except FileNotFoundError:
        return None
    if len(head) < HEADER_SIZE or head[0:4] != TABLE_MAGIC or head[4] != TABLE_VERSION \
            or int.from_bytes(head[8:12], "little") != RECORD_SIZE:
        return None
    return int.from_bytes(head[16:24], "little", signed=True)


def due(records, int32_t cutoff_s, int32_t max_checks=-1):
    """Indices (into ``records``, a RECORD_DTYPE array) of PREPARED records
    stored at or before ``cutoff_s``, with numpy; with ``max_checks`` >= 0,
    only those checked fewer times. :meth:`StateTable.due` is the same
    scan over the mapping itself."""
    mask = (records["state"] == PREPARED) & (records["store_time"] <= cutoff_s)
    if max_checks >= 0:
        mask &= records["check_count"] < max_checks
    return np.flatnonzero(mask)


def count_states(records):
    """How many records are in each state: an array indexed by state."""
    return np.bincount(records["state"], minlength=len(STATE_NAMES))[:len(STATE_NAMES)]


# -- frames ---------------------------------------------------------------------------

def record_frame(int64_t index, int64_t offset, int32_t size, int32_t store_time, int32_t group_hash,
                 int32_t state, int32_t check_count, int32_t partition=-1, int32_t sequence=-1,
                 int32_t immunity_ms=-1):
    """The payload of a RECORD frame."""
    out = PyBytes_FromStringAndSize(NULL, RECORD_FRAME_SIZE)
    cdef char *p = PyBytes_AS_STRING(out)
    cdef StateRecord r
    fill(&r, offset, size, store_time, group_hash, state, check_count)
    store_i64(p, index)
    memcpy(p + 8, &r, REC)
    store_i32(p + 36, partition)
    store_i32(p + 40, sequence)
    store_i32(p + 44, immunity_ms)
    return out


def update_frame(updates):
    """The payload of an UPDATE frame: ``updates`` is [(index, state, checks)]."""
    out = PyBytes_FromStringAndSize(NULL, len(updates) * UPDATE_ENTRY_SIZE)
    cdef char *p = PyBytes_AS_STRING(out)
    cdef int64_t index
    cdef int32_t state, checks
    for index, state, checks in updates:
        store_i64(p, index)
        store_i32(p + 8, state)
        store_i32(p + 12, checks)
        p += UPDATE_ENTRY_SIZE
    return out


def _str16(s):
    raw = s.encode("utf-8")
    if len(raw) > 0xFFFF:
        raise ValueError(f"name of {len(raw)} bytes: at most 65535")
    return len(raw).to_bytes(2, "little") + raw


def group_frame(int64_t producer_id, topic, group):
    """The payload of a GROUP frame."""
    return producer_id.to_bytes(8, "little", signed=True) + _str16(topic) + _str16(group)


cdef _group(Reader r, dict groups):
    """A GROUP payload: i64 producer id, then its topic and group as texts."""
    cdef int64_t pid = r.i64()
    topic = r.text()
    group = r.text()
    groups[pid] = (topic, group)


cpdef note(dict intents, dict immunities, int64_t index, int32_t state, int32_t partition=-1,
           int32_t sequence=-1, int32_t immunity_ms=-1):
    """What a write to record ``index`` does to the side tables, the one
    rule for replay and for the live store: a COMMITTING / DISCARDING
    record keeps the intent (partition, sequence) it was framed with, any
    other state has none; a record's own check immunity lasts until it is
    resolved (COMMITTED, ROLLED_BACK, DISCARDED)."""
    if partition >= 0:
        intents[index] = (partition, sequence)
    elif state != COMMITTING and state != DISCARDING:
        intents.pop(index, None)
    if state == COMMITTED or state == ROLLED_BACK or state == DISCARDED:
        immunities.pop(index, None)
    elif immunity_ms >= 0:
        immunities[index] = immunity_ms


def replay(frames, int64_t base=0, path=None):
    """Rebuild the table from redo-log frames (a SNAPSHOT frame first if the
    log has one): ``(base, records, intents, immunities, groups)``.

    ``records`` is a bytearray of records [base, base + len/28); ``intents``
    maps the index of each COMMITTING / DISCARDING record to its
    (partition, sequence); ``immunities`` maps an index to its check
    immunity in ms where one was given; ``groups`` maps a producer id to
    (topic, group).

    ``frames`` are ``(type, payload, position)`` as ``_redolog.parse`` and
    ``RedoLog.replay(positions=True)`` give them (or ``(type, payload)``
    pairs, whose bytes then count from each payload's first). A frame that
    passed its CRC but does not parse raises CorruptLogError at its first
    bad byte of file ``path`` (ValueError without a path).
    """
    cdef bytearray records = bytearray()
    cdef dict intents = {}, immunities = {}, groups = {}
    cdef Reader r = Reader(path, "half-message redo frame of type")
    cdef int64_t index, end, n, i
    cdef Py_ssize_t k, at, outer
    cdef int32_t state
    cdef char *rp
    cdef const char *q
    cdef StateRecord *rec
    cdef tuple frame
    cdef int ftype
    for frame in frames:
        ftype = frame[0]
        r.reset(frame[1], payload_position(frame), ftype)
        if ftype == 1:
            at = r.pos
            if r.u8() != SNAPSHOT_VERSION:
                r.fail(at, "unknown half snapshot version")
            at = r.pos
            base = r.i64()
            end = r.i64()
            if end < base:
                r.fail(at, f"snapshot end {end} below base {base}")
            if <uint64_t>end - <uint64_t>base > <uint64_t>(PY_SSIZE_T_MAX // REC):
                r.fail(at, f"snapshot of records [{base}, {end}): more than any table holds")
            q = r.take_array(end - base, REC)
            records = bytearray(q[:(end - base) * REC])
            intents = {}
            immunities = {}
            groups = {}
            n = r.u32()
            for i in range(n):
                index = r.i64()
                part = r.i32()
                seq = r.i32()
                imm = r.i32()
                if part >= 0:
                    intents[index] = (part, seq)
                if imm >= 0:
                    immunities[index] = imm
            n = r.u32()
            for i in range(n):
                outer = r.enter(r.u32())
                _group(r, groups)
                r.leave(outer)
            r.done()
        elif ftype == F_RECORD:
            q = r.take(RECORD_FRAME_SIZE)
            r.done()
            index = load_i64(q)
            if index < base:
                continue                      # compacted away since
            # index >= base: their difference fits in a uint64_t
            if <uint64_t>index - <uint64_t>base >= <uint64_t>(PY_SSIZE_T_MAX // REC):
                r.fail(0, f"record of half message {index} lies past any table from {base}")
            k = (index - base + 1) * REC
            if len(records) < k:
                records.extend(bytes(k - len(records)))
            rp = PyByteArray_AS_STRING(records)
            memcpy(rp + (index - base) * REC, q + 8, REC)
            note(intents, immunities, index, load_i32(q + 8 + 20), load_i32(q + 36), load_i32(q + 40),
                 load_i32(q + 44))
        elif ftype == F_UPDATE:
            if r.end % UPDATE_ENTRY_SIZE:
                r.fail(r.end - r.end % UPDATE_ENTRY_SIZE,
                       f"update frame of {r.end} bytes, not whole entries of {UPDATE_ENTRY_SIZE}")
            rp = PyByteArray_AS_STRING(records)
            for i in range(r.end // UPDATE_ENTRY_SIZE):
                at = r.pos
                q = r.take(UPDATE_ENTRY_SIZE)
                index = load_i64(q)
                if index < base:
                    continue
                if <uint64_t>index - <uint64_t>base >= <uint64_t>(len(records) // REC):
                    r.fail(at, f"update of half message {index}, which has no record")
                rec = <StateRecord *>(rp + (index - base) * REC)
                state = load_i32(q + 8)
                rec.state = state
                rec.check_count = load_i32(q + 12)
                note(intents, immunities, index, state)
        elif ftype == F_GROUP:
            _group(r, groups)
            r.done()
        else:
            r.fail(-1, "unknown frame type")
    return base, records, intents, immunities, groups


def snapshot(int64_t base, int64_t end, records, intents, immunities, groups):
    """The payload of a SNAPSHOT frame (see the module docstring)."""
    keys = sorted(set(intents) | set(immunities))
    parts = [bytes([SNAPSHOT_VERSION]), base.to_bytes(8, "little", signed=True),
             end.to_bytes(8, "little", signed=True), bytes(records),
             len(keys).to_bytes(4, "little")]
    for index in keys:
        part, seq = intents.get(index, (-1, -1))
        parts.append(index.to_bytes(8, "little", signed=True) + part.to_bytes(4, "little", signed=True)
                     + seq.to_bytes(4, "little", signed=True)
                     + immunities.get(index, -1).to_bytes(4, "little", signed=True))
    parts.append(len(groups).to_bytes(4, "little"))
    for pid, (topic, group) in sorted(groups.items()):
        g = group_frame(pid, topic, group)
        parts.append(len(g).to_bytes(4, "little") + g)
    if len(parts[3]) != (end - base) * RECORD_SIZE:
        raise ValueError("snapshot records do not cover [base, end)")
    return b"".join(parts)
