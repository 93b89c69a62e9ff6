"""A subscription's backlog (consumer_lag, stats, the read-only view)
counts what will be delivered again, before and after a reopen."""

from __future__ import annotations

import pytest

import txmq
import txmq.readonly

# linger_ms=0: every send appended at once, so an aborted transaction leaves its data.
FAST = dict(fsync="never", control_socket=False, linger_ms=0)


@pytest.mark.parametrize("isolation", ["read_committed", "read_uncommitted"])
def test_backlog_after_a_clean_reopen_counts_no_marker(tmp_path, isolation):
    """A consumer read a committed transaction's 3 messages (past its
    COMMIT marker) and an aborted one's, acked nothing: the lag is what
    will be delivered again, before and after a reopen."""
    d = tmp_path / "d"
    with txmq.Broker(d, **FAST) as b:
        b.create_topic("t")
        c = b.subscribe("t", "s", initial_position="earliest", isolation=isolation)
        p = b.producer("t")
        with b.transaction() as txn:
            for i in range(3):
                p.send(b"c%d" % i, txn=txn)
        txn = b.new_transaction()
        p.send(b"a", txn=txn)
        txn.abort()
        p.send(b"plain")
        got = c.receive_many(10, timeout=0.5)
        before = b.consumer_lag("t", "s")
        stats_before = b.stats()["topics"]["t"]["subscriptions"]["s"]["backlog"]
    expect = len(got)
    assert expect == (4 if isolation == "read_committed" else 5)
    assert before == {0: expect} and stats_before == expect
    assert _readonly_backlog(d) == expect
    with txmq.Broker(d, **FAST) as b:
        assert b.consumer_lag("t", "s") == {0: expect}
        assert _readonly_backlog(d) == expect
        c = b.subscribe("t", "s", isolation=isolation)
        again = c.receive_many(10, timeout=0.5)
        assert [m.value for m in again] == [m.value for m in got]
        c.ack(again)
        assert b.consumer_lag("t", "s") == {0: 0}


def _readonly_backlog(d):
    view = txmq.readonly.open(d)
    try:
        return view.subscription("t", "s")["partitions"][0]["backlog"]
    finally:
        view.close()
