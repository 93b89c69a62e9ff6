"""Acks inside a transaction, one message at a time (``ack(m, txn=)``):
conflicts are refused by the ack itself (G7), the pending-ack log gets one
frame per transaction and partition when a flush (or a prepare) asks and
none for a commit, and the ranges a transaction acked are there for the
coordinator to read."""

from __future__ import annotations

import os

import pytest

import txmq
from txmq._redolog import RedoLog
from txmq._txnlog import PA_ACK, PA_COMMIT
from txmq.errors import TransactionConflictError


@pytest.fixture
def broker(tmp_path):
    b = txmq.Broker(tmp_path / "data", fsync="never")
    yield b
    b.close()


def fed(broker, n=20, partitions=1):
    broker.create_topic("in", partitions)
    broker.producer("in").send_batch([b"m%d" % i for i in range(n)], partition=0)
    c = broker.subscribe("in", "s", initial_position="earliest")
    return c, c.receive_many(n, 1.0)


def frames(broker, partition=0):
    """(type, payload) of every frame of the pending-ack log of in/s."""
    path = os.path.join(broker.path, "subscriptions", "in", "s", f"pending-{partition}.log")
    log = RedoLog(path, "never")
    try:
        return log.replay()
    finally:
        log.close()


def test_conflicts_are_refused_by_the_ack_itself(broker):
    c, ms = fed(broker)
    a, b = broker.new_transaction(), broker.new_transaction()
    c.ack(ms[0], txn=a)
    c.ack(ms[0], txn=a)                       # again in the same transaction: nothing new
    with pytest.raises(TransactionConflictError) as e:
        c.ack(ms[0], txn=b)                   # G7: pending in at most one transaction
    assert e.value.other == a.id
    with pytest.raises(TransactionConflictError):
        c.ack(ms[0])                          # a plain ack must not take it either
    c.ack(ms[1])
    with pytest.raises(TransactionConflictError):
        c.ack(ms[1], txn=b)                   # already acknowledged
    b.abort()
    a.commit()
    with pytest.raises(TransactionConflictError):
        c.ack(ms[0], txn=broker.new_transaction())


@pytest.mark.parametrize("flushed", [False, True])
def test_a_commit_frames_no_ack_and_a_flush_one_frame_per_partition(broker, flushed):
    c, ms = fed(broker)
    txn = broker.new_transaction()
    before = len(frames(broker))
    for m in ms[:10]:
        c.ack(m, txn=txn)
    assert len(frames(broker)) == before      # held in memory
    pa = broker._topics["in"].subscriptions["s"].pending_acks
    assert pa.txn_ack_ranges(txn.id) == [[(0, 10)]]
    framed = []
    if flushed:
        txn.flush()
        framed = [PA_ACK]                     # the 10 offsets in one frame
    assert [t for t, _ in frames(broker)[before:]] == framed
    txn.commit()                              # no frame of its own: the decision record names them
    assert pa.txn_ack_ranges(txn.id) == [[]]
    assert [t for t, _ in frames(broker)[before:]] == framed
    # The cursor's sync (the coordinator's flush), then the COMMIT frame a
    # framed transaction owes.
    pa.flush()
    assert [t for t, _ in frames(broker)[before:]] == framed + [PA_COMMIT] * flushed
    assert broker.stats()["topics"]["in"]["subscriptions"]["s"]["partitions"][0]["mark_delete"] == 10


def test_flush_writes_an_open_transactions_acks(broker):
    c, ms = fed(broker)
    txn = broker.new_transaction()
    c.ack(ms[3], txn=txn)
    c.ack(ms[4], txn=txn)
    txn.flush()
    assert [t for t, _ in frames(broker)].count(PA_ACK) == 1
    txn.abort()


def test_an_abort_makes_the_messages_deliverable_again(broker):
    c, ms = fed(broker, 5)
    txn = broker.new_transaction()
    for m in ms:
        c.ack(m, txn=txn)
    assert c.receive(0.05) is None            # pending: not delivered again
    txn.abort()
    again = c.receive_many(10, 1.0)
    assert [m.offset for m in again] == [0, 1, 2, 3, 4]
    assert {m.redelivery_count for m in again} == {1}


def test_acks_of_a_transaction_open_at_close_are_aborted_on_open(tmp_path):
    path = tmp_path / "d"
    with txmq.Broker(path, fsync="never") as b:
        c, ms = fed(b, 5)
        txn = b.new_transaction()
        for m in ms[:3]:
            c.ack(m, txn=txn)
    with txmq.Broker(path, fsync="never") as b:
        assert b.stats()["transactions"]["recovered"]["aborted"] == 1
        c = b.subscribe("in", "s")
        assert [m.offset for m in c.receive_many(10, 1.0)] == [0, 1, 2, 3, 4]


def test_commit_applies_scattered_acks(broker):
    c, ms = fed(broker, 40)
    txn = broker.new_transaction()
    for m in ms[::3]:                          # 14 ranges of one offset
        c.ack(m, txn=txn)
    txn.commit()
    left = c.receive_many(100, 0.2)
    assert left == []                          # the rest is still out with this consumer
    cursor = broker._topics["in"].subscriptions["s"].lanes[0].cursor
    assert cursor.mark_delete == 1             # offset 0, then the rest one by one
    assert [a for a, _ in cursor.acked.ranges()] == list(range(3, 40, 3))
    c.ack([m for m in ms if m.offset % 3])
    assert broker.consumer_lag("in", "s") == {0: 0}
