"""The Kafka codec (txmq._kafka, txmq.kafka.protocol / records): known-good
byte tables, record batches checked against kafka-python's own independent
encoder and decoder, every compression codec, and a fuzz of the request
and record-batch decoders with random and mutated bytes (the result is a
decoded value or KafkaProtocolError, never another exception or a hang).
"""

import random
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from txmq import _kafka, _kafka_records
from txmq.errors import KafkaProtocolError
from txmq.kafka import protocol, records, schema
from txmq.kafka.protocol import Error

kafka_records = pytest.importorskip("kafka.record.default_records")

# ApiVersions v3 request as librdkafka sends it: header v2 (key 18, version 3,
# correlation 1, client id "rdkafka", no tags), body: compact strings
# "librdkafka" / "2.16.1", no tags.
API_VERSIONS_V3 = (b"\x00\x12\x00\x03\x00\x00\x00\x01\x00\x07rdkafka\x00"
                   b"\x0blibrdkafka\x072.16.1\x00")


def test_request_header_and_flexible_body_known_bytes():
    req = protocol.decode_request(API_VERSIONS_V3)
    assert (req.api_key, req.api_version, req.correlation_id, req.client_id) == (18, 3, 1, "rdkafka")
    assert req.body == {"client_software_name": "librdkafka", "client_software_version": "2.16.1"}


def test_api_versions_response_uses_header_v0_and_lists_exact_ranges():
    frame = protocol.encode_response(18, 3, 1, protocol.api_versions_body())
    size, corr, err = struct.unpack(">iih", frame[:10])
    assert size == len(frame) - 4 and corr == 1 and err == 0        # no tagged byte after the correlation id
    body = _kafka.read_struct(_kafka.Reader(frame, 8), schema.response(18, 3))
    served = {a["api_key"]: (a["min_version"], a["max_version"]) for a in body["api_keys"]}
    assert served == protocol.SUPPORTED_KEYS
    # What librdkafka 2.16 and kafka-python 3 need at least.
    for name, least in (("InitProducerId", 3), ("TxnOffsetCommit", 3), ("Fetch", 4), ("ListOffsets", 2)):
        lo, hi = protocol.SUPPORTED[name]
        assert lo <= least <= hi, name


def test_flexible_response_has_header_v1_tag_byte():
    frame = protocol.encode_response(3, 9, 5, {"brokers": [], "topics": []})
    assert frame[4:8] == b"\x00\x00\x00\x05" and frame[8] == 0      # tagged-field count of header v1


@pytest.mark.parametrize("key", sorted(protocol.SUPPORTED_KEYS))
def test_every_served_version_round_trips_defaults(key):
    lo, hi = protocol.SUPPORTED_KEYS[key]
    for v in range(lo, hi + 1):
        for compiled in (schema.request(key, v), schema.response(key, v)):
            w = _kafka.Writer()
            _kafka.write_struct(w, {}, compiled)
            raw = w.getvalue()
            r = _kafka.Reader(raw, 0)
            decoded = _kafka.read_struct(r, compiled)
            assert r.remaining() == 0
            w2 = _kafka.Writer()
            _kafka.write_struct(w2, decoded, compiled)
            assert w2.getvalue() == raw


def test_tagged_fields_written_only_when_set_and_read_back():
    compiled = schema.response(18, 3)
    w = _kafka.Writer()
    _kafka.write_struct(w, {"api_keys": [], "finalized_features_epoch": 7}, compiled)
    d = _kafka.read_struct(_kafka.Reader(w.getvalue(), 0), compiled)
    assert d["finalized_features_epoch"] == 7 and d["supported_features"] == []


def _kafka_python_batch(codec=0, transactional=False, pid=-1, epoch=-1, seq=-1, n=5):
    b = kafka_records.DefaultRecordBatchBuilder(2, codec, transactional, pid, epoch, seq, 1 << 20)
    for i in range(n):
        b.append(i, 1_700_000_000_000 + i, b"k%d" % i if i % 2 else None, b"value-%d" % i,
                 [("h", b"x%d" % i), ("e", None)] if i % 3 == 0 else [])
    return bytes(b.build())


@pytest.mark.parametrize("codec", [records.NONE, records.GZIP, records.SNAPPY, records.LZ4, records.ZSTD])
def test_decodes_kafka_python_batches_in_every_codec(codec):
    raw = _kafka_python_batch(codec=codec, transactional=True, pid=42, epoch=3, seq=10)
    (b,) = records.decode_produce(raw, 1 << 20)
    assert (b.producer_id, b.producer_epoch, b.base_sequence, b.count, b.transactional) == (42, 3, 10, 5, True)
    values, keys, headers, timestamps = b.columns.to_lists()
    assert values == [b"value-%d" % i for i in range(5)]
    assert keys == [None, b"k1", None, b"k3", None]
    assert headers[0] == [("h", b"x0"), ("e", None)] and headers[1] is None
    assert timestamps == [1_700_000_000_000 + i for i in range(5)]


def test_record_columns_known_bytes():
    # Two records as librdkafka lays them out: key null / b"k", values b"ab" / b"",
    # one header ("h", null) on the second, timestamps base+0 / base+300.
    recs = _kafka_records.encode_records([(10, None, b"ab", None, 1000), (11, b"k", b"", [("h", None)], 1300)], 10, 1000)
    c = _kafka_records.decode_records(recs, 2, 1000)
    assert bytes(c.values) == b"ab" and bytes(c.value_offsets) == struct.pack("<3i", 0, 2, 2)
    assert bytes(c.keys) == b"k" and bytes(c.key_offsets) == struct.pack("<3i", 0, 0, 1)
    assert bytes(c.key_validity) == b"\x02"
    assert c.headers == b"\x01\x00h\xff\xff\xff\xff"           # u16 key length, key, u32 value length (null)
    assert bytes(c.header_offsets) == struct.pack("<3i", 0, 0, 7)
    assert bytes(c.event_deltas) == struct.pack("<2i", 0, 300)
    assert (c.first_timestamp, c.max_timestamp) == (1000, 1300)
    only_values = _kafka_records.decode_records(_kafka_records.encode_records([(0, None, b"v", None, 5)], 0, 5), 1, 5)
    assert only_values.keys is None and only_values.key_validity is None and only_values.headers is None


@pytest.mark.parametrize("key", [b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"h\xe2\x82",
                                 b"\xe2\x82\xac", b"\xf0\x9f\x98\x80", "é".encode(), b"plain"])
def test_header_keys_must_be_strict_utf8(key):
    recs = _kafka_records.encode_records([(0, None, b"v", [(key, b"1")], 5)], 0, 5)
    try:
        expected = key.decode("utf-8")
    except UnicodeDecodeError:
        with pytest.raises(KafkaProtocolError, match="UTF-8"):
            _kafka_records.decode_records(recs, 1, 5)
        return
    assert _kafka_records.decode_records(recs, 1, 5).to_lists()[2] == [[(expected, b"1")]]


def test_columns_append_and_read_back(tmp_path):
    import txmq
    msgs = [(i, None if i % 3 else b"k%d" % i, b"v%d" % i, [("h", b"%d" % i)] if i % 2 else None, 7_000 + 11 * i)
            for i in range(50)]
    (b,) = records.decode_produce(records.encode_data_batch(_Info(0, 50, False, -1, -1, -1), msgs), 1 << 20)
    with txmq.Broker(tmp_path / "d", fsync="never", control_socket=False) as broker:
        broker.create_topic("t", 1)
        base = broker.producer("t").append_spec(b.spec(), 0)
        sub = broker.subscribe("t", "s", initial_position="earliest")
        got = sub.receive_many(100, timeout=1.0)
        assert base == 0 and len(got) == 50
        assert [(m.key, m.value, m.headers, m.event_time) for m in got] == \
            [(k, v, h or [], ts) for _, k, v, h, ts in msgs]


def test_from_columns_refuses_malformed_buffers():
    from txmq._batch import BatchSpec
    from txmq.errors import InvalidMessageError
    offs = struct.pack("<3i", 0, 2, 3)
    assert BatchSpec.from_columns(2, b"abc", offs).count == 2
    for bad in (struct.pack("<3i", 0, 2, 4), struct.pack("<3i", 1, 2, 3), struct.pack("<3i", 0, 3, 2),
                struct.pack("<2i", 0, 3)):
        with pytest.raises(InvalidMessageError):
            BatchSpec.from_columns(2, b"abc", bad)
    with pytest.raises(InvalidMessageError, match="header"):
        BatchSpec.from_columns(2, b"abc", offs, headers=b"\x05\x00h", header_offsets=struct.pack("<3i", 0, 0, 3))
    with pytest.raises(InvalidMessageError, match="key_validity"):
        BatchSpec.from_columns(2, b"abc", offs, b"k", struct.pack("<3i", 0, 1, 1), b"")
    with pytest.raises(InvalidMessageError, match="event_deltas"):
        BatchSpec.from_columns(2, b"abc", offs, event_deltas=b"\0" * 4)


class _Info:
    """The BatchInfo fields encode_data_batch reads."""
    def __init__(self, base, count, transactional, pid, epoch, seq, publish_time=5):
        self.base_offset, self.count, self.is_transactional = base, count, transactional
        self.producer_id, self.producer_epoch, self.base_sequence = pid, epoch, seq
        self.publish_time = publish_time


def test_encoded_batches_read_by_kafka_python():
    msgs = [(100 + i, None if i == 1 else b"k%d" % i, b"v%d" % i, [("a", b"1")] if i == 2 else None,
             1_000 + 3 * i) for i in range(4)]
    raw = records.encode_data_batch(_Info(100, 4, True, 9, 2, 77), msgs)
    batch = kafka_records.DefaultRecordBatch(raw)
    assert batch.validate_crc()
    assert (batch.base_offset, batch.producer_id, batch.producer_epoch, batch.base_sequence) == (100, 9, 2, 77)
    assert batch.is_transactional and not batch.is_control_batch
    got = [(r.offset, r.key, r.value, list(r.headers), r.timestamp) for r in batch]
    assert got == [(100, b"k0", b"v0", [], 1000), (101, None, b"v1", [], 1003),
                   (102, b"k2", b"v2", [("a", b"1")], 1006), (103, b"k3", b"v3", [], 1009)]
    marker = records.encode_marker(_Info(104, 1, True, 9, 2, -1), commit=False)
    m = kafka_records.DefaultRecordBatch(marker)
    assert m.validate_crc() and m.is_control_batch and m.is_transactional and m.base_offset == 104
    (rec,) = list(m)
    assert rec.key == b"\x00\x00\x00\x00"                # version 0, type 0: ABORT


def test_stored_batches_encoded_straight_from_the_log_read_by_kafka_python(tmp_path):
    import txmq
    with txmq.Broker(tmp_path / "d", fsync="never", control_socket=False) as broker:
        broker.create_topic("t", 1)
        prod = broker.producer("t")
        prod.send(b"first", partition=0)
        keys = [None if i % 3 else b"k%d" % i for i in range(40)]
        headers = [[("h", b"%d" % i), ("n", None)] if i % 2 else None for i in range(40)]
        stamps = [5_000 - 7 * i if i % 5 else 5_000 + i for i in range(40)]     # not in order
        prod.send_batch([b"v%d" % i for i in range(40)], keys, headers, stamps, partition=0)
        p = broker._partition("t", 0)
        seg, pos = p.segment_for(1)
        w = _kafka.Writer()
        _kafka.write_bytes(w, b"prefix")
        n = _kafka_records.encode_stored_batch(w, seg.batch_bytes(pos))
        raw = w.getvalue()
        assert raw[:6] == b"prefix" and len(raw) == 6 + n
        batch = kafka_records.DefaultRecordBatch(raw[6:])
        assert batch.validate_crc() and batch.base_offset == 1 and not batch.is_transactional
        assert (batch.producer_id, batch.base_sequence) == (prod.producer_id, 1)
        got = [(r.offset, r.key, r.value, list(r.headers), r.timestamp) for r in batch]
        assert got == [(1 + i, keys[i], b"v%d" % i, headers[i] or [], stamps[i]) for i in range(40)]


def test_batch_checks_refuse_bad_crc_magic_and_counts():
    raw = bytearray(_kafka_python_batch())
    good = bytes(raw)
    raw[-1] ^= 0xFF
    with pytest.raises(KafkaProtocolError, match="CRC"):
        records.decode_produce(bytes(raw), 1 << 20)
    bad_magic = good[:16] + b"\x01" + good[17:]
    with pytest.raises(KafkaProtocolError, match="magic"):
        records.decode_produce(bad_magic, 1 << 20)
    with pytest.raises(KafkaProtocolError):
        records.decode_produce(good[:-3], 1 << 20)


@pytest.mark.parametrize("codec", [records.GZIP, records.SNAPPY, records.LZ4, records.ZSTD])
def test_decompression_is_bounded(codec):
    """A batch that decompresses past the limit is refused in every codec
    (a zip bomb), and one that fits, however far past its first guess of
    the size, comes back whole."""
    bomb = records.compress(codec, b"\0" * (4 << 20))
    with pytest.raises(KafkaProtocolError, match="past"):
        records.decompress(codec, bomb, 1 << 20)
    fits = b"ab" * (300 << 10)                            # 600 KiB: over 8x its compressed size
    assert records.decompress(codec, records.compress(codec, fits), 1 << 20) == fits
    assert records.decompress(codec, records.compress(codec, fits), len(fits)) == fits
    with pytest.raises(KafkaProtocolError, match="past"):
        records.decompress(codec, records.compress(codec, fits), len(fits) - 1)


def test_xerial_snappy_blocks_are_bounded_before_they_are_decompressed():
    import cramjam
    block = bytes(cramjam.snappy.compress_raw(b"\0" * (1 << 20)))
    framed = records.XERIAL_MAGIC + bytes(records.XERIAL_HEADER_BYTES - len(records.XERIAL_MAGIC))
    framed += b"".join(len(block).to_bytes(4, "big") + block for _ in range(3))
    assert len(records.decompress(records.SNAPPY, framed, 3 << 20)) == 3 << 20
    with pytest.raises(KafkaProtocolError, match="past"):
        records.decompress(records.SNAPPY, framed, (2 << 20) + 5)


# -- fuzz ------------------------------------------------------------------------------------

def _valid_frames():
    frames = [API_VERSIONS_V3]
    for key in sorted(protocol.SUPPORTED_KEYS):
        lo, hi = protocol.SUPPORTED_KEYS[key]
        for v in (lo, hi):
            w = _kafka.Writer()
            _kafka.write_i16(w, key)
            _kafka.write_i16(w, v)
            _kafka.write_i32(w, 7)
            _kafka.write_i16(w, 3)
            head = w.getvalue() + b"abc" + (b"\x00" if schema.is_flexible(key, v) else b"")
            body = _kafka.Writer()
            _kafka.write_struct(body, {}, schema.request(key, v))
            frames.append(head + body.getvalue())
    return frames


VALID = _valid_frames()


def _decode_or_protocol_error(frame: bytes) -> None:
    try:
        req = protocol.decode_request(frame)
    except KafkaProtocolError:
        return
    assert isinstance(req, protocol.Request)
    if req.body is None:                  # not served: the answer must still encode
        assert protocol.unsupported_response(req)[:4]


def test_valid_frames_decode():
    for f in VALID:
        assert protocol.decode_request(f).body is not None


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_fuzz_random_frames(frame):
    _decode_or_protocol_error(frame)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(VALID), st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=6),
       st.integers(0, 400))
def test_fuzz_mutated_frames(frame, flips, cut):
    raw = bytearray(frame)
    for pos, byte in flips:
        if raw:
            raw[pos % len(raw)] = byte
    _decode_or_protocol_error(bytes(raw[:len(raw) - cut % (len(raw) + 1)]))


def test_fuzz_mutated_record_batches():
    rng = random.Random(17)
    seeds = [_kafka_python_batch(codec=c) for c in range(5)] + [_kafka_python_batch(n=1)]
    for _ in range(4000):
        raw = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        if rng.random() < 0.3:
            raw = raw[:rng.randrange(len(raw))]
        # CRC checks catch most flips; fix the CRC up so record parsing is fuzzed too.
        if rng.random() < 0.5 and len(raw) > 61:
            crc = _kafka_crc(bytes(raw[21:]))
            raw[17:21] = crc.to_bytes(4, "big")
        try:
            batches = records.decode_produce(bytes(raw), 1 << 20)
        except KafkaProtocolError:
            continue
        for b in batches:                   # columns that decode are always a valid txmq batch
            assert b.spec().count == b.count


def _kafka_crc(data: bytes) -> int:
    from txmq._crc32c import crc32c_of
    return crc32c_of(data)


def test_unknown_key_and_version_answers():
    unknown = protocol.Request(9999, 0, 5, None, None)
    frame = protocol.unsupported_response(unknown)
    assert struct.unpack(">iih", frame) == (6, 5, Error.UNSUPPORTED_VERSION)
    too_new = protocol.Request(18, 99, 6, None, None)
    frame = protocol.unsupported_response(too_new)
    body = _kafka.read_struct(_kafka.Reader(frame, 8), schema.response(18, 0))
    assert body["error_code"] == Error.UNSUPPORTED_VERSION and body["api_keys"]
    old_fetch = protocol.Request(1, 0, 7, None, None)       # Fetch v0: defined by Kafka, not served
    frame = protocol.unsupported_response(old_fetch)
    assert struct.unpack(">i", frame[4:8]) == (7,)


def test_no_codec_writes_past_the_limit(monkeypatch):
    """The buffers handed to the decompressor never exceed ``limit + 1``
    bytes, and no whole-output call is made: the bomb is never written whole."""
    import cramjam
    sizes = []

    class Spy:
        def __init__(self, real):
            self.real = real

        def decompress_into(self, data, buf):
            sizes.append(len(buf))
            return self.real.decompress_into(data, buf)

        def decompress(self, data):
            raise AssertionError("a whole-output decompress")

    bombs = {codec: records.compress(codec, b"\0" * (64 << 20)) for codec in (records.LZ4, records.ZSTD)}
    spy = type("cj", (), {"lz4": Spy(cramjam.lz4), "zstd": Spy(cramjam.zstd), "snappy": cramjam.snappy})
    monkeypatch.setattr(records, "_cramjam", lambda: spy)
    for codec, bomb in bombs.items():
        with pytest.raises(KafkaProtocolError, match="past"):
            records.decompress(codec, bomb, 1 << 20)
    assert sizes and max(sizes) == (1 << 20) + 1


def test_a_missing_tagged_field_gets_a_default_of_its_own():
    """Two bodies decoded without a tagged array / struct field get their
    own empty list / dict: filling one does not change the other (or the
    schema's default)."""
    compiled = ((), {0: ("items", int(_kafka.Kind.K_ARRAY), int(_kafka.Kind.K_INT32), False, True, 0, [], None),
                     1: ("info", int(_kafka.Kind.K_STRUCT), 0, False, True, 1, {}, ((), {}))})
    first = _kafka.read_struct(_kafka.Reader(b"\x00"), compiled)
    first["items"].append(1)
    first["info"]["x"] = 1
    second = _kafka.read_struct(_kafka.Reader(b"\x00"), compiled)
    assert second == {"items": [], "info": {}}
    assert compiled[1][0][6] == [] and compiled[1][1][6] == {}
