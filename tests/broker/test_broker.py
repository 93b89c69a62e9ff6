"""The embedded broker's public surface: topics, producers, consumers,
cursors across reopen, errors, stats."""

import datetime
import subprocess
import sys
import time

import pyarrow as pa
import pytest

import txmq
from txmq import errors
from txmq._partitioner import partition_for


@pytest.fixture
def broker(tmp_path):
    b = txmq.Broker(tmp_path / "data", fsync="never")
    yield b
    b.close()


def reopen(b, **kw):
    path = b.path
    b.close()
    return txmq.Broker(path, fsync=kw.pop("fsync", "never"), **kw)


# -- topics -----------------------------------------------------------------

def test_topic_lifecycle(broker):
    broker.create_topic("orders", partitions=3)
    broker.create_topic("a.b_c-1")
    assert broker.topics() == ["a.b_c-1", "orders"]
    d = broker.describe_topic("orders")
    assert d["partitions"] == 3 and d["end_offsets"] == [0, 0, 0]
    with pytest.raises(errors.TopicExistsError):
        broker.create_topic("orders")
    broker.delete_topic("orders")
    assert broker.topics() == ["a.b_c-1"]
    with pytest.raises(errors.TopicNotFoundError) as e:
        broker.producer("orders")
    assert e.value.name == "orders"
    broker.create_topic("orders", partitions=1)       # the name is free again, data gone
    assert broker.describe_topic("orders")["end_offsets"] == [0]


@pytest.mark.parametrize("name", ["", "a/b", "..", ".", "x" * 250, "ü", "a b", 7, None])
def test_bad_topic_names(broker, name):
    with pytest.raises(errors.InvalidTopicNameError) as e:
        broker.create_topic(name)
    assert e.value.name == name


@pytest.mark.parametrize("n", [0, -1, 1.5, "2", True])
def test_bad_partition_counts(broker, n):
    with pytest.raises(errors.InvalidArgumentError):
        broker.create_topic("t", partitions=n)


def test_topics_survive_reopen_and_delete_refuses_busy_topic(broker):
    broker.create_topic("t", partitions=2, retention_ms=1000)
    c = broker.subscribe("t", "s")
    with pytest.raises(errors.TopicBusyError):
        broker.delete_topic("t")
    c.close()
    broker = reopen(broker)
    assert broker.describe_topic("t")["retention_ms"] == 1000
    assert broker.subscriptions("t") == ["s"]
    broker.delete_topic("t")
    broker = reopen(broker)
    assert broker.topics() == []
    broker.close()


# -- producing ----------------------------------------------------------------

def test_send_round_trip_with_everything(broker):
    broker.create_topic("t")
    p = broker.producer("t")
    mid = p.send(b"v1", key=b"k1", headers={"a": b"1", "b": "two"}, event_time=1234)
    mid2 = p.send(b"", key=None, headers=[("x", None), ("x", b"2")])
    assert mid == txmq.MessageId("t", 0, 0) and mid2.offset == 1
    c = broker.subscribe("t", "s", initial_position="earliest")
    m1, m2 = c.receive_many(10, timeout=1)
    assert (m1.value, m1.key, m1.headers, m1.event_time) == (b"v1", b"k1", [("a", b"1"), ("b", b"two")], 1234)
    assert m1.properties == {"a": "1", "b": "two"}
    assert (m2.value, m2.key, m2.headers) == (b"", None, [("x", None), ("x", b"2")])
    assert m1.publish_time <= m2.publish_time and abs(m2.event_time - time.time() * 1000) < 60_000
    assert m1.txn_id is None and m1.redelivery_count == 0


def test_keys_land_where_kafka_puts_them(broker):
    broker.create_topic("t", partitions=5)
    p = broker.producer("t")
    keys = [b"user-%d" % i for i in range(200)]
    for k in keys[:20]:
        assert p.send(b"x", key=k).partition == partition_for(k, 5)
    ids = p.send_batch([b"v%d" % i for i in range(200)], keys=keys)
    assert [i.partition for i in ids] == [partition_for(k, 5) for k in keys]
    arrow_ids = p.send_batch(pa.array([b"w"] * 200), keys=pa.array(keys))
    assert [i.partition for i in arrow_ids] == [i.partition for i in ids]
    # Per partition, the offsets follow input order and are dense.
    c = broker.subscribe("t", "s", initial_position="earliest")
    got = {}
    while ms := c.receive_many(1000, timeout=0.2):
        for m in ms:
            got[m.message_id] = m
    for i, mid in enumerate(ids):
        assert got[mid].value == b"v%d" % i and got[mid].key == keys[i]


def test_round_robin_without_keys(broker):
    broker.create_topic("t", partitions=4)
    p = broker.producer("t")
    parts = {p.send(b"x").partition for _ in range(8)}
    assert parts == {0, 1, 2, 3}
    ids = p.send_batch([b"a", b"b", b"c"])
    assert len({i.partition for i in ids}) == 1        # one batch, one partition


def test_send_batch_arrow_and_lists_agree(broker):
    broker.create_topic("t")
    p = broker.producer("t")
    values = [b"%d" % i * (i % 7) for i in range(1000)]
    p.send_batch(values)
    p.send_batch(pa.array(values, pa.binary()))
    p.send_batch(pa.array(values, pa.large_binary()).slice(10, 20))
    c = broker.subscribe("t", "s", initial_position="earliest")
    got = []
    while ms := c.receive_many(5000, timeout=0.2):
        got += [m.value for m in ms]
    assert got == values + values + values[10:30]


def test_bad_messages_get_typed_errors(broker):
    broker.create_topic("t", partitions=2)
    p = broker.producer("t")
    for bad in ("text", 12, None, [b"x"]):
        with pytest.raises(errors.InvalidMessageError):
            p.send(bad)
    with pytest.raises(errors.InvalidMessageError):
        p.send(b"x", key=12)
    with pytest.raises(errors.InvalidMessageError):
        p.send(b"x", headers={1: b"x"})
    with pytest.raises(errors.InvalidMessageError):
        p.send(b"x", event_time="now")
    with pytest.raises(errors.InvalidMessageError):
        p.send_batch([])
    with pytest.raises(errors.InvalidMessageError):
        p.send_batch([b"a", b"b"], keys=[b"k"])
    with pytest.raises(errors.InvalidMessageError):
        p.send_batch(pa.array([1, 2]))
    with pytest.raises(errors.PartitionNotFoundError):
        p.send(b"x", partition=2)
    assert broker.describe_topic("t")["end_offsets"] == [0, 0]   # nothing half-written


def test_message_too_large(tmp_path):
    with txmq.Broker(tmp_path / "d", fsync="never", max_message_bytes=1000) as b:
        b.create_topic("t")
        p = b.producer("t")
        p.send(b"x" * 1000)
        with pytest.raises(errors.MessageTooLargeError) as e:
            p.send(b"x" * 1001)
        assert (e.value.size, e.value.limit) == (1001, 1000)
        with pytest.raises(errors.MessageTooLargeError):
            p.send_batch([b"x", b"y" * 5000])
        assert b.describe_topic("t")["end_offsets"] == [1]


def test_segments_roll_and_everything_reads_back(tmp_path):
    with txmq.Broker(tmp_path / "d", fsync="never", segment_bytes_max=16384) as b:
        b.create_topic("t")
        p = b.producer("t")
        for i in range(300):
            p.send(b"%05d" % i + b"x" * 200)
        assert b.stats()["topics"]["t"]["partitions"][0]["segments"] > 3
    with txmq.Broker(tmp_path / "d", fsync="never", segment_bytes_max=16384) as b:
        c = b.subscribe("t", "s", initial_position="earliest")
        got = []
        while ms := c.receive_many(100, timeout=0.2):
            got += ms
        assert [m.value[:5] for m in got] == [b"%05d" % i for i in range(300)]
        assert [m.offset for m in got] == list(range(300))


@pytest.mark.parametrize("fsync", ["always", "commit"])
def test_fsync_modes_work(tmp_path, fsync):
    with txmq.Broker(tmp_path / "d", fsync=fsync) as b:
        b.create_topic("t")
        b.producer("t").send_batch([b"a"] * 10)
        c = b.subscribe("t", "s", initial_position="earliest")
        c.ack(c.receive_many(10, timeout=1))
    with txmq.Broker(tmp_path / "d", fsync=fsync) as b:
        assert b.stats()["topics"]["t"]["subscriptions"]["s"]["partitions"][0]["mark_delete"] == 10


def test_bad_broker_arguments(tmp_path):
    with pytest.raises(errors.InvalidArgumentError):
        txmq.Broker(tmp_path / "d", fsync="sometimes")
    with pytest.raises(errors.InvalidArgumentError):
        txmq.Broker(tmp_path / "d", segment_bytes_max=100)
    txmq.Broker(tmp_path / "d").close()                 # the failed opens left no lock behind


def test_closed_broker_refuses_work(tmp_path):
    b = txmq.Broker(tmp_path / "d", fsync="never")
    b.create_topic("t")
    p = b.producer("t")
    b.close()
    with pytest.raises(errors.BrokerClosedError):
        p.send(b"x")
    with pytest.raises(errors.BrokerClosedError):
        b.topics()


# -- the data directory lock ----------------------------------------------------

def test_second_writer_process_is_refused(tmp_path):
    path = tmp_path / "d"
    with txmq.Broker(path, fsync="never"):
        code = ("import txmq, sys\n"
                "try:\n"
                f"    txmq.Broker({str(path)!r})\n"
                "except txmq.errors.DataDirLockedError as e:\n"
                "    print('locked', e.path); sys.exit(3)\n")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert r.returncode == 3, r.stderr
        assert "locked" in r.stdout and str(path) in r.stdout
        with pytest.raises(errors.DataDirLockedError):
            txmq.Broker(path)                              # a second broker in-process too
    txmq.Broker(path).close()                             # free again after close


# -- consuming -----------------------------------------------------------------------

def test_initial_position_latest_and_earliest(broker):
    broker.create_topic("t")
    p = broker.producer("t")
    p.send(b"old")
    late = broker.subscribe("t", "late")                  # latest is the default
    early = broker.subscribe("t", "early", initial_position="earliest")
    p.send(b"new")
    assert [m.value for m in late.receive_many(10, timeout=0.5)] == [b"new"]
    assert [m.value for m in early.receive_many(10, timeout=0.5)] == [b"old", b"new"]


def test_exclusive_refuses_second_consumer_and_type_changes(broker):
    broker.create_topic("t")
    c = broker.subscribe("t", "s", "exclusive")
    with pytest.raises(errors.SubscriptionBusyError):
        broker.subscribe("t", "s", "exclusive")
    with pytest.raises(errors.SubscriptionTypeError) as e:
        broker.subscribe("t", "s", "shared")
    assert (e.value.have, e.value.wanted) == ("exclusive", "shared")
    c.close()
    broker.subscribe("t", "s", "shared").close()          # no consumers: the type may change
    assert broker.stats()["topics"]["t"]["subscriptions"]["s"]["type"] == "shared"


def test_isolation_level_is_fixed_per_subscription(broker):
    broker.create_topic("t")
    broker.subscribe("t", "s", "shared", isolation="read_uncommitted").close()
    with pytest.raises(errors.IsolationLevelMismatchError) as e:
        broker.subscribe("t", "s", "shared")
    assert (e.value.have, e.value.wanted) == ("read_uncommitted", "read_committed")
    assert broker.stats()["topics"]["t"]["subscriptions"]["s"]["isolation"] == "read_uncommitted"
    with pytest.raises(errors.InvalidArgumentError):
        broker.subscribe("t", "s2", isolation="serializable")
    with pytest.raises(errors.InvalidArgumentError):
        broker.subscribe("t", "s2", type="key_shared")
    with pytest.raises(errors.InvalidSubscriptionNameError):
        broker.subscribe("t", "a/b")


def test_ack_cumulative_only_for_exclusive_and_failover(broker):
    broker.create_topic("t")
    broker.producer("t").send_batch([b"a", b"b", b"c"])
    shared = broker.subscribe("t", "sh", "shared", initial_position="earliest")
    m = shared.receive(timeout=1)
    with pytest.raises(errors.SubscriptionTypeError):
        shared.ack_cumulative(m)
    ex = broker.subscribe("t", "ex", "exclusive", initial_position="earliest")
    ms = ex.receive_many(3, timeout=1)
    ex.ack_cumulative(ms[1])
    s = broker.stats()["topics"]["t"]["subscriptions"]["ex"]
    assert s["partitions"][0]["mark_delete"] == 2 and s["backlog"] == 1 and s["unacked"] == 1


def test_nack_redelivers_after_delay_with_count(broker):
    broker.create_topic("t")
    broker.producer("t").send(b"a")
    c = broker.subscribe("t", "s", initial_position="earliest", nack_delay=0.3)
    m = c.receive(timeout=1)
    t0 = time.monotonic()
    c.nack(m)
    assert c.receive(timeout=0.1) is None
    m2 = c.receive(timeout=2)
    assert time.monotonic() - t0 >= 0.25
    assert m2.message_id == m.message_id and m2.redelivery_count == 1
    c.nack(m2)
    assert c.receive(timeout=2).redelivery_count == 2


def test_ack_timeout_redelivers(broker):
    broker.create_topic("t")
    broker.producer("t").send(b"a")
    c = broker.subscribe("t", "s", initial_position="earliest", ack_timeout=0.2)
    m = c.receive(timeout=1)
    again = c.receive(timeout=2)
    assert again.message_id == m.message_id and again.redelivery_count == 1
    c.ack(again)
    assert c.receive(timeout=0.4) is None


def test_acks_persist_across_reopen_with_gaps(broker):
    broker.create_topic("t")
    broker.producer("t").send_batch([b"%d" % i for i in range(10)])
    c = broker.subscribe("t", "s", initial_position="earliest")
    ms = c.receive_many(10, timeout=1)
    c.ack([ms[0], ms[1], ms[4], ms[7]])
    broker = reopen(broker)
    c = broker.subscribe("t", "s")
    got = [m.offset for m in c.receive_many(10, timeout=0.5)]
    assert got == [2, 3, 5, 6, 8, 9]
    st = broker.stats()["topics"]["t"]["subscriptions"]["s"]
    assert st["partitions"][0]["mark_delete"] == 2 and st["backlog"] == 6
    broker.close()


def test_bad_acks_are_typed_errors(broker):
    broker.create_topic("t")
    broker.create_topic("u")
    broker.producer("t").send(b"a")
    c = broker.subscribe("t", "s", initial_position="earliest")
    with pytest.raises(errors.NotAcknowledgeableError):
        c.ack(txmq.MessageId("u", 0, 0))
    with pytest.raises(errors.NotAcknowledgeableError):
        c.ack(txmq.MessageId("t", 0, 5))
    with pytest.raises(errors.NotAcknowledgeableError):
        c.ack(txmq.MessageId("t", 3, 0))
    with pytest.raises(errors.InvalidArgumentError):
        c.ack("offset 0")
    assert c.receive(timeout=1).value == b"a"             # nothing was acknowledged


def test_a_transactional_ack_of_received_messages_from_elsewhere_is_refused_whole(broker):
    """ack(list, txn=) of received Messages reads their ids in compiled
    code: a message of another topic among them is a typed error naming
    its id, and none of the list becomes pending."""
    broker.create_topic("t")
    broker.create_topic("u")
    broker.producer("t").send_batch([b"a", b"b"])
    broker.producer("u").send(b"x")
    c = broker.subscribe("t", "s", initial_position="earliest")
    other = broker.subscribe("u", "s", initial_position="earliest").receive(timeout=1)
    mine = c.receive_many(2, timeout=1)
    txn = broker.new_transaction()
    with pytest.raises(errors.NotAcknowledgeableError) as e:
        c.ack(mine + [other], txn=txn)
    assert e.value.message_id == txmq.MessageId("u", 0, 0)
    other_txn = broker.new_transaction()
    c.ack(mine, txn=other_txn)           # no conflict: the refused ack held none of them
    txn.commit()
    other_txn.commit()
    assert broker.stats()["topics"]["t"]["subscriptions"]["s"]["backlog"] == 0


def test_seek(broker):
    broker.create_topic("t", partitions=2)
    p = broker.producer("t")
    p.send_batch([b"a%d" % i for i in range(5)], partition=0)
    time.sleep(0.01)
    mark = int(time.time() * 1000)
    time.sleep(0.01)
    p.send_batch([b"b%d" % i for i in range(5)], partition=0)
    c = broker.subscribe("t", "s", initial_position="earliest")
    c.ack(c.receive_many(100, timeout=0.5))
    c.seek(3, partition=0)
    assert [m.value for m in c.receive_many(100, timeout=0.5)] == [b"a3", b"a4", b"b0", b"b1", b"b2", b"b3", b"b4"]
    c.seek(timestamp=mark)
    assert [m.offset for m in c.receive_many(100, timeout=0.5)] == [5, 6, 7, 8, 9]
    c.seek(datetime.datetime.fromtimestamp(mark / 1000))
    assert c.receive(timeout=0.5).offset == 5
    c.seek(txmq.MessageId("t", 0, 9))
    assert [m.offset for m in c.receive_many(100, timeout=0.5)][-1] == 9
    c.seek("latest")
    assert c.receive(timeout=0.2) is None
    c.seek("earliest")
    assert len(c.receive_many(100, timeout=0.5)) == 10
    for bad in (-1, "middle", 1.5, None):
        with pytest.raises(errors.InvalidArgumentError):
            c.seek(bad)


def test_unsubscribe_forgets_the_cursor(broker):
    broker.create_topic("t")
    broker.producer("t").send(b"a")
    c = broker.subscribe("t", "s", initial_position="earliest")
    c.ack(c.receive(timeout=1))
    c.unsubscribe()
    assert broker.subscriptions("t") == []
    c = broker.subscribe("t", "s", initial_position="earliest")
    assert c.receive(timeout=1).value == b"a"


def test_receive_batch_is_zero_copy_and_acks_as_a_range(broker):
    broker.create_topic("t")
    p = broker.producer("t")
    p.send_batch([b"v%03d" % i for i in range(100)], keys=[b"k%d" % i if i % 3 else None for i in range(100)])
    c = broker.subscribe("t", "s", initial_position="earliest")
    first = c.receive(timeout=1)
    c.ack(first)
    rb = c.receive_batch(max_messages=40, timeout=1)
    assert rb.num_rows == 40
    assert rb.column("offset").to_pylist() == list(range(1, 41))
    assert rb.column("value").to_pylist() == [b"v%03d" % i for i in range(1, 41)]
    assert rb.column("key").to_pylist() == [b"k%d" % i if i % 3 else None for i in range(1, 41)]
    assert rb.schema.metadata[b"topic"] == b"t" and rb.schema.metadata[b"partition"] == b"0"
    # The value bytes live in the mapped segment, not in a copy.
    seg = broker._topics["t"].partitions[0].segments[0]
    base = memoryview(seg.mapping)
    lo = pa.py_buffer(base).address
    addr = rb.column("value").buffers()[2].address
    assert lo <= addr < lo + seg.mapping.size
    del base
    c.ack(rb)
    rest = c.receive_many(1000, timeout=0.5)
    assert [m.offset for m in rest] == list(range(41, 100))
    c.ack(rest)
    assert broker.stats()["topics"]["t"]["subscriptions"]["s"]["backlog"] == 0


def test_stats_shape(broker):
    broker.create_topic("t", partitions=2)
    broker.producer("t").send_batch([b"x" * 10] * 5, partition=1)
    c = broker.subscribe("t", "s", "failover", consumer_name="c1", initial_position="earliest")
    c.receive(timeout=1)
    st = broker.stats()
    part = st["topics"]["t"]["partitions"][1]
    assert part["end_offset"] == 5 and part["bytes"] > 50 and part["segments"] == 1
    sub = st["topics"]["t"]["subscriptions"]["s"]
    assert sub["type"] == "failover" and sub["isolation"] == "read_committed"
    assert sub["consumers"] == ["c1"] and sub["backlog"] == 5 and sub["unacked"] == 1


def test_blocked_receive_wakes_on_send(broker):
    import threading
    broker.create_topic("t")
    c = broker.subscribe("t", "s")
    got = []
    t = threading.Thread(target=lambda: got.append(c.receive(timeout=10)))
    t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    broker.producer("t").send(b"wake")
    t.join(5)
    assert got and got[0].value == b"wake" and time.monotonic() - t0 < 2


def test_receive_batch_serves_redeliveries_too(broker):
    broker.create_topic("t")
    broker.producer("t").send_batch([b"m%d" % i for i in range(10)])
    c = broker.subscribe("t", "s", "shared", initial_position="earliest", nack_delay=0)
    rb = c.receive_batch(timeout=1)
    assert rb.num_rows == 10
    c.nack([txmq.MessageId("t", 0, 2), txmq.MessageId("t", 0, 7)])
    c.ack([txmq.MessageId("t", 0, o) for o in range(10) if o not in (2, 7)])
    again = c.receive_batch(timeout=1)
    assert again.column("offset").to_pylist() == [2, 7]
    assert again.column("value").to_pylist() == [b"m2", b"m7"]
    c.ack(again)                                   # scattered offsets, acked one by one
    assert broker.stats()["topics"]["t"]["subscriptions"]["s"]["backlog"] == 0
    assert c.receive_batch(timeout=0.2) is None


def test_append_and_sync_after_close_are_typed_errors(tmp_path):
    """The window a send can race with close(), made deterministic: the
    partition itself refuses with BrokerClosedError."""
    from txmq._batch import BatchSpec
    b = txmq.Broker(tmp_path / "d", fsync="always")
    b.create_topic("t")
    part = b._topics["t"].partitions[0]
    b.producer("t").send(b"x")
    b.close()
    with pytest.raises(errors.BrokerClosedError):
        part.append(BatchSpec([b"late"]))
    with pytest.raises(errors.BrokerClosedError):
        part.sync_to(10)


def test_received_messages_are_not_tracked_by_the_cyclic_collector(tmp_path):
    """A Message holds no reference that can lead back to it, so it is
    not tracked: receiving 1,000 of them adds nothing to the collector's
    count (each tracked allocation would: 700 trigger a collection that
    walks the young objects), and dropping them frees them."""
    import gc
    import tracemalloc
    with txmq.Broker(tmp_path / "d", fsync="never") as b:
        b.create_topic("t")
        b.producer("t").send_batch([b"x" * 100] * 5000)
        c = b.subscribe("t", "s", initial_position="earliest")
        first = c.receive_many(1000, 1)
        assert len(first) == 1000 and not any(gc.is_tracked(m) for m in first)
        gc.disable()
        try:
            before = gc.get_count()[0]
            msgs = c.receive_many(1000, 1)
            assert len(msgs) == 1000
            assert gc.get_count()[0] - before < 100
        finally:
            gc.enable()
        del first, msgs
        tracemalloc.start()
        try:
            c.receive_many(1000, 1)                    # (warm)
            base = tracemalloc.get_traced_memory()[0]
            for _ in range(2):
                assert len(c.receive_many(1000, 1)) == 1000
            assert tracemalloc.get_traced_memory()[0] - base < 50_000   # 1,000 messages are ~250 KB
        finally:
            tracemalloc.stop()
