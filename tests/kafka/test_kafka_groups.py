"""Consumer groups through real clients: members join, get disjoint
assignments covering every partition, rebalance when one joins or leaves
(or dies: its session times out), and commit offsets that are the txmq
subscription's cursor (and the other way round)."""

import threading
import time

import pytest

from kafka_support import kafka, wait_until  # noqa: F401 (fixture)

confluent_kafka = pytest.importorskip("confluent_kafka")
kafka_python = pytest.importorskip("kafka")


class Member(threading.Thread):
    """A confluent-kafka consumer polling in its own thread."""

    def __init__(self, bootstrap, group, topic, name, **extra):
        super().__init__(daemon=True)
        conf = {"bootstrap.servers": bootstrap, "group.id": group, "auto.offset.reset": "earliest",
                "enable.auto.commit": False, "session.timeout.ms": 6000, "heartbeat.interval.ms": 300,
                "client.id": name}
        conf.update(extra)
        self.consumer = confluent_kafka.Consumer(conf)
        self.topic = topic
        self.assigned: list = []
        self.values: list = []
        self.stop_flag = threading.Event()
        self.consumer.subscribe([topic], on_assign=self._on_assign, on_revoke=self._on_revoke)

    def _on_assign(self, consumer, parts):
        self.assigned = sorted(tp.partition for tp in parts)

    def _on_revoke(self, consumer, parts):
        self.assigned = []

    def run(self):
        while not self.stop_flag.is_set():
            m = self.consumer.poll(0.1)
            if m is not None and not m.error():
                self.values.append(m.value())
                try:
                    self.consumer.commit(message=m, asynchronous=False)
                except confluent_kafka.KafkaException as e:
                    # A commit during a rebalance is refused (the message comes again).
                    assert e.args[0].code() in (confluent_kafka.KafkaError.REBALANCE_IN_PROGRESS,
                                                confluent_kafka.KafkaError.ILLEGAL_GENERATION,
                                                confluent_kafka.KafkaError.UNKNOWN_MEMBER_ID), e

    def leave(self):
        self.stop_flag.set()
        self.join(10)
        self.consumer.close()


def test_join_rebalance_leave(kafka):
    kafka.broker.create_topic("g", partitions=4)
    prod = kafka.broker.producer("g")
    for i in range(40):
        prod.send(b"m%d" % i, partition=i % 4)
    a = Member(kafka.bootstrap, "grp", "g", "a")
    a.start()
    assert wait_until(lambda: a.assigned == [0, 1, 2, 3], 20)
    b = Member(kafka.bootstrap, "grp", "g", "b")
    b.start()
    assert wait_until(lambda: len(a.assigned) == 2 and len(b.assigned) == 2, 30), (a.assigned, b.assigned)
    assert sorted(a.assigned + b.assigned) == [0, 1, 2, 3]
    b.leave()
    assert wait_until(lambda: a.assigned == [0, 1, 2, 3], 30), a.assigned
    assert wait_until(lambda: len(set(a.values + b.values)) == 40, 20)
    # Committed offsets are the subscription's cursor: each partition read to its end.
    def cursor():
        sub = kafka.broker.stats()["topics"]["g"]["subscriptions"].get("grp")   # created by the first commit
        return sub and [p["mark_delete"] for p in sub["partitions"]]
    assert wait_until(lambda: cursor() == [10, 10, 10, 10], 10), cursor()
    a.leave()
    g = kafka.server.handlers.groups.groups["grp"]
    assert g.state == "Empty" and not g.members


MEMBER_PROCESS = """
import sys, confluent_kafka
c = confluent_kafka.Consumer({"bootstrap.servers": sys.argv[1], "group.id": "grp2", "client.id": "doomed",
                              "session.timeout.ms": 6000, "heartbeat.interval.ms": 300})
c.subscribe(["h"])
while True:
    c.poll(0.1)
"""


def test_member_killed_times_out_and_the_group_rebalances(kafka):
    import signal
    import subprocess
    import sys
    kafka.broker.create_topic("h", partitions=2)
    a = Member(kafka.bootstrap, "grp2", "h", "a")
    a.start()
    assert wait_until(lambda: a.assigned == [0, 1], 20)
    doomed = subprocess.Popen([sys.executable, "-c", MEMBER_PROCESS, kafka.bootstrap])
    try:
        assert wait_until(lambda: len(a.assigned) == 1, 30), a.assigned
        group = kafka.server.handlers.groups.groups["grp2"]
        gen = group.generation
        assert sorted(m.client_id for m in group.members.values()) == ["a", "doomed"]
        doomed.send_signal(signal.SIGKILL)         # no LeaveGroup: only its session can end it
        assert wait_until(lambda: a.assigned == [0, 1], 30), a.assigned
        assert group.generation > gen and [m.client_id for m in group.members.values()] == ["a"]
    finally:
        doomed.kill()
        doomed.wait()
        a.leave()


def test_offsets_shared_with_the_python_api(kafka):
    kafka.broker.create_topic("o", partitions=2)
    prod = kafka.broker.producer("o")
    for i in range(10):
        prod.send(b"%d" % i, partition=i % 2)
    # A txmq subscription's cursor is the group's committed offset ...
    c = kafka.broker.subscribe("o", "shared-g", type="failover", initial_position="earliest")
    ms = c.receive_many(3, timeout=1)
    c.ack_cumulative(ms[-1])
    c.close()
    kc = kafka_python.KafkaConsumer(bootstrap_servers=kafka.bootstrap, group_id="shared-g",
                                    enable_auto_commit=False)
    tps = [kafka_python.TopicPartition("o", i) for i in (0, 1)]
    md = {p: kafka.broker.stats()["topics"]["o"]["subscriptions"]["shared-g"]["partitions"][p]["mark_delete"]
          for p in (0, 1)}
    assert [kc.committed(tp) for tp in tps] == [md[0], md[1]] and sum(md.values()) == 3
    # ... and a Kafka commit moves it.
    kc.assign(tps)
    kc.commit({tps[0]: kafka_python.OffsetAndMetadata(4, "", -1), tps[1]: kafka_python.OffsetAndMetadata(2, "", -1)})
    kc.close()
    parts = kafka.broker.stats()["topics"]["o"]["subscriptions"]["shared-g"]["partitions"]
    assert [p["mark_delete"] for p in parts] == [4, 2]
    # A group with no subscription has committed nothing.
    kc = kafka_python.KafkaConsumer(bootstrap_servers=kafka.bootstrap, group_id="nobody")
    assert kc.committed(tps[0]) is None
    kc.close()
