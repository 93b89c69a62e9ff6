"""The one bounds-checked reader (pyx/_reader.pyx) and every decoder that
reads through it: a read past the data, stray bytes or a refused value is a
CorruptLogError at the file position of the first bad byte (a ValueError
naming that byte when the bytes came from no file), never a crash or a
misread."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from txmq import _half
from txmq import _txn as T
from txmq import _txnlog as L
from txmq._ackset import AckSet
from txmq._producers import ProducerStates
from txmq._reader import Reader
from txmq._redolog import FRAME_HEADER_BYTES, RedoLog, frame, parse, payload_position_of
from txmq.storage.cursor import ACK, ACK_RANGE, MARK_DELETE
from txmq.storage.cursor import replay as replay_cursor
from txmq.errors import CorruptLogError

PATH = "/data/some.log"


def test_reads_are_little_endian_and_advance():
    raw = struct.pack("<BHhIiQq", 0xAB, 0xBEEF, -2, 0xDEADBEEF, -3, 2**64 - 1, -4) + b"\x02\x00hi"
    r = Reader(PATH, "test").reset(raw, 1000)
    assert (r.u8(), r.u16(), r.i16(), r.u32(), r.i32(), r.u64(), r.i64()) == (
        0xAB, 0xBEEF, -2, 0xDEADBEEF, -3, 2**64 - 1, -4)
    assert r.text() == "hi" and r.position == 1000 + len(raw) and r.remaining() == 0
    r.done()


def test_a_read_past_the_end_names_the_file_position_of_the_field():
    r = Reader(PATH, "coordinator frame of type", ).reset(b"\1\2\3\4\5\6", 500, 3)
    assert r.u32() == 0x04030201
    with pytest.raises(CorruptLogError) as e:
        r.u32()
    assert (e.value.path, e.value.position) == (PATH, 504)
    assert e.value.reason.startswith("coordinator frame of type 3: ends at byte 506")


def test_without_a_path_the_error_is_a_value_error_naming_the_byte():
    r = Reader(None, "ack set").reset(b"\1\2", 7)
    with pytest.raises(ValueError, match=r"ack set: .* \(at byte 7\)"):
        r.u32()


def test_stray_bytes_are_reported_where_they_start():
    r = Reader(PATH, "t").reset(b"\0" * 10, 64)
    r.i64()
    with pytest.raises(CorruptLogError) as e:
        r.done()
    assert e.value.position == 72 and "2 stray bytes" in e.value.reason


def test_a_count_read_from_a_file_cannot_overflow_an_array_read():
    r = Reader(PATH, "t").reset(b"\0" * 16, 0)
    for count, size in ((2**62, 28), (2**61 + 1, 8), (-1, 8), (3, 8)):
        with pytest.raises(CorruptLogError) as e:
            r.read(count, size)
        assert e.value.position == 0
    assert r.read(2, 8) == b"\0" * 16


@pytest.mark.parametrize("payload, bad, what", [
    (b"", 0, "ends at byte"),                      # no length at all
    (b"\x05", 0, "ends at byte"),                  # one byte of the two-byte length
    (b"\x05\x00abc", 0, "text of 5 bytes runs past"),  # the length says more than is left
])
def test_a_truncated_text_is_corrupt_at_the_text(payload, bad, what):
    r = Reader(PATH, "t").reset(b"\0" * 4 + payload, 100)
    r.u32()
    with pytest.raises(CorruptLogError, match=what) as e:
        r.text()
    assert e.value.position == 104 + bad


def test_a_text_that_is_not_utf8_is_corrupt_at_the_bad_byte():
    r = Reader(PATH, "t").reset(b"\x04\x00ab\xffc", 10)
    with pytest.raises(CorruptLogError, match="not UTF-8") as e:
        r.text()
    assert e.value.position == 14


def test_other_buffers_are_read_too():
    for data in (bytearray(b"\x01\x00\x00\x00"), memoryview(b"xx\x01\x00\x00\x00")[2:]):
        assert Reader().reset(data).u32() == 1
    with pytest.raises(ValueError):
        Reader().reset(b"").u8()


# -- every decoder, on frames of a real file ---------------------------------------------

def _log_with(tmp_path, good: list, bad: tuple, name: str = "x.log"):
    """A redo log holding the ``good`` frames then the ``bad`` one (its CRC
    is right: only its payload is wrong); its path, its frames as parse
    gives them, and the position of the bad frame's payload."""
    path = str(tmp_path / name)
    log = RedoLog(path, "never")
    for t, p in good:
        log.append(t, p)
    at = log.size
    log.append(*bad)
    log.close()
    with open(path, "rb") as f:
        frames, _, reason = parse(f.read())
    assert reason is None and frames[-1][2] == at
    return path, frames, at + FRAME_HEADER_BYTES


TXN = struct.pack("<QQ", 1 << 48, 7)
BEGIN = (L.TC_BEGIN, TXN + struct.pack("<qq", 60_000, 1))


@pytest.mark.parametrize("good, bad, field", [
    # ADD_PARTITION whose topic text claims 9 bytes and has 3: at the text
    ([BEGIN], (L.TC_ADD_PARTITION, TXN + b"\x09\x00abc"), 16),
    # a partition number cut short after a whole topic
    ([BEGIN], (L.TC_ADD_PARTITION, TXN + L.encode_text("t") + b"\1\0"), 16 + 3),
    # COMMITTING a transaction never begun: at its id
    ([BEGIN], (L.TC_COMMITTING, struct.pack("<QQ", 1 << 48, 8)), 0),
    # BEGIN with a stray byte after its last field
    ([], (L.TC_BEGIN, TXN + struct.pack("<qq", 1, 2) + b"x"), 32),
    # an unknown frame type: at the type byte in front of the payload
    ([BEGIN], (77, b""), -1),
])
def test_coordinator_frames(tmp_path, good, bad, field):
    path, frames, payload = _log_with(tmp_path, good, bad)
    with pytest.raises(CorruptLogError) as e:
        L.replay_coordinator(frames, path)
    assert (e.value.path, e.value.position) == (path, payload + field)
    assert e.value.reason.startswith(f"coordinator frame of type {bad[0]}: ")


def test_registry_and_pending_ack_frames(tmp_path):
    i64 = struct.Struct("<q").pack
    path, frames, payload = _log_with(tmp_path, [(L.PR_BLOCK, i64(1024))],
                                      (L.PR_NAME, L.encode_text("svc") + b"\1\2\3"))
    with pytest.raises(CorruptLogError) as e:
        L.replay_registry(frames, path)
    assert e.value.position == payload + 5 and "producer registry frame of type 3" in e.value.reason
    # a pending ack of 1000 offsets that holds 2
    path, frames, payload = _log_with(tmp_path, [(L.PA_CUMULATIVE, TXN + i64(3))],
                                      (L.PA_ACK, TXN + struct.pack("<I", 1000) + i64(1) + i64(2)), "p.log")
    with pytest.raises(CorruptLogError) as e:
        L.replay_pending(frames, path)
    assert e.value.position == payload + 20 and "pending-ack frame of type 2" in e.value.reason


def test_half_message_frames(tmp_path):
    rec = _half.record_frame(0, 0, 100, 1_700_000_000, 0, _half.PREPARED, 0)
    # GROUP whose group text has one byte of its two-byte length: the read
    # of that length must not load past the payload (it loaded 4 bytes)
    payload = struct.pack("<q", 5) + b"\x01\x00t" + b"\x03"
    path, frames, at = _log_with(tmp_path, [(_half.F_RECORD, rec)], (_half.F_GROUP, payload))
    with pytest.raises(CorruptLogError) as e:
        _half.replay(frames, path=path)
    assert (e.value.path, e.value.position) == (path, at + 11)
    assert e.value.reason.startswith(f"half-message redo frame of type {_half.F_GROUP}: ends at byte")
    # an UPDATE of a record that does not exist: at that entry
    upd = _half.update_frame([(0, _half.COMMITTED, 0), (9, _half.COMMITTED, 0)])
    path, frames, at = _log_with(tmp_path, [(_half.F_RECORD, rec)], (_half.F_UPDATE, upd), "u.log")
    with pytest.raises(CorruptLogError, match="has no record") as e:
        _half.replay(frames, path=path)
    assert e.value.position == at + 16
    # a snapshot whose group part is shorter than the group in it: the
    # group's reads stop at the part's end
    snap = bytearray(_half.snapshot(0, 1, rec[8:36], {}, {}, {5: ("t", "g")}))
    cut = len(snap) - len(_half.group_frame(5, "t", "g")) - 4
    struct.pack_into("<I", snap, cut, 11)                   # the group takes 14 bytes
    path, frames, at = _log_with(tmp_path, [], (1, bytes(snap)), "s.log")
    with pytest.raises(CorruptLogError, match="ends at byte") as e:
        _half.replay(frames, path=path)
    assert e.value.position == at + cut + 4 + 11
    # ... and one longer than its group: the stray bytes in it
    snap = bytearray(_half.snapshot(0, 1, rec[8:36], {}, {}, {5: ("t", "g")}) + b"\0")
    struct.pack_into("<I", snap, cut, 15)
    path, frames, at = _log_with(tmp_path, [], (1, bytes(snap)), "s2.log")
    with pytest.raises(CorruptLogError, match="1 stray bytes") as e:
        _half.replay(frames, path=path)
    assert e.value.position == at + cut + 4 + 14


def test_cursor_frames(tmp_path):
    i64 = struct.Struct("<q").pack
    path, frames, at = _log_with(tmp_path, [(MARK_DELETE, i64(4))], (ACK, struct.pack("<I", 3) + i64(5)))
    with pytest.raises(CorruptLogError) as e:
        replay_cursor(frames, 0, path)
    assert e.value.position == at + 4 and e.value.reason.startswith(f"cursor frame of type {ACK}: ")
    # a snapshot whose ack set holds an empty range: at that range
    snap = i64(10) + struct.pack("<Iqqqq", 2, 12, 14, 20, 20)
    path, frames, at = _log_with(tmp_path, [], (1, snap), "s.log")
    with pytest.raises(CorruptLogError, match=r"empty range \[20, 20\)") as e:
        replay_cursor(frames, 0, path)
    assert e.value.position == at + 8 + 4 + 16
    path, frames, at = _log_with(tmp_path, [], (ACK_RANGE, i64(1) + i64(2) + b"\0"), "r.log")
    with pytest.raises(CorruptLogError, match="1 stray bytes") as e:
        replay_cursor(frames, 0, path)
    assert e.value.position == at + 16


@pytest.mark.parametrize("table, entry, make", [
    (T.OngoingQueue, 32, lambda: _ongoing()),
    (T.AbortSet, 32, lambda: _aborted()),
    (ProducerStates, 24 + 16 * 5, lambda: _producers()),
])
def test_tables_name_the_byte_of_a_file(table, entry, make):
    raw = make()
    with pytest.raises(CorruptLogError) as e:
        table.from_bytes(raw[:-1], "/x.snap", 16)
    assert e.value.path == "/x.snap" and e.value.position == 16 + 4     # the entries that do not fit
    with pytest.raises(ValueError, match=r"at byte 4\)"):
        table.from_bytes(raw[:-1])                                          # no file: ValueError
    assert table.from_bytes(raw, "/x.snap", 16)[1] == len(raw)


def test_table_entries_the_decoder_refuses_are_reported_at_the_entry():
    q = T.OngoingQueue()
    q.add(1, 1, 50)
    q.add(1, 2, 60)
    raw = bytearray(q.to_bytes())
    struct.pack_into("<q", raw, 4 + 32 + 16, 10)     # second first offset below the first's
    with pytest.raises(CorruptLogError, match="entry 1: first offset 10") as e:
        T.OngoingQueue.from_bytes(bytes(raw), "/x.snap", 16)
    assert e.value.position == 16 + 4 + 32
    t = ProducerStates()
    t.record(5, 0, 0, 1, 0, 1)
    twice = (2).to_bytes(4, "little") + t.to_bytes()[4:] * 2
    with pytest.raises(CorruptLogError, match="bad producer entry 1") as e:
        ProducerStates.from_bytes(twice, "/p.snap", 16)
    assert e.value.position == 16 + 4 + 24 + 16 * 5
    with pytest.raises(CorruptLogError, match="empty range") as e:
        AckSet.from_bytes(struct.pack("<Iqq", 1, 9, 2), "/c.log", 100)
    assert e.value.position == 104


def _ongoing():
    q = T.OngoingQueue()
    q.add(1, 1, 50, 7)
    return q.to_bytes()


def _aborted():
    s = T.AbortSet()
    s.add(1 << 48, 3, 10, 20)
    return s.to_bytes()


def _producers():
    t = ProducerStates()
    t.record(5, 0, 0, 1, 0, 1)
    return t.to_bytes()


def test_batch_headers_that_do_not_parse_are_reported_at_their_byte(tmp_path):
    """A batch whose CRC is right but whose encoded headers run past their
    section: the error names the header value's length field."""
    from txmq._batch import BatchSpec, encode_headers
    from txmq._crc32c import crc32c_of
    from txmq._segment import Segment
    path = tmp_path / "00000000000000000000.log"
    seg = Segment(path, 0, 1 << 16, True)
    seg.recover(0, 0)
    seg.append(BatchSpec([b"a", b"b"], headers=[None, {"key": b"value"}]), publish_time=1)
    length = seg.size
    seg.close()
    raw = bytearray(path.read_bytes()[:length])
    blob = encode_headers({"key": b"value"})
    at = raw.index(blob) + 2 + 3                    # the value's u32 length
    struct.pack_into("<I", raw, at, 1000)
    struct.pack_into("<I", raw, 8, crc32c_of(raw[12:length], crc32c_of(raw[4:8])))
    path.write_bytes(bytes(raw))
    seg = Segment(path, 0, 0, False)
    assert seg.recover(0, 0) is None                # the CRC passes
    with pytest.raises(CorruptLogError) as e:
        seg.messages(0)
    assert (e.value.path, e.value.position) == (str(path), at + 4)
    assert e.value.reason.startswith("headers of offset 1: ends at byte")
    seg.close()


# Each field of the header encoding cut short by a wrong length before it:
# (offset of the u16 / u32 patched in the message's encoded headers, its
# format, the value written, offset of the field reported, bytes it needs).
# The headers are {"key": b"value", "k2": b"v"}: 14 + 9 bytes.
HEADER_CUTS = {
    "key": (0, "<H", 30, 2, 30),                 # a key longer than the headers
    "value length": (0, "<H", 19, 21, 4),        # the key leaves 2 bytes for the value length
    "value": (5, "<I", 1000, 9, 1000),           # a value longer than the headers
    "key length": (5, "<I", 13, 22, 2),          # the value leaves 1 byte of the next key length
}


@pytest.mark.parametrize("cut", sorted(HEADER_CUTS))
def test_every_header_field_cut_short_is_reported_at_its_first_byte(tmp_path, cut):
    """Headers are parsed by next_header (_batch_layout.pxd) alone; where a
    field does not fit, the batch decoder reports that field's first byte
    and the bytes it needs, as the reader does for any read."""
    from txmq._batch import BatchSpec, encode_headers
    from txmq._crc32c import crc32c_of
    from txmq._segment import Segment
    at, fmt, value, field, need = HEADER_CUTS[cut]
    path = tmp_path / "00000000000000000000.log"
    seg = Segment(path, 0, 1 << 16, True)
    seg.recover(0, 0)
    seg.append(BatchSpec([b"a", b"b"], headers=[None, [("key", b"value"), ("k2", b"v")]]), publish_time=1)
    length = seg.size
    seg.close()
    raw = bytearray(path.read_bytes()[:length])
    blob = encode_headers([("key", b"value"), ("k2", b"v")])
    start = raw.index(blob)
    struct.pack_into(fmt, raw, start + at, value)
    struct.pack_into("<I", raw, 8, crc32c_of(raw[12:length], crc32c_of(raw[4:8])))
    path.write_bytes(bytes(raw))
    seg = Segment(path, 0, 0, False)
    assert seg.recover(0, 0) is None                # the CRC passes
    with pytest.raises(CorruptLogError) as e:
        seg.messages(0)
    assert (e.value.path, e.value.position) == (str(path), start + field)
    assert e.value.reason == (f"headers of offset 1: ends at byte {start + len(blob)} "
                              f"({need} bytes needed from byte {start + field})")
    seg.close()


# -- no payload makes a decoder crash, hang or report outside its frame ---------------------

DECODERS = {
    "coordinator": (lambda frames, path: L.replay_coordinator(frames, path),
                    [1, L.TC_BEGIN, L.TC_ADD_PARTITION, L.TC_ADD_SUBSCRIPTION, L.TC_COMMITTING,
                     L.TC_ABORTING, L.TC_COMMITTED, L.TC_ABORTED, L.TC_PRODUCER, 42]),
    "registry": (lambda frames, path: L.replay_registry(frames, path), [1, L.PR_BLOCK, L.PR_NAME, 42]),
    "pending": (lambda frames, path: L.replay_pending(frames, path),
                [1, L.PA_ACK, L.PA_CUMULATIVE, L.PA_COMMIT, L.PA_ABORT, 42]),
    "half": (lambda frames, path: _half.replay(frames, path=path),
             [1, _half.F_RECORD, _half.F_UPDATE, _half.F_GROUP, 42]),
    "cursor": (lambda frames, path: replay_cursor(frames, 0, path), [1, 2, 3, 4, 5, 42]),
}


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(sorted(DECODERS)), st.data())
def test_random_payloads_parse_or_fail_inside_their_frame(name, data):
    replay, kinds = DECODERS[name]
    frames, pos = [], 8
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(kinds))
        payload = data.draw(st.binary(max_size=64))
        if name == "half" and kind == _half.F_RECORD and len(payload) >= 8:
            # a RECORD's index sizes the table: a far one is a big table, not bad bytes
            payload = struct.pack("<q", data.draw(st.integers(-5, 50))) + payload[8:]
        frames.append((kind, payload, pos))
        pos += FRAME_HEADER_BYTES + len(payload)
    try:
        replay(frames, PATH)
    except CorruptLogError as e:
        assert e.path == PATH
        assert any(f[2] + FRAME_HEADER_BYTES - 1 <= e.position <= f[2] + FRAME_HEADER_BYTES + len(f[1])
                   for f in frames), (e.position, frames)


def _valid_frames():
    """Frames each decoder accepts, of every type it knows."""
    i64 = struct.Struct("<q").pack
    txn2 = struct.pack("<QQ", 1 << 48, 8)
    snap = L.encode_coordinator_snapshot(9, {(1 << 48, 7): [L.OPEN, 5, 6, {("t", 1)}, {("t", "s")}]},
                                         {"tid": (4, 2)})
    rec = _half.record_frame(0, 0, 100, 1_700_000_000, 0, _half.COMMITTING, 0, 1, 2, 3)
    return {
        "coordinator": [(1, snap), BEGIN, (L.TC_ADD_PARTITION, TXN + L.encode_text("topic") + i64(3)[:4]),
                        (L.TC_ADD_SUBSCRIPTION, TXN + L.encode_text("t") + L.encode_text("sub")),
                        (L.TC_PRODUCER, L.encode_producer("tid", 5, 1)), (L.TC_BEGIN, txn2 + i64(1) + i64(2)),
                        (L.TC_COMMITTING, TXN), (L.TC_COMMITTED, TXN), (L.TC_ABORTING, txn2),
                        (L.TC_ABORTED, txn2)],
        "registry": [(1, L.encode_registry_snapshot(10, {"a": 3})), (L.PR_BLOCK, i64(2048)),
                     (L.PR_NAME, L.encode_text("svc") + i64(11))],
        "pending": [(1, struct.pack("<I", 1) + TXN + i64(4) + struct.pack("<I", 2) + i64(7) + i64(9)),
                    (L.PA_ACK, txn2 + struct.pack("<I", 2) + i64(20) + i64(21)),
                    (L.PA_CUMULATIVE, txn2 + i64(25)), (L.PA_COMMIT, TXN), (L.PA_ABORT, txn2)],
        "half": [(1, _half.snapshot(0, 1, rec[8:36], {0: (1, 2)}, {0: 3}, {5: ("t", "g")})),
                 (_half.F_RECORD, _half.record_frame(1, 1, 10, 1, 0, _half.PREPARED, 0)),
                 (_half.F_UPDATE, _half.update_frame([(1, _half.COMMITTED, 1)])),
                 (_half.F_GROUP, _half.group_frame(6, "topic", "group"))],
        "cursor": [(1, i64(3) + struct.pack("<Iqq", 1, 5, 7)), (ACK, struct.pack("<I", 2) + i64(3) + i64(4)),
                   (MARK_DELETE, i64(8)), (ACK_RANGE, i64(10) + i64(12)), (4, i64(2))],
    }


@settings(max_examples=600, deadline=None)
@given(st.sampled_from(sorted(DECODERS)), st.data())
def test_damaged_valid_frames_parse_or_fail_inside_the_damaged_frame(name, data):
    """One frame of a sound log is cut, lengthened or has a byte changed
    (its CRC made right again): the decoders accept it or report a byte of
    that frame, never one before it."""
    replay, _ = DECODERS[name]
    good = _valid_frames()[name]
    replay([(t, p, 0) for t, p in good], PATH)                  # sound as written
    hit = data.draw(st.integers(0, len(good) - 1))
    kind, payload = good[hit]
    how = data.draw(st.sampled_from(["cut", "grow", "flip"]))
    if how == "cut":
        payload = payload[:data.draw(st.integers(0, max(len(payload) - 1, 0)))]
    elif how == "grow":
        payload = payload + data.draw(st.binary(min_size=1, max_size=9))
    elif payload:
        # a RECORD's index sizes the table: changing it is not bad bytes
        lo = 8 if name == "half" and kind == _half.F_RECORD else 0
        if lo < len(payload):
            i = data.draw(st.integers(lo, len(payload) - 1))
            payload = payload[:i] + bytes([payload[i] ^ data.draw(st.integers(1, 255))]) + payload[i + 1:]
    frames, pos = [], 8
    for i, (t, p) in enumerate(good):
        p = payload if i == hit else p
        frames.append((t, p, pos))
        pos += FRAME_HEADER_BYTES + len(p)
    try:
        replay(frames, PATH)
    except CorruptLogError as e:
        start = frames[hit][2]
        assert start + FRAME_HEADER_BYTES - 1 <= e.position, (e.position, start, e.reason)
        assert e.position <= pos, (e.position, pos, e.reason)


def test_payload_position_of_a_frame():
    assert payload_position_of((2, b"x", 100)) == 100 + FRAME_HEADER_BYTES
    assert payload_position_of((2, b"x")) == 0
    assert frame(2, b"x")[FRAME_HEADER_BYTES:] == b"x"
