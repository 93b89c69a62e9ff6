"""Kafka transactions through real clients on txmq's transactional
producers: commit and abort across partitions and topics, read_committed
consumers never see aborted data (read_uncommitted ones do), offsets sent
to a transaction ride in it, an older instance of a transactional id is
fenced, and Kafka transactions and the Python API see each other."""

import time

import pytest

import txmq
import txmq.readonly
from kafka_support import confluent_consume, kafka, wait_until  # noqa: F401 (fixture)
from txmq.errors import ProducerFencedError

confluent_kafka = pytest.importorskip("confluent_kafka")
kafka_python = pytest.importorskip("kafka")


def _tx_producer(bootstrap, tid, **extra):
    conf = {"bootstrap.servers": bootstrap, "transactional.id": tid, "linger.ms": 1}
    conf.update(extra)
    p = confluent_kafka.Producer(conf)
    p.init_transactions(10)
    return p


def test_commit_and_abort_multi_partition_multi_topic(kafka):
    kafka.broker.create_topic("a", partitions=3)
    kafka.broker.create_topic("b", partitions=2)
    p = _tx_producer(kafka.bootstrap, "t-1")
    expected_committed = set()
    for round_ in range(6):
        p.begin_transaction()
        values = [b"r%d-%s-%d" % (round_, t.encode(), i) for t in ("a", "b") for i in range(5)]
        for v in values:
            topic = v.split(b"-")[1].decode()
            p.produce(topic, value=v, partition=int(v[-1:]) % (3 if topic == "a" else 2))
        if round_ % 2:
            p.flush(10)
            p.abort_transaction(10)
        else:
            p.commit_transaction(10)
            expected_committed.update(values)
    everything = {b"r%d-%s-%d" % (r, t.encode(), i) for r in range(6) for t in ("a", "b") for i in range(5)}
    rc = {m.value() for m in confluent_consume(kafka.bootstrap, ["a", "b"], "rc", want=len(expected_committed))}
    ru = {m.value() for m in confluent_consume(kafka.bootstrap, ["a", "b"], "ru", isolation="read_uncommitted",
                                               want=len(everything))}
    assert rc == expected_committed
    assert ru == everything
    # kafka-python's read_committed consumer, and txmq's own reader, agree.
    kc = kafka_python.KafkaConsumer("a", "b", bootstrap_servers=kafka.bootstrap, isolation_level="read_committed",
                                    auto_offset_reset="earliest", consumer_timeout_ms=3000)
    assert {r.value for r in kc} == expected_committed
    kc.close()
    ro = txmq.readonly.open(kafka.path)
    native = {m.value for t, n in (("a", 3), ("b", 2)) for part in range(n) for m in ro.read(t, part, 0)}
    assert native == expected_committed
    # The broker lists every aborted transaction in its .txnindex, per partition.
    assert all(kafka.broker.aborted_transactions("a", part, 0) for part in range(3))


def test_open_transaction_holds_read_committed_back(kafka):
    kafka.broker.create_topic("lso")
    plain = kafka.broker.producer("lso")
    plain.send(b"before")
    p = _tx_producer(kafka.bootstrap, "t-open")
    p.begin_transaction()
    p.produce("lso", value=b"pending")
    p.flush(10)
    plain.send(b"after-open")                      # invisible read_committed until the transaction ends
    rc = confluent_consume(kafka.bootstrap, ["lso"], "g1", seconds=3)
    assert [m.value() for m in rc] == [b"before"]
    assert kafka.broker.last_stable_offset("lso", 0) == 1
    p.commit_transaction(10)
    rc = confluent_consume(kafka.bootstrap, ["lso"], "g2", want=3)
    assert [m.value() for m in rc] == [b"before", b"pending", b"after-open"]


def test_send_offsets_to_transaction_commits_with_outputs(kafka):
    kafka.broker.create_topic("in", partitions=2)
    kafka.broker.create_topic("out")
    src = kafka.broker.producer("in")
    for i in range(10):
        src.send(b"m%d" % i, partition=i % 2)
    c = confluent_kafka.Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": "etl",
                                  "auto.offset.reset": "earliest", "enable.auto.commit": False,
                                  "isolation.level": "read_committed"})
    c.subscribe(["in"])
    got = []
    deadline = time.monotonic() + 15
    while len(got) < 10 and time.monotonic() < deadline:
        m = c.poll(0.2)
        if m is not None and not m.error():
            got.append(m)
    assert len(got) == 10
    p = _tx_producer(kafka.bootstrap, "etl-1")

    def position():
        return [confluent_kafka.TopicPartition("in", part, max(m.offset() for m in got if m.partition() == part) + 1)
                for part in (0, 1)]

    # Aborted: neither the outputs nor the offsets.
    p.begin_transaction()
    for m in got:
        p.produce("out", value=m.value().upper())
    p.send_offsets_to_transaction(position(), c.consumer_group_metadata(), 10)
    p.abort_transaction(10)
    subs = kafka.broker.stats()["topics"]["in"]["subscriptions"]
    assert [x["mark_delete"] for x in subs["etl"]["partitions"]] == [0, 0]
    # Committed: both, atomically, as one txmq transaction.
    p.begin_transaction()
    for m in got:
        p.produce("out", value=m.value().upper())
    p.send_offsets_to_transaction(position(), c.consumer_group_metadata(), 10)
    p.commit_transaction(10)
    committed = c.committed([confluent_kafka.TopicPartition("in", 0), confluent_kafka.TopicPartition("in", 1)], 10)
    assert [tp.offset for tp in committed] == [5, 5]
    c.close()
    subs = kafka.broker.stats()["topics"]["in"]["subscriptions"]
    assert [x["mark_delete"] for x in subs["etl"]["partitions"]] == [5, 5]
    assert sorted(m.value for m in txmq.readonly.open(kafka.path).read("out", 0, 0)) == \
        sorted(b"M%d" % i for i in range(10))


def test_kafka_reads_keep_offset_order_beside_an_out_of_order_subscription(kafka):
    """An out-of-order subscription of the Python API reads past an open
    transaction; the Kafka front end has no such mode and keeps Kafka's: a
    read_committed consumer stops at the last stable offset, the group
    named like that subscription reads its mark-delete (below the open
    transaction) as its committed offset, and a TxnOffsetCommit to it is
    refused with INVALID_GROUP_ID (abortable), not with a closed connection."""
    b = kafka.broker
    b.create_topic("in")
    plain = b.producer("in")
    plain.send_batch([b"m%d" % i for i in range(4)])
    held = b.new_transaction(timeout=120)
    plain.send(b"held", txn=held)
    held.flush()
    plain.send(b"after")
    audit = b.subscribe("in", "audit", "shared", initial_position="earliest", allow_out_of_order_delivery=True)
    got = audit.receive_many(10, timeout=1.0)
    assert [m.value for m in got] == [b"m0", b"m1", b"m2", b"m3", b"after"]
    audit.ack(got)
    rc = confluent_consume(kafka.bootstrap, ["in"], "g-rc", seconds=3)
    assert [m.value() for m in rc] == [b"m0", b"m1", b"m2", b"m3"]
    c = confluent_kafka.Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": "audit",
                                  "auto.offset.reset": "earliest", "enable.auto.commit": False,
                                  "isolation.level": "read_committed"})
    assert [tp.offset for tp in c.committed([confluent_kafka.TopicPartition("in", 0)], 10)] == [4]
    p = _tx_producer(kafka.bootstrap, "audit-writer")
    p.begin_transaction()
    with pytest.raises(confluent_kafka.KafkaException) as e:
        p.send_offsets_to_transaction([confluent_kafka.TopicPartition("in", 0, 6)], c.consumer_group_metadata(), 10)
    assert e.value.args[0].code() == confluent_kafka.KafkaError.INVALID_GROUP_ID
    assert e.value.args[0].txn_requires_abort()
    p.abort_transaction(10)
    c.close()
    held.commit()
    assert [m.value for m in audit.receive_many(10, timeout=1.0)] == [b"held"]


def test_older_instance_is_fenced_and_its_transaction_aborted(kafka):
    kafka.broker.create_topic("f")
    old = _tx_producer(kafka.bootstrap, "zombie")
    old.begin_transaction()
    old.produce("f", value=b"from the old instance")
    old.flush(10)
    new = _tx_producer(kafka.bootstrap, "zombie")              # fences old, aborts its transaction
    with pytest.raises(confluent_kafka.KafkaException) as e:
        old.commit_transaction(10)
    assert e.value.args[0].fatal() or e.value.args[0].code() in (
        confluent_kafka.KafkaError._FENCED, confluent_kafka.KafkaError.PRODUCER_FENCED,
        confluent_kafka.KafkaError.INVALID_PRODUCER_EPOCH)
    new.begin_transaction()
    new.produce("f", value=b"from the new instance")
    new.commit_transaction(10)
    rc = confluent_consume(kafka.bootstrap, ["f"], "g", want=1, seconds=5)
    assert [m.value() for m in rc] == [b"from the new instance"]
    # The same id opened from the Python API fences the Kafka client in turn.
    tp = kafka.broker.transactional_producer("zombie")
    new.begin_transaction()
    new.produce("f", value=b"late")
    with pytest.raises(confluent_kafka.KafkaException):
        new.commit_transaction(10)
    with tp.begin() as txn:
        tp.producer("f").send(b"from python", txn=txn)
    # ... and a Kafka client opening it fences the Python instance.
    third = _tx_producer(kafka.bootstrap, "zombie")
    with pytest.raises(ProducerFencedError):
        tp.begin()
    third.begin_transaction()
    third.produce("f", value=b"third")
    third.commit_transaction(10)
    rc = confluent_consume(kafka.bootstrap, ["f"], "g2", want=3, seconds=8)
    assert [m.value() for m in rc] == [b"from the new instance", b"from python", b"third"]


def test_kafka_python_transactions(kafka):
    p = kafka_python.KafkaProducer(bootstrap_servers=kafka.bootstrap, transactional_id="kp-1")
    p.init_transactions()
    p.begin_transaction()
    p.send("kp", b"kept", partition=0)
    p.commit_transaction()
    p.begin_transaction()
    p.send("kp", b"dropped", partition=0)
    p.flush()
    p.abort_transaction()
    p.close()
    kc = kafka_python.KafkaConsumer("kp", bootstrap_servers=kafka.bootstrap, isolation_level="read_committed",
                                    auto_offset_reset="earliest", consumer_timeout_ms=3000)
    assert [r.value for r in kc] == [b"kept"]
    kc.close()


def test_transaction_timeout_aborts(kafka):
    p = _tx_producer(kafka.bootstrap, "slow", **{"transaction.timeout.ms": 1000})
    p.begin_transaction()
    p.produce("to", value=b"never")
    p.flush(10)
    assert wait_until(lambda: kafka.broker.stats()["transactions"]["timed_out"] >= 1, 10)
    with pytest.raises(confluent_kafka.KafkaException):
        p.commit_transaction(10)
    rc = confluent_consume(kafka.bootstrap, ["to"], "g", seconds=2)
    assert rc == []
    assert kafka.broker.last_stable_offset("to", 0) == kafka.broker.high_watermark("to", 0)
