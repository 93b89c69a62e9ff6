"""Out-of-order delivery (``allow_out_of_order_delivery=True``, a shared
read_committed subscription; dispatch/subscription.py): committed data past
an open transaction is delivered at once, the open transaction's batches
when it commits (redelivery count 0), never when it aborts; acks, nacks,
ack timeouts, consumers leaving, Arrow batches, seek, the backlog and a
reopen keep their rules; the option is refused where it does not apply.

Every test runs with the lane check on (TXMQ_DEBUG=1, tests/conftest.py),
which also checks that no read_committed lane hands out an offset of an
open or aborted transaction."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

import txmq
from txmq import MessageId
from txmq.dispatch import lane_invariant
from txmq.errors import InvalidArgumentError, OutOfOrderDeliveryError, TransactionConflictError

# linger_ms=0: every send inside a transaction is appended at once.
FAST = dict(fsync="never", control_socket=False, linger_ms=0)


@pytest.fixture
def broker(tmp_path):
    b = txmq.Broker(tmp_path / "d", **FAST)
    b.create_topic("t")
    yield b
    b.close()


def ooo(broker, name="o", **kw):
    return broker.subscribe("t", name, "shared", initial_position="earliest", allow_out_of_order_delivery=True,
                            nack_delay=0, **kw)


def values(msgs) -> list:
    return [m.value for m in msgs]


def sub_stats(broker, name="o") -> dict:
    return broker.stats()["topics"]["t"]["subscriptions"][name]


def lane(consumer, partition=0):
    return consumer._sub.lanes[partition]


def test_committed_data_past_an_open_transaction_is_delivered_at_once(broker):
    p = broker.producer("t")
    c = ooo(broker)
    classic = broker.subscribe("t", "classic", "shared", initial_position="earliest")
    p.send(b"a")
    held = broker.new_transaction()
    p.send_batch([b"h1", b"h2"], txn=held)
    p.send(b"b")
    with broker.transaction() as txn:
        p.send_batch([b"c1", b"c2"], txn=txn)
    p.send(b"d")
    got = c.receive_many(100, timeout=0.2)
    assert values(got) == [b"a", b"b", b"c1", b"c2", b"d"]
    assert {m.redelivery_count for m in got} == {0}
    assert values(classic.receive_many(100, timeout=0.2)) == [b"a"]     # held back at maxReadPosition
    assert c.receive_many(100, timeout=0.1) == []
    st = sub_stats(broker)
    assert st["allow_out_of_order_delivery"] is True and st["partitions"][0]["parked_transactions"] == 1
    held.commit()
    late = c.receive_many(100, timeout=1.0)
    assert values(late) == [b"h1", b"h2"] and [m.redelivery_count for m in late] == [0, 0]
    assert {m.txn_id for m in late} == {held.id}
    assert sub_stats(broker)["partitions"][0]["parked_transactions"] == 0
    assert values(classic.receive_many(100, timeout=0.2)) == [b"h1", b"h2", b"b", b"c1", b"c2", b"d"]


def test_an_aborted_open_transaction_is_never_delivered_and_passed_over(broker):
    p = broker.producer("t")
    c = ooo(broker)
    bad = broker.new_transaction()
    p.send_batch([b"x1", b"x2", b"x3"], txn=bad)
    p.send(b"after")
    got = c.receive_many(100, timeout=0.2)
    assert values(got) == [b"after"]
    c.ack(got)
    # Mark-delete never passes a parked offset: it waits below the open transaction.
    assert sub_stats(broker)["partitions"][0]["mark_delete"] == 0
    bad.abort()
    assert c.receive_many(100, timeout=0.2) == []
    part = sub_stats(broker)["partitions"][0]
    # Aborted data and both markers passed over as acknowledged: nothing left.
    assert part["mark_delete"] == broker.high_watermark("t", 0) and part["backlog"] == 0


def test_interleaved_transactions_and_plain_sends(broker):
    """Two open transactions whose batches interleave with each other and
    with plain sends; one commits, one aborts, in either order of their
    first offsets; each committed message is delivered exactly once."""
    p = broker.producer("t")
    c = ooo(broker)
    t1, t2 = broker.new_transaction(), broker.new_transaction()
    sent = []
    for i in range(4):
        p.send(b"t1-%d" % i, txn=t1)
        p.send(b"t2-%d" % i, txn=t2)
        p.send(b"n-%d" % i)
        sent.append(b"n-%d" % i)
    got = values(c.receive_many(100, timeout=0.2))
    assert got == sent
    t2.commit()
    got += values(c.receive_many(100, timeout=1.0))
    assert got == sent + [b"t2-%d" % i for i in range(4)]
    t1.abort()
    assert c.receive_many(100, timeout=0.2) == []
    with broker.transaction() as t3:
        p.send(b"t3", txn=t3)
    assert values(c.receive_many(100, timeout=1.0)) == [b"t3"]


def test_a_consumer_waiting_is_woken_when_the_parked_transaction_commits(broker):
    p = broker.producer("t")
    c = ooo(broker)
    txn = broker.new_transaction()
    p.send(b"late", txn=txn)
    box = []
    th = threading.Thread(target=lambda: box.append(c.receive(timeout=10)))
    th.start()
    time.sleep(0.2)
    assert not box
    txn.commit()
    th.join(5)
    assert not th.is_alive() and box[0].value == b"late"


def test_released_messages_follow_the_redelivery_rules(broker):
    """A parked transaction's messages, once committed, are delivered like
    any other: a nack redelivers with count 1, an ack timeout too, and a
    consumer that leaves hands them to the others."""
    p = broker.producer("t")
    a = ooo(broker, ack_timeout=0.3)
    b = ooo(broker)
    txn = broker.new_transaction()
    p.send_batch([b"r%d" % i for i in range(3)], txn=txn)
    p.send(b"plain")
    plain = a.receive_many(10, timeout=0.2)
    assert values(plain) == [b"plain"]
    a.ack(plain)
    txn.commit()
    got = a.receive_many(10, timeout=1.0)
    assert values(got) == [b"r0", b"r1", b"r2"]
    a.nack(got[0])
    again = b.receive_many(10, timeout=1.0)
    assert [(m.value, m.redelivery_count) for m in again] == [(b"r0", 1)]
    b.ack(again)
    # r1 and r2 time out at a (0.3 s) and come again, with count 1.
    timed_out = []
    deadline = time.monotonic() + 5
    while len(timed_out) < 2 and time.monotonic() < deadline:
        timed_out += a.receive_many(10, timeout=0.2)
    assert sorted((m.value, m.redelivery_count) for m in timed_out) == [(b"r1", 1), (b"r2", 1)]
    a.close()                                     # leaves them unacknowledged: b gets them
    rest = b.receive_many(10, timeout=1.0)
    assert sorted((m.value, m.redelivery_count) for m in rest) == [(b"r1", 2), (b"r2", 2)]
    b.ack(rest)
    assert sub_stats(broker)["backlog"] == 0


def test_released_and_redelivered_messages_go_out_in_offset_order(broker):
    p = broker.producer("t")
    c = ooo(broker)
    txn = broker.new_transaction()
    p.send_batch([b"t0", b"t1"], txn=txn)                       # offsets 0, 1
    p.send_batch([b"p2", b"p3", b"p4"])                         # 2, 3, 4
    first = c.receive_many(10, timeout=0.2)
    assert values(first) == [b"p2", b"p3", b"p4"]
    c.release(first[1:])                          # 3 and 4 due again at once
    txn.commit()                                  # 0 and 1 released (marker at 5)
    assert [m.offset for m in c.receive_many(10, timeout=1.0)] == [0, 1, 3, 4]


def test_receive_batch_delivers_past_open_transactions_and_released_batches(broker):
    p = broker.producer("t")
    c = ooo(broker)
    txn = broker.new_transaction()
    p.send_batch([b"o%d" % i for i in range(40)], txn=txn)      # 0..39
    p.send_batch([b"p%d" % i for i in range(20)])               # 40..59
    rb = c.receive_batch(100, timeout=0.2)
    assert rb.column("offset").to_pylist() == list(range(40, 60))
    assert rb.column("value").to_pylist() == [b"p%d" % i for i in range(20)]
    assert c.receive_batch(100, timeout=0.1) is None
    txn.commit()
    first = c.receive_batch(25, timeout=1.0)
    second = c.receive_batch(25, timeout=1.0)
    assert first.column("offset").to_pylist() == list(range(25))
    assert second.column("offset").to_pylist() == list(range(25, 40))
    assert second.column("value").to_pylist() == [b"o%d" % i for i in range(25, 40)]
    assert sub_stats(broker)["unacked"] == 60
    for batch in (rb, first, second):
        c.ack(batch)
    st = sub_stats(broker)
    assert st["unacked"] == 0 and st["backlog"] == 0
    assert c.receive_batch(100, timeout=0) is None              # (passes the COMMIT marker)
    assert sub_stats(broker)["partitions"][0]["mark_delete"] == broker.high_watermark("t", 0)


def test_receive_many_and_receive_batch_mixed_deliver_each_once(broker):
    p = broker.producer("t")
    c = ooo(broker)
    txns = [broker.new_transaction() for _ in range(3)]
    for i in range(30):
        p.send(b"x%d" % i, txn=txns[i % 3])
        if i % 4 == 0:
            p.send(b"n%d" % i)
    txns[0].commit()
    txns[1].abort()
    seen = []
    for k in range(12):
        if k % 2:
            rb = c.receive_batch(3, timeout=0.05)
            if rb is not None:
                seen += rb.column("value").to_pylist()
                c.ack(rb)
        else:
            ms = c.receive_many(3, timeout=0.05)
            seen += values(ms)
            c.ack(ms)
        if k == 5:
            txns[2].commit()
    while ms := c.receive_many(100, timeout=0.2):
        seen += values(ms)
        c.ack(ms)
    want = [b"x%d" % i for i in range(30) if i % 3 != 1] + [b"n%d" % i for i in range(0, 30, 4)]
    assert sorted(seen) == sorted(want) and len(seen) == len(set(seen))
    assert sub_stats(broker)["backlog"] == 0


def test_backlog_counts_committed_unacknowledged_deliverable_offsets(broker):
    p = broker.producer("t")
    c = ooo(broker)
    held = broker.new_transaction()
    p.send_batch([b"h"] * 5, txn=held)
    p.send_batch([b"p"] * 3)
    # Before any read: the open transaction's 5 offsets are no backlog.
    assert sub_stats(broker)["backlog"] == 3
    assert broker.consumer_lag("t", "o") == {0: 3}
    got = c.receive_many(100, timeout=0.2)
    assert len(got) == 3 and sub_stats(broker)["backlog"] == 3     # delivered, not acknowledged
    c.ack(got[:2])
    assert sub_stats(broker)["backlog"] == 1
    with broker.transaction() as txn:
        p.send_batch([b"c"] * 4, txn=txn)
    assert sub_stats(broker)["backlog"] == 5
    held.commit()
    assert sub_stats(broker)["backlog"] == 10
    c.ack(c.receive_many(100, timeout=1.0))
    c.ack(got[2])
    assert sub_stats(broker)["backlog"] == 0
    held2 = broker.new_transaction()
    p.send_batch([b"h2"] * 2, txn=held2)
    assert c.receive_many(100, timeout=0.1) == []                  # parked now
    assert sub_stats(broker)["backlog"] == 0
    held2.abort()
    assert sub_stats(broker)["backlog"] == 0


def test_seek_back_parks_an_open_transaction_again(broker):
    p = broker.producer("t")
    c = ooo(broker)
    p.send(b"a")
    txn = broker.new_transaction()
    p.send(b"t", txn=txn)
    p.send(b"b")
    c.ack(c.receive_many(10, timeout=0.2))
    c.seek("earliest")
    assert values(c.receive_many(10, timeout=0.2)) == [b"a", b"b"]
    txn.commit()
    assert values(c.receive_many(10, timeout=1.0)) == [b"t"]
    c.seek("earliest")
    assert values(c.receive_many(10, timeout=0.2)) == [b"a", b"t", b"b"]


def test_transactional_acks_of_released_messages(broker):
    """Consume-process-produce on out-of-order deliveries: the inputs'
    acks and the outputs commit or abort together; aborted acks make the
    inputs deliverable again with redelivery count + 1."""
    broker.create_topic("out")
    p, out = broker.producer("t"), broker.producer("out")
    c = ooo(broker)
    held = broker.new_transaction()
    p.send_batch([b"i0", b"i1"], txn=held)
    p.send(b"i2")
    held.commit()
    got = c.receive_many(10, timeout=1.0)
    assert sorted(values(got)) == [b"i0", b"i1", b"i2"]
    txn = broker.new_transaction()
    for m in got:
        out.send(b"out-" + m.value, txn=txn)
        c.ack(m, txn=txn)
    with pytest.raises(TransactionConflictError):
        c.ack(got[0])                                   # pending in txn
    txn.abort()
    again = c.receive_many(10, timeout=1.0)
    assert sorted((m.value, m.redelivery_count) for m in again) == [(b"i0", 1), (b"i1", 1), (b"i2", 1)]
    with broker.transaction() as txn:
        for m in again:
            out.send(b"out-" + m.value, txn=txn)
        c.ack(again, txn=txn)
    assert c.receive_many(10, timeout=0.2) == [] and sub_stats(broker)["backlog"] == 0
    reader = broker.subscribe("out", "r", initial_position="earliest")
    assert sorted(values(reader.receive_many(10, timeout=0.5))) == [b"out-i0", b"out-i1", b"out-i2"]


def test_an_ack_ahead_of_a_parked_message_that_aborts_leaves_it_to_its_release(broker):
    """A message of an open transaction acknowledged by id inside another
    transaction, which then aborts while the message is still parked: it
    goes out once, from its release, not also from the redelivery queue."""
    p = broker.producer("t")
    c = ooo(broker)
    held = broker.new_transaction()
    p.send(b"h", txn=held)                                    # offset 0
    p.send(b"n")                                              # 1
    assert values(c.receive_many(10, timeout=0.2)) == [b"n"]
    acker = broker.new_transaction()
    c.ack(MessageId("t", 0, 0), txn=acker)
    acker.abort()
    assert c.receive_many(10, timeout=0.1) == []              # still parked
    held.commit()
    got = c.receive_many(10, timeout=1.0)
    assert [(m.value, m.redelivery_count) for m in got] == [(b"h", 0)]
    assert c.receive_many(10, timeout=0.2) == []


def test_a_parked_message_acknowledged_ahead_is_not_delivered(broker):
    p = broker.producer("t")
    c = ooo(broker)
    held = broker.new_transaction()
    p.send_batch([b"h0", b"h1", b"h2"], txn=held)            # 0..2
    p.send(b"n")
    assert values(c.receive_many(10, timeout=0.2)) == [b"n"]
    c.ack(MessageId("t", 0, 1))
    acker = broker.new_transaction()
    c.ack(MessageId("t", 0, 2), txn=acker)
    held.commit()
    assert values(c.receive_many(10, timeout=1.0)) == [b"h0"]
    acker.commit()
    assert c.receive_many(10, timeout=0.2) == []


def test_several_partitions_and_consumers(tmp_path):
    with txmq.Broker(tmp_path / "d", **FAST) as b:
        b.create_topic("t", 3)
        p = b.producer("t")
        consumers = [b.subscribe("t", "o", "shared", initial_position="earliest",
                                 allow_out_of_order_delivery=True) for _ in range(2)]
        held = b.new_transaction()
        for part in range(3):
            p.send(b"h%d" % part, partition=part, txn=held)
            p.send_batch([b"n%d-%d" % (part, i) for i in range(5)], partition=part)
        seen = []
        for c in consumers:
            ms = c.receive_many(8, timeout=0.2)
            seen += values(ms)
            c.ack(ms)
        while ms := consumers[0].receive_many(100, timeout=0.1):
            seen += values(ms)
            consumers[0].ack(ms)
        assert sorted(seen) == sorted(b"n%d-%d" % (part, i) for part in range(3) for i in range(5))
        held.commit()
        late = []
        for c in consumers:
            while ms := c.receive_many(100, timeout=0.3):
                late += values(ms)
                c.ack(ms)
        assert sorted(late) == [b"h0", b"h1", b"h2"]
        assert b.stats()["topics"]["t"]["subscriptions"]["o"]["backlog"] == 0


# -- where the option does not apply -------------------------------------------------------------

@pytest.mark.parametrize("type_", ["exclusive", "failover"])
def test_refused_for_subscriptions_that_keep_offset_order(broker, type_):
    with pytest.raises(OutOfOrderDeliveryError) as e:
        broker.subscribe("t", "x", type_, allow_out_of_order_delivery=True)
    assert e.value.subscription == "x" and e.value.wanted == type_ and "shared" in str(e.value)
    assert broker.subscriptions("t") == []


def test_refused_with_read_uncommitted(broker):
    with pytest.raises(OutOfOrderDeliveryError) as e:
        broker.subscribe("t", "x", "shared", isolation="read_uncommitted", allow_out_of_order_delivery=True)
    assert "read_committed" in str(e.value)
    assert broker.subscriptions("t") == []


def test_an_existing_subscription_keeps_its_setting(broker):
    c = ooo(broker)
    with pytest.raises(OutOfOrderDeliveryError) as e:
        broker.subscribe("t", "o", "shared")
    assert (e.value.have, e.value.wanted) == (True, False)
    broker.subscribe("t", "plain", "shared").close()
    with pytest.raises(OutOfOrderDeliveryError) as e:
        broker.subscribe("t", "plain", "shared", allow_out_of_order_delivery=True)
    assert (e.value.have, e.value.wanted) == (False, True)
    c.close()
    # No consumers left: a type change is allowed for others, not to a type that keeps order.
    for type_ in ("exclusive", "failover"):
        with pytest.raises(OutOfOrderDeliveryError) as e:
            broker.subscribe("t", "o", type_)
        assert e.value.have is True and e.value.wanted == type_
    assert sub_stats(broker)["type"] == "shared"


@pytest.mark.parametrize("bad", [1, "true", None])
def test_the_option_is_a_bool(broker, bad):
    with pytest.raises(InvalidArgumentError):
        broker.subscribe("t", "x", "shared", allow_out_of_order_delivery=bad)


# -- persistence ---------------------------------------------------------------------------------

def test_the_setting_is_stored_and_survives_a_reopen(tmp_path):
    d = tmp_path / "d"
    with txmq.Broker(d, **FAST) as b:
        b.create_topic("t")
        b.subscribe("t", "o", "shared", allow_out_of_order_delivery=True).close()
        b.subscribe("t", "plain", "shared").close()
    meta = json.loads((d / "subscriptions" / "t" / "o" / "subscription.json").read_text())
    assert meta["allow_out_of_order_delivery"] is True and meta["type"] == "shared"
    plain = d / "subscriptions" / "t" / "plain" / "subscription.json"
    assert json.loads(plain.read_text())["allow_out_of_order_delivery"] is False
    # A file written before the option existed has no key: False.
    old = json.loads(plain.read_text())
    del old["allow_out_of_order_delivery"]
    plain.write_text(json.dumps(old))
    with txmq.Broker(d, **FAST) as b:
        subs = b.stats()["topics"]["t"]["subscriptions"]
        assert subs["o"]["allow_out_of_order_delivery"] is True
        assert subs["plain"]["allow_out_of_order_delivery"] is False
        with pytest.raises(OutOfOrderDeliveryError):
            b.subscribe("t", "o", "shared")
        b.subscribe("t", "o", "shared", allow_out_of_order_delivery=True).close()
        b.subscribe("t", "plain", "failover").close()            # a type change keeps created_ms
    assert json.loads(plain.read_text())["created_ms"] == old["created_ms"]


def test_a_reopen_in_the_middle_delivers_committed_once_more_and_never_the_open_one(tmp_path):
    """Closed while a transaction is open and committed data past it is
    partly acknowledged: after the reopen (recovery aborts the open
    transaction) each committed unacknowledged message comes once more,
    the acknowledged ones never, the open transaction's never."""
    d = tmp_path / "d"
    with txmq.Broker(d, **FAST) as b:
        b.create_topic("t")
        p = b.producer("t")
        c = b.subscribe("t", "o", "shared", initial_position="earliest", allow_out_of_order_delivery=True)
        open_txn = b.new_transaction()
        p.send_batch([b"open%d" % i for i in range(3)], txn=open_txn)
        p.send_batch([b"c%d" % i for i in range(6)])
        got = c.receive_many(100, timeout=0.2)
        assert values(got) == [b"c%d" % i for i in range(6)]
        c.ack(got[::2])
    with txmq.Broker(d, **FAST) as b:
        c = b.subscribe("t", "o", "shared", allow_out_of_order_delivery=True)
        again = []
        while ms := c.receive_many(100, timeout=0.2):
            again += ms
        assert values(again) == [b"c1", b"c3", b"c5"]
        c.ack(again)
        st = b.stats()["topics"]["t"]["subscriptions"]["o"]
        assert st["backlog"] == 0 and st["partitions"][0]["mark_delete"] == b.high_watermark("t", 0)


def test_the_lane_check_catches_a_parked_offset_handed_out(broker, monkeypatch):
    """The lane invariant's out-of-order part: a parked offset that is also
    outstanding, or queued, or an open transaction's offset in the read
    buffer, is caught."""
    monkeypatch.setattr(lane_invariant, "DEBUG_SMALL", 1 << 40)
    p = broker.producer("t")
    c = ooo(broker)
    held = broker.new_transaction()
    p.send_batch([b"h0", b"h1"], txn=held)
    p.send(b"n")
    assert values(c.receive_many(10, timeout=0.2)) == [b"n"]
    ln = lane(c)
    lane_invariant.check_lane(ln)
    ln.outstanding[0] = c.id
    with pytest.raises(AssertionError, match="offset 0 in two dispatch states"):
        lane_invariant.check_lane(ln)
    del ln.outstanding[0]
    ln.redeliver.append((0.0, 1))
    with pytest.raises(AssertionError, match="offset 1 queued for redelivery and parked or released"):
        lane_invariant.check_lane(ln)
    ln.redeliver.clear()
    spans = ln.parked.pop(next(iter(ln.parked)))
    ln.outstanding.update({0: c.id, 1: c.id})
    with pytest.raises(AssertionError, match="handed out .*open or aborted transaction"):
        lane_invariant.check_lane(ln)
    del ln.outstanding[0], ln.outstanding[1]
    ln.released.append(tuple(spans[0]))
    with pytest.raises(AssertionError, match="released span .* not of a committed transaction"):
        lane_invariant.check_lane(ln)
    ln.released.clear()
    ln.parked[(held.id.words[0], held.id.words[1])] = spans
    lane_invariant.check_lane(ln)
    held.abort()


# -- the bank: a transfer held open while deposits commit ---------------------------------------

HOLD_S = 10.0                 # the transfer stays open this long
DEPOSITS_PER_S = 1000         # each deposit its own committed transaction
IDLE_S = 1.0                  # deposits before the transfer opens: the idle delay


def test_bank_transfer_held_open_holds_back_committed_deposits_only_in_offset_order(tmp_path):
    """The bank: a transfer (debit and credit legs, one transaction) is held
    open for 10 s while deposits commit at 1,000 per second on the same
    partitions. The out-of-order subscription delivers the deposits as they
    commit (its p99 delay stays near its idle delay; bound: < 2 s), the
    classic read_committed one waits behind the open transfer (its longest
    delay is the hold; bound: >= 8 s); both get every deposit once, and the
    transfer's legs once, after its commit. The one test that times
    delivery (the margins hold on a loaded 2-core machine; a broken mode
    fails them by seconds)."""
    with txmq.Broker(tmp_path / "d", fsync="never", control_socket=False) as b:
        b.create_topic("bank", 4)
        readers = {"out_of_order": b.subscribe("bank", "monitor", "shared", initial_position="earliest",
                                               allow_out_of_order_delivery=True),
                   "classic": b.subscribe("bank", "processor", "shared", initial_position="earliest")}
        got = {name: [] for name in readers}          # (phase, delay ms, monotonic time, value)
        stop = threading.Event()
        phase = ["idle"]
        sent = []

        def read(name):
            c = readers[name]
            while True:
                ms = c.receive_many(1000, timeout=0.05)
                if not ms:
                    if stop.is_set():
                        return
                    continue
                now_ms, now = time.time() * 1000, time.monotonic()
                for m in ms:
                    v = json.loads(m.value)
                    got[name].append((v["phase"], now_ms - m.publish_time, now, m.value))
                c.ack(ms)

        def deposit():
            p = b.producer("bank")
            t0 = time.monotonic()
            i = 0
            while not stop.is_set():
                wait = t0 + i / DEPOSITS_PER_S - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                value = json.dumps({"kind": "deposit", "n": i, "phase": phase[0], "amount": 10}).encode()
                with b.transaction() as txn:
                    p.send(value, key=b"acct-%02d" % (i % 12), txn=txn)
                sent.append(value)
                i += 1

        threads = [threading.Thread(target=read, args=(n,)) for n in readers]
        threads.append(threading.Thread(target=deposit))
        for th in threads:
            th.start()
        try:
            time.sleep(IDLE_S)
            transfer = b.new_transaction(timeout=60)
            p = b.producer("bank")
            legs = [json.dumps({"kind": "transfer", "leg": leg, "phase": "transfer"}).encode()
                    for leg in ("debit", "credit")]
            p.send(legs[0], key=b"acct-00", txn=transfer)
            transfer.flush()                          # the debit leg is in the log: the hold begins
            phase[0] = "held"
            time.sleep(HOLD_S)
            p.send(legs[1], key=b"acct-01", txn=transfer)
            committing = time.monotonic()
            transfer.commit()
            phase[0] = "after"
            time.sleep(0.5)
        finally:
            stop.set()
            for th in threads:
                th.join(60)
        assert not any(th.is_alive() for th in threads)

    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    figures = {}
    for name, rows in got.items():
        assert sorted(r[3] for r in rows) == sorted(sent + legs), f"{name}: not every message once"
        leg_times = [r[2] for r in rows if r[0] == "transfer"]
        assert min(leg_times) >= committing, f"{name}: a transfer leg before its commit began"
        idle = [r[1] for r in rows if r[0] == "idle"]
        held = [r[1] for r in rows if r[0] == "held"]
        assert idle and held
        figures[name] = {"idle_p99_ms": round(pct(idle, 0.99)), "held_p99_ms": round(pct(held, 0.99)),
                         "held_max_ms": round(max(held)), "held_deposits": len(held)}
    print("bank, transfer held open %.0f s:" % HOLD_S, figures)
    assert figures["out_of_order"]["held_p99_ms"] < 2000, figures
    assert figures["classic"]["held_max_ms"] >= 8000, figures
