"""A batching producer (docs/API.md, "A batching producer"): its
one-message sends outside transactions accumulate per partition as sends
inside a transaction do, and reach the log as one batch by size, by the
timer, when an offset is asked for, on flush, before the producer's other
sends to that partition, and when it or the broker closes. What a crash
keeps is a prefix of its sends, and everything a flush returned for."""

from __future__ import annotations

import os
import random
import signal
import gc
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest

import txmq
from txmq._accumulator import PendingMessageId
from txmq.errors import (InvalidArgumentError, InvalidMessageError, InvalidTxnStateError, MessageTooLargeError,
                         ProducerFencedError)
from txmq.message import MessageId

from batching import LONG, batches, disk_full, run_threads


@pytest.fixture
def broker(tmp_path):
    b = txmq.Broker(tmp_path / "data", fsync="never", linger_ms=LONG)
    yield b
    b.close()


def values(broker, topic="t", name="check"):
    c = broker.subscribe(topic, name, isolation="read_uncommitted", initial_position="earliest")
    out = []
    while ms := c.receive_many(1000, 0.05):
        out += [m.value for m in ms]
        c.ack(ms)
    c.close()
    return out


def test_sends_accumulate_until_the_flush(broker):
    broker.create_topic("t", 1)
    p = broker.producer("t", batching=True)
    mids = [p.send(b"m%d" % i) for i in range(100)]
    assert all(type(m) is PendingMessageId and not m.done() for m in mids)
    assert broker.high_watermark("t", 0) == 0
    p.flush()
    assert batches(broker) == [(0, 100, False)]
    assert [m.offset for m in mids] == list(range(100))
    assert mids[7] == MessageId("t", 0, 7) and tuple(mids[7]) == ("t", 0, 7)
    assert values(broker) == [b"m%d" % i for i in range(100)]


def test_a_plain_producer_still_appends_every_send(broker):
    broker.create_topic("t", 1)
    mid = broker.producer("t").send(b"a")
    assert type(mid) is MessageId and batches(broker) == [(0, 1, False)]


def test_linger_zero_turns_batching_off(tmp_path):
    with txmq.Broker(tmp_path / "d", fsync="never", linger_ms=0) as b:
        b.create_topic("t", 1)
        mid = b.producer("t", batching=True).send(b"a")
        assert type(mid) is MessageId and b.high_watermark("t", 0) == 1


def test_batching_must_be_a_bool(broker):
    broker.create_topic("t", 1)
    for bad in (1, "yes", None):
        with pytest.raises(InvalidArgumentError):
            broker.producer("t", batching=bad)


def test_the_timer_appends_after_linger(tmp_path):
    """A reader sees the sends within linger_ms (and the timer's period),
    with no flush."""
    with txmq.Broker(tmp_path / "d", fsync="never", linger_ms=20) as b:
        b.create_topic("t", 1)
        c = b.subscribe("t", "s", initial_position="earliest")
        mid = b.producer("t", batching=True).send(b"late")
        got = c.receive(timeout=5.0)
        assert got is not None and got.value == b"late"
        assert mid.done() and mid.offset == got.offset == 0


def test_asking_for_an_offset_appends_the_batch(broker):
    broker.create_topic("t", 1)
    p = broker.producer("t", batching=True)
    first, second = p.send(b"a"), p.send(b"b")
    assert second.offset == 1 and first.done()
    third = p.send(b"c")
    assert batches(broker) == [(0, 2, False)] and not third.done()


def test_a_full_batch_is_appended_at_once(tmp_path):
    with txmq.Broker(tmp_path / "d", fsync="never", linger_ms=LONG, batch_bytes=1000) as b:
        b.create_topic("t", 1)
        p = b.producer("t", batching=True)
        for _ in range(100):
            p.send(b"x" * 100)
        sizes = [n for _, n, _ in batches(b)]
        assert sizes and sum(sizes) > 80 and all(n <= 9 for n in sizes)


def test_its_other_sends_keep_the_order(broker):
    """send_batch, an explicit sequence and a transactional send to the
    same partition append the accumulated batch first."""
    broker.create_topic("t", 1)
    p = broker.producer("t", batching=True)
    p.send(b"1")
    p.send_batch([b"2", b"3"])
    p.send(b"4")
    txn = broker.new_transaction()
    p.send(b"5", txn=txn)
    p.send(b"6")
    txn.commit()
    p.flush()
    # ("5" is appended before "6" joins a batch; the commit marker at 5 comes before "6")
    assert batches(broker) == [(0, 1, False), (1, 2, False), (3, 1, False), (4, 1, True), (5, 1, True),
                               (6, 1, False)]
    assert values(broker) == [b"1", b"2", b"3", b"4", b"5", b"6"]
    assert p.last_sequence == {0: 5}
    mid = p.send(b"7", sequence=6)                  # explicit: appended at once
    assert type(mid) is MessageId and mid.offset == 7


def test_keys_headers_and_event_times_go_with_their_message(tmp_path):
    with txmq.Broker(tmp_path / "d", fsync="never", linger_ms=LONG) as b:
        b.create_topic("t", 3)
        p = b.producer("t", batching=True)
        sent = [(b"k%d" % (i % 5), b"v%d" % i) for i in range(60)]
        mids = [p.send(v, key=k, headers={"i": v} if i % 3 == 0 else None, event_time=1_000 + i)
                for i, (k, v) in enumerate(sent)]
        p.flush()
        c = b.subscribe("t", "s", initial_position="earliest")
        got = {}
        while ms := c.receive_many(1000, 0.05):
            for m in ms:
                got[m.value] = m
        for i, (k, v) in enumerate(sent):
            m = got[v]
            assert (m.key, m.event_time, m.partition, m.offset) == (k, 1_000 + i, mids[i].partition, mids[i].offset)
            assert (m.headers == [("i", v)]) if i % 3 == 0 else not m.headers
        # (a key always lands on the same partition)
        assert len({(m.key, m.partition) for m in got.values()}) == 5


def test_a_send_refuses_by_itself_what_it_can(broker):
    broker.create_topic("t", 1)
    p = broker.producer("t", batching=True)
    with pytest.raises(InvalidMessageError):
        p.send("not bytes")
    with pytest.raises(MessageTooLargeError):
        p.send(b"x" * (5 * 1024 * 1024 + 1))
    with pytest.raises(InvalidMessageError):
        p.send(b"x", event_time="now")
    p.send(b"ok")
    p.flush()
    assert values(broker) == [b"ok"]


@pytest.mark.parametrize("mode", ["batching", "plain", "transaction"])
def test_its_compiled_send_refuses_and_routes_as_the_general_send(broker, mode):
    """``Producer.send`` is compiled for its common cases (a batching
    producer's send, a plain one's, a send inside a transaction) and hands
    every other one to ``Producer._send``: both refuse the same things and
    put a key on the same partition."""
    from txmq._accumulator import producer_send
    from txmq.errors import BrokerClosedError, PartitionNotFoundError, TopicNotFoundError
    assert txmq.Producer.send is producer_send
    broker.create_topic("t", 4)
    p = broker.producer("t", batching=mode == "batching")
    txn = broker.new_transaction() if mode == "transaction" else None
    general = broker.producer("t")._send

    def send(value, **kw):
        return p.send(value, txn=txn, **kw)

    for bad in (4, -1, True, "0"):
        with pytest.raises(PartitionNotFoundError):
            send(b"x", partition=bad)
    keyed = [send(b"k", key=k) for k in ("order-7", b"order-7")]      # (a str key: its UTF-8 bytes)
    assert keyed[0].partition == keyed[1].partition == general(b"k", key=b"order-7").partition
    assert len({send(b"rr").partition for _ in range(8)}) == 4      # round robin without a key
    with pytest.raises(InvalidMessageError):
        send("not bytes")
    with pytest.raises(InvalidMessageError):
        send(b"x", event_time="now")
    p.flush()
    broker.delete_topic("t")
    with pytest.raises(TopicNotFoundError):
        send(b"x")
    broker.create_topic("u", 1)
    q = broker.producer("u", batching=mode == "batching")
    txn = broker.new_transaction() if mode == "transaction" else None
    q.send(b"a", txn=txn)
    q.close()
    with pytest.raises(BrokerClosedError):
        q.send(b"b", txn=txn)


def test_a_send_in_a_transaction_no_longer_open_is_refused(broker):
    """The compiled send takes a transaction's send only while it is open:
    after its end the general send raises why."""
    from txmq.errors import InvalidArgumentError, InvalidTxnStateError
    broker.create_topic("t", 1)
    p = broker.producer("t")
    txn = broker.new_transaction()
    p.send(b"a", txn=txn)
    p.send(b"b", txn=txn)
    txn.commit()
    with pytest.raises(InvalidTxnStateError):
        p.send(b"c", txn=txn)
    with pytest.raises(InvalidArgumentError):
        p.send(b"c", txn="not a transaction")
    assert values(broker) == [b"a", b"b"]


def test_a_plain_send_after_a_transactions_batch_comes_after_it(broker):
    """A plain producer that sends inside transactions too: its plain send
    to a partition where its transaction's batch waits appends that batch
    first (the general send); once the batch is appended, plain sends are
    the compiled call's again, and every send keeps its order."""
    from txmq.testing.counters import count_calls
    broker.create_topic("t", 1)
    p = broker.producer("t")
    txn = broker.new_transaction()
    first = p.send(b"in-txn", txn=txn)                # accumulating
    plain = p.send(b"plain")                          # appends the transaction's batch first
    assert first.offset < plain.offset
    txn.commit()
    p.send(b"warm")
    assert count_calls(p.send, b"again") == count_calls(
        broker.producer("t").send, b"fresh")
    got = broker.subscribe("t", "s", initial_position="earliest").receive_many(10, 1.0)
    assert [m.value for m in got] == [b"in-txn", b"plain", b"warm", b"again", b"fresh"]


def test_a_failed_append_is_raised_by_the_ids_the_flush_and_later_sends(broker, monkeypatch):
    """Nothing is lost in silence: an append the log refuses (a full disk)
    is raised by the ids of its messages, by flush and by every later send
    to that partition; another producer carries on."""
    broker.create_topic("t", 1)
    p = broker.producer("t", batching=True)
    mid = p.send(b"x")
    disk_full(monkeypatch, broker._topics["t"].partitions[0])
    with pytest.raises(OSError):
        p.flush()
    monkeypatch.undo()
    with pytest.raises(OSError):
        mid.offset
    with pytest.raises(OSError):
        p.send(b"y")
    with pytest.raises(OSError):
        p.close()
    assert broker.producer("t", batching=True).send(b"z").offset == 0


def test_close_appends_what_it_accumulated(broker):
    broker.create_topic("t", 1)
    p = broker.producer("t", batching=True)
    mid = p.send(b"a")
    p.close()
    assert mid.done() and values(broker) == [b"a"]


def test_broker_close_appends_what_producers_accumulated(tmp_path):
    path = tmp_path / "d"
    with txmq.Broker(path, fsync="never", linger_ms=LONG) as b:
        b.create_topic("t", 2)
        p = b.producer("t", batching=True)
        for i in range(10):
            p.send(b"%d" % i, partition=i % 2)
    with txmq.Broker(path, fsync="never") as b:
        assert sorted(values(b), key=int) == [b"%d" % i for i in range(10)]


def test_a_fenced_named_producer_is_refused(broker):
    broker.create_topic("t", 1)
    old = broker.producer("t", name="svc", batching=True)
    old.send(b"before")
    new = broker.producer("t", name="svc", batching=True)      # fences old
    with pytest.raises(ProducerFencedError):
        old.send(b"zombie")
    with pytest.raises(ProducerFencedError):
        old.flush()                  # (its batch is refused at the append too)
    new.send(b"fresh")
    new.flush()
    assert values(broker) == [b"fresh"]


def timer_appends_slowly(broker, monkeypatch, fail=False):
    """The partition's append, made slow (and failing, with ``fail``) when
    the broker's timer thread calls it: between its take() of the batch and
    the append."""
    part = broker._topics["t"].partitions[0]
    real = part.append

    def slow(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.2)
            if fail:
                raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(part, "append", slow)
    return part


def wait_taken(acc):
    """Until the timer has taken the open batch (it is appending it)."""
    deadline = time.monotonic() + 10
    while acc.count:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert acc.pending


@pytest.mark.parametrize("then", ["send_batch", "sequence", "transaction"])
def test_a_batch_the_timer_is_appending_stays_first(tmp_path, monkeypatch, then):
    """The producer's next send to the partition waits for the timer's
    append of its batch in progress."""
    with txmq.Broker(tmp_path / "d", fsync="never", linger_ms=20) as b:
        b.create_topic("t", 1)
        part = timer_appends_slowly(b, monkeypatch)
        p = b.producer("t", batching=True)
        first = p.send(b"first")
        wait_taken(p._plain[part])
        if then == "send_batch":
            second = p.send_batch([b"second"])[0]
        elif then == "sequence":
            second = p.send(b"second", sequence=1)
        else:
            txn = b.new_transaction()
            second = p.send(b"second", txn=txn)
            txn.commit()
        assert (first.offset, second.offset) == (0, 1)
        assert values(b)[:2] == [b"first", b"second"]


def test_a_transactions_batch_the_timer_is_appending_stays_first(tmp_path, monkeypatch):
    """The same for a plain producer's batch inside a transaction: its send
    outside the transaction waits for the timer's append."""
    with txmq.Broker(tmp_path / "d", fsync="never", linger_ms=20) as b:
        b.create_topic("t", 1)
        part = timer_appends_slowly(b, monkeypatch)
        p = b.producer("t")
        txn = b.new_transaction()
        first = p.send(b"first", txn=txn)
        wait_taken(p._accs[part])
        second = p.send(b"second")
        assert (first.offset, second.offset) == (0, 1)
        txn.commit()


def test_nothing_is_appended_after_a_batch_the_log_refused(tmp_path, monkeypatch):
    """A send made while the timer's failing append is in flight is not
    appended after the failure: it raises the failure, as its id does, and
    the log keeps no gap."""
    with txmq.Broker(tmp_path / "d", fsync="never", linger_ms=20) as b:
        b.create_topic("t", 1)
        part = timer_appends_slowly(b, monkeypatch, fail=True)
        p = b.producer("t", batching=True)
        a = p.send(b"A")
        acc = p._plain[part]
        wait_taken(acc)
        later = p.send(b"B")                  # accepted: the failure is not known yet
        deadline = time.monotonic() + 10
        while acc.error is None:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        for mid in (a, later):
            with pytest.raises(OSError):
                mid.offset
        for then in (lambda: p.send(b"C"), lambda: p.send_batch([b"C"]), lambda: p.send(b"C", sequence=5),
                     lambda: p.send(b"C", txn=b.new_transaction()), p.flush, p.close):
            with pytest.raises(OSError):
                then()
        monkeypatch.undo()
        assert values(b) == []


def test_threads_sharing_a_producer_lose_nothing_and_keep_their_order(tmp_path):
    """Threads send through one batching producer, inside and outside
    transactions, while the timer flushes: after flush() every plain send is
    in the log once, each thread's in its order."""
    with txmq.Broker(tmp_path / "d", fsync="never", linger_ms=1, batch_bytes=2048) as b:
        b.create_topic("t", 1)
        p = b.producer("t", batching=True)

        def sender(k):
            for i in range(3000):
                p.send(b"%d-%d" % (k, i))
                if i % 500 == 0:
                    with b.transaction() as txn:
                        p.send(b"txn-%d-%d" % (k, i), txn=txn)

        run_threads(sender, 4)
        p.flush()
        got = [v for v in values(b) if not v.startswith(b"txn")]
        assert sorted(got) == sorted(b"%d-%d" % (k, i) for k in range(4) for i in range(3000))
        for k in range(4):
            mine = [int(v.split(b"-")[1]) for v in got if v.startswith(b"%d-" % k)]
            assert mine == list(range(3000))


def test_threads_filling_batches_of_a_few_messages_lose_none(tmp_path):
    """Batches of one message (values larger than half of batch_bytes):
    a thread whose message did not fit flushes and tries again, even when
    another thread filled the next batch in between; every send gets its
    id and reaches the log."""
    with txmq.Broker(tmp_path / "d", fsync="never", linger_ms=LONG, batch_bytes=1024) as b:
        b.create_topic("t", 1)
        p = b.producer("t", batching=True)
        ids = {k: [] for k in range(4)}

        def sender(k):
            for i in range(3000):
                ids[k].append(p.send((b"%d-%d-" % (k, i)).ljust(600, b"x")))

        run_threads(sender, 4)
        p.flush()
        assert all(type(m) is PendingMessageId for k in ids for m in ids[k])
        assert b.high_watermark("t", 0) == 12_000
        assert len({m.offset for k in ids for m in ids[k]}) == 12_000


def test_an_aborted_transactions_leftovers_do_not_stick_to_the_producer(broker):
    """What an aborted transaction accumulated is dropped with it: its ids
    raise, and the producer's flush and later sends are not refused for it."""
    broker.create_topic("t", 1)
    p = broker.producer("t", batching=True)
    txn = broker.new_transaction()
    dropped = p.send(b"x", txn=txn)
    txn.abort()
    p.send(b"y")
    assert p.send(b"z", sequence=1).offset == 1
    p.flush()
    p.flush()
    with pytest.raises(InvalidTxnStateError):
        dropped.offset
    assert values(broker) == [b"y", b"z"]


def test_the_timer_appends_while_the_sender_keeps_adding(tmp_path):
    """Sends slower than linger_ms: the timer, not the size, appends most
    batches, and every id still names its message."""
    with txmq.Broker(tmp_path / "d", fsync="never", linger_ms=1) as b:
        b.create_topic("t", 1)
        p = b.producer("t", batching=True)
        mids = []
        for i in range(400):
            mids.append(p.send(b"%d" % i))
            if i % 20 == 0:
                time.sleep(0.015)
        p.flush()
        assert len(batches(b)) >= 10          # (one batch per pause at least: the timer's)
        assert [m.offset for m in mids] == list(range(400))
        assert values(b) == [b"%d" % i for i in range(400)]


def test_a_flushed_producer_dropped_without_close_is_not_kept(tmp_path):
    with txmq.Broker(tmp_path / "d", fsync="never", linger_ms=1) as b:
        b.create_topic("t", 1)
        refs = []
        for i in range(50):
            p = b.producer("t", batching=True)
            p.send(b"%d" % i)
            p.flush()
            refs.append(weakref.ref(p))
        del p
        b._batching.flush_due()                # (what the timer does every period)
        gc.collect()
        assert [r for r in refs if r() is not None] == [] and not b._batching.live
        # Sent and dropped without a flush: the timer appends it, nothing is lost.
        b.producer("t", batching=True).send(b"last")
        gc.collect()
        deadline = time.monotonic() + 10
        while b.high_watermark("t", 0) < 51:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert values(b)[-1] == b"last"


CHILD = textwrap.dedent("""
    import sys, txmq
    path, fsync = sys.argv[1], sys.argv[2]
    b = txmq.Broker(path, fsync=fsync, linger_ms=2, batch_bytes=2048)
    if "t" not in b.topics():
        b.create_topic("t", 1)
    p = b.producer("t", batching=True)
    start = int(sys.argv[3])
    i = start
    while True:
        p.send(b"%d" % i)
        i += 1
        if i % 97 == 0:
            p.flush()
            print(i, flush=True)
""")


@pytest.mark.parametrize("fsync", ["never", "commit"])
def test_a_kill_keeps_a_prefix_of_the_sends_and_everything_flushed(tmp_path, fsync):
    """SIGKILL at a random moment while a batching producer sends: the log
    holds its sends in order, with no gap and no duplicate (a prefix), and
    at least every send that a returned flush covered."""
    path = str(tmp_path / "d")
    rng = random.Random(fsync)
    kept = 0
    for cycle in range(4):
        child = subprocess.Popen([sys.executable, "-c", CHILD, path, fsync, str(kept)], stdout=subprocess.PIPE,
                                 env={**os.environ, "TXMQ_DEBUG": "0"})
        flushed = kept
        deadline = time.monotonic() + 60
        want = rng.randrange(2, 40)
        for _ in range(want):
            line = child.stdout.readline()
            assert line, f"child ended early (cycle {cycle})"
            flushed = int(line)
            assert time.monotonic() < deadline
        time.sleep(rng.random() * 0.02)
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
        with txmq.Broker(path, fsync="never", linger_ms=0) as b:
            got = values(b, name=f"check-{cycle}")
        assert got == [b"%d" % i for i in range(len(got))], f"not a prefix of the sends (cycle {cycle})"
        assert len(got) >= flushed, f"{flushed} flushed, {len(got)} kept (cycle {cycle})"
        kept = len(got)
