"""The Kafka front end: confluent-kafka (librdkafka, idempotent, acks=all,
batched by the client) producing 100 B messages into ``txmq.kafka.serve_kafka``
against txmq's own ``send_batch`` of the same messages, fsync="never",
measured in the same run (conftest.COMPARISONS).

A third side, "client alone", times the same ``produce()`` calls into
librdkafka's queue with no broker behind it (nothing is sent; the queue is
purged after each round, untimed): the most the Python client can hand
over, so the table shows how much of the gap is the client's and how much
the server's."""

from __future__ import annotations

import pytest

import conftest
import txmq
from txmq.kafka import serve_kafka

confluent_kafka = pytest.importorskip("confluent_kafka")

MESSAGES = 50_000
VALUE = b"x" * 100
ROUNDS = 15
GROUP = "confluent-kafka 100B idempotent into serve_kafka vs send_batch, never"
conftest.add_comparison(
    GROUP,
    conftest.Comparison(GROUP, "kafka produce", "send_batch", 0.3, ">=",
                        note="goal >= 0.3x txmq's own send_batch of the same messages"),
    conftest.Comparison(GROUP + " (vs the client alone)", "kafka produce", "client alone", None, ">=",
                        note="information: the produce() calls with no broker are the ceiling"))


@pytest.fixture
def served(tmp_path):
    b = txmq.Broker(tmp_path / "data", fsync="never", control_socket=False)
    b.create_topic("t", 1)
    server = serve_kafka(b, "127.0.0.1", 0)
    yield b, f"127.0.0.1:{server.port}"
    b.close()


def _produce_all(p) -> None:
    for _ in range(MESSAGES):
        try:
            p.produce("t", VALUE)
        except BufferError:
            p.poll(0.01)
            p.produce("t", VALUE)


def test_kafka_produce(served, measure):
    _, bootstrap = served
    p = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all",
                                  "linger.ms": 5, "batch.num.messages": 10_000})
    p.produce("t", VALUE)
    assert p.flush(10) == 0                       # connected, metadata known

    def round_():
        _produce_all(p)
        assert p.flush(30) == 0

    measure(GROUP, "kafka produce", round_, ops_per_round=MESSAGES, unit="msg", rounds=ROUNDS, warmup=2)


def test_client_alone(measure):
    # A port nothing listens on: produce() only queues. The queue limits are
    # raised so a round never blocks on a full queue.
    p = confluent_kafka.Producer({"bootstrap.servers": "127.0.0.1:1", "enable.idempotence": True, "acks": "all",
                                  "linger.ms": 5, "batch.num.messages": 10_000,
                                  "queue.buffering.max.messages": 2 * MESSAGES, "log_level": 0})

    def purge():
        p.purge()
        p.poll(0)
        return (), {}

    measure(GROUP, "client alone", lambda: _produce_all(p), ops_per_round=MESSAGES, unit="msg", rounds=ROUNDS,
            warmup=2, setup=purge)
    p.purge()
    p.flush(0)


def test_send_batch(served, measure):
    b, _ = served
    prod = b.producer("t")
    values = [VALUE] * 10_000

    def round_():
        for _ in range(MESSAGES // len(values)):
            prod.send_batch(values, partition=0)

    measure(GROUP, "send_batch", round_, ops_per_round=MESSAGES, unit="msg", rounds=ROUNDS, warmup=2)
