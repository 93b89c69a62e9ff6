"""Bad input at the Kafka server: oversized, malformed and random frames,
unknown API keys and versions, silent and idle connections. Each gets its
documented answer or a closed connection; the server keeps serving every
other client and loses nothing it acknowledged."""

import random
import socket
import struct
import time

import pytest

from kafka_support import RawClient, kafka, wait_until  # noqa: F401 (fixture)
from txmq import _kafka
from txmq.kafka import protocol, schema, serve_kafka
from txmq.kafka.protocol import Error

confluent_kafka = pytest.importorskip("confluent_kafka")


def _still_serves(kafka, value: bytes) -> None:
    p = confluent_kafka.Producer({"bootstrap.servers": kafka.bootstrap, "acks": "all"})
    p.produce("alive", value=value)
    assert p.flush(10) == 0


def test_unknown_key_and_wrong_versions_answer_unsupported(kafka):
    with RawClient(kafka.server.port) as rc:
        rc.send_frame(struct.pack(">hhih", 999, 0, 41, -1))
        raw = rc.read_frame()
        assert struct.unpack(">ih", raw) == (41, Error.UNSUPPORTED_VERSION)
        rc.send_frame(struct.pack(">hhih", 18, 77, 42, -1))        # ApiVersions from the future
        raw = rc.read_frame()
        body = _kafka.read_struct(_kafka.Reader(raw, 4), schema.response(18, 0))
        assert body["error_code"] == Error.UNSUPPORTED_VERSION
        assert {a["api_key"] for a in body["api_keys"]} == set(protocol.SUPPORTED_KEYS)
        rc.send_frame(struct.pack(">hhih", 1, 0, 43, -1))         # Fetch v0: not served
        raw = rc.read_frame()
        assert struct.unpack(">i", raw[:4]) == (43,)
        # ... and the connection still works.
        assert rc.request(18, 2, {})["error_code"] == 0


def test_oversized_and_malformed_frames_close_only_that_connection(kafka, caplog):
    _still_serves(kafka, b"before")
    with RawClient(kafka.server.port) as big:
        big.sock.sendall(struct.pack(">i", kafka.server.max_request_bytes + 1))
        assert big.closed_by_server()
    with RawClient(kafka.server.port) as neg:
        neg.sock.sendall(struct.pack(">i", -5))
        assert neg.closed_by_server()
    with RawClient(kafka.server.port) as bad:
        bad.send_frame(struct.pack(">hhih", 3, 9, 1, -1) + b"\x00\xff\xff\xff\xff\xff")   # Metadata, broken body
        assert bad.closed_by_server()
    with RawClient(kafka.server.port) as short:
        short.sock.sendall(struct.pack(">i", 100) + b"\x00" * 10)     # then silence: it waits, then we close
    _still_serves(kafka, b"after")
    import txmq.readonly
    assert [m.value for m in txmq.readonly.open(kafka.path).read("alive", 0, 0)] == \
        [b"before", b"after"]
    lines = [r for r in caplog.records if r.name == "txmq.kafka" and "connection closed" in r.getMessage()]
    assert lines and all(r.exc_info is None for r in lines)           # one line each, no traceback


def test_corrupt_record_batch_is_refused_per_partition(kafka):
    from kafka.record.default_records import DefaultRecordBatchBuilder
    kafka.broker.create_topic("c")
    b = DefaultRecordBatchBuilder(2, 0, False, -1, -1, -1, 1 << 20)
    b.append(0, 1, None, b"x", [])
    raw = bytearray(b.build())
    raw[-1] ^= 1
    with RawClient(kafka.server.port) as rc:
        body = {"transactional_id": None, "acks": -1, "timeout_ms": 1000, "topic_data": [
            {"name": "c", "partition_data": [{"index": 0, "records": bytes(raw)}, {"index": 5, "records": b""}]}]}
        parts = rc.request(0, 8, body)["responses"][0]["partition_responses"]
    assert [(p["index"], p["error_code"]) for p in parts] == [(0, Error.CORRUPT_MESSAGE),
                                                              (5, Error.UNKNOWN_TOPIC_OR_PARTITION)]
    assert kafka.broker.high_watermark("c", 0) == 0


def test_silent_and_idle_connections(tmp_path):
    import txmq
    b = txmq.Broker(tmp_path / "d", fsync="never", control_socket=False)
    try:
        s = serve_kafka(b, "127.0.0.1", 0, idle_timeout=1.0)
        idle = [socket.create_connection(("127.0.0.1", s.port), timeout=5) for _ in range(1000)]
        bootstrap = f"127.0.0.1:{s.port}"
        p = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "acks": "all"})
        p.produce("busy", value=b"served beside 1000 idle connections")
        assert p.flush(10) == 0
        time.sleep(1.5)
        assert wait_until(lambda: len(s._connections) <= 2, 10)      # the idle ones are closed
        for sock in idle[:20]:
            sock.settimeout(2)
            assert sock.recv(1) == b""
        for sock in idle:
            sock.close()
        assert b.high_watermark("busy", 0) == 1
    finally:
        b.close()


def test_fuzz_live_server_with_random_and_mutated_frames(kafka):
    """Random and mutated frames at a live server: every connection gets
    an answer or is closed, and afterwards a real client still works and
    finds everything acknowledged before."""
    _still_serves(kafka, b"acked")
    rng = random.Random(1717)
    seeds = []
    with RawClient(kafka.server.port) as rc:
        for key in sorted(protocol.SUPPORTED_KEYS):
            lo, hi = protocol.SUPPORTED_KEYS[key]
            seeds.append(rc.frame(key, rng.randint(lo, hi), {}))
    for i in range(300):
        if rng.random() < 0.3:
            payload = bytes(rng.randrange(256) for _ in range(rng.randint(8, 80)))
        else:
            payload = bytearray(rng.choice(seeds))
            for _ in range(rng.randint(1, 5)):
                payload[rng.randrange(len(payload))] = rng.randrange(256)
            payload = bytes(payload)
        payload = payload[:2] + b"\x00" + payload[3:]       # versions below 256, so most frames reach a body decoder
        with RawClient(kafka.server.port) as rc:
            rc.sock.settimeout(5)
            rc.send_frame(payload)
            try:
                rc.read_frame()                              # an answer ...
            except (ConnectionError, socket.timeout, OSError):
                pass                                         # ... or a closed connection (or a wait)
    _still_serves(kafka, b"after fuzz")
    import txmq.readonly
    values = [m.value for m in txmq.readonly.open(kafka.path).read("alive", 0, 0)]
    assert values[0] == b"acked" and values[-1] == b"after fuzz"
