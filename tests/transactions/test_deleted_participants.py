"""A transaction whose participant goes away while it is open (a topic or
a subscription deleted, a topic deleted and created again): the commit
ends the transaction either way, never leaving it COMMITTING or its other
partitions blocked for read_committed readers (G1, G2), and the
coordinator's compaction and later transactions are not disturbed."""

from __future__ import annotations

import time

import pytest

import txmq
import txmq.transactions.coordinator as coordinator_mod
from txmq.errors import TxmqError


def _wait(pred, timeout=2.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def _partition_stats(broker, topic, p=0):
    return broker.stats()["topics"][topic]["partitions"][p]


# -- a participant deleted before the commit --------------------------------------------------


def test_commit_after_participant_topic_deleted_does_not_wedge(tmp_path):
    """The coordinator prepares every participant before it decides; a
    partition of a deleted topic must not stop it: the transaction ends
    (committed, or refused with a typed error and aborted), and topic "a"
    is not left blocked for read_committed readers."""
    with txmq.Broker(tmp_path / "d", fsync="commit") as b:
        b.create_topic("a")
        b.create_topic("b")
        c = b.subscribe("a", "rc", initial_position="earliest")
        txn = b.new_transaction(timeout=0.3)
        b.producer("a").send(b"x", txn=txn)
        b.producer("b").send(b"y", txn=txn)
        b.delete_topic("b")
        raised = None
        try:
            txn.commit()
        except Exception as e:        # a typed refusal would be acceptable
            raised = e
        # Committed or aborted, the transaction must end and stop blocking "a".
        assert _wait(lambda: not b.transactions(), 1.5), b.transactions()
        assert _partition_stats(b, "a")["blocked_by"] is None
        got = [m.value for m in c.receive_many(10, 0.2)]
        assert got in ([b"x"], [])
        assert raised is None or isinstance(raised, TxmqError), repr(raised)


def test_commit_after_ack_participant_unsubscribed_does_not_wedge(tmp_path):
    """The same on the subscription side: preparing the pending acks of a
    subscription unsubscribed meanwhile (its pending-ack log closed) must
    not leave the output topic of the consume-process-produce transaction
    blocked."""
    with txmq.Broker(tmp_path / "d", fsync="commit") as b:
        b.create_topic("in")
        b.create_topic("out")
        b.producer("in").send(b"m")
        c = b.subscribe("in", "s", initial_position="earliest")
        out = b.subscribe("out", "rc", initial_position="earliest")
        m = c.receive(1.0)
        txn = b.new_transaction(timeout=0.3)
        b.producer("out").send(b"out-of-m", txn=txn)
        c.ack(m, txn=txn)
        c.unsubscribe()
        raised = None
        try:
            txn.commit()
        except Exception as e:
            raised = e
        assert _wait(lambda: not b.transactions(), 1.5), b.transactions()
        assert _partition_stats(b, "out")["blocked_by"] is None
        assert [x.value for x in out.receive_many(10, 0.2)] in ([b"out-of-m"], [])
        assert raised is None or isinstance(raised, TxmqError), repr(raised)


# -- the coordinator's compaction after a topic delete ------------------------------------------


def test_coordinator_compaction_after_topic_delete(tmp_path, monkeypatch):
    """The coordinator's compaction syncs every partition touched since the
    last one, a deleted topic's among them; it runs inside the end of an
    unrelated, already-decided commit, which must still return COMMITTED
    (and new transactions still begin). COMPACT_FRAMES is lowered so the
    compaction comes soon."""
    monkeypatch.setattr(coordinator_mod, "COMPACT_FRAMES", 20)
    with txmq.Broker(tmp_path / "d", fsync="commit", num_coordinators=1) as b:
        b.create_topic("a")
        b.create_topic("b")
        with b.transaction() as t:
            b.producer("b").send(b"x", txn=t)
        b.delete_topic("b")
        pa = b.producer("a")
        for i in range(15):
            t = b.new_transaction()
            pa.send(b"y%d" % i, txn=t)
            t.commit()
            assert t.state.value == "COMMITTED"


# -- a topic deleted and created again inside an open transaction ------------------------------


def test_recreated_topic_data_of_committed_txn_is_visible(tmp_path):
    """A transaction registers a partition by (topic, index); after the
    topic is deleted and created again under the same name, a send to the
    new partition must register the new partition, so the commit makes
    its message visible and leaves the partition unblocked."""
    with txmq.Broker(tmp_path / "d", fsync="never") as b:
        b.create_topic("t")
        txn = b.new_transaction()
        b.producer("t").send(b"old", txn=txn)
        b.delete_topic("t")
        b.create_topic("t")
        c = b.subscribe("t", "rc", initial_position="earliest")
        b.producer("t").send(b"new", txn=txn)
        txn.commit()
        assert txn.state.value == "COMMITTED"
        assert [m.value for m in c.receive_many(10, 0.3)] == [b"new"]
        assert _partition_stats(b, "t")["blocked_by"] is None
