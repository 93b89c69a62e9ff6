# cython: boundscheck=False, wraparound=False
"""The frames of the transaction logs (docs/FORMAT.md): encoding and replay
of a coordinator log, the producer registry (``producers.log``) and a
pending-ack log, and a commit's decision record. The structures their
state rebuilds are ``txmq._txn``.

Frames are decoded through ``_reader.Reader``: a frame that does not parse
raises ``CorruptLogError`` at its first bad byte.
"""
from libc.stdint cimport int16_t, int64_t, uint64_t, uint8_t, uint32_t, uint16_t

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.string cimport memcpy
from _bytes cimport load_i64, packed_i64, packed_txn, packed_u32, store_i64, store_u32
from _redo_layout cimport payload_position
from txmq._reader cimport Reader

# Frame types of a coordinator log (SNAPSHOT = 1 is the redo log's own).
TC_BEGIN, TC_ADD_PARTITION, TC_ADD_SUBSCRIPTION = 2, 3, 4
TC_COMMITTING, TC_ABORTING, TC_COMMITTED, TC_ABORTED = 5, 6, 7, 8
TC_PRODUCER = 9          # a transactional id's (producer id, epoch)
TC_DECIDED = 10          # COMMITTING with what the commit covers (txmq.transactions.decision)
TC_PREPARED = 11         # PREPARED: durable, held until commit_prepared / abort_prepared; names what it covers
TC_FORGET = 12           # the outcome of an ended prepared transaction is no longer kept
TC_RESERVE = 13          # u64 end: sequences below it may have been handed out (synced before they are)
# Frame types of the producer registry (producers.log).
PR_BLOCK, PR_NAME = 2, 3
# Frame types of a pending-ack log.
PA_ACK, PA_CUMULATIVE, PA_COMMIT, PA_ABORT = 2, 3, 4, 5

# Transaction states as stored in a coordinator snapshot.
OPEN, COMMITTING, ABORTING, COMMITTED, ABORTED, PREPARED = 0, 1, 2, 3, 4, 5


def pack_txn(uint64_t hi, uint64_t lo):
    """The 16 bytes (u64 hi, u64 lo) of a transaction id in every log."""
    return packed_txn(hi, lo)


cdef tuple _read_txn(Reader r):
    """A transaction id: u64 hi, u64 lo."""
    cdef uint64_t hi = r.u64()
    return (hi, r.u64())


def replay_coordinator(frames, path=None, records=None, prepared=None):
    """State of a coordinator log from its frames (the last SNAPSHOT on).

    Returns ``(next_lo, txns, tids)``: the lowest sequence word never used
    (nor reserved by a RESERVE frame),
    ``{(hi, lo): [state, timeout_ms, start_ms, partitions, subscriptions]}``
    with ``partitions`` a set of (topic, partition) and ``subscriptions`` a
    set of (topic, subscription), each None when empty, and ``{transactional
    id: (producer id, epoch)}``. Transactions whose final record is logged
    stay in with state COMMITTED / ABORTED (and no participants), so
    recovery knows their outcome.

    ``frames`` are ``(type, payload, position)`` as ``_redolog.parse`` and
    ``RedoLog.replay(positions=True)`` give them (or ``(type, payload)``
    pairs, whose bytes then count from each payload's first). A frame that
    passed its CRC but does not parse raises CorruptLogError at its first
    bad byte of file ``path`` (ValueError without a path).

    A DECIDED frame is a COMMITTING one that also names what the commit
    covers; with ``records`` (a dict) its bytes after the transaction id
    are stored there under the transaction's words, also once the
    transaction is COMMITTED (recovery checks every decision the log still
    holds), and a SNAPSHOT's records of decided transactions likewise.

    A PREPARED frame leaves its transaction in state PREPARED and stores
    its record the same way; with ``prepared`` (a dict) every prepared
    transaction whose outcome the log keeps is there as ``{(hi, lo):
    [prepared_ms, xid, outcome]}``, ``outcome`` PREPARED while it is, then
    COMMITTED or ABORTED (kept across snapshots until a FORGET frame).
    """
    cdef dict txns = {}, tids = {}, kept = {} if prepared is None else prepared
    cdef uint64_t next_lo = 0, lo
    cdef uint32_t n, k, j
    cdef Reader r = Reader(path, "coordinator frame of type")
    cdef int kind
    cdef list entry
    cdef tuple frame
    for frame in frames:
        kind = frame[0]
        r.reset(frame[1], payload_position(frame), kind)
        if kind == 1:
            txns.clear()
            next_lo = r.u64()
            n = r.u32()
            for k in range(n):
                key = _read_txn(r)
                state = r.u8()
                timeout = r.i64()
                start = r.i64()
                parts = subs = None
                for j in range(r.u32()):
                    topic = r.text()
                    parts = parts or set()
                    parts.add((topic, <int>r.u32()))
                for j in range(r.u32()):
                    topic = r.text()
                    subs = subs or set()
                    subs.add((topic, r.text()))
                txns[key] = [state, timeout, start, parts, subs]
            tids.clear()
            if records is not None:
                records.clear()
            if r.pos < r.end:        # snapshots before transactional ids end here
                for k in range(r.u32()):
                    tid = r.text()
                    pid = r.i64()
                    tids[tid] = (pid, <int>r.i16())
            if r.pos < r.end:        # ... and before decision records here
                for k in range(r.u32()):
                    key = _read_txn(r)
                    record = r.read(r.u32())
                    if records is not None:
                        records[key] = record
            kept.clear()
            if r.pos < r.end:        # ... and before prepared transactions here
                for k in range(r.u32()):
                    key = _read_txn(r)
                    state = r.u8()
                    if state not in (PREPARED, COMMITTED, ABORTED):
                        r.fail(r.pos - 1, f"prepared outcome {state}")
                    prepared_ms = r.i64()
                    kept[key] = [prepared_ms, r.text(), state]
        elif kind == TC_PRODUCER:
            tid = r.text()
            pid = r.i64()
            tids[tid] = (pid, <int>r.i16())
        elif kind == TC_BEGIN:
            key = _read_txn(r)
            timeout = r.i64()
            txns[key] = [OPEN, timeout, r.i64(), None, None]
            lo = key[1]
            if lo >= next_lo:
                next_lo = lo + 1
        elif kind == TC_ADD_PARTITION:
            entry = _txn_entry(txns, r)
            topic = r.text()
            if entry[3] is None:
                entry[3] = set()
            entry[3].add((topic, <int>r.u32()))
        elif kind == TC_ADD_SUBSCRIPTION:
            entry = _txn_entry(txns, r)
            topic = r.text()
            if entry[4] is None:
                entry[4] = set()
            entry[4].add((topic, r.text()))
        elif kind == TC_COMMITTING or kind == TC_ABORTING:
            key, entry = _keyed_entry(txns, r)
            entry[0] = COMMITTING if kind == TC_COMMITTING else ABORTING
            if key in kept:          # (a prepared transaction's decision: its outcome)
                kept[key][2] = COMMITTED if kind == TC_COMMITTING else ABORTED
        elif kind == TC_DECIDED:
            key, entry = _keyed_entry(txns, r)
            entry[0] = COMMITTING
            _decision_of(r, key, records)
        elif kind == TC_PREPARED:
            key, entry = _keyed_entry(txns, r)
            entry[0] = PREPARED
            prepared_ms = r.i64()
            kept[key] = [prepared_ms, r.text(), PREPARED]
            _decision_of(r, key, records)
        elif kind == TC_FORGET:
            kept.pop(_read_txn(r), None)
        elif kind == TC_RESERVE:
            lo = r.u64()
            if lo > next_lo:
                next_lo = lo
        elif kind == TC_COMMITTED or kind == TC_ABORTED:
            key, entry = _keyed_entry(txns, r)
            entry[0] = COMMITTED if kind == TC_COMMITTED else ABORTED
            entry[3] = entry[4] = None      # only the outcome is needed now
        else:
            r.fail(-1, "unknown frame type")
        r.done()
    return next_lo, txns, tids


cdef int _decision_of(Reader r, tuple key, dict records) except -1:
    """The rest of the frame is the decision record of ``key``."""
    record = r.read(r.end - r.pos)
    if records is not None:
        records[key] = record
    return 0


cdef list _txn_entry(dict txns, Reader r):
    """The entry of the transaction whose id ``r`` reads next."""
    return _keyed_entry(txns, r)[1]


cdef tuple _keyed_entry(dict txns, Reader r):
    """(id, entry) of the transaction whose id ``r`` reads next."""
    cdef Py_ssize_t at = r.pos
    key = _read_txn(r)
    entry = txns.get(key)
    if entry is None:
        r.fail(at, f"frame for transaction {key} before its BEGIN")
    return key, entry


def encode_coordinator_snapshot(uint64_t next_lo, txns, tids=None, records=None, prepared=None):
    """SNAPSHOT payload: ``txns`` and ``tids`` as :func:`replay_coordinator`
    returns them, the decision ``records`` of decided and prepared
    transactions ({words: bytes}; a snapshot keeps what their commits
    cover), and ``prepared`` as :func:`replay_coordinator` fills it."""
    out = [packed_i64(<int64_t>next_lo), packed_u32(len(txns))]
    for (hi, lo), (state, timeout, start, parts, subs) in txns.items():
        out.append(packed_txn(hi, lo) + bytes([state]) + packed_i64(timeout) + packed_i64(start))
        parts = parts or ()
        subs = subs or ()
        out.append(packed_u32(len(parts)))
        for topic, p in sorted(parts):
            out.append(encode_text(topic) + packed_u32(p))
        out.append(packed_u32(len(subs)))
        for topic, sub in sorted(subs):
            out.append(encode_text(topic) + encode_text(sub))
    tids = tids or {}
    out.append(packed_u32(len(tids)))
    for tid, (pid, epoch) in tids.items():
        out.append(encode_text(tid) + packed_i64(pid) + pack_i16(epoch))
    if records or prepared:
        records = records or {}
        out.append(packed_u32(len(records)))
        for (hi, lo), record in records.items():
            out.append(packed_txn(hi, lo) + packed_u32(len(record)) + record)
    if prepared:
        out.append(packed_u32(len(prepared)))
        for (hi, lo), (prepared_ms, xid, outcome) in prepared.items():
            out.append(packed_txn(hi, lo) + bytes([outcome]) + packed_i64(prepared_ms) + encode_text(xid))
    return b"".join(out)


def encode_prepared(int64_t prepared_ms, str xid, bytes record):
    """TC_PREPARED payload after the transaction id."""
    return packed_i64(prepared_ms) + encode_text(xid) + record


def encode_producer(str tid, int64_t pid, int epoch):
    """TC_PRODUCER payload."""
    return encode_text(tid) + packed_i64(pid) + pack_i16(epoch)


cdef bytes pack_i16(int v):
    return bytes([v & 0xFF, (v >> 8) & 0xFF])


def replay_registry(frames, path=None):
    """State of a producer registry from its frames (the last SNAPSHOT on):
    ``(reserved, names)``, the id below which every id may have been handed
    out and ``{name: producer id}``. ``frames`` and ``path`` are as for
    :func:`replay_coordinator`: a frame that passed its CRC but does not
    parse raises CorruptLogError at its first bad byte."""
    cdef int64_t reserved = 0, pid
    cdef dict names = {}
    cdef uint32_t k
    cdef Reader r = Reader(path, "producer registry frame of type")
    cdef int kind
    cdef tuple frame
    for frame in frames:
        kind = frame[0]
        r.reset(frame[1], payload_position(frame), kind)
        if kind == 1:
            reserved = r.i64()
            names = {}
            for k in range(r.u32()):
                name = r.text()
                names[name] = r.i64()
        elif kind == PR_BLOCK:
            reserved = max(reserved, r.i64())
        elif kind == PR_NAME:
            name = r.text()
            pid = r.i64()
            names[name] = pid
            reserved = max(reserved, pid + 1)
        else:
            r.fail(-1, "unknown frame type")
        r.done()
    return reserved, names


def encode_registry_snapshot(int64_t reserved, names):
    """SNAPSHOT payload of a producer registry."""
    out = [packed_i64(reserved), packed_u32(len(names))]
    for name, pid in names.items():
        out.append(encode_text(name) + packed_i64(pid))
    return b"".join(out)


def encode_text(str s):
    """u16 length + UTF-8 bytes."""
    b = s.encode("utf-8")
    if len(b) > 0xFFFF:
        raise ValueError("name longer than 65535 bytes")
    return bytes([len(b) & 0xFF, len(b) >> 8]) + b


def replay_pending(frames, path=None):
    """Pending acks of a pending-ack log from its frames (the last SNAPSHOT on).

    Returns ``{(hi, lo): [offsets list, cumulative offset or -1]}`` for every
    transaction with acks and no COMMIT / ABORT frame yet. ``frames`` and
    ``path`` are as for :func:`replay_coordinator`: a frame that passed its
    CRC but does not parse raises CorruptLogError at its first bad byte.
    """
    cdef dict txns = {}
    cdef uint32_t n, k, j
    cdef Reader r = Reader(path, "pending-ack frame of type")
    cdef const char *p
    cdef int kind
    cdef tuple frame
    for frame in frames:
        kind = frame[0]
        r.reset(frame[1], payload_position(frame), kind)
        if kind == 1:
            txns.clear()
            n = r.u32()
            for k in range(n):
                key = _read_txn(r)
                cum = r.i64()
                j = r.u32()
                p = r.take_array(j, 8)
                txns[key] = [[load_i64(p + 8 * i) for i in range(j)], cum]
        elif kind == PA_ACK:
            key = _read_txn(r)
            j = r.u32()
            p = r.take_array(j, 8)
            entry = txns.setdefault(key, [[], -1])
            entry[0].extend([load_i64(p + 8 * i) for i in range(j)])
        elif kind == PA_CUMULATIVE:
            key = _read_txn(r)
            cum = r.i64()
            entry = txns.setdefault(key, [[], -1])
            entry[1] = max(entry[1], cum)
        elif kind in (PA_COMMIT, PA_ABORT):
            txns.pop(_read_txn(r), None)
        else:
            r.fail(-1, "unknown frame type")
        r.done()
    return txns


# -- the decision record of a commit (txmq.transactions.decision has its layout) --

def ranges_of(offsets):
    """Sorted, merged ``[(start, end)]`` (end exclusive) of int ``offsets``."""
    cdef list out = []
    cdef int64_t s, e, o
    cdef list ordered = sorted(offsets)
    if not ordered:
        return out
    s = e = ordered[0]
    for o in ordered:
        if o <= e:
            continue
        if o == e + 1:
            e = o
        else:
            out.append((s, e + 1))
            s = e = o
    out.append((s, e + 1))
    return out


def encode_decision(partitions, acks):
    """The record after the transaction id: ``partitions`` is ``[(topic,
    partition, [(base offset, count, crc, length, bytes or None)])]``,
    ``acks`` is ``[(topic, subscription, partition, cumulative or -1,
    [(start, end)])]``. One allocation: the size is summed first, then
    every field is stored in place (a commit of thousands of batches
    encodes in microseconds)."""
    cdef Py_ssize_t size = 8, n
    cdef list names = []
    cdef bytes name, out
    cdef char *p
    for topic, index, batches in partitions:
        name = encode_text(topic)
        names.append(name)
        size += len(name) + 8 + 21 * len(batches)
        for b in batches:
            data = b[4]
            if data is not None:
                size += len(<bytes?>data)
    for topic, sub, index, cumulative, ranges in acks:
        name = encode_text(topic)
        names.append(name)
        size += len(name)
        name = encode_text(sub)
        names.append(name)
        size += len(name) + 16 + 16 * len(ranges)
    out = PyBytes_FromStringAndSize(NULL, size)
    p = PyBytes_AS_STRING(out)
    cdef Py_ssize_t k = 0
    store_u32(p, <uint32_t>len(partitions))
    p += 4
    for topic, index, batches in partitions:
        p = _put(p, names[k])
        k += 1
        store_u32(p, <uint32_t>index)
        store_u32(p + 4, <uint32_t>len(batches))
        p += 8
        for base, count, crc, length, data in batches:
            store_i64(p, <int64_t>base)
            store_u32(p + 8, <uint32_t>(<int64_t>count & 0xFFFFFFFF))
            store_u32(p + 12, <uint32_t>crc)
            store_u32(p + 16, <uint32_t>length)
            p[20] = 0 if data is None else 1
            p += 21
            if data is not None:
                p = _put(p, data)
    store_u32(p, <uint32_t>len(acks))
    p += 4
    for topic, sub, index, cumulative, ranges in acks:
        p = _put(p, names[k])
        p = _put(p, names[k + 1])
        k += 2
        store_u32(p, <uint32_t>index)
        store_i64(p + 4, <int64_t>cumulative)
        store_u32(p + 12, <uint32_t>len(ranges))
        p += 16
        for s, e in ranges:
            store_i64(p, <int64_t>s)
            store_i64(p + 8, <int64_t>e)
            p += 16
    assert p == PyBytes_AS_STRING(out) + size
    return out


cdef inline char *_put(char *p, bytes b):
    cdef Py_ssize_t n = PyBytes_GET_SIZE(b)
    memcpy(p, PyBytes_AS_STRING(b), n)
    return p + n


def decode_decision(record, path=None, Py_ssize_t position=0):
    """``(partitions, acks)`` of a record :func:`encode_decision` made:
    ``{(topic, partition): [(base, count, crc, length, bytes or None)]}``
    and the ack tuples. A record that does not parse raises
    CorruptLogError at its bad byte of ``path`` (ValueError without one)."""
    cdef Reader r = Reader(path, "decision record")
    cdef dict partitions = {}
    cdef list acks = [], batches
    cdef uint32_t n, k, j, m
    cdef uint8_t copied
    r.reset(record, position)
    n = r.u32()
    for k in range(n):
        topic = r.text()
        index = r.u32()
        batches = partitions.setdefault((topic, index), [])
        m = r.u32()
        for j in range(m):
            base = r.i64()
            count = r.i32()
            crc = r.u32()
            length = r.u32()
            copied = r.u8()
            if copied > 1:
                r.fail(r.pos - 1, f"copied flag {copied}")
            batches.append((base, count, crc, length, r.read(length) if copied else None))
    n = r.u32()
    for k in range(n):
        topic = r.text()
        sub = r.text()
        index = r.u32()
        cumulative = r.i64()
        m = r.u32()
        acks.append((topic, sub, index, cumulative, [(r.i64(), r.i64()) for j in range(m)]))
    r.done()
    return partitions, acks
