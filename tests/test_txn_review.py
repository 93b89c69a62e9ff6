"""Review of the transactions change: each test shows a bug (they fail
until it is fixed). See the review report for the analysis."""

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


# -- 1. a failing prepare leaves the transaction COMMITTING forever ----------------------------


def test_commit_after_participant_topic_deleted_does_not_wedge(tmp_path):
    """coordinator.end() prepares (p.sync_to(p.end_offset)) every participant
    before it decides, with no handling for a deleted one: the closed
    partition raises IndexError, the transaction stays COMMITTING with no
    decision, the timeout never aborts it (not OPEN) and force-abort is
    refused, so topic "a" is blocked for READ_COMMITTED until a restart."""
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
    """Same hole on the subscription side: prepare_txn() fdatasyncs the
    closed pending-ack log (fd -1 -> ValueError); the output topic of the
    consume-process-produce transaction stays blocked forever."""
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


# -- 2. coordinator compaction after a topic delete -------------------------------------------


def test_coordinator_compaction_after_topic_delete(tmp_path, monkeypatch):
    """TransactionCoordinator._compact() syncs every partition touched since
    the last compaction with p.sync_to(p.end_offset); for a deleted topic
    p.end_offset raises IndexError (only BrokerClosedError is caught). The
    compaction runs inside _finish() of an unrelated, already-decided
    commit: commit() raises IndexError and the Transaction stays
    COMMITTING although it committed (or inside begin(): new_transaction
    fails). COMPACT_FRAMES is lowered so the compaction comes soon."""
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


# -- 3. a topic deleted and created again inside an open transaction ----------------------------


def test_recreated_topic_data_of_committed_txn_is_visible(tmp_path):
    """Producer._append() skips registering a partition whose (topic, index)
    key is already in meta.partitions, but the key now names the closed
    Partition of the deleted topic. The append to the new partition enters
    its transaction buffer, yet commit() ends only the old object (the
    BrokerClosedError is swallowed by _participant_exists): commit returns,
    the message is invisible and the new partition is blocked by a
    transaction its coordinator has forgotten (until a restart; and once the
    coordinator log is compacted, the restart aborts the committed data)."""
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


# -- 4. receive + ack inside one big transaction is quadratic ------------------------------------


def test_receive_and_ack_in_one_large_transaction_is_linear(tmp_path):
    """Every receive calls _touches() -> PendingAckTable.next_pending(),
    which walks every offset pending in the lane (and settled() calls
    is_pending() per message): consuming N messages and acking each in one
    transaction costs O(N^2). 60k messages should take ~1 s; they take
    ~15 s. The loop stops at the deadline so the test stays short."""
    n = 60_000
    with txmq.Broker(tmp_path / "d", fsync="never") as b:
        b.create_topic("t")
        b.producer("t").send_batch([b"x"] * n)
        c = b.subscribe("t", "s", initial_position="earliest")
        txn = b.new_transaction(timeout=120)
        done = 0
        deadline = time.monotonic() + 4.0
        while done < n and time.monotonic() < deadline:
            m = c.receive(1.0)
            assert m is not None
            c.ack(m, txn=txn)
            done += 1
        txn.abort()
        assert done == n, f"only {done} of {n} received and acked in a transaction in 4 s"
