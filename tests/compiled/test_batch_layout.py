"""Known-good bytes of the on-disk batch layout (pyx/_batch_layout.pxd,
docs/FORMAT.md), Arrow zero-copy reads of a mapped segment, and the ways a
batch can be handed to BatchSpec (lists, pyarrow arrays, headers, keys)."""
import gc
import os
import struct

import pyarrow as pa
import pytest

from txmq import _batch
from txmq._batch import BatchSpec
from txmq._crc32c import crc32c_of
from txmq._segment import Segment
from txmq.errors import InvalidMessageError

TXN_HI = 0x0102030405060708
TXN_LO = 0x1112131415161718
F_TXN = _batch.FLAG["transactional"]
F_CONTROL = _batch.FLAG["control"]
F_COMMIT = _batch.FLAG["marker_commit"]
F_NULL_KEYS = _batch.FLAG["null_keys"]
F_HEADERS = _batch.FLAG["headers"]


def align8(n):
    return (n + 7) & ~7


def new_segment(tmp_path, name="00000000000000000000.log", base=0, capacity=1 << 16):
    seg = Segment(tmp_path / name, base, capacity, True)
    assert seg.recover(0, base) is None
    return seg


def file_bytes(seg, n):
    with open(seg.path, "rb") as f:
        return f.read(n)


def test_exported_layout_constants():
    assert _batch.HEADER_SIZE_BYTES == 88
    assert _batch.MAGIC == struct.unpack("<I", b"TXMB")[0]
    assert _batch.VERSION == 1
    assert _batch.FIELD_OFFSETS == {
        "magic": 0, "version": 4, "flags": 6, "crc": 8, "length": 12, "base_offset": 16,
        "count": 24, "base_sequence": 28, "txn_id": 32, "producer_id": 48,
        "producer_epoch": 56, "header_bytes": 60, "first_event_time": 64,
        "max_event_time": 72, "publish_time": 80,
    }
    assert _batch.FLAG == {"transactional": 1, "control": 2, "marker_commit": 4,
                         "marker_abort": 8, "null_keys": 0x10, "headers": 0x20}


# --------------------------------------------------------------------------
# One batch with every optional section, byte for byte.

VALUES = [b"hello", b"", b"xyz"]
KEYS = [b"k1", None, b"key3"]
HEADERS = [{"h": b"v"}, None, [("a", None), ("b", "s")]]
EVENT_TIMES = [1000, 990, 1010]
PUBLISH = 2000

# Encoded headers: [u16 key len][key][u32 value len | 0xFFFFFFFF][value].
H0 = b"\x01\x00h" + b"\x01\x00\x00\x00v"
H2 = b"\x01\x00a" + b"\xff\xff\xff\xff" + b"\x01\x00b" + b"\x01\x00\x00\x00s"
HEADER_BLOB = H0 + H2  # 8 + 15 = 23 bytes

# Section starts, computed by hand from the .pxd table for count=3.
KEY_OFFSETS_AT = 88          # i32[4] = 16 bytes
VALUE_OFFSETS_AT = 104       # i32[4] = 16 bytes
VALIDITY_AT = 120            # 1 byte, padded to 8
HEADER_OFFSETS_AT = 128      # i32[4] = 16 bytes
HEADERS_AT = 144             # 23 bytes, padded to 24
EVENT_DELTAS_AT = 168        # i32[3] = 12 bytes, padded to 16
KEYS_AT = 184                # 6 bytes, padded to 8
VALUES_AT = 192              # 8 bytes
LENGTH = 200


@pytest.fixture
def full_batch(tmp_path):
    seg = new_segment(tmp_path)
    spec = BatchSpec(list(VALUES), keys=list(KEYS), headers=list(HEADERS),
                     event_times=list(EVENT_TIMES))
    assert spec.encoded_size() == LENGTH
    assert spec.header_bytes == len(HEADER_BLOB) == 23
    base = seg.append(spec, F_TXN, TXN_HI, TXN_LO, 42, 7, 100, PUBLISH)
    assert base == 0
    assert seg.size == LENGTH and seg.next_offset == 3
    yield seg
    seg.close()


def test_header_fields_known_good(full_batch):
    raw = file_bytes(full_batch, LENGTH)
    expected_flags = F_TXN | F_NULL_KEYS | F_HEADERS
    assert expected_flags == 0x31
    table = [
        # offset, struct format, expected value
        (0, "4s", b"TXMB"),
        (4, "B", 1),                      # version
        (5, "B", 0),                      # reserved
        (6, "<H", expected_flags),
        (8, "<I", crc32c_of(raw[12:LENGTH], crc32c_of(raw[4:8]))),
        (12, "<I", LENGTH),
        (16, "<q", 0),                    # base offset
        (24, "<i", 3),                    # count
        (28, "<i", 100),                  # base sequence
        (32, "<Q", TXN_HI),
        (40, "<Q", TXN_LO),
        (48, "<q", 42),                   # producer id
        (56, "<h", 7),                    # producer epoch
        (58, "<H", 0),                    # reserved
        (60, "<I", 23),                   # header bytes
        (64, "<q", 1000),                 # first event time
        (72, "<q", 1010),                 # max event time
        (80, "<q", PUBLISH),
    ]
    for off, fmt, want in table:
        got = struct.unpack_from(fmt, raw, off)[0]
        assert got == want, (off, fmt, got, want)
    # The crc field is the CRC of [4, 8) (version, reserved, flags) followed
    # by [12, length) — also as the literal bytes.
    assert raw[8:12] == struct.pack("<I", crc32c_of(raw[12:], crc32c_of(raw[4:8])))
    assert raw[:4] == struct.pack("<I", 0x424D5854)


def test_sections_known_good(full_batch):
    raw = file_bytes(full_batch, LENGTH + 8)
    expected = bytearray(LENGTH)
    struct.pack_into("<4i", expected, KEY_OFFSETS_AT, 0, 2, 2, 6)      # null key: empty slot
    struct.pack_into("<4i", expected, VALUE_OFFSETS_AT, 0, 5, 5, 8)
    expected[VALIDITY_AT] = 0b101                                        # keys 0 and 2 present
    struct.pack_into("<4i", expected, HEADER_OFFSETS_AT, 0, 8, 8, 23)
    expected[HEADERS_AT:HEADERS_AT + 23] = HEADER_BLOB
    struct.pack_into("<3i", expected, EVENT_DELTAS_AT, 0, -10, 10)
    expected[KEYS_AT:KEYS_AT + 6] = b"k1key3"
    expected[VALUES_AT:VALUES_AT + 8] = b"helloxyz"
    assert raw[88:LENGTH] == bytes(expected[88:])
    # Every section starts 8-aligned and the batch is padded to 8.
    for at in (KEY_OFFSETS_AT, VALUE_OFFSETS_AT, VALIDITY_AT, HEADER_OFFSETS_AT, HEADERS_AT,
               EVENT_DELTAS_AT, KEYS_AT, VALUES_AT, LENGTH):
        assert at % 8 == 0
    # Padding is zero and nothing is written past the batch.
    assert raw[HEADERS_AT + 23:EVENT_DELTAS_AT] == b"\0"
    assert raw[LENGTH:] == bytes(8)


def test_read_back(full_batch):
    info = full_batch.batch_at(0)
    assert (info.position, info.length, info.end) == (0, LENGTH, LENGTH)
    assert (info.base_offset, info.count, info.last_offset, info.next_offset) == (0, 3, 2, 3)
    assert info.flags == 0x31 and info.is_transactional and not info.is_control
    assert info.txn_id == (TXN_HI, TXN_LO)
    assert (info.producer_id, info.producer_epoch, info.base_sequence) == (42, 7, 100)
    assert (info.first_event_time, info.max_event_time, info.publish_time) == (1000, 1010, PUBLISH)
    assert full_batch.messages(0) == [
        (0, b"k1", b"hello", [("h", b"v")], 1000),
        (1, None, b"", None, 990),
        (2, b"key3", b"xyz", [("a", None), ("b", b"s")], 1010),
    ]
    assert full_batch.messages(0, from_offset=1, limit=1) == [(1, None, b"", None, 990)]


def test_reopen_and_recover_reads_same_bytes(full_batch, tmp_path):
    path = full_batch.path
    full_batch.close()
    assert os.path.getsize(path) == LENGTH   # a closed writable segment is trimmed
    ro = Segment(path, 0, 0, False)
    assert ro.recover(0, 0) is None
    assert ro.next_offset == 3 and ro.size == LENGTH
    assert [m[2] for m in ro.messages(0)] == VALUES
    ro.close()


def test_minimal_batch_known_good(tmp_path):
    """One message, no keys, no headers, no event times: keyless batches set
    FLAG_NULL_KEYS so Arrow reads null keys, with an all-zero bitmap, and
    the event time is the publish time."""
    seg = new_segment(tmp_path, base=0)
    spec = BatchSpec([b"abc"])
    assert spec.encoded_size() == 88 + 8 + 8 + 8 + 8 + 0 + 8
    seg.append(spec, publish_time=-5)
    raw = file_bytes(seg, 128)
    expected = bytearray(128)
    struct.pack_into("<4sBBH", expected, 0, b"TXMB", 1, 0, F_NULL_KEYS)
    struct.pack_into("<Iqii", expected, 12, 128, 0, 1, -1)
    struct.pack_into("<QQqhHIqqq", expected, 32, 0, 0, -1, -1, 0, 0, -5, -5, -5)
    struct.pack_into("<2i", expected, 88, 0, 0)        # key offsets
    struct.pack_into("<2i", expected, 96, 0, 3)        # value offsets
    expected[104] = 0                                  # validity: the key is null
    struct.pack_into("<i", expected, 112, 0)           # event delta
    expected[120:123] = b"abc"                         # values (no key bytes)
    struct.pack_into("<I", expected, 8, crc32c_of(bytes(expected[12:]), crc32c_of(bytes(expected[4:8]))))
    assert raw == bytes(expected)
    info = seg.batch_at(0)
    assert info.txn_id is None and info.producer_id == -1 and info.base_sequence == -1
    assert seg.messages(0) == [(0, None, b"abc", None, -5)]
    seg.close()


def test_second_batch_and_nonzero_base(tmp_path):
    seg = new_segment(tmp_path, "00000000000000001000.log", base=1000)
    assert seg.append(BatchSpec([b"a", b"b"], keys=[b"x", b"y"]), publish_time=1) == 1000
    assert seg.append(BatchSpec([b"c"], keys=[b"z"]), F_CONTROL | F_COMMIT, publish_time=2) == 1002
    first = seg.batch_at(0)
    second = seg.batch_at(first.end)
    raw = file_bytes(seg, seg.size)
    assert struct.unpack_from("<q", raw, first.end + 16)[0] == 1002
    assert struct.unpack_from("<H", raw, first.end + 6)[0] == F_CONTROL | F_COMMIT
    assert second.is_control and second.base_offset == 1002
    # keys without nulls: no validity bitmap, flag clear
    assert not first.flags & F_NULL_KEYS
    assert seg.locate(1001) == 0 and seg.locate(1002) == first.end and seg.locate(1003) == -1
    assert seg.find_time(2) == 1002 and seg.find_time(3) == -1
    seg.close()


# --------------------------------------------------------------------------
# Arrow zero-copy.

def _arrow_from_segment(seg, pos):
    bufs = seg.arrow_buffers(pos)
    n = bufs["count"]
    validity = pa.py_buffer(bufs["validity"]) if bufs["validity"] is not None else None
    keys = pa.Array.from_buffers(pa.binary(), n, [validity, pa.py_buffer(bufs["key_offsets"]),
                                                   pa.py_buffer(bufs["keys"])])
    values = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(bufs["value_offsets"]),
                                                     pa.py_buffer(bufs["values"])])
    return bufs, keys, values


def test_arrow_zero_copy_values_and_null_keys(tmp_path):
    seg = new_segment(tmp_path)
    seg.append(BatchSpec([b"v0"], keys=[b"first"]))          # position 0
    pos = seg.size
    values = [b"alpha", b"", b"gamma" * 100, b"d", b"e", b"f", b"g", b"h", b"i"]
    keys = [b"k0", None, b"k2", None, None, b"k5", b"", None, b"k8"]
    seg.append(BatchSpec(list(values), keys=list(keys), event_times=range(9)))
    bufs, k_arr, v_arr = _arrow_from_segment(seg, pos)
    k_arr.validate(full=True)
    v_arr.validate(full=True)
    assert v_arr.to_pylist() == values
    assert k_arr.to_pylist() == keys
    assert k_arr.null_count == 4
    deltas = memoryview(bufs["event_deltas"]).cast("i").tolist()
    assert deltas == list(range(9))
    # Zero copy: the Arrow buffer addresses lie inside the mapping.
    base = pa.py_buffer(seg.mapping).address
    assert base <= v_arr.buffers()[2].address < base + seg.mapping.size
    assert v_arr.buffers()[2].address == base + pos + (seg.size - pos) - align8(len(b"".join(values)))
    del bufs
    seg.close()


def test_arrow_view_keeps_mapping_alive_after_close(tmp_path):
    seg = new_segment(tmp_path)
    values = [b"x%d" % i for i in range(20)]
    seg.append(BatchSpec(list(values), keys=[b"k%d" % i if i % 3 else None for i in range(20)]))
    bufs, k_arr, v_arr = _arrow_from_segment(seg, 0)
    del bufs
    gc.collect()
    mapping = seg.mapping
    assert mapping.exports > 0
    seg.close()
    assert seg.closed
    assert not mapping.closed            # unmap deferred while Arrow holds views
    assert v_arr.to_pylist() == values
    assert k_arr.to_pylist() == [b"k%d" % i if i % 3 else None for i in range(20)]
    del k_arr, v_arr
    gc.collect()
    assert mapping.exports == 0
    assert mapping.closed                # last view released: unmapped


def test_mapping_unmaps_at_once_without_views(tmp_path):
    seg = new_segment(tmp_path)
    seg.append(BatchSpec([b"a"]))
    mapping = seg.mapping
    assert mapping.exports == 0
    seg.close()
    assert mapping.closed
    with pytest.raises(ValueError):
        memoryview(mapping)


def test_read_only_mapping_refuses_writable_view(tmp_path):
    seg = new_segment(tmp_path)
    seg.append(BatchSpec([b"a"]))
    seg.close()
    ro = Segment(seg.path, 0, 0, False)
    assert ro.recover(0, 0) is None
    view = memoryview(ro.mapping)
    assert view.readonly
    assert ro.mapping.exports == 1
    with open(seg.path, "rb") as f, pytest.raises((BufferError, TypeError)):
        f.readinto(ro.mapping)           # asks for a writable buffer
    assert ro.mapping.exports == 1       # the refused request was not counted
    view.release()
    assert ro.mapping.exports == 0
    with pytest.raises(PermissionError):
        ro.append(BatchSpec([b"b"]))
    ro.close()


# --------------------------------------------------------------------------
# BatchSpec inputs.

def _roundtrip(tmp_path, values, **kw):
    seg = new_segment(tmp_path, f"{abs(hash(repr(kw))) % 10**20:020d}.log")
    seg.append(BatchSpec(values, **kw), publish_time=9)
    out = seg.messages(0)
    seg.close()
    return out


def test_send_list_of_bytes_like(tmp_path):
    vals = [b"a", bytearray(b"bb"), memoryview(b"ccc")]
    out = _roundtrip(tmp_path, vals, keys=["str-key", bytearray(b"bk"), memoryview(b"mk")])
    assert [m[2] for m in out] == [b"a", b"bb", b"ccc"]
    assert [m[1] for m in out] == [b"str-key", b"bk", b"mk"]
    assert [m[0] for m in out] == [0, 1, 2]


@pytest.mark.parametrize("typ", [pa.binary(), pa.large_binary(), pa.string(), pa.large_string()])
def test_send_arrow_values(tmp_path, typ):
    py = ["v%d" % i * (i % 4) for i in range(50)]
    conv = (lambda s: s.encode()) if typ in (pa.binary(), pa.large_binary()) else (lambda s: s)
    arr = pa.array([conv(s) for s in py], typ)
    out = _roundtrip(tmp_path, arr)
    assert [m[2] for m in out] == [s.encode() for s in py]
    assert all(m[1] is None for m in out)


@pytest.mark.parametrize("typ", [pa.binary(), pa.large_binary(), pa.string()])
def test_send_sliced_arrow_arrays(tmp_path, typ):
    conv = (lambda b: b) if typ != pa.string() else (lambda b: None if b is None else b.decode())
    all_vals = [b"val-%d" % i for i in range(40)]
    all_keys = [None if i % 5 == 0 else b"key-%d" % i for i in range(40)]
    vals = pa.array([conv(v) for v in all_vals], typ).slice(13, 17)
    keys = pa.array([conv(k) for k in all_keys], typ).slice(7, 17)   # different offsets
    assert vals.offset == 13 and keys.offset == 7
    out = _roundtrip(tmp_path, vals, keys=keys)
    assert [m[2] for m in out] == all_vals[13:30]
    assert [m[1] for m in out] == all_keys[7:24]


def test_send_chunked_array(tmp_path):
    arr = pa.chunked_array([[b"a", b"b"], [b"c"]], pa.binary())
    out = _roundtrip(tmp_path, arr)
    assert [m[2] for m in out] == [b"a", b"b", b"c"]


def test_arrow_keys_without_nulls_and_empty_values(tmp_path):
    out = _roundtrip(tmp_path, pa.array([b"", b"", b""]), keys=pa.array([b"k", b"", b"kk"]))
    assert [(m[1], m[2]) for m in out] == [(b"k", b""), (b"", b""), (b"kk", b"")]


def test_headers_dict_pairs_none_values(tmp_path):
    headers = [
        {"a": b"1", "b": "text", "c": None},
        [("dup", b"x"), ("dup", b"y"), ("n", None)],
        None,
        {},
        [("ü", b"\x00\xff")],
    ]
    out = _roundtrip(tmp_path, [b"m%d" % i for i in range(5)], headers=headers)
    assert [m[3] for m in out] == [
        [("a", b"1"), ("b", b"text"), ("c", None)],
        [("dup", b"x"), ("dup", b"y"), ("n", None)],
        None,
        None,
        [("ü", b"\x00\xff")],
    ]


def test_all_headers_empty_sets_no_flag(tmp_path):
    seg = new_segment(tmp_path)
    seg.append(BatchSpec([b"a", b"b"], headers=[None, {}]))
    assert not seg.batch_at(0).flags & F_HEADERS
    assert [m[3] for m in seg.messages(0)] == [None, None]
    seg.close()


def test_event_times(tmp_path):
    times = [1_700_000_000_000, 1_699_999_999_000, 1_700_000_005_000]
    seg = new_segment(tmp_path)
    seg.append(BatchSpec([b"a", b"b", b"c"], event_times=times), publish_time=3)
    info = seg.batch_at(0)
    assert (info.first_event_time, info.max_event_time) == (times[0], max(times))
    assert [m[4] for m in seg.messages(0)] == times
    seg.append(BatchSpec([b"d"], default_event_time=77))
    assert seg.messages(seg.batch_at(0).end) == [(3, None, b"d", None, 77)]
    seg.close()


def test_invalid_inputs_raise_typed_errors():
    with pytest.raises(ValueError):
        BatchSpec([])
    with pytest.raises(InvalidMessageError):
        BatchSpec([b"a", 5])
    with pytest.raises(InvalidMessageError):
        BatchSpec([b"a"], keys=[b"a", b"b"])
    with pytest.raises(InvalidMessageError):
        BatchSpec([b"a"], keys=[3])
    with pytest.raises(InvalidMessageError):
        BatchSpec([b"a"], headers=[{1: b"x"}])
    with pytest.raises(InvalidMessageError):
        BatchSpec([b"a"], headers=[{"k": 5}])
    with pytest.raises(InvalidMessageError):
        BatchSpec([b"a", b"b"], event_times=[0])
    with pytest.raises(InvalidMessageError):
        BatchSpec([b"a", b"b"], event_times=[0, 2**31 + 5])
    with pytest.raises(InvalidMessageError):
        BatchSpec(pa.array([b"a", None]))
    with pytest.raises(InvalidMessageError):
        BatchSpec(pa.array([1, 2]))


def test_full_segment_returns_minus_one(tmp_path):
    seg = new_segment(tmp_path, capacity=256)
    assert seg.append(BatchSpec([b"x" * 100])) == 0     # 88+8+8+8+8+104 = 224
    assert seg.append(BatchSpec([b"y"])) == -1
    assert seg.next_offset == 1 and seg.room() == 256 - seg.size
    seg.close()
