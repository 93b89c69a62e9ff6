"""Transactions through the embedded API (docs/GUARANTEES.md: G1–G3,
G6–G8): atomic produce, the bank, conflicting acks, timeouts, ordering behind
an open transaction, consume-process-produce, the API and the admin calls.
Crash scenarios are in test_txn_crash.py, the model test in
test_txn_model.py (both in this folder)."""

from __future__ import annotations

import threading
import time

import pytest

import txmq
from txmq.errors import (InvalidTxnStateError, InvalidTxnTimeoutError, IsolationLevelMismatchError,
                         SubscriptionTypeError, TransactionConflictError, TransactionNotFoundError,
                         TransactionTimeoutError)


@pytest.fixture
def broker(tmp_path):
    b = txmq.Broker(tmp_path / "data", fsync="never")
    yield b
    b.close()


def values(msgs):
    return [m.value for m in msgs]


def drain(consumer, timeout=0.2, n=10_000):
    out = []
    while True:
        got = consumer.receive_many(n, timeout)
        if not got:
            return out
        out += got


# -- 1. atomic produce across partitions and topics ----------------------------------------


@pytest.mark.parametrize("outcome", ["commit", "abort"])
def test_atomic_produce_three_partitions_two_topics(broker, outcome):
    broker.create_topic("t1", partitions=2)
    broker.create_topic("t2", partitions=1)
    p1, p2 = broker.producer("t1"), broker.producer("t2")
    rc1 = broker.subscribe("t1", "rc", initial_position="earliest")
    rc2 = broker.subscribe("t2", "rc", initial_position="earliest")
    ru1 = broker.subscribe("t1", "ru", isolation="read_uncommitted", initial_position="earliest")
    ru2 = broker.subscribe("t2", "ru", isolation="read_uncommitted", initial_position="earliest")
    txn = broker.new_transaction()
    sent = {0: [], 1: [], "t2": []}
    for i in range(5):
        sent[0].append(p1.send(f"a{i}".encode(), partition=0, txn=txn))
        sent[1].append(p1.send(f"b{i}".encode(), partition=1, txn=txn))
    sent["t2"] += list(p2.send_batch([f"c{i}".encode() for i in range(5)], txn=txn))
    assert rc1.receive_many(100, 0.1) == [] and rc2.receive_many(100, 0.1) == []
    # READ_UNCOMMITTED sees the open transaction's data at once.
    assert sorted(values(drain(ru1))) == sorted([f"a{i}".encode() for i in range(5)]
                                                + [f"b{i}".encode() for i in range(5)])
    assert values(drain(ru2)) == [f"c{i}".encode() for i in range(5)]
    getattr(txn, outcome)()
    if outcome == "commit":
        assert txn.state is txmq.TxnState.COMMITTED
        got = drain(rc1)
        for part, prefix in ((0, "a"), (1, "b")):
            mine = [m for m in got if m.partition == part]
            assert values(mine) == [f"{prefix}{i}".encode() for i in range(5)]   # in order
            assert [m.message_id for m in mine] == sent[part]
            assert all(m.txn_id == txn.id for m in mine)
        assert values(drain(rc2)) == [f"c{i}".encode() for i in range(5)]
    else:
        assert txn.state is txmq.TxnState.ABORTED
        assert drain(rc1) == [] and drain(rc2) == []
        # Later plain data is delivered; the aborted data never is.
        p1.send(b"after", partition=0)
        assert values(drain(rc1)) == [b"after"]
    # READ_UNCOMMITTED never delivers a marker.
    assert values(drain(ru1)) == ([] if outcome == "commit" else [b"after"])
    assert drain(ru2) == []


def test_atomic_produce_survives_reopen(tmp_path):
    path = tmp_path / "data"
    with txmq.Broker(path) as b:
        b.create_topic("t", partitions=3)
        p = b.producer("t")
        committed = b.new_transaction()
        aborted = b.new_transaction()
        left_open = b.new_transaction()
        for i in range(3):
            p.send(b"c%d" % i, partition=i, txn=committed)
            p.send(b"a%d" % i, partition=i, txn=aborted)
            p.send(b"o%d" % i, partition=i, txn=left_open)
        committed.commit()
        aborted.abort()
    with txmq.Broker(path) as b:
        assert b.stats()["transactions"]["recovered"]["aborted"] == 1   # the open one
        assert b.transactions() == []
        c = b.subscribe("t", "s", initial_position="earliest")
        assert sorted(values(drain(c))) == [b"c0", b"c1", b"c2"]
        for part in b.stats()["topics"]["t"]["partitions"]:
            assert part["open_transactions"] == 0
            assert part["max_read_position"] == part["end_offset"]
        # Sequences are never reused after a reopen.
        assert b.new_transaction().id not in (committed.id, aborted.id, left_open.id)


# -- 3. the bank -----------------------------------------------------------------------------


def test_bank_open_transfer_blocks_committed_reader_only(broker):
    broker.create_topic("C", partitions=1)
    p = broker.producer("C")
    system_d = broker.subscribe("C", "D", isolation="read_uncommitted", initial_position="earliest")
    system_e = broker.subscribe("C", "E", isolation="read_committed", initial_position="earliest")
    p.send(b"deposit 1")
    assert values(system_e.receive_many(10, 0.5)) == [b"deposit 1"]
    assert values(system_d.receive_many(10, 0.5)) == [b"deposit 1"]
    transfer = broker.new_transaction()
    p.send(b"transfer debit", txn=transfer)
    for i in range(3):
        p.send(b"withdrawal %d" % i)
        # D, monitoring, sees everything as it arrives, never blocked.
        got = values(drain(system_d, 0.1))
        assert got[-1] == b"withdrawal %d" % i
    p.send(b"transfer credit", txn=transfer)
    assert values(drain(system_d, 0.1)) == [b"transfer credit"]
    # E, processing, receives nothing after the transfer's first message.
    assert system_e.receive_many(10, 0.2) == []
    part = broker.stats()["topics"]["C"]["partitions"][0]
    assert part["blocked_by"] == str(transfer.id) and part["max_read_position"] == 1
    info = broker.transaction_info(transfer.id)
    assert info["state"] == "OPEN" and info["partitions"] == ["C/0"]
    transfer.commit()
    assert values(drain(system_e)) == [b"transfer debit", b"withdrawal 0", b"withdrawal 1",
                                       b"withdrawal 2", b"transfer credit"]


def test_read_committed_receiver_wakes_on_commit(broker):
    broker.create_topic("C")
    p = broker.producer("C")
    e = broker.subscribe("C", "E", initial_position="earliest")
    txn = broker.new_transaction()
    p.send(b"x", txn=txn)
    got = []
    t = threading.Thread(target=lambda: got.extend(e.receive_many(10, 5.0)))
    t.start()
    time.sleep(0.1)
    txn.commit()
    t.join()
    assert values(got) == [b"x"]


# -- 4. conflicting acks ------------------------------------------------------------------------


def test_two_transactions_ack_the_same_message(broker):
    broker.create_topic("t")
    broker.producer("t").send_batch([b"m0", b"m1", b"m2"])
    c = broker.subscribe("t", "s", type="shared", initial_position="earliest")
    ms = c.receive_many(3, 0.5)
    t1, t2 = broker.new_transaction(), broker.new_transaction()
    c.ack(ms[1], txn=t1)
    c.ack(ms[1], txn=t1)                     # the same transaction again: fine
    with pytest.raises(TransactionConflictError) as e:
        c.ack([ms[0], ms[1]], txn=t2)        # m0 is free, m1 is held: nothing changes
    assert e.value.txn_id == t2.id and e.value.other == t1.id
    assert e.value.message_id == ms[1].message_id
    t2.commit()
    t1.commit()
    # m0 was not acknowledged by t2's failed call: it is still unacked.
    c.nack([ms[0], ms[2]])
    assert sorted(values(drain(c, 1.5))) == [b"m0", b"m2"]


def test_ack_of_acknowledged_message_conflicts(broker):
    broker.create_topic("t")
    broker.producer("t").send_batch([b"m0", b"m1"])
    c = broker.subscribe("t", "s", initial_position="earliest")
    ms = c.receive_many(2, 0.5)
    c.ack(ms[0])
    txn = broker.new_transaction()
    with pytest.raises(TransactionConflictError, match="already acknowledged"):
        c.ack(ms[0], txn=txn)
    with pytest.raises(TransactionConflictError, match="already acknowledged"):
        c.ack_cumulative(ms[0], txn=txn)
    c.ack(ms[1], txn=txn)
    txn.commit()
    t2 = broker.new_transaction()
    with pytest.raises(TransactionConflictError):
        c.ack(ms[1], txn=t2)                 # acknowledged by t1's commit


def test_cumulative_ack_conflicts_with_pending_below(broker):
    broker.create_topic("t")
    broker.producer("t").send_batch([b"m%d" % i for i in range(5)])
    c = broker.subscribe("t", "s", type="failover", initial_position="earliest")
    ms = c.receive_many(5, 0.5)
    t1, t2 = broker.new_transaction(), broker.new_transaction()
    c.ack(ms[2], txn=t1)
    with pytest.raises(TransactionConflictError):
        c.ack_cumulative(ms[4], txn=t2)
    c.ack_cumulative(ms[1], txn=t2)          # below t1's pending ack: fine
    with pytest.raises(TransactionConflictError):
        c.ack(ms[0], txn=t1)                 # covered by t2's cumulative ack
    t2.commit()
    t1.abort()
    again = drain(c, 1.5)
    assert values(again) == [b"m2"] and again[0].redelivery_count == 1


def test_cumulative_ack_in_shared_subscription_refused(broker):
    broker.create_topic("t")
    broker.producer("t").send(b"m")
    c = broker.subscribe("t", "s", type="shared", initial_position="earliest")
    m = c.receive(0.5)
    with pytest.raises(SubscriptionTypeError):
        c.ack_cumulative(m, txn=broker.new_transaction())


def test_pending_message_is_not_redelivered_until_abort(broker):
    broker.create_topic("t")
    broker.producer("t").send_batch([b"a", b"b"])
    sub = dict(type="shared", initial_position="earliest", ack_timeout=0.2)
    c1 = broker.subscribe("t", "s", **sub)
    c2 = broker.subscribe("t", "s", **sub)
    ms = c1.receive_many(2, 0.5)
    txn = broker.new_transaction()
    c1.ack(ms[0], txn=txn)
    c1.nack([ms[0]])                         # pending: a nack does not release it
    c1.close()                               # nor does its consumer leaving
    got = c2.receive_many(10, 0.5)
    assert values(got) == [b"b"]
    c2.ack(got)
    assert c2.receive_many(10, 0.6) == []    # nor an ack timeout
    txn.abort()
    again = c2.receive_many(10, 1.0)
    assert values(again) == [b"a"] and again[0].redelivery_count >= 1


# -- 5. timeouts ------------------------------------------------------------------------------


def test_timeout_aborts_and_later_use_fails(broker):
    broker.create_topic("t")
    broker.producer("t").send(b"in")
    p = broker.producer("t")
    c = broker.subscribe("t", "s", initial_position="earliest")
    m = c.receive(0.5)
    txn = broker.new_transaction(timeout=0.2)
    p.send(b"out", txn=txn)
    c.ack(m, txn=txn)
    deadline = time.monotonic() + 5
    while txn.state is not txmq.TxnState.ABORTED and time.monotonic() < deadline:
        time.sleep(0.02)
    assert txn.state is txmq.TxnState.ABORTED
    with pytest.raises(TransactionTimeoutError) as e:
        p.send(b"late", txn=txn)
    assert e.value.txn_id == txn.id
    with pytest.raises(TransactionTimeoutError):
        c.ack(m, txn=txn)
    with pytest.raises(TransactionTimeoutError):
        txn.commit()
    txn.abort()                              # the broker already did: no error
    assert broker.stats()["transactions"]["timed_out"] == 1
    # Its data never shows; its ack was dropped, so the input comes again.
    again = c.receive(1.0)
    assert again.value == b"in" and again.redelivery_count == 1
    assert c.receive(0.2) is None


def test_commit_after_deadline_is_refused_even_before_the_timer(broker):
    broker.create_topic("t")
    c = broker.subscribe("t", "s", initial_position="earliest")
    broker._scheduler.stop()                 # no timer: only commit() can notice
    txn = broker.new_transaction(timeout=0.05)
    broker.producer("t").send(b"late", txn=txn)
    time.sleep(0.1)
    with pytest.raises(TransactionTimeoutError):
        txn.commit()
    assert txn.state is txmq.TxnState.ABORTED
    assert c.receive_many(10, 0.1) == []


def test_context_manager_timeout_raises_not_masked(broker):
    broker.create_topic("t")
    with pytest.raises(TransactionTimeoutError):
        with broker.transaction(timeout=0.1) as txn:
            broker.producer("t").send(b"x", txn=txn)
            time.sleep(0.4)
    assert txn.state is txmq.TxnState.ABORTED


def test_invalid_timeouts(tmp_path):
    with txmq.Broker(tmp_path / "d", fsync="never", transaction_timeout_max=10) as b:
        for bad in (0, -1, 10.5, "60", None, True):
            with pytest.raises(InvalidTxnTimeoutError):
                b.new_transaction(timeout=bad)
        assert b.new_transaction(timeout=10).timeout == 10


# -- 6. order: plain data after an open transaction waits for it --------------------------------


def test_plain_message_after_open_transaction_waits(broker):
    broker.create_topic("t")
    p = broker.producer("t")
    c = broker.subscribe("t", "s", initial_position="earliest")
    p.send(b"before")
    txn = broker.new_transaction()
    p.send(b"txn", txn=txn)
    p.send(b"plain after")
    assert values(drain(c, 0.1)) == [b"before"]
    txn.abort()
    assert values(drain(c)) == [b"plain after"]


def test_receive_batch_skips_markers_and_aborted(broker):
    broker.create_topic("t")
    p = broker.producer("t")
    c = broker.subscribe("t", "s", initial_position="earliest")
    for i in range(4):
        txn = broker.new_transaction()
        p.send_batch([b"%d-%d" % (i, j) for j in range(3)], txn=txn)
        txn.commit() if i % 2 == 0 else txn.abort()
    got = []
    while (rb := c.receive_batch(100, 0.2)) is not None:
        got += rb.column("value").to_pylist()
        c.ack(rb)
    assert got == [b"0-0", b"0-1", b"0-2", b"2-0", b"2-1", b"2-2"]
    # Markers and aborted data count as passed: nothing is left behind.
    stats = broker.stats()["topics"]["t"]["subscriptions"]["s"]
    assert stats["backlog"] == 0 and stats["partitions"][0]["mark_delete"] == 16


# -- the API and admin ------------------------------------------------------------------------


def begun_in_threads(broker, threads: int, per_thread: int) -> list:
    """The ids of ``per_thread`` transactions begun in each of ``threads``
    threads (one after the other), in each thread's order."""
    out = []

    def run():
        out.append([broker.new_transaction().id for _ in range(per_thread)])
    for _ in range(threads):
        t = threading.Thread(target=run)
        t.start()
        t.join()
    return out


def test_txn_id_shape(broker):
    by_thread = begun_in_threads(broker, 4, 3)
    # One coordinator per thread, the threads round-robin over the 4.
    assert [{i.coordinator for i in ids} for ids in by_thread] == [{0}, {1}, {2}, {3}]
    assert all([i.sequence - ids[0].sequence for i in ids] == [0, 1, 2] for ids in by_thread)
    assert {broker.new_transaction().id.coordinator for _ in range(3)} == {4 % 4}    # this thread: the fifth
    i = by_thread[1][0]
    assert str(i) == f"({i.coordinator},{i.sequence})"
    hi, lo = i.words
    assert hi >> 48 == i.coordinator and int(i) == (hi << 64) | lo
    assert txmq.TxnID.parse(str(i)) == i and txmq.TxnID.from_words(hi, lo) == i


def test_states_and_invalid_transitions(broker):
    broker.create_topic("t")
    txn = broker.new_transaction()
    assert txn.state is txmq.TxnState.OPEN
    txn.commit()
    with pytest.raises(InvalidTxnStateError) as e:
        txn.abort()
    assert e.value.state == "COMMITTED" and "abort" in str(e.value)
    with pytest.raises(InvalidTxnStateError):
        txn.commit()
    with pytest.raises(InvalidTxnStateError):
        broker.producer("t").send(b"x", txn=txn)
    aborted = broker.new_transaction()
    aborted.abort()
    with pytest.raises(InvalidTxnStateError) as e:
        aborted.commit()
    assert e.value.state == "ABORTED"


def test_with_block_commits_or_aborts(broker):
    broker.create_topic("t")
    p = broker.producer("t")
    c = broker.subscribe("t", "s", initial_position="earliest")
    with broker.transaction() as ok:
        p.send(b"kept", txn=ok)
    with pytest.raises(ZeroDivisionError):
        with broker.transaction() as bad:
            p.send(b"dropped", txn=bad)
            1 / 0
    assert ok.state is txmq.TxnState.COMMITTED and bad.state is txmq.TxnState.ABORTED
    assert values(drain(c)) == [b"kept"]


def test_admin_list_info_force_abort(broker):
    broker.create_topic("t", partitions=2)
    broker.producer("t").send(b"in", partition=1)
    c = broker.subscribe("t", "s", initial_position="earliest")
    m = c.receive(0.5)
    txn = broker.new_transaction(timeout=30)
    p = broker.producer("t")
    p.send(b"x", partition=0, txn=txn)
    p.flush()                    # appended now, not at the commit: it holds the partition back
    c.ack(m, txn=txn)
    [info] = broker.transactions()
    assert info["id"] == str(txn.id) and info["state"] == "OPEN" and info["timeout_s"] == 30
    assert info["partitions"] == ["t/0"] and info["subscriptions"] == ["t/s"]
    by_text = broker.transaction_info(str(txn.id))
    by_id = broker.transaction_info(txn.id)
    assert by_text.pop("age_s") <= by_id.pop("age_s") and by_text == by_id
    part = broker.stats()["topics"]["t"]["partitions"][0]
    assert part["blocked_by"] == str(txn.id) and part["blocked_since_ms"] > 0
    broker.abort_transaction(txn.id)
    assert txn.state is txmq.TxnState.ABORTED and broker.transactions() == []
    with pytest.raises(InvalidTxnStateError):
        broker.producer("t").send(b"late", partition=0, txn=txn)
    with pytest.raises(TransactionNotFoundError) as e:
        broker.transaction_info(txn.id)
    assert e.value.txn_id == txn.id
    with pytest.raises(TransactionNotFoundError):
        broker.abort_transaction((3, 999))
    assert broker.stats()["topics"]["t"]["partitions"][0]["blocked_by"] is None


def test_isolation_mismatch_and_stats(broker):
    broker.create_topic("t")
    broker.subscribe("t", "s", isolation="read_uncommitted").close()
    with pytest.raises(IsolationLevelMismatchError):
        broker.subscribe("t", "s")                       # default read_committed
    assert broker.stats()["topics"]["t"]["subscriptions"]["s"]["isolation"] == "read_uncommitted"


def test_transaction_of_another_broker_refused(tmp_path, broker):
    broker.create_topic("t")
    with txmq.Broker(tmp_path / "other", fsync="never") as other:
        other.create_topic("t")
        txn = other.new_transaction()
        with pytest.raises(txmq.errors.InvalidArgumentError):
            broker.producer("t").send(b"x", txn=txn)


def test_consume_process_produce_exactly_once(broker):
    """Consume-process-produce without crashes: the output of an input is committed iff
    the input's ack is (G6)."""
    for t in ("A1", "A2", "B"):
        broker.create_topic(t)
    broker.producer("A1").send_batch([b"1", b"2", b"3"])
    broker.producer("A2").send_batch([b"10", b"20"])
    out = broker.producer("B")
    c1 = broker.subscribe("A1", "agg", initial_position="earliest")
    c2 = broker.subscribe("A2", "agg", initial_position="earliest")
    # First attempt aborts: nothing of it shows, the inputs come again.
    for commit in (False, True):
        txn = broker.new_transaction()
        m1, m2 = c1.receive_many(10, 1.5), c2.receive_many(10, 1.5)
        total = sum(int(m.value) for m in m1 + m2)
        out.send(str(total).encode(), txn=txn)
        c1.ack(m1, txn=txn)
        c2.ack(m2, txn=txn)
        txn.commit() if commit else txn.abort()
    b = broker.subscribe("B", "check", initial_position="earliest")
    assert values(drain(b)) == [b"36"]
    assert c1.receive_many(10, 0.2) == [] and c2.receive_many(10, 0.2) == []
    subs = broker.stats()["topics"]
    assert subs["A1"]["subscriptions"]["agg"]["backlog"] == 0


def test_concurrent_commits_share_syncs(tmp_path):
    """Many threads committing under fsync="commit": every transaction
    lands whole (group commit must not lose or mix anything)."""
    with txmq.Broker(tmp_path / "d", fsync="commit") as b:
        b.create_topic("t", partitions=2)
        p = b.producer("t")
        errors = []

        def work(k):
            try:
                for i in range(20):
                    with b.transaction() as txn:
                        p.send_batch([b"%d-%d-%d" % (k, i, j) for j in range(3)], partition=k % 2, txn=txn)
            except Exception as e:        # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        c = b.subscribe("t", "s", initial_position="earliest")
        got = values(drain(c))
        assert len(got) == 6 * 20 * 3 and len(set(got)) == len(got)
        assert b.stats()["transactions"]["committed"] == 120


# -- ending twice, ending after the broker did, a plain ack of a pending message ------------


def test_a_second_abort_is_a_no_op_and_commit_after_abort_still_raises(broker):
    broker.create_topic("t")
    p = broker.producer("t")
    c = broker.subscribe("t", "s", initial_position="earliest")
    p.send(b"in")
    m = c.receive(1.0)
    txn = broker.new_transaction()
    p.send(b"out", txn=txn)
    c.ack(m, txn=txn)
    txn.abort()
    txn.abort()                                    # no error, nothing more happens
    assert txn.state is txmq.TxnState.ABORTED
    with pytest.raises(InvalidTxnStateError) as e:
        txn.commit()
    assert e.value.state == "ABORTED"
    again = c.receive(1.0)                         # redelivered once, not twice
    assert again.value == b"in" and again.redelivery_count == 1 and c.receive(0.2) is None
    committed = broker.new_transaction()
    committed.commit()
    with pytest.raises(InvalidTxnStateError):
        committed.abort()                          # a commit is not undone by an abort


def test_abort_after_a_force_abort_is_a_no_op(broker):
    txn = broker.new_transaction()
    broker.abort_transaction(txn.id)
    txn.abort()
    assert txn.state is txmq.TxnState.ABORTED


def test_a_transaction_open_at_close_reads_aborted(tmp_path):
    b = txmq.Broker(tmp_path / "d", fsync="never")
    b.create_topic("t")
    p = b.producer("t")
    c = b.subscribe("t", "s", initial_position="earliest")
    p.send(b"in")
    m = c.receive(1.0)
    txn = b.new_transaction()
    p.send(b"out", txn=txn)
    c.ack(m, txn=txn)
    done = b.new_transaction()
    done.commit()
    b.close()
    assert txn.state is txmq.TxnState.ABORTED and done.state is txmq.TxnState.COMMITTED
    assert "ABORTED" in repr(txn)
    txn.abort()                                    # the close aborted it: no error
    with pytest.raises(txmq.errors.BrokerClosedError):
        txn.commit()
    with pytest.raises(txmq.errors.BrokerClosedError):
        p.send(b"late", txn=txn)
    with txmq.Broker(tmp_path / "d", fsync="never") as b:
        c = b.subscribe("t", "s")
        assert values(drain(c)) == [b"in"]             # its send gone, its ack dropped


def _pending_setup(broker, sub_type="exclusive"):
    broker.create_topic("t")
    broker.producer("t").send_batch([b"m%d" % i for i in range(6)])
    c = broker.subscribe("t", "s", sub_type, initial_position="earliest")
    return c, c.receive_many(6, 1.0)


@pytest.mark.parametrize("sub_type", ["exclusive", "shared"])
def test_a_plain_ack_of_a_message_pending_in_a_transaction_is_refused(broker, sub_type):
    c, ms = _pending_setup(broker, sub_type)
    txn = broker.new_transaction()
    c.ack(ms[2], txn=txn)
    for plain in (ms[2], [ms[0], ms[2]], ms[2].message_id, [ms[1], ms[3], ms[2]]):
        with pytest.raises(TransactionConflictError) as e:
            c.ack(plain)
        assert e.value.txn_id is None and e.value.other == txn.id
        assert e.value.message_id == ms[2].message_id
        assert str(txn.id) in str(e.value) and "pending" in str(e.value)
    # Nothing of a refused ack was applied, the other messages included.
    lag = broker.consumer_lag("t", "s")[0]
    assert lag == 6
    txn.abort()
    again = c.receive_many(10, 1.0)
    assert [m.offset for m in again] == [2] and again[0].redelivery_count == 1
    c.ack(ms[:2] + again + ms[3:])                 # free again: a plain ack takes it
    assert broker.consumer_lag("t", "s")[0] == 0


def test_the_refused_plain_ack_never_stays_after_the_transaction_aborts(tmp_path):
    b = txmq.Broker(tmp_path / "d", fsync="never")
    c, ms = _pending_setup(b)
    txn = b.new_transaction()
    c.ack(ms[4], txn=txn)
    with pytest.raises(TransactionConflictError):
        c.ack(ms[4])
    txn.abort()
    c.ack([m for m in ms if m.offset != 4])
    c.close()
    b.close()
    with txmq.Broker(tmp_path / "d", fsync="never") as b:
        c = b.subscribe("t", "s")
        assert [m.offset for m in drain(c)] == [4]


def test_plain_cumulative_and_batch_acks_of_pending_messages_are_refused(broker):
    c, ms = _pending_setup(broker)
    txn = broker.new_transaction()
    c.ack(ms[3], txn=txn)
    with pytest.raises(TransactionConflictError) as e:
        c.ack_cumulative(ms[4])                    # would acknowledge offset 3 too
    assert e.value.message_id.offset == 3 and e.value.other == txn.id
    c.ack_cumulative(ms[2])                        # below it: fine
    txn.abort()
    c.seek(3)
    rb = c.receive_batch(10, 1.0)
    assert rb.column("offset").to_pylist() == [3, 4, 5]
    cum = broker.new_transaction()
    c.ack_cumulative(ms[4], txn=cum)               # a transaction's cumulative ack holds 3 and 4
    with pytest.raises(TransactionConflictError) as e:
        c.ack(rb)
    assert e.value.message_id.offset == 3 and e.value.other == cum.id
    with pytest.raises(TransactionConflictError):
        c.ack(ms[4])
    with pytest.raises(TransactionConflictError):
        c.ack_cumulative(ms[5])
    assert broker.consumer_lag("t", "s")[0] == 3
    cum.commit()
    c.ack(ms[5])
    assert broker.consumer_lag("t", "s")[0] == 0
