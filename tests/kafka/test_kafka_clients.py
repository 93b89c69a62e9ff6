"""Real Kafka clients (confluent-kafka / librdkafka, kafka-python, aiokafka)
against ``txmq.kafka.serve_kafka``: produce and consume both ways with keys,
headers and timestamps, Kafka offsets equal to txmq offsets, every
compression codec, idempotent acks=all, admin APIs, ListOffsets, and the
server's lifecycle."""

import asyncio
import subprocess
import sys
import time

import pytest

import txmq
import txmq.readonly
from txmq.kafka import serve_kafka
from kafka_support import RawClient, confluent_consume, kafka, listening, wait_until  # noqa: F401 (fixture)

confluent_kafka = pytest.importorskip("confluent_kafka")
kafka_python = pytest.importorskip("kafka")
aiokafka = pytest.importorskip("aiokafka")


def test_confluent_produce_read_through_python_api(kafka):
    kafka.broker.create_topic("orders", partitions=3)
    # murmur2_random: the Java client's partitioner (librdkafka's default is CRC32-based)
    p = confluent_kafka.Producer({"bootstrap.servers": kafka.bootstrap, "linger.ms": 5,
                                  "partitioner": "murmur2_random"})
    for i in range(30):
        p.produce("orders", value=b"v%d" % i, key=b"k%d" % (i % 7), headers=[("h", b"%d" % i), ("n", None)],
                  timestamp=1_700_000_000_000 + i)
    assert p.flush(10) == 0
    c = kafka.broker.subscribe("orders", "check", initial_position="earliest")
    ms = c.receive_many(100, timeout=2.0)
    assert len(ms) == 30
    by_value = {m.value: m for m in ms}
    for i in range(30):
        m = by_value[b"v%d" % i]
        assert m.key == b"k%d" % (i % 7)
        assert m.headers == [("h", b"%d" % i), ("n", None)]
        assert m.event_time == 1_700_000_000_000 + i
        # Keys land where the Java client's partitioner puts them, and so where txmq's does.
        assert m.message_id.partition == kafka.broker.producer("orders")._partition(m.key, None).index


def test_python_api_produce_read_by_confluent_with_equal_offsets(kafka):
    kafka.broker.create_topic("events", partitions=2)
    prod = kafka.broker.producer("events")
    sent = {}
    for i in range(20):
        mid = prod.send(b"e%d" % i, key=b"key%d" % i, headers=[("trace", b"t%d" % i)], event_time=1_600_000_000_000 + i)
        sent[b"e%d" % i] = mid
    with kafka.broker.transaction() as txn:                 # a marker takes an offset, as in Kafka
        prod.send(b"in-txn", partition=0, txn=txn)
    sent[b"in-txn"] = None
    got = confluent_consume(kafka.bootstrap, ["events"], "g", want=21)
    assert len(got) == 21
    for m in got:
        if m.value() == b"in-txn":
            continue
        mid = sent[m.value()]
        assert (m.partition(), m.offset()) == (mid.partition, mid.offset)
        i = int(m.value()[1:])
        assert m.key() == b"key%d" % i and m.headers() == [("trace", b"t%d" % i)]
        assert m.timestamp() == (confluent_kafka.TIMESTAMP_CREATE_TIME, 1_600_000_000_000 + i)


@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
def test_kafka_python_compressed_round_trip(kafka, codec):
    topic = f"c-{codec}"
    p = kafka_python.KafkaProducer(bootstrap_servers=kafka.bootstrap, compression_type=codec, linger_ms=20)
    for i in range(50):
        p.send(topic, value=b"x" * 50 + b"%d" % i, key=b"k", headers=[("c", codec.encode())], timestamp_ms=1000 + i)
    p.flush(10)
    p.close()
    ro = txmq.readonly.open(kafka.path)
    msgs = list(ro.read(topic, 0, 0, isolation="read_uncommitted"))
    assert [m.value for m in msgs] == [b"x" * 50 + b"%d" % i for i in range(50)]
    assert all(m.headers == [("c", codec.encode())] and m.key == b"k" for m in msgs)
    c = kafka_python.KafkaConsumer(topic, bootstrap_servers=kafka.bootstrap, auto_offset_reset="earliest",
                                   consumer_timeout_ms=3000, group_id=None)
    got = [(r.offset, r.value, r.timestamp) for r in c]
    c.close()
    assert got == [(i, b"x" * 50 + b"%d" % i, 1000 + i) for i in range(50)]


@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
def test_confluent_compressed_idempotent(kafka, codec):
    p = confluent_kafka.Producer({"bootstrap.servers": kafka.bootstrap, "compression.type": codec,
                                  "enable.idempotence": True, "acks": "all", "linger.ms": 10})
    for i in range(200):
        p.produce("z", value=b"%d" % i)
    assert p.flush(10) == 0
    ro = txmq.readonly.open(kafka.path)
    assert [m.value for m in ro.read("z", 0, 0)] == [b"%d" % i for i in range(200)]


def test_idempotent_acks_all_uses_the_producer_table(kafka):
    kafka.broker.create_topic("idem", partitions=2)
    p = confluent_kafka.Producer({"bootstrap.servers": kafka.bootstrap, "enable.idempotence": True,
                                  "acks": "all", "linger.ms": 2, "batch.num.messages": 10})
    delivered = []
    for i in range(500):
        p.produce("idem", value=b"%d" % i, key=b"%d" % (i % 13),
                  on_delivery=lambda err, msg: delivered.append((err, msg.partition(), msg.offset())))
        if i % 100 == 0:
            p.poll(0)
    assert p.flush(10) == 0
    assert all(err is None for err, _, _ in delivered) and len(delivered) == 500
    assert len({(pp, off) for _, pp, off in delivered}) == 500
    stats = kafka.broker.stats()["topics"]["idem"]["partitions"]
    assert sum(s["end_offset"] for s in stats) == 500
    assert all(s["producer_ids"] == 1 for s in stats)            # one Kafka producer id, in txmq's table


def test_kafka_retry_of_a_batch_appends_once(kafka):
    """A batch resent with the same producer id, epoch and sequence (a
    client's retry after a lost answer) is answered with the first
    append's offset and not appended again."""
    from kafka.record.default_records import DefaultRecordBatchBuilder
    kafka.broker.create_topic("retry")
    with RawClient(kafka.server.port) as rc:
        pid = rc.request(22, 4, {"transactional_id": None, "transaction_timeout_ms": 60000})["producer_id"]
        answers = []
        for seq in (0, 0, 2):
            b = DefaultRecordBatchBuilder(2, 0, False, pid, 0, seq, 1 << 20)
            b.append(0, 1, None, b"a", [])
            b.append(1, 1, None, b"b", [])
            body = {"transactional_id": None, "acks": -1, "timeout_ms": 1000, "topic_data": [
                {"name": "retry", "partition_data": [{"index": 0, "records": bytes(b.build())}]}]}
            part = rc.request(0, 8, body)["responses"][0]["partition_responses"][0]
            answers.append((part["error_code"], part["base_offset"]))
        b = DefaultRecordBatchBuilder(2, 0, False, pid, 0, 9, 1 << 20)
        b.append(0, 1, None, b"gap", [])
        body["topic_data"][0]["partition_data"][0]["records"] = bytes(b.build())
        gap = rc.request(0, 8, body)["responses"][0]["partition_responses"][0]["error_code"]
    assert answers == [(0, 0), (0, 0), (0, 2)]
    assert gap == 45                                               # OUT_OF_ORDER_SEQUENCE_NUMBER
    assert kafka.broker.high_watermark("retry", 0) == 4


def test_aiokafka_round_trip(kafka):
    async def run():
        p = aiokafka.AIOKafkaProducer(bootstrap_servers=kafka.bootstrap, enable_idempotence=True)
        await p.start()
        for i in range(20):
            await p.send_and_wait("aio", b"a%d" % i, key=b"k%d" % i, headers=[("x", b"y")])
        await p.stop()
        c = aiokafka.AIOKafkaConsumer("aio", bootstrap_servers=kafka.bootstrap, group_id="aio-g",
                                      auto_offset_reset="earliest", enable_auto_commit=False)
        await c.start()
        got = []
        try:
            while len(got) < 20:
                batch = await c.getmany(timeout_ms=1000)
                for recs in batch.values():
                    got.extend(recs)
            await c.commit()
        finally:
            await c.stop()
        return got
    got = asyncio.run(asyncio.wait_for(run(), 60))
    assert [(r.offset, r.key, r.value, list(r.headers)) for r in got] == \
        [(i, b"k%d" % i, b"a%d" % i, [("x", b"y")]) for i in range(20)]
    sub = kafka.broker.stats()["topics"]["aio"]["subscriptions"]["aio-g"]
    assert sub["partitions"][0]["mark_delete"] == 20                 # the group's offset is the cursor


def test_list_offsets_with_isolation_and_times(kafka):
    kafka.broker.create_topic("lo")
    prod = kafka.broker.producer("lo")
    prod.send_batch([b"a", b"b"], event_times=[10, 20])
    txn = kafka.broker.new_transaction()
    prod.send(b"open", txn=txn).offset              # appended now, not only accumulated
    c = confluent_kafka.Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": "x",
                                  "isolation.level": "read_committed"})
    tp = confluent_kafka.TopicPartition("lo", 0)
    assert c.get_watermark_offsets(tp, timeout=5, cached=False) == (0, 2)     # stops at the open one
    c.close()
    c = confluent_kafka.Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": "x",
                                  "isolation.level": "read_uncommitted"})
    assert c.get_watermark_offsets(tp, timeout=5, cached=False) == (0, 3)
    c.close()
    kp = kafka_python.KafkaConsumer(bootstrap_servers=kafka.bootstrap, isolation_level="read_committed")
    ktp = kafka_python.TopicPartition("lo", 0)
    assert kp.end_offsets([ktp])[ktp] == 2                             # the last stable offset
    kp.close()
    kp = kafka_python.KafkaConsumer(bootstrap_servers=kafka.bootstrap, isolation_level="read_uncommitted")
    assert kp.end_offsets([ktp])[ktp] == 3 and kp.beginning_offsets([ktp])[ktp] == 0
    found = kp.offsets_for_times({ktp: 0})[ktp]
    assert found.offset == 0
    kp.close()
    txn.abort()


def test_admin_create_describe_delete(kafka):
    from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    fs = admin.create_topics([NewTopic("adm", num_partitions=4, replication_factor=1,
                                       config={"retention.ms": "3600000"}),
                              NewTopic("bad", num_partitions=1, replication_factor=3),
                              NewTopic("compacted", num_partitions=1, config={"cleanup.policy": "compact"})])
    fs["adm"].result(10)
    for name in ("bad", "compacted"):
        with pytest.raises(confluent_kafka.KafkaException):
            fs[name].result(10)
    assert kafka.broker.describe_topic("adm")["partitions"] == 4
    assert kafka.broker.describe_topic("adm")["retention_ms"] == 3600000
    with pytest.raises(confluent_kafka.KafkaException) as e:
        admin.create_topics([NewTopic("adm", 1)])["adm"].result(10)
    assert e.value.args[0].code() == confluent_kafka.KafkaError.TOPIC_ALREADY_EXISTS
    res = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, "adm")])
    configs = list(res.values())[0].result(10)
    assert configs["retention.ms"].value == "3600000" and configs["cleanup.policy"].value == "delete"
    md = admin.list_topics(timeout=10)
    assert len(md.topics["adm"].partitions) == 4 and md.brokers[0].port == kafka.server.port
    admin.delete_topics(["adm"])["adm"].result(10)
    assert "adm" not in kafka.broker.topics()


def test_server_stops_with_the_broker_and_on_its_own(tmp_path):
    import socket
    b = txmq.Broker(tmp_path / "d", fsync="never", control_socket=False)
    s1 = serve_kafka(b, "127.0.0.1", 0)
    s2 = serve_kafka(b, "127.0.0.1", 0)
    assert s1.port != s2.port
    s1.stop()
    s1.stop()                                                  # idempotent
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", s1.port), timeout=2)
    socket.create_connection(("127.0.0.1", s2.port), timeout=2).close()
    with pytest.raises(OSError):
        serve_kafka(b, "127.0.0.1", s2.port)                    # taken
    assert b._services == [s2]                                 # the stopped and the refused ones left
    b.close()
    assert s2.stopped and b._services == []
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", s2.port), timeout=2)
    with pytest.raises(txmq.errors.BrokerClosedError):
        serve_kafka(b, "127.0.0.1", 0)                         # nothing bound for a closed broker


def test_cli_serve_as_owner(tmp_path):
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    data = tmp_path / "d"
    proc = subprocess.Popen([sys.executable, "-m", "txmq.cli", "serve", str(data), "--kafka", f"127.0.0.1:{port}",
                             "--partitions", "2"], stderr=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: listening(port), 20), "txmq serve did not start listening"
        p = kafka_python.KafkaProducer(bootstrap_servers=f"127.0.0.1:{port}", acks="all")
        for i in range(10):
            p.send("cli", b"m%d" % i, key=b"%d" % i)
        p.flush(10)
        p.close()
        assert txmq.readonly.writer_pid(str(data)) == proc.pid      # it holds the directory
        ro = txmq.readonly.open(data)
        assert sorted(m.value for part in (0, 1) for m in ro.read("cli", part, 0)) == \
            sorted(b"m%d" % i for i in range(10))
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "stopped" in err


@pytest.mark.skipif(__import__("shutil").which("kcat") is None, reason="kcat (Debian package kcat) not installed")
def test_kcat_produce_and_consume(kafka):
    """kcat as an operator would use it: lines with keys in, then out with
    their offsets, read_committed (kcat's default client is librdkafka)."""
    kafka.broker.create_topic("ops", partitions=1)
    lines = "".join(f"k{i}:v{i}\n" for i in range(5))
    subprocess.run(["kcat", "-b", kafka.bootstrap, "-P", "-t", "ops", "-K:"], input=lines, text=True,
                   check=True, timeout=60)
    kafka.broker.producer("ops").send(b"from python", key=b"py", headers=[("h", b"1")])
    out = subprocess.run(["kcat", "-b", kafka.bootstrap, "-C", "-t", "ops", "-o", "beginning", "-e",
                          "-X", "isolation.level=read_committed", "-f", "%o %k=%s %h\\n"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    assert out.splitlines() == [f"{i} k{i}=v{i} " for i in range(5)] + ["5 py=from python h=1"]
    meta = subprocess.run(["kcat", "-b", kafka.bootstrap, "-L", "-t", "ops"], capture_output=True, text=True,
                          check=True, timeout=60).stdout
    assert "1 partitions" in meta and "leader 0" in meta
