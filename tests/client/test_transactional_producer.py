"""Transactional ids and fencing (docs/FORMAT.md, "Idempotent producers"; docs/GUARANTEES.md G5, G9): fencing races,
zombies, late requests of earlier transactions, Kafka-style
consume–process–produce with send_offsets_to_transaction, persistence of
(producer id, epoch) in the coordinator log."""

from __future__ import annotations

import threading

import pytest

import txmq
import txmq.broker.broker
import txmq.transactions.coordinator
from txmq.errors import (InvalidArgumentError, InvalidTxnStateError, ProducerFencedError,
                         SubscriptionTypeError, TransactionError)
from txmq.transactions.records import TxnState


@pytest.fixture
def broker(tmp_path):
    b = txmq.Broker(tmp_path / "data", fsync="never")
    b.create_topic("in", partitions=2)
    b.create_topic("out", partitions=2)
    yield b
    b.close()


def drain(consumer, timeout=0.2):
    out = []
    while True:
        got = consumer.receive_many(10_000, timeout)
        if not got:
            return out
        out += got


def committed(broker, topic, sub="check"):
    c = broker.subscribe(topic, sub, initial_position="earliest")
    try:
        return sorted(m.value for m in drain(c))
    finally:
        c.close()


def test_begin_send_commit_and_ids(broker):
    tp = broker.transactional_producer("etl-1")
    assert (tp.epoch, tp.transactional_id) == (0, "etl-1")
    with tp.begin() as txn:
        tp.producer("out").send(b"a", partition=0, txn=txn)
        tp.producer("in").send(b"b", partition=1, txn=txn)
    assert txn.state is TxnState.COMMITTED
    assert committed(broker, "out") == [b"a"] and committed(broker, "in") == [b"b"]
    txn2 = tp.begin()
    tp.producer("out").send(b"c", txn=txn2)
    tp.producer("out").flush()           # in the log, so its abort leaves a marker
    txn2.abort()
    assert committed(broker, "out", "check2") == [b"a"]
    # Its batches carry the producer id and epoch: the Kafka view names it.
    aborted = [a for p in (0, 1) for a in broker.aborted_transactions("out", p, 0)]
    assert [a.producer_id for a in aborted] == [tp.producer_id]


def test_misuse_is_refused(broker):
    tp = broker.transactional_producer("etl-1")
    other = broker.new_transaction()
    with pytest.raises(InvalidArgumentError):
        tp.producer("out").send(b"x")                       # no transaction
    with pytest.raises(InvalidArgumentError):
        tp.producer("out").send(b"x", txn=other)            # not one of its own
    txn = tp.begin()
    with pytest.raises(InvalidTxnStateError):
        tp.begin()                                          # one at a time
    with pytest.raises(txmq.errors.InvalidTxnTimeoutError):
        broker.transactional_producer("etl-2", timeout=0)
    for bad in ("", None, 3):
        with pytest.raises(InvalidArgumentError):
            broker.transactional_producer(bad)
    txn.commit()
    other.abort()
    tp.close()
    with pytest.raises(TransactionError):
        tp.begin()


def test_reopen_fences_aborts_and_refuses_everything(broker):
    c = broker.subscribe("in", "proc", initial_position="earliest")
    broker.producer("in").send_batch([b"i0", b"i1"], partition=0)
    old = broker.transactional_producer("etl")
    txn = old.begin()
    old.producer("out").send(b"old", partition=0, txn=txn)
    msgs = c.receive_many(10, 0.5)
    c.ack(msgs[:1], txn=txn)
    new = broker.transactional_producer("etl")
    assert new.producer_id == old.producer_id and new.epoch == old.epoch + 1
    assert txn.state is TxnState.ABORTED and old.fenced
    calls = {
        "send": lambda: old.producer("out").send(b"x", txn=txn),
        "send via the held producer": lambda: new_pr_old.send(b"x", txn=txn),
        "ack": lambda: c.ack(msgs[1:], txn=txn),
        "commit": txn.commit,
        "abort": txn.abort,
        "begin": old.begin,
        "send_offsets": lambda: old.send_offsets_to_transaction(txn, c, {0: 2}),
    }
    new_pr_old = txmq.client.producer.Producer(broker, broker._topic("out"), old.producer_id, old.epoch, owner=old)
    for name, call in calls.items():
        with pytest.raises(ProducerFencedError):
            call()
    # Nothing of the old instance is visible; its acked message comes back.
    assert committed(broker, "out") == []
    again = drain(c)
    assert [m.value for m in again] == [b"i0"]      # i1 is still delivered, unacked
    with new.begin() as t2:
        new.producer("out").send(b"new", partition=0, txn=t2)
        c.ack(again + msgs[1:], txn=t2)
    assert committed(broker, "out", "c2") == [b"new"]
    assert broker.consumer_lag("in", "proc") == {0: 0, 1: 0}


def test_zombie_commit_after_new_instance_began(broker):
    a = broker.transactional_producer("etl")
    t1 = a.begin()
    a.producer("out").send(b"zombie", partition=0, txn=t1)
    b = broker.transactional_producer("etl")
    t2 = b.begin()
    b.producer("out").send(b"fresh", partition=0, txn=t2)
    with pytest.raises(ProducerFencedError):
        t1.commit()                                   # the delayed commit
    with pytest.raises(ProducerFencedError):
        a.producer("out").send(b"late", partition=0, txn=t1)
    assert t2.state is TxnState.OPEN and t1.state is TxnState.ABORTED
    assert set(t2._meta.partitions) == {("out", 0)}
    t2.commit()
    assert committed(broker, "out") == [b"fresh"]


def test_late_requests_of_an_earlier_transaction_never_touch_the_next(broker):
    tp = broker.transactional_producer("etl")
    pr = tp.producer("out")
    c = broker.subscribe("in", "proc", initial_position="earliest")
    broker.producer("in").send_batch([b"m0", b"m1"], partition=0)
    msgs = c.receive_many(10, 0.5)
    t1 = tp.begin()
    pr.send(b"one", partition=0, txn=t1)
    t1.commit()
    t2 = tp.begin()
    pr.send(b"two", partition=1, txn=t2)
    # Late send, ack, commit and abort of t1 (same transactional id, same
    # epoch): each is refused and t2 is unchanged.
    with pytest.raises(InvalidTxnStateError):
        pr.send(b"late", partition=0, txn=t1)
    with pytest.raises(InvalidTxnStateError):
        c.ack(msgs, txn=t1)
    with pytest.raises(InvalidTxnStateError):
        t1.commit()
    with pytest.raises(InvalidTxnStateError):
        t1.abort()
    assert t2.state is TxnState.OPEN and set(t2._meta.partitions) == {("out", 1)}
    assert t2._meta.subscriptions == {}
    t2.abort()
    assert committed(broker, "out") == [b"one"]
    assert len(drain(c)) == 0 and broker.consumer_lag("in", "proc") == {0: 2, 1: 0}


def test_fencing_race(broker):
    """Two instances of one transactional id run consume-transform-produce
    loops; a third opening fences the second mid-stream. Only the newest
    commits from then on; every fenced call raises ProducerFencedError; no
    aborted output is visible to read_committed."""
    n_in = 400
    broker.producer("in").send_batch([f"m{i}".encode() for i in range(n_in)], partition=0)
    results = {}
    started = threading.Barrier(2)

    def run(name, fence_after=None):
        if fence_after is None:
            started.wait()              # the first instance is mid-stream
        tp = broker.transactional_producer("etl")
        c = broker.subscribe("in", "proc", type="failover", consumer_name=name,
                             initial_position="earliest")
        out = tp.producer("out")
        committed_vals, outcome = [], "done"
        try:
            while True:
                msgs = c.receive_many(5, 0.1)
                if not msgs:
                    if broker.consumer_lag("in", "proc")[0] == 0:
                        break
                    continue            # a standby until the fenced one lets go
                txn = tp.begin()
                for m in msgs:
                    out.send(b"out-" + m.value, partition=0, txn=txn)
                tp.send_offsets_to_transaction(txn, c, {0: msgs[-1].message_id.offset + 1})
                txn.commit()
                committed_vals += [b"out-" + m.value for m in msgs]
                if fence_after is not None and len(committed_vals) >= fence_after:
                    started.wait()
                    fence_after = None
        except ProducerFencedError:
            outcome = "fenced"
        finally:
            c.close()
        results[name] = (outcome, committed_vals)

    first = threading.Thread(target=run, args=("a", 50))
    first.start()
    second = threading.Thread(target=run, args=("b",))
    second.start()
    first.join(60)
    second.join(60)
    assert results["a"][0] == "fenced"
    visible = committed(broker, "out")
    # Every input once, exactly: the fenced instance's committed part plus
    # the newer one's; nothing of the aborted transaction.
    assert visible == sorted(results["a"][1] + results["b"][1])
    assert sorted(visible) == sorted({f"out-m{i}".encode() for i in range(n_in)})
    assert broker.consumer_lag("in", "proc") == {0: 0, 1: 0}


def test_send_offsets_to_transaction(broker):
    broker.producer("in").send_batch([f"m{i}".encode() for i in range(10)], partition=1)
    c = broker.subscribe("in", "proc", initial_position="earliest")
    tp = broker.transactional_producer("etl")
    msgs = c.receive_many(4, 0.5)
    txn = tp.begin()
    tp.send_offsets_to_transaction(txn, ("in", "proc"), {1: 4})
    assert broker._subscription("in", "proc").mark_delete(1) == 0
    txn.abort()
    assert broker._subscription("in", "proc").mark_delete(1) == 0
    again = c.receive_many(10, 0.5)
    assert [m.value for m in again][:4] == [m.value for m in msgs]
    txn = tp.begin()
    tp.send_offsets_to_transaction(txn, c, {1: 4, 0: 0})
    txn.commit()
    assert broker._subscription("in", "proc").mark_delete(1) == 4
    assert broker.consumer_lag("in", "proc") == {0: 0, 1: 6}
    txn = tp.begin()
    tp.send_offsets_to_transaction(txn, c, {1: 2})            # behind: nothing to do
    with pytest.raises(InvalidArgumentError):
        tp.send_offsets_to_transaction(txn, c, [4])
    with pytest.raises(txmq.errors.PartitionNotFoundError):
        tp.send_offsets_to_transaction(txn, c, {5: 1})
    with pytest.raises(InvalidArgumentError):
        tp.send_offsets_to_transaction(txn, "in/proc", {1: 5})
    txn.commit()
    shared = broker.subscribe("in", "sh", type="shared", initial_position="earliest")
    txn = tp.begin()
    with pytest.raises(SubscriptionTypeError):
        tp.send_offsets_to_transaction(txn, shared, {1: 1})
    txn.abort()


def test_epoch_survives_restart_and_compaction(tmp_path, monkeypatch):
    monkeypatch.setattr(txmq.transactions.coordinator, "COMPACT_FRAMES", 8)
    path = tmp_path / "data"
    with txmq.Broker(path, fsync="never", num_coordinators=2) as b:
        b.create_topic("out")
        tp = b.transactional_producer("etl")
        pid = tp.producer_id
        for _ in range(20):                                # compacts the log several times
            with tp.begin() as txn:
                tp.producer("out").send(b"v", txn=txn)
        open_txn = tp.begin()
        tp.producer("out").send(b"never", txn=open_txn)
    with txmq.Broker(path, fsync="never", num_coordinators=2) as b:
        assert b.recovered_transactions["aborted"] == 1
        tp = b.transactional_producer("etl")
        assert (tp.producer_id, tp.epoch) == (pid, 1)
        with tp.begin() as txn:
            tp.producer("out").send(b"after", txn=txn)
    # More coordinators later: the id keeps its producer id and epoch order.
    with txmq.Broker(path, fsync="never", num_coordinators=5) as b:
        tp = b.transactional_producer("etl")
        assert (tp.producer_id, tp.epoch) == (pid, 2)
        assert committed(b, "out").count(b"v") == 20 and b"never" not in committed(b, "out", "c2")


def test_epoch_overflow_takes_a_new_producer_id(broker, monkeypatch):
    monkeypatch.setattr(txmq.broker.broker, "EPOCH_MAX", 2)
    ids = [(tp.producer_id, tp.epoch) for tp in (broker.transactional_producer("etl") for _ in range(4))]
    assert ids[0][1] == 0 and ids[1] == (ids[0][0], 1) and ids[2] == (ids[0][0], 2)
    assert ids[3][1] == 0 and ids[3][0] != ids[0][0]


def test_close_aborts_the_open_transaction(broker):
    tp = broker.transactional_producer("etl")
    txn = tp.begin()
    tp.producer("out").send(b"x", txn=txn)
    tp.close()
    assert txn.state is TxnState.ABORTED
    assert broker.last_stable_offset("out", 0) == broker.high_watermark("out", 0)
    # A fenced instance closing changes nothing for the newer one.
    a = broker.transactional_producer("etl")
    b = broker.transactional_producer("etl")
    tb = b.begin()
    a.close()
    assert tb.state is TxnState.OPEN
    tb.commit()


# -- reopening an id mid-commit, names, a damaged registry, redelivery after aborts ------------


def test_reopen_waits_for_a_commit_being_applied(broker, monkeypatch):
    """The previous instance's commit is decided and half applied when the
    id is opened again: the new instance is returned only once that commit
    is applied everywhere, so it starts from the committed positions."""
    from txmq.transactions import coordinator

    gate, at_half = threading.Event(), threading.Event()
    orig = coordinator.crashpoints.reached

    def reached(name):
        if name == "txn.markers_half" and threading.current_thread().name == "old":
            at_half.set()
            gate.wait(10)
        orig(name)

    monkeypatch.setattr(coordinator.crashpoints, "reached", reached)
    monkeypatch.setattr(coordinator.crashpoints, "ARMED", True)   # (the coordinator asks only when armed)
    src = broker.producer("in")
    for i in range(3):
        src.send(b"m%d" % i, partition=0)
    c = broker.subscribe("in", "g", initial_position="earliest")
    old = broker.transactional_producer("etl")
    txn = old.begin()

    def run():
        for part in (0, 1):
            old.producer("out").send(b"out", partition=part, txn=txn)
        old.send_offsets_to_transaction(txn, c, {0: 3})
        txn.commit()

    th = threading.Thread(target=run, name="old")
    th.start()
    assert at_half.wait(10)
    opened = []
    opener = threading.Thread(target=lambda: opened.append(broker.transactional_producer("etl")))
    opener.start()
    opener.join(0.3)
    assert not opened and txn.state is TxnState.COMMITTING     # still waiting
    gate.set()
    th.join(10)
    opener.join(10)
    new = opened[0]
    assert txn.state is TxnState.COMMITTED and new.epoch == old.epoch + 1
    assert broker._subscription("in", "g").mark_delete(0) == 3
    assert [broker.last_stable_offset("out", p) for p in (0, 1)] == [2, 2]


def test_reopen_gives_up_on_a_commit_that_cannot_finish(broker, monkeypatch):
    import txmq.client.transactional_producer

    monkeypatch.setattr(txmq.client.transactional_producer, "FENCE_WAIT", 0.2)
    old = broker.transactional_producer("etl")
    txn = old.begin()
    old.producer("out").send(b"x", partition=0, txn=txn)
    txn._meta.state = TxnState.COMMITTING          # a fan-out the scheduler keeps retrying
    with pytest.raises(txmq.errors.ConcurrentTransactionsError):
        broker.transactional_producer("etl")
    assert old.fenced
    txn._meta.state = TxnState.OPEN
    txn._coordinator.end(txn._meta, False)
    new = broker.transactional_producer("etl")
    assert new.epoch == old.epoch + 1


def test_names_and_offsets_are_checked(broker):
    for bad in ("x" * 70_000, "\ud800"):
        with pytest.raises(InvalidArgumentError):
            broker.transactional_producer(bad)
        with pytest.raises(InvalidArgumentError):
            broker.producer("out", name=bad)
    tp = broker.transactional_producer("etl")
    c = broker.subscribe("in", "g", initial_position="earliest")
    txn = tp.begin()
    with pytest.raises(InvalidArgumentError):
        tp.send_offsets_to_transaction(txn, c, {0: 1, "x": 2})
    txn.abort()


def test_a_damaged_registry_never_reuses_a_producer_id(tmp_path):
    path = tmp_path / "data"
    with txmq.Broker(path, fsync="never") as b:
        b.create_topic("t")
        ids = [b.producer("t").producer_id for _ in range(3)]
        b.producer("t").send(b"x", partition=0)
        tp = b.transactional_producer("etl")
        ids += [tp.producer_id]
    raw = bytearray((path / "producers.log").read_bytes())
    raw[-3] ^= 0xFF                                # the last frame fails its CRC: cut
    (path / "producers.log").write_bytes(bytes(raw))
    with txmq.Broker(path, fsync="never") as b:
        fresh = [b.producer("t").producer_id for _ in range(5)]
        assert not set(fresh) & set(ids)
        b.producer("t").send(b"y", partition=0)


def test_redeliveries_after_two_aborts_come_in_offset_order(broker):
    """Kafka-style positions (send_offsets_to_transaction) rely on an
    exclusive consumer seeing its messages in order: two aborted
    transactions in a row hand their messages back in offset order."""
    p = broker.producer("in")
    for i in range(10):
        p.send(b"in-%d" % i, partition=0)
    c = broker.subscribe("in", "etl", "exclusive", initial_position="earliest")
    tp = broker.transactional_producer("etl-1")
    for n in (6, 2):
        ms = c.receive_many(n, 0.2)
        t = tp.begin()
        tp.send_offsets_to_transaction(t, c, {0: ms[-1].message_id.offset + 1})
        t.abort()
    assert [m.message_id.offset for m in c.receive_many(10, 0.2)] == list(range(10))
