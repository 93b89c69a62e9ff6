"""The lane invariant of a subscription (dispatch/subscription.py) and its
check under TXMQ_DEBUG (dispatch/lane_invariant.py): the suite's normal
operation keeps it (every test runs with the check on; here a workload
touching every kind of lane change is checked after each change), and a
lane broken on purpose, in each way the invariant forbids, is caught —
by ``check_lane`` and by the next operation on the subscription."""

from __future__ import annotations

import heapq
import os

import pytest

import txmq
from txmq.dispatch import lane_invariant
from txmq.message import MessageId
from txmq.testing.counters import count_calls


def test_the_suite_runs_with_the_lane_check_on():
    assert os.environ.get("TXMQ_DEBUG") == "1" and lane_invariant.DEBUG


@pytest.fixture
def checks(monkeypatch):
    """The lane check on, run after every change, counting the full checks."""
    monkeypatch.setattr(lane_invariant, "DEBUG", True)
    monkeypatch.setattr(lane_invariant, "DEBUG_SMALL", 1 << 40)
    ran = []
    real = lane_invariant.check_lane

    def counted(lane):
        ran.append(lane.partition.index)
        real(lane)

    monkeypatch.setattr(lane_invariant, "check_lane", counted)
    return ran


@pytest.fixture
def broker(tmp_path):
    with txmq.Broker(tmp_path / "d", fsync="never") as b:
        b.create_topic("t", 2)
        for p in (0, 1):
            b.producer("t").send_batch([b"%d-%d" % (p, i) for i in range(40)], partition=p)
        yield b


def lane(consumer, partition=0):
    return consumer._sub.lanes[partition]


def test_every_kind_of_change_keeps_the_invariant(broker, checks):
    """Receives (one by one, many, Arrow batches), plain, range and
    cumulative acks, nacks, acks in transactions that commit and abort
    (individual and cumulative), releases, a consumer leaving, a seek, an
    ack timeout: the check runs after each and never raises."""
    a = broker.subscribe("t", "s", "shared", initial_position="earliest", nack_delay=0, ack_timeout=0.2)
    b = broker.subscribe("t", "s", "shared", initial_position="earliest", nack_delay=0)
    first = a.receive_many(5, 1.0)
    a.ack(first[:2])
    a.nack(first[2:3])
    a.release(first[3:4])
    batch = b.receive_batch(10, 1.0)
    b.ack(batch)
    txn = broker.new_transaction()
    got = b.receive_many(6, 1.0)
    b.ack(got[:3], txn=txn)
    b.ack([MessageId("t", got[0].partition, 39)], txn=txn)     # ahead of delivery, still buffered or unread
    txn.abort()
    txn = broker.new_transaction()
    b.ack(got[3:], txn=txn)
    txn.commit()
    a.close()                                                 # what a held goes to b
    rest = []
    while msgs := b.receive_many(100, 0.3):
        rest += msgs
        b.ack(msgs[::2])
    b.seek("earliest", partition=0)
    c = broker.subscribe("t", "x", "exclusive", initial_position="earliest")
    m = c.receive_many(10, 1.0)
    txn = broker.new_transaction()
    c.ack_cumulative(m[5], txn=txn)
    txn.abort()
    c.ack_cumulative(m[-1])
    assert len(checks) > 30 and set(checks) == {0, 1}
    for sub in broker._topic("t").subscriptions.values():
        for ln in sub.lanes:
            lane_invariant.check_lane(ln)


def broken_lane(broker):
    """A lane in a known state: offsets 0-9 of partition 0 delivered one by
    one, 0-1 acknowledged, 10-39 in the read buffer."""
    c = broker.subscribe("t", "k", "exclusive", initial_position="earliest")
    msgs = c.receive_many(10, 1.0)
    assert [(m.partition, m.offset) for m in msgs] == [(0, i) for i in range(10)]
    c.ack(msgs[:2])
    ln = lane(c)
    lane_invariant.check_lane(ln)
    return c, ln


@pytest.mark.parametrize("damage,message", [
    (lambda ln: ln.outstanding.pop(5), "offset 5 in no state"),
    (lambda ln: ln.outstanding.__setitem__(0, 7), "outstanding offset 0 outside"),
    (lambda ln: ln.cursor.acked.add(6), "offset 6 outstanding acknowledged or pending"),
    (lambda ln: ln.ranges.append([4, 6, 3]), "offset 4 in two dispatch states"),
    (lambda ln: ln.ranges.append([38, 45, 0]), "batch delivery \\[38, 45\\) outside"),
    (lambda ln: heapq.heappush(ln.redeliver, (0.0, ln.buffer[ln.buf_i].offset)),
     "queued for redelivery and in the read buffer"),
    (lambda ln: setattr(ln, "buf_i", ln.buf_i + 1), "in no state"),
    (lambda ln: setattr(ln, "read_offset", ln.read_offset + 3), "in no state"),
], ids=["lost", "below-mark-delete", "acked-and-outstanding", "two-states", "range-past-read",
        "queued-and-buffered", "skipped-in-buffer", "read-offset-jumped"])
def test_a_broken_lane_is_caught(broker, damage, message):
    c, ln = broken_lane(broker)
    damage(ln)
    with pytest.raises(AssertionError, match=message):
        lane_invariant.check_lane(ln)


def test_an_outstanding_offset_that_a_transaction_holds_is_caught(broker):
    c, ln = broken_lane(broker)
    txn = broker.new_transaction()
    c.ack([MessageId("t", 0, 12)], txn=txn)
    lane_invariant.check_lane(ln)
    ln.outstanding[12] = c.id
    with pytest.raises(AssertionError, match="offset 12 outstanding acknowledged or pending"):
        lane_invariant.check_lane(ln)
    del ln.outstanding[12]
    ln.ranges.append([12, 13, c.id])
    with pytest.raises(AssertionError, match="offset 12 in a batch delivery and pending"):
        lane_invariant.check_lane(ln)
    ln.ranges.pop()
    txn.abort()


def test_the_next_operation_on_a_broken_lane_raises(broker, checks):
    c, ln = broken_lane(broker)
    ln.outstanding.pop(5)
    with pytest.raises(AssertionError, match="offset 5 in no state"):
        c.ack(MessageId("t", 0, 2))
    with pytest.raises(AssertionError, match="offset 5 in no state"):
        c.nack([MessageId("t", 0, 3)])


def test_off_nothing_is_called(broker, monkeypatch):
    """Off, every change of a lane costs a flag test and no call."""
    monkeypatch.setattr(lane_invariant, "DEBUG", False)
    monkeypatch.setattr(lane_invariant, "changed", lambda ln: pytest.fail("checked while off"))
    c = broker.subscribe("t", "n", "exclusive", initial_position="earliest", nack_delay=0)
    c.ack(c.receive(1.0))
    c.nack(c.receive_many(3, 1.0))
    txn = broker.new_transaction()
    c.ack(c.receive_many(5, 1.0), txn=txn)
    c.ack_cumulative(c.receive(1.0), txn=txn)
    txn.abort()
    c.ack(c.receive_batch(10, 1.0))
    c.ack_cumulative(c.receive(1.0))
    c.seek("earliest")
    c.close()


def test_counts_are_taken_with_the_check_off(broker, checks):
    """txmq.testing's counters count what txmq costs without TXMQ_DEBUG."""
    c = broker.subscribe("t", "n", "exclusive", initial_position="earliest")
    checks.clear()
    count_calls(lambda: c.ack(c.receive(1.0)))
    assert checks == [] and lane_invariant.DEBUG
    c.ack(c.receive(1.0))
    assert len(checks) == 2                  # the receive's lane, then the ack's


def test_acks_held_as_ranges_keep_the_invariant(broker, checks):
    """A transaction's acks are ranges in the pending-ack table: a received
    run acked as a list (one range), messages acked one by one with
    ``ack(m, txn=)`` (the check runs after each), a commit and an abort keep
    the invariant; an offset inside a held range that is outstanding again
    is caught."""
    c = broker.subscribe("t", "r", "exclusive", initial_position="earliest", nack_delay=0)
    run = []
    while len(run) < 40:
        run += [m for m in c.receive_many(40, 1.0) if m.partition == 0]
    assert [m.offset for m in run] == list(range(40))
    ln = lane(c)
    txn = broker.new_transaction()
    c.ack(run[:20], txn=txn)
    before = len(checks)
    for m in run[20:30]:
        c.ack(m, txn=txn)
    assert len(checks) == before + 10
    assert ln.pending.ranges_of(txn.id) == [(0, 30)]
    lane_invariant.check_lane(ln)
    ln.outstanding[25] = c.id
    with pytest.raises(AssertionError, match="offset 25 outstanding acknowledged or pending"):
        lane_invariant.check_lane(ln)
    del ln.outstanding[25]
    txn.commit()
    lane_invariant.check_lane(ln)
    assert ln.cursor.mark_delete == 30
    txn = broker.new_transaction()
    for m in run[30:]:
        c.ack(m, txn=txn)
    txn.abort()
    lane_invariant.check_lane(ln)
    again = []
    while msgs := c.receive_many(100, 0.2):
        again += [m for m in msgs if m.partition == 0]
    assert sorted(m.offset for m in again) == list(range(30, 40))
    assert {m.redelivery_count for m in again} == {1}
