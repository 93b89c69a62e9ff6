"""What a Kafka client produces reads back through txmq's other paths,
beside the running server: ``txmq consume`` (the CLI, read-only) and the
Spark ``txmq`` source, with keys, headers and timestamps intact
(docs/KAFKA.md, the mapping)."""

import json
import subprocess
import sys

import pytest

from spark_fixtures import spark  # noqa: F401  (pytest fixture)
from kafka_support import kafka  # noqa: F401 (fixture)

confluent_kafka = pytest.importorskip("confluent_kafka")

T0 = 1_700_000_123_456          # ms
SENT = [
    # key, value, headers, timestamp
    (b"k0", b"first", [("h1", b"v1"), ("h2", b"")], T0),
    (None, b"no key, no headers", None, T0 + 5),
    (b"k2", b"\xff binary \x00", [("dup", b"a"), ("dup", b"b")], T0 - 1_000),
]


def _produce(bootstrap: str) -> None:
    p = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all"})
    for key, value, headers, ts in SENT:
        p.produce("orders", key=key, value=value, headers=headers, timestamp=ts, partition=0)
    assert p.flush(10) == 0


def test_kafka_messages_read_by_txmq_consume(kafka):
    kafka.broker.create_topic("orders", 1)
    _produce(kafka.bootstrap)
    out = subprocess.run([sys.executable, "-m", "txmq.cli", "consume", str(kafka.path), "orders", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = [json.loads(line) for line in out.stdout.splitlines()]
    assert [m["offset"] for m in got] == [0, 1, 2]
    assert [(m.get("key"), m.get("value"), m.get("value_base64")) for m in got] == [
        ("k0", "first", None), (None, "no key, no headers", None), ("k2", None, "/yBiaW5hcnkgAA==")]
    assert [m.get("headers") for m in got] == [[["h1", "v1"], ["h2", ""]], None, [["dup", "a"], ["dup", "b"]]]
    assert [m["event_time"] for m in got] == [ts for *_, ts in SENT]


def test_kafka_messages_read_by_spark(kafka, spark):  # noqa: F811
    kafka.broker.create_topic("orders", 1)
    _produce(kafka.bootstrap)
    df = (spark.read.format("txmq").option("path", str(kafka.path)).option("subscribe", "orders")
          .option("includeHeaders", "true").load())
    rows = df.selectExpr("offset", "key", "value", "headers", "unix_millis(timestamp) AS ts",
                         "timestampType").orderBy("offset").collect()
    assert [(r.offset, None if r.key is None else bytes(r.key), bytes(r.value),
             [(h.key, bytes(h.value)) for h in r.headers], r.ts, r.timestampType) for r in rows] == [
        (i, key, value, headers or [], ts, 0) for i, (key, value, headers, ts) in enumerate(SENT)]
