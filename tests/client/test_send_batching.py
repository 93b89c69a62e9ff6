"""One-message sends inside a transaction are batched (docs/API.md, "Sends
inside a transaction are batched"): what reaches the log when, what a
read_uncommitted reader sees of an open transaction, and which errors a
send still raises itself and which surface at the flush or the commit."""

from __future__ import annotations

import gc
import time

import pytest

import txmq
from txmq._accumulator import PendingMessageId
from txmq.errors import (InvalidArgumentError, InvalidMessageError, InvalidTxnStateError, MessageTooLargeError,
                         ProducerFencedError, TopicNotFoundError, TransactionTimeoutError)
from txmq.message import MessageId

from batching import LONG, batches, disk_full


@pytest.fixture
def broker(tmp_path):
    b = txmq.Broker(tmp_path / "data", fsync="never", linger_ms=LONG)
    yield b
    b.close()


def drain(consumer):
    out = []
    while ms := consumer.receive_many(1000, 0.05):
        out += ms
        consumer.ack(ms)
    return out


def test_sends_of_a_transaction_reach_the_log_as_one_batch_at_commit(broker):
    broker.create_topic("t", 1)
    p = broker.producer("t")
    txn = broker.new_transaction()
    mids = [p.send(b"m%d" % i, partition=0, txn=txn) for i in range(100)]
    assert all(type(m) is PendingMessageId and not m.done() for m in mids)
    assert broker.high_watermark("t", 0) == 0 and batches(broker) == []
    # The transaction lists its partition from the first send on.
    assert broker.transaction_info(txn.id)["partitions"] == ["t/0"]
    txn.commit()
    assert batches(broker) == [(0, 100, True), (100, 1, True)]      # the data, then the COMMIT marker
    assert [m.offset for m in mids] == list(range(100))
    assert mids[7] == MessageId("t", 0, 7) and tuple(mids[7]) == ("t", 0, 7)
    c = broker.subscribe("t", "s", initial_position="earliest")
    assert [m.value for m in drain(c)] == [b"m%d" % i for i in range(100)]


def test_asking_for_an_offset_appends_the_batch(broker):
    broker.create_topic("t", 1)
    p = broker.producer("t")
    txn = broker.new_transaction()
    first = p.send(b"a", partition=0, txn=txn)
    second = p.send(b"b", partition=0, txn=txn)
    assert second.offset == 1 and first.done() and second.done()
    third = p.send(b"c", partition=0, txn=txn)
    assert batches(broker) == [(0, 2, True)] and not third.done()
    p.flush()
    assert third.done() and third.offset == 2 and batches(broker) == [(0, 2, True), (2, 1, True)]
    txn.commit()


def test_a_full_batch_is_appended_while_the_transaction_is_open(tmp_path):
    with txmq.Broker(tmp_path / "d", fsync="never", linger_ms=LONG, batch_bytes=1000) as b:
        b.create_topic("t", 1)
        p = b.producer("t")
        txn = b.new_transaction()
        for i in range(100):
            p.send(b"x" * 100, partition=0, txn=txn)
        sizes = [n for _, n, _ in batches(b)]
        assert sizes and sum(sizes) > 80 and all(n <= 9 for n in sizes)   # 100 B + 16 per message
        txn.commit()
        assert sum(n for _, n, _ in batches(b)) == 101


def test_read_uncommitted_sees_an_open_transaction_after_linger(tmp_path):
    """The bank demo's monitor: an open transfer's legs are visible to a
    read_uncommitted reader within linger_ms (and the timer's period),
    while the transaction stays open and a read_committed one sees none."""
    with txmq.Broker(tmp_path / "d", fsync="never", linger_ms=20) as b:
        b.create_topic("t", 1)
        ru = b.subscribe("t", "ru", isolation="read_uncommitted", initial_position="earliest")
        rc = b.subscribe("t", "rc", isolation="read_committed", initial_position="earliest")
        txn = b.new_transaction()
        mid = b.producer("t").send(b"leg", partition=0, txn=txn)
        got = ru.receive(timeout=5.0)
        assert got is not None and got.value == b"leg" and txn.state == "OPEN"
        assert mid.done() and got.offset == mid.offset and got.txn_id == txn.id
        assert rc.receive(timeout=0.1) is None
        txn.commit()
        assert rc.receive(timeout=1.0).value == b"leg"


def test_linger_zero_appends_every_send(tmp_path):
    with txmq.Broker(tmp_path / "d", fsync="never", linger_ms=0) as b:
        b.create_topic("t", 1)
        txn = b.new_transaction()
        mid = b.producer("t").send(b"a", partition=0, txn=txn)
        assert type(mid) is MessageId and b.high_watermark("t", 0) == 1
        txn.abort()


def test_an_abort_drops_what_was_never_appended(broker):
    broker.create_topic("t", 1)
    p = broker.producer("t")
    txn = broker.new_transaction()
    mids = [p.send(b"x", partition=0, txn=txn) for _ in range(5)]
    txn.abort()
    assert batches(broker) == [] and broker.aborted_transactions("t", 0, 0) == []
    with pytest.raises(InvalidTxnStateError):
        mids[0].offset          # never appended: the id says why
    p.send(b"after", partition=0)
    assert batches(broker) == [(0, 1, False)]


def test_a_plain_send_after_batched_ones_keeps_the_producers_order(broker):
    broker.create_topic("t", 1)
    p = broker.producer("t")
    txn = broker.new_transaction()
    p.send(b"in-txn", partition=0, txn=txn)
    plain = p.send(b"plain", partition=0)
    assert plain.offset == 1 and batches(broker) == [(0, 1, True), (1, 1, False)]
    txn.commit()


def test_a_send_refuses_by_itself_what_it_can(broker):
    broker.create_topic("t", 1, )
    p = broker.producer("t")
    txn = broker.new_transaction()
    with pytest.raises(InvalidMessageError):
        p.send("not bytes", partition=0, txn=txn)
    with pytest.raises(InvalidMessageError):
        p.send(b"v", partition=0, txn=txn, headers={"h": 1})
    with pytest.raises(InvalidMessageError):
        p.send(b"v", partition=0, txn=txn, event_time=1.5)
    with pytest.raises(MessageTooLargeError):
        p.send(b"x" * (broker._partition_options["max_message_bytes"] + 1), partition=0, txn=txn)
    with pytest.raises(InvalidArgumentError):
        p.send(b"v", partition=0, txn="not a transaction")
    p.send(b"ok", partition=0, txn=txn, headers={"h": b"1"}, event_time=5)
    txn.commit()
    with pytest.raises(InvalidTxnStateError):       # a committed transaction: at the send
        p.send(b"late", partition=0, txn=txn)
    c = broker.subscribe("t", "s", initial_position="earliest")
    [m] = drain(c)
    assert m.value == b"ok" and m.headers == [("h", b"1")] and m.event_time == 5


def test_a_timed_out_transaction_refuses_the_send(broker):
    broker.create_topic("t", 1)
    p = broker.producer("t")
    txn = broker.new_transaction(timeout=0.05)
    p.send(b"x", partition=0, txn=txn)
    deadline = time.monotonic() + 5
    while txn.state == "OPEN" and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(TransactionTimeoutError):
        p.send(b"y", partition=0, txn=txn)
    with pytest.raises(TransactionTimeoutError):
        txn.commit()
    assert batches(broker) == []


def test_a_fenced_transactional_producer_is_refused_at_the_send(broker):
    broker.create_topic("t", 1)
    old = broker.transactional_producer("tid")
    out = old.producer("t")
    txn = old.begin()
    out.send(b"zombie", partition=0, txn=txn)
    broker.transactional_producer("tid")           # a newer instance fences the old one
    with pytest.raises(ProducerFencedError):
        out.send(b"more", partition=0, txn=txn)
    with pytest.raises(ProducerFencedError):
        txn.commit()
    assert [n for _, n, _ in batches(broker)] == []


def test_a_topic_deleted_before_the_send_is_named(broker):
    broker.create_topic("t", 1)
    p = broker.producer("t")
    txn = broker.new_transaction()
    broker.delete_topic("t")
    with pytest.raises(TopicNotFoundError):
        p.send(b"x", partition=0, txn=txn)


def test_a_topic_deleted_after_the_send_drops_its_batch_and_commits_the_rest(broker):
    """As data appended before a topic's deletion goes with it: the batch has
    nowhere to go, its ids name the deleted topic, the other participants
    commit."""
    broker.create_topic("t", 1)
    broker.create_topic("other", 1)
    p, q = broker.producer("t"), broker.producer("other")
    txn = broker.new_transaction()
    mid = p.send(b"x", partition=0, txn=txn)
    q.send(b"y", partition=0, txn=txn)
    broker.delete_topic("t")
    txn.commit()
    assert txn.state == "COMMITTED"
    with pytest.raises(TopicNotFoundError):
        mid.offset
    c = broker.subscribe("other", "s", isolation="read_committed", initial_position="earliest")
    assert [m.value for m in drain(c)] == [b"y"]


def test_a_failed_append_fails_the_commit_which_aborts(broker, monkeypatch):
    """What the log refuses at the append (here a full disk) surfaces at the
    flush, the commit: the transaction aborts, nothing of it takes effect."""
    broker.create_topic("t", 1)
    broker.create_topic("other", 1)
    p, q = broker.producer("t"), broker.producer("other")
    txn = broker.new_transaction()
    mid = p.send(b"x", partition=0, txn=txn)
    q.send(b"y", partition=0, txn=txn)
    disk_full(monkeypatch, broker._topics["t"].partitions[0])
    with pytest.raises(OSError):
        txn.commit()
    assert txn.state == "ABORTED"
    with pytest.raises(OSError):
        mid.offset
    monkeypatch.undo()
    c = broker.subscribe("other", "s", isolation="read_committed", initial_position="earliest")
    assert drain(c) == []


def test_a_batched_send_in_a_transaction_of_another_broker_is_refused(tmp_path, broker):
    broker.create_topic("t", 1)
    with txmq.Broker(tmp_path / "other", fsync="never") as b2:
        with pytest.raises(InvalidArgumentError):
            broker.producer("t").send(b"x", partition=0, txn=b2.new_transaction())


def test_sequences_stay_exact_across_batches(broker):
    """An idempotent producer's sequence counts messages, batched or not."""
    broker.create_topic("t", 1)
    p = broker.producer("t", name="svc")
    txn = broker.new_transaction()
    for i in range(10):
        p.send(b"%d" % i, partition=0, txn=txn)
    txn.commit()
    assert p.last_sequence == {0: 9}
    assert p.send(b"next", partition=0, sequence=10).offset == 11      # after the marker at 10
    assert p.send(b"next", partition=0, sequence=10).offset == 11      # a retry: appended once


def test_close_appends_what_an_open_transaction_accumulated(tmp_path):
    """The next open aborts the open transaction it finds in the log."""
    path = tmp_path / "d"
    with txmq.Broker(path, fsync="never", linger_ms=LONG) as b:
        b.create_topic("t", 1)
        txn = b.new_transaction()
        b.producer("t").send(b"open", partition=0, txn=txn)
    with txmq.Broker(path, fsync="never") as b:
        assert b.stats()["transactions"]["recovered"]["aborted"] == 1
        c = b.subscribe("t", "s", isolation="read_uncommitted", initial_position="earliest")
        assert [m.value for m in drain(c)] == [b"open"]


def test_a_named_producer_fenced_before_the_commit_fails_it(broker):
    """The fence is checked again when the batch is appended: the commit of
    a transaction whose batch a fenced instance accumulated aborts."""
    broker.create_topic("t", 1)
    old = broker.producer("t", name="svc")
    txn = broker.new_transaction()
    old.send(b"zombie", partition=0, txn=txn)
    new = broker.producer("t", name="svc")            # fences old
    with pytest.raises(ProducerFencedError):
        old.send(b"more", partition=0, txn=txn)
    with pytest.raises(ProducerFencedError):
        txn.commit()
    assert txn.state == "ABORTED" and batches(broker) == []
    assert new.send(b"fresh", partition=0).offset == 0


@pytest.mark.parametrize("batching", [False, True], ids=["transaction", "batching-producer"])
def test_ids_stay_exact_when_a_flush_runs_inside_a_send(broker, batching):
    """Another thread can run between any two allocations of a send: the
    garbage collector, which an allocation may start, runs Python code
    (its callbacks, finalizers), and the GIL can change hands there. Here
    a collection at every allocation flushes the open batch, as the timer
    would: every id still names its own message, keys, headers and event
    times included."""
    broker.create_topic("t", 1)
    p = broker.producer("t", batching=batching)
    txn = None if batching else broker.new_transaction()
    p.send(b"first", partition=0, txn=txn)
    accs = [a for a in broker._batching.live if a.producer is p]
    assert len(accs) == 1
    acc = accs[0]

    def flush_in_the_middle(phase, info):
        if phase == "start" and acc.count and not acc.lock.locked():     # (not inside a flush)
            broker._batching.flush(acc)

    sent = []
    threshold = gc.get_threshold()
    gc.callbacks.append(flush_in_the_middle)
    gc.set_threshold(1)
    try:
        for i in range(400):
            sent.append((p.send(b"%d" % i, key=b"k%d" % i if i % 5 == 0 else None,
                                headers={"h": b"%d" % i} if i % 7 == 0 else None,
                                event_time=1_000 + i if i % 11 == 0 else None, partition=0, txn=txn), i))
    finally:
        gc.callbacks.remove(flush_in_the_middle)
        gc.set_threshold(*threshold)
    if batching:
        p.flush()
    else:
        txn.commit()
    assert len(batches(broker)) > 20
    c = broker.subscribe("t", "s", initial_position="earliest")
    got = {m.offset: m for m in drain(c)}
    for mid, i in sent:
        m = got[mid.offset]
        assert m.value == b"%d" % i
        assert m.key == (b"k%d" % i if i % 5 == 0 else None)
        assert dict(m.headers or {}) == ({"h": b"%d" % i} if i % 7 == 0 else {})
        if i % 11 == 0:
            assert m.event_time == 1_000 + i


def test_ids_stay_exact_while_the_timer_flushes_concurrently(tmp_path):
    """The broker's timer appends batches while the sender keeps adding:
    every id names its own message, in send order."""
    with txmq.Broker(tmp_path / "d", fsync="never", linger_ms=1, batch_bytes=4096) as b:
        b.create_topic("t", 1)
        p = b.producer("t")
        txn = b.new_transaction()
        mids = []
        for i in range(20_000):
            mids.append((p.send(b"%d" % i, partition=0, txn=txn, headers={"i": b"%d" % i} if i % 7 == 0 else None), i))
            if i % 2000 == 0:
                time.sleep(0.012)          # let the timer in mid-batch
        txn.commit()
        assert len(batches(b)) > 2
        c = b.subscribe("t", "s", initial_position="earliest")
        got = {m.offset: m.value for m in drain(c)}
        assert [got[mid.offset] for mid, _ in mids] == [b"%d" % i for _, i in mids]
        assert [mid.offset for mid, _ in mids] == sorted(mid.offset for mid, _ in mids)
