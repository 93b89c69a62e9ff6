"""The Kafka front end: confluent-kafka (librdkafka, idempotent, batched by
the client) producing 100 B messages into ``Broker.serve_kafka`` against
txmq's own ``send_batch`` of the same messages, fsync="never", measured in
the same run (conftest.COMPARISONS)."""

from __future__ import annotations

import pytest

import conftest
import txmq

confluent_kafka = pytest.importorskip("confluent_kafka")

MESSAGES = 50_000
VALUE = b"x" * 100
GROUP = "confluent-kafka 100B idempotent into serve_kafka vs send_batch, never"
conftest.add_comparison(GROUP, conftest.Comparison(
    GROUP, "kafka produce", "send_batch", 0.3, ">=", note="goal >= 0.3x txmq's own send_batch of the same messages"))


@pytest.fixture
def served(tmp_path):
    b = txmq.Broker(tmp_path / "data", fsync="never", control_socket=False)
    b.create_topic("t", 1)
    server = b.serve_kafka("127.0.0.1", 0)
    yield b, f"127.0.0.1:{server.port}"
    b.close()


def test_kafka_produce(served, measure):
    _, bootstrap = served
    p = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all",
                                  "linger.ms": 5, "batch.num.messages": 10_000})
    p.produce("t", VALUE)
    assert p.flush(10) == 0                       # connected, metadata known

    def round_():
        for _ in range(MESSAGES):
            try:
                p.produce("t", VALUE)
            except BufferError:
                p.poll(0.01)
                p.produce("t", VALUE)
        assert p.flush(30) == 0

    measure(GROUP, "kafka produce", round_, ops_per_round=MESSAGES, unit="msg", rounds=5, warmup=1)


def test_send_batch(served, measure):
    b, _ = served
    prod = b.producer("t")
    values = [VALUE] * 10_000

    def round_():
        for _ in range(MESSAGES // len(values)):
            prod.send_batch(values, partition=0)

    measure(GROUP, "send_batch", round_, ops_per_round=MESSAGES, unit="msg", rounds=5, warmup=1)
