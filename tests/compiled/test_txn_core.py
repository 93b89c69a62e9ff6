"""The transaction structures of the Cython core (txmq._txn) against plain
Python models."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from txmq import _txn as T
from txmq import _txnlog as L
from txmq._redolog import parse, frame


# -- OngoingQueue -----------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 60)), max_size=400))
def test_ongoing_queue_matches_model(ops):
    q = T.OngoingQueue()
    model = {}            # lo -> first offset, insertion order = offset order
    offset = 0
    for add, k in ops:
        if add:
            offset += 3
            added = q.add(0, k, offset, offset * 10)
            assert added == (k not in model)
            if added:
                model[k] = offset
        else:
            assert q.remove(0, k) == model.pop(k, -1)
        end = offset + 100
        assert q.max_read_position(end) == (min(model.values()) if model else end)
        assert len(q) == len(model)
        assert [e[1] for e in q.entries()] == list(model)
    q2, n = T.OngoingQueue.from_bytes(q.to_bytes())
    assert n == len(q.to_bytes()) and q2.entries() == q.entries()


def test_ongoing_queue_refuses_offsets_out_of_order():
    q = T.OngoingQueue()
    q.add(0, 1, 10)
    with pytest.raises(ValueError):
        q.add(0, 2, 5)


def test_ongoing_queue_many_open_stays_o1():
    q = T.OngoingQueue()
    for i in range(100_000):
        q.add(1 << 48, i + 1, i)
    for i in range(1, 100_000, 2):          # end every other one, oldest first kept
        q.remove(1 << 48, i + 1)
    assert q.max_read_position(10**9) == 0
    q.remove(1 << 48, 1)
    assert q.max_read_position(10**9) == 2 and q.oldest()[:3] == (1 << 48, 3, 2)


def test_ongoing_queue_memory_follows_open_count():
    """One transaction stays open while 200,000 others come and go behind
    it: the queue compacts instead of growing."""
    q = T.OngoingQueue()
    q.add(0, 1, 0)
    model = {}
    for i in range(2, 200_002):
        q.add(0, i, i)
        model[i] = i
        if i % 7:                            # a few stay open for a while
            q.remove(0, i)
            del model[i]
        if i % 1000 == 0:
            for k in list(model)[:-3]:
                assert q.remove(0, k) == model.pop(k)
    assert q.capacity <= 4096
    assert q.max_read_position(10**9) == 0
    assert q.remove(0, 1) == 0
    assert q.max_read_position(10**9) == min(model.values())
    assert [e[1] for e in q.entries()] == list(model)


# -- AbortSet ----------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 3000)), max_size=200, unique=True),
       st.integers(0, 250))
def test_abort_set_matches_model(txns, cut):
    s = T.AbortSet()
    model = []
    for i, (tc, seq) in enumerate(txns):
        hi, lo = T.txn_words(tc, seq)
        s.add(hi, lo, i * 2, i * 2 + 1)
        model.append((i * 2 + 1, hi, lo))
    hi = np.array([T.txn_words(tc, seq)[0] for tc in range(5) for seq in range(0, 3100, 7)], np.uint64)
    lo = np.array([seq for tc in range(5) for seq in range(0, 3100, 7)], np.uint64)
    expect = {(h, l) for _, h, l in model}
    assert s.contains_many(hi, lo).tolist() == [(int(h), int(l)) in expect for h, l in zip(hi, lo)]
    dropped = s.trim_below(cut)
    kept = [(m, h, l) for m, h, l in model if m >= cut]
    assert dropped == len(model) - len(kept) and len(s) == len(kept)
    for m, h, l in model:
        assert s.contains(h, l) == (m >= cut)
    s2, _ = T.AbortSet.from_bytes(s.to_bytes())
    assert s2.entries() == s.entries()


def test_abort_set_overlapping_ranges():
    s = T.AbortSet()
    s.add(0, 5, 10, 20)
    s.add(0, 6, 15, 40)
    assert [e[1] for e in s.overlapping(0, 11)] == [5]
    assert [e[1] for e in s.overlapping(21, 30)] == [6]
    assert s.overlapping(41, 50) == []


def test_abort_set_grows_downwards():
    s = T.AbortSet()
    s.add(0, 100_000, 0, 1)
    s.add(0, 3, 2, 3)
    assert s.contains(0, 3) and s.contains(0, 100_000) and not s.contains(0, 4)


# -- PendingAckTable ------------------------------------------------------------------------


class FakeAcked:
    def __init__(self, offs=()):
        self.offs = set(offs)

    def contains(self, o):
        return o in self.offs

    def __len__(self):
        return len(self.offs)


def test_pending_individual_conflicts():
    t = T.PendingAckTable()
    assert t.conflict_individual("a", [5, 6], 0, FakeAcked()) is None
    t.add("a", [5, 6])
    assert t.conflict_individual("a", [5], 0, FakeAcked()) is None          # same txn again
    assert t.conflict_individual("b", [7, 6], 0, FakeAcked()) == (6, "pending in another transaction", "a")
    assert t.conflict_individual("b", [3], 4, FakeAcked())[1] == "already acknowledged"
    assert t.conflict_individual("b", [9], 0, FakeAcked([9]))[1] == "already acknowledged"
    assert t.is_pending(5) and not t.is_pending(7) and t.next_pending(0) == 5 and t.next_pending(7) == -1
    assert t.take("a") == ([5, 6], -1)
    assert len(t) == 0 and t.conflict_individual("b", [6], 0, FakeAcked()) is None


def test_pending_cumulative_conflicts():
    t = T.PendingAckTable()
    t.add("a", [10])
    assert t.conflict_cumulative("b", 12, 0)[2] == "a"           # a holds 10 <= 12
    assert t.conflict_cumulative("b", 9, 0) is None
    t.add_cumulative("b", 9)
    assert t.conflict_individual("a", [4], 0, FakeAcked())[2] == "b"   # covered by b
    assert t.conflict_cumulative("c", 3, 0)[2] == "b"            # another cumulative holder
    assert t.owner_of(2) == "b" and t.owner_of(10) == "a" and t.owner_of(11) is None
    assert t.next_pending(0) == 0
    assert t.take("b") == ([], 9)


# -- log replay ----------------------------------------------------------------------------


def _txn(tc, seq):
    return L.pack_txn(*T.txn_words(tc, seq))


def test_replay_coordinator_and_snapshot_roundtrip():
    frames = [
        (L.TC_BEGIN, _txn(1, 1) + struct.pack("<qq", 5000, 123)),
        (L.TC_ADD_PARTITION, _txn(1, 1) + L.encode_text("orders") + struct.pack("<I", 3)),
        (L.TC_ADD_SUBSCRIPTION, _txn(1, 1) + L.encode_text("orders") + L.encode_text("billing")),
        (L.TC_BEGIN, _txn(1, 2) + struct.pack("<qq", 60000, 124)),
        (L.TC_COMMITTING, _txn(1, 1)),
        (L.TC_BEGIN, _txn(1, 3) + struct.pack("<qq", 60000, 125)),
        (L.TC_ABORTING, _txn(1, 3)),
        (L.TC_ABORTED, _txn(1, 3)),
        (L.TC_PRODUCER, L.encode_producer("etl-1", 7, 0)),
        (L.TC_PRODUCER, L.encode_producer("etl-1", 7, 1)),
        (L.TC_PRODUCER, L.encode_producer("etl-2", 9, 32767)),
    ]
    next_lo, txns, tids = L.replay_coordinator(frames)
    w1, w2, w3 = (T.txn_words(1, s) for s in (1, 2, 3))
    assert next_lo == 4
    assert txns[w1] == [L.COMMITTING, 5000, 123, {("orders", 3)}, {("orders", "billing")}]
    assert txns[w2] == [L.OPEN, 60000, 124, None, None] and txns[w3][0] == L.ABORTED
    assert tids == {"etl-1": (7, 1), "etl-2": (9, 32767)}
    # Through the real frame encoder, and a snapshot of the result.
    raw = b"".join(frame(k, p) for k, p in frames)
    parsed, end, reason = parse(raw, 0)
    assert reason is None and L.replay_coordinator([(k, p) for k, p, _ in parsed]) == (next_lo, txns, tids)
    snap = L.encode_coordinator_snapshot(next_lo, {w1: txns[w1], w2: txns[w2]}, tids)
    again = L.replay_coordinator([(1, snap)])
    assert again == (4, {w1: txns[w1], w2: txns[w2]}, tids)
    again = L.replay_coordinator([(1, snap), (L.TC_COMMITTED, _txn(1, 1))])
    assert again[1][w1] == [L.COMMITTED, 5000, 123, None, None]


def test_replay_coordinator_rejects_bad_frames():
    with pytest.raises(ValueError, match="before its BEGIN"):
        L.replay_coordinator([(L.TC_COMMITTING, _txn(0, 9))])
    with pytest.raises(ValueError, match="stray"):
        L.replay_coordinator([(L.TC_BEGIN, _txn(0, 1) + struct.pack("<qq", 1, 2) + b"x")])
    with pytest.raises(ValueError, match="ends at byte"):
        L.replay_coordinator([(L.TC_BEGIN, _txn(0, 1)[:10])])
    with pytest.raises(ValueError, match="unknown"):
        L.replay_coordinator([(77, b"")])


def test_replay_pending():
    a, b = T.txn_words(0, 1), T.txn_words(2, 5)
    frames = [
        (L.PA_ACK, L.pack_txn(*a) + struct.pack("<I", 2) + np.array([4, 9], "<i8").tobytes()),
        (L.PA_ACK, L.pack_txn(*b) + struct.pack("<I", 1) + np.array([11], "<i8").tobytes()),
        (L.PA_CUMULATIVE, L.pack_txn(*b) + struct.pack("<q", 3)),
        (L.PA_COMMIT, L.pack_txn(*a)),
    ]
    assert L.replay_pending(frames) == {b: [[11], 3]}

    class Id:
        def __init__(self, words):
            self.words = words

        def __hash__(self):
            return hash(self.words)

        def __eq__(self, other):
            return self.words == other.words

    t = T.PendingAckTable()
    t.add(Id(b), [11, 12])
    t.add_cumulative(Id(b), 3)
    assert L.replay_pending([(1, t.to_bytes())]) == {b: [[11, 12], 3]}


def test_txn_words_range():
    assert T.txn_parts(*T.txn_words(65535, (1 << 112) - 1)) == (65535, (1 << 112) - 1)
    for bad in ((65536, 1), (0, 1 << 112), (-1, 1)):
        with pytest.raises(ValueError):
            T.txn_words(*bad)


# -- PendingAckTable: one ack at a time, ranges, what is not logged yet --------------------


def test_pending_add_one_checks_and_records_in_one_call():
    t = T.PendingAckTable()
    assert t.add_one("a", 5, 0, FakeAcked()) == 1
    assert t.add_one("a", 5, 0, FakeAcked()) == 0               # a again: nothing new
    assert t.add_one("b", 5, 0, FakeAcked()) == -1              # held by a
    assert t.conflict_individual("b", [5], 0, FakeAcked()) == (5, "pending in another transaction", "a")
    assert t.add_one("b", 3, 4, FakeAcked()) == -1              # below mark-delete
    assert t.add_one("b", 9, 0, FakeAcked([9])) == -1           # acknowledged already
    for o in (6, 7, 8):
        assert t.add_one("a", o, 0, FakeAcked()) == 1
    assert t.ranges_of("a") == [(5, 9)] and t.owner_of(7) == "a" and len(t) == 4
    t.add_cumulative("c", 20)
    assert t.add_one("b", 12, 0, FakeAcked()) == -1             # covered by c's cumulative ack
    assert t.add_one("c", 12, 0, FakeAcked()) == 1              # c's own
    assert len(t) == 6
    t.check_invariants()


def test_pending_unlogged_offsets_are_taken_once():
    t = T.PendingAckTable()
    for o in (4, 2, 3):
        t.add_one("a", o, 0, FakeAcked())
    t.add("b", [10, 11])
    assert t.has_unlogged("a") and sorted(t.unlogged_txns()) == ["a", "b"]
    assert t.take_unlogged("a").tolist() == [4, 2, 3]           # in ack order
    assert t.take_unlogged("a") is None and not t.has_unlogged("a")
    t.add_one("a", 5, 0, FakeAcked())
    assert t.take_unlogged("a").tolist() == [5]
    t.mark_logged()
    assert t.unlogged_txns() == [] and t.take_unlogged("b") is None
    assert t.take("a") == ([2, 3, 4, 5], -1) and t.ranges_of("a") == []
    assert t.owner_of(10) == "b" and not t.is_pending(3)
    t.check_invariants()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["one", "many", "take", "log"]), st.integers(0, 3),
                          st.lists(st.integers(0, 40), max_size=5)), max_size=60))
def test_pending_table_one_at_a_time_against_a_model(ops):
    """add_one/add/take/take_unlogged against dicts: who holds what, and
    exactly which offsets are still to be logged."""
    t, owner, unlogged = T.PendingAckTable(), {}, {}
    for op, txn, offsets in ops:
        if op == "one":
            for o in offsets:
                want = 1 if o not in owner else (0 if owner[o] == txn else -1)
                assert t.add_one(txn, o, 0, FakeAcked()) == want
                if want == 1:
                    owner[o] = txn
                    unlogged.setdefault(txn, []).append(o)
        elif op == "many":
            new = [o for o in dict.fromkeys(offsets) if o not in owner]
            assert t.add(txn, offsets) == new
            owner.update({o: txn for o in new})
            unlogged.setdefault(txn, []).extend(new)
        elif op == "take":
            mine, _ = t.take(txn)
            assert mine == sorted(o for o, x in owner.items() if x == txn)
            owner = {o: x for o, x in owner.items() if x != txn}
            unlogged.pop(txn, None)
        else:
            got = t.take_unlogged(txn)
            assert (got.tolist() if got is not None else []) == unlogged.pop(txn, [])
        assert all(t.owner_of(o) == x for o, x in owner.items())
        assert len(t) == len(owner)
    t.check_invariants()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["range", "one", "cumulative", "take"]), st.integers(0, 2),
                          st.integers(0, 40), st.integers(0, 8)), max_size=50),
       st.integers(0, 5), st.lists(st.integers(0, 48), max_size=4))
def test_pending_table_by_ranges_agrees_with_offsets(ops, mark_delete, acked_offsets):
    """conflict_range / add_range, the path of a received run, answer as
    conflict_individual / add over the same offsets one by one."""
    acked = FakeAcked(acked_offsets)
    acked.next_acked = lambda x: next(((o, o + 1) for o in sorted(acked.offs) if o >= x), None)
    by_range, by_offset = T.PendingAckTable(), T.PendingAckTable()
    for op, txn, start, n in ops:
        if op == "range":
            want = by_offset.conflict_individual(txn, range(start, start + n), mark_delete, acked)
            assert by_range.conflict_range(txn, start, start + n, mark_delete, acked) == want
            if want is None:
                assert by_range.add_range(txn, start, start + n) == len(by_offset.add(txn, range(start, start + n)))
        elif op == "one":
            assert by_range.add_one(txn, start, mark_delete, acked) == by_offset.add_one(txn, start, mark_delete, acked)
        elif op == "cumulative":
            by_range.add_cumulative(txn, start)
            by_offset.add_cumulative(txn, start)
        else:
            assert by_range.take(txn) == by_offset.take(txn)
        for t in range(3):
            assert by_range.ranges_of(t) == by_offset.ranges_of(t)
            got = by_range.take_unlogged(t)
            want = by_offset.take_unlogged(t)
            assert sorted(got.tolist() if got is not None else []) == sorted(want.tolist() if want is not None else [])
    by_range.check_invariants()
