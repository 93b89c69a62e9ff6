"""Arrow batch deliveries (``receive_batch``) in a subscription's lanes
(dispatch/subscription.py): a closed consumer's waiting receive ends, the
count is checked, what is unacknowledged is counted once, and a nack or an
ack timeout inside a batch redelivers each message once."""

import threading
import time

import pytest

import txmq
from txmq import errors


@pytest.fixture
def broker(tmp_path):
    b = txmq.Broker(tmp_path / "d", fsync="never")
    b.create_topic("t")
    yield b
    b.close()


def test_receive_batch_refuses_closed_consumers(broker):
    c1 = broker.subscribe("t", "s", "shared", initial_position="earliest")
    c2 = broker.subscribe("t", "s", "shared")
    box = []

    def wait():
        try:
            box.append(c1.receive_batch(timeout=None))
        except errors.BrokerClosedError as e:
            box.append(e)

    th = threading.Thread(target=wait)
    th.start()
    time.sleep(0.2)
    c1.close()
    th.join(3)
    assert not th.is_alive() and isinstance(box[0], errors.BrokerClosedError)
    broker.producer("t").send_batch([b"a", b"b", b"c"])
    assert [m.value for m in c2.receive_many(10, timeout=1)] == [b"a", b"b", b"c"]


def test_receive_batch_needs_a_positive_count(broker):
    broker.producer("t").send_batch([b"%d" % i for i in range(10)])
    c = broker.subscribe("t", "s", initial_position="earliest")
    c.receive_many(5, timeout=1)
    for bad in (0, -3, 1.5, True):
        with pytest.raises(errors.InvalidArgumentError):
            c.receive_batch(bad, timeout=0)
    assert c.receive_batch(100, timeout=0).column("offset").to_pylist() == [5, 6, 7, 8, 9]


def test_unacked_counts_a_batch_straddling_mark_delete_once(broker):
    broker.producer("t").send_batch([b"%d" % i for i in range(10)])
    c = broker.subscribe("t", "s", initial_position="earliest")
    rb = c.receive_batch(timeout=1)
    c.ack([txmq.MessageId("t", 0, o) for o in range(5)])
    st = broker.stats()["topics"]["t"]["subscriptions"]["s"]
    assert st["unacked"] == 5 and st["backlog"] == 5
    c.ack(rb)
    assert broker.stats()["topics"]["t"]["subscriptions"]["s"]["unacked"] == 0


def test_nack_inside_a_batch_redelivers_once(broker):
    broker.producer("t").send_batch([b"%d" % i for i in range(4)])
    c = broker.subscribe("t", "s", "shared", initial_position="earliest", nack_delay=0)
    c.receive_batch(timeout=1)
    c.nack(txmq.MessageId("t", 0, 2))
    c.close()                                   # releases the rest of the batch
    c = broker.subscribe("t", "s", "shared")
    got = {m.offset: m.redelivery_count for m in c.receive_many(10, timeout=1)}
    assert got == {0: 1, 1: 1, 2: 1, 3: 1}


def test_ack_timeout_still_covers_a_batch_split_by_a_nack(broker):
    broker.producer("t").send_batch([b"%d" % i for i in range(4)])
    c = broker.subscribe("t", "s", "shared", initial_position="earliest", nack_delay=0,
                         ack_timeout=0.3)
    c.receive_batch(timeout=1)
    c.nack(txmq.MessageId("t", 0, 2))
    seen = set()
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and seen != {0, 1, 2, 3}:
        for m in c.receive_many(10, timeout=0.1):
            seen.add(m.offset)
            c.ack(m)
    assert seen == {0, 1, 2, 3}


def test_a_batch_delivery_has_the_fields_of_the_messages(broker):
    """Each column of ``receive_batch`` holds what ``receive_many`` gives
    for the same messages, from the middle of a stored batch on: keys
    (null where none), values, offsets, event and publish times."""
    import pyarrow as pa
    p = broker.producer("t")
    p.send_batch([b"v%d" % i for i in range(6)], keys=[None, b"k1", None, b"k3", b"k4", None],
                 event_times=[1_000 + 7 * i for i in range(6)])
    p.send_batch([b"w%d" % i for i in range(3)])
    want = broker.subscribe("t", "expected", initial_position="earliest").receive_many(9, timeout=1)
    c = broker.subscribe("t", "s", initial_position="earliest")
    c.ack(c.receive_many(2, timeout=1))
    c.close()
    c = broker.subscribe("t", "s")
    got = []
    while len(got) < 7:
        batch = c.receive_batch(100, timeout=1)
        assert batch.schema.field("event_time").type == pa.timestamp("ms")
        assert batch.schema.field("publish_time").type == pa.timestamp("ms")
        assert batch.schema.field("offset").type == pa.int64()
        ms = {name: batch.column(name).cast(pa.int64()).to_pylist() for name in ("event_time", "publish_time")}
        got += [dict(r, event_time=e, publish_time=t)
                for r, e, t in zip(batch.to_pylist(), ms["event_time"], ms["publish_time"])]
    assert [r["offset"] for r in got] == [m.offset for m in want[2:]]
    assert [r["key"] for r in got] == [m.key for m in want[2:]]
    assert [r["value"] for r in got] == [m.value for m in want[2:]]
    assert [r["event_time"] for r in got] == [m.event_time for m in want[2:]]
    assert [r["publish_time"] for r in got] == [m.publish_time for m in want[2:]]


def unacked(broker):
    return broker.stats()["topics"]["t"]["subscriptions"]["s"]["unacked"]


def test_an_ack_of_a_received_batch_takes_its_run_and_of_a_slice_its_column(broker):
    """``receive_batch`` remembers the run each batch it returns covers,
    while the batch lives: its ack is that run. A slice of it (another
    object) is acked by its offset column, only those offsets; a dropped
    batch is forgotten."""
    import gc
    from txmq.dispatch.arrow_delivery import _RUNS, delivered_run
    broker.producer("t").send_batch([b"v%d" % i for i in range(30)])
    c = broker.subscribe("t", "s", initial_position="earliest")
    batch = c.receive_batch(20, timeout=1)
    assert delivered_run(batch) == ("t", 0, 0, 20)
    part = batch.slice(5, 10)
    assert delivered_run(part) is None and delivered_run(object()) is None
    c.ack(part)                               # offsets 5..14, from the column
    assert unacked(broker) == 10
    txn = broker.new_transaction()
    with pytest.raises(errors.TransactionConflictError):
        c.ack(batch, txn=txn)                 # the run 0..19 holds acked offsets: refused whole
    txn.abort()
    rest = c.receive_batch(20, timeout=1)
    assert delivered_run(rest) == ("t", 0, 20, 30)
    with broker.transaction() as txn:
        c.ack(rest, txn=txn)
    assert unacked(broker) == 10
    n = len(_RUNS)
    del batch, part, rest
    gc.collect()
    assert len(_RUNS) == n - 2
