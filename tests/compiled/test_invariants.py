"""Debug invariants of the Cython tables (TXMQ_DEBUG=1, which the suite
sets): random sequences of operations, compared with a plain model, with
every change re-checked inside the table; the checks themselves are run
once more at the end, and turned off they cost nothing but a flag test."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings, strategies as st

from txmq import _ackset, _txn
from txmq._ackset import AckSet
from txmq._txn import AbortSet, OngoingQueue, PendingAckTable


def test_the_suite_runs_with_the_checks_on():
    assert os.environ.get("TXMQ_DEBUG") == "1"


@pytest.fixture(autouse=True)
def checks_on():
    _ackset.set_debug(True)
    _txn.set_debug(True)
    yield
    on = os.environ.get("TXMQ_DEBUG") == "1"
    _ackset.set_debug(on)
    _txn.set_debug(on)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "remove", "range", "trim"]), st.integers(0, 200),
                          st.integers(0, 20)), max_size=80))
def test_ackset_against_a_set(ops):
    acks, model = AckSet(), set()
    for op, a, n in ops:
        if op == "add":
            assert acks.add(a) == (a not in model)
            model.add(a)
        elif op == "remove":
            assert acks.remove(a) == (a in model)
            model.discard(a)
        elif op == "range":
            new = set(range(a, a + n)) - model
            assert acks.add_range(a, a + n) == len(new)
            model |= new
        else:
            acks.trim_below(a)
            model = {o for o in model if o >= a}
        assert acks.count() == len(model)
    acks.check_invariants()
    assert all(acks.contains(o) for o in model)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 30), st.integers(0, 3)), max_size=120))
def test_ongoing_queue_against_a_dict(ops):
    q, model, offset = OngoingQueue(), {}, 0
    for add, lo, step in ops:
        offset += step
        if add:
            assert q.add(0, lo, offset, 7) == (lo not in model)
            model.setdefault(lo, offset)
        else:
            assert q.remove(0, lo) == model.pop(lo, -1)
        assert len(q) == len(model)
        assert q.max_read_position(10**9) == (min(model.values()) if model else 10**9)
    q.check_invariants()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 500), st.integers(0, 5)), max_size=60))
def test_abort_set_against_a_list(ops):
    s, model, marker = AbortSet(), [], 0
    for tc, lo, step in ops:
        marker += step
        if step == 0 and model:
            s.trim_below(marker)
            model = [e for e in model if e[3] >= marker]
        else:
            s.add(tc << 48, lo, marker - step, marker)
            if not any(e[:2] == (tc << 48, lo) for e in model):
                model.append((tc << 48, lo, marker - step, marker))
        assert s.entries() == model
    s.check_invariants()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "cumulative", "take"]), st.integers(0, 3),
                          st.lists(st.integers(0, 50), max_size=6)), max_size=60))
def test_pending_ack_table_against_dicts(ops):
    t, owner, cumulative = PendingAckTable(), {}, {}
    for op, txn, offsets in ops:
        if op == "add":
            new = [o for o in dict.fromkeys(offsets) if o not in owner]
            assert t.add(txn, offsets) == new
            owner.update({o: txn for o in new})
        elif op == "cumulative" and offsets:
            t.add_cumulative(txn, offsets[0])
            cumulative[txn] = max(cumulative.get(txn, -1), offsets[0])
        elif op == "take":
            mine, cum = t.take(txn)
            assert sorted(mine) == sorted(o for o, x in owner.items() if x == txn)
            assert cum == cumulative.pop(txn, -1)
            owner = {o: x for o, x in owner.items() if x != txn}
        assert all(t.owner_of(o) == x for o, x in owner.items())
    t.check_invariants()
