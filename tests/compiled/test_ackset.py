"""AckSet (pyx/_ackset.pyx) against a plain Python set of offsets, with
Hypothesis: every operation, the range invariants, and serialisation."""
import struct

import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from txmq._ackset import AckSet

# A small universe makes merges, splits and adjacency common.
OFF = st.integers(min_value=0, max_value=200)
BIG = st.integers(min_value=-2**40, max_value=2**40)


def ranges_of(model):
    """Canonical maximal runs of a set of ints as half-open ranges."""
    out = []
    for x in sorted(model):
        if out and out[-1][1] == x:
            out[-1][1] = x + 1
        else:
            out.append([x, x + 1])
    return [tuple(r) for r in out]


class AckSetMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.acks = AckSet()
        self.model = set()

    @rule(x=OFF)
    def add(self, x):
        assert self.acks.add(x) == (x not in self.model)
        self.model.add(x)

    @rule(a=OFF, n=st.integers(min_value=-3, max_value=40))
    def add_range(self, a, n):
        new = set(range(a, a + n)) - self.model
        assert self.acks.add_range(a, a + n) == len(new)
        self.model |= new

    @rule(x=OFF)
    def remove(self, x):
        assert self.acks.remove(x) == (x in self.model)
        self.model.discard(x)

    @rule(a=OFF, n=st.integers(min_value=-3, max_value=60))
    def remove_range(self, a, n):
        gone = set(range(a, a + n)) & self.model
        assert self.acks.remove_range(a, a + n) == len(gone)
        self.model -= gone

    @rule(x=OFF)
    def contains(self, x):
        assert self.acks.contains(x) == (x in self.model)
        assert (x in self.acks) == (x in self.model)

    @rule(x=OFF)
    def first_unacked(self, x):
        want = x
        while want in self.model:
            want += 1
        assert self.acks.first_unacked(x) == want

    @rule(x=OFF)
    def next_acked(self, x):
        want = None
        for s, e in ranges_of(self.model):
            if e > x:
                want = (s, e)
                break
        assert self.acks.next_acked(x) == want

    @rule(x=OFF)
    def trim_below(self, x):
        self.acks.trim_below(x)
        self.model = {y for y in self.model if y >= x}

    @rule(a=OFF, b=OFF)
    def count_in(self, a, b):
        assert self.acks.count_in(a, b) == len([y for y in self.model if a <= y < b])

    @rule()
    def round_trip(self):
        raw = self.acks.to_bytes()
        rs = ranges_of(self.model)
        assert raw == struct.pack("<I", len(rs)) + b"".join(struct.pack("<qq", s, e) for s, e in rs)
        back = AckSet.from_bytes(raw)
        assert back.ranges() == self.acks.ranges()
        assert back.count() == self.acks.count()

    @precondition(lambda self: len(self.model) > 150)
    @rule()
    def clear(self):
        self.acks.clear()
        self.model.clear()

    @invariant()
    def same_ranges(self):
        rs = self.acks.ranges()
        # sorted, disjoint, non-adjacent, non-empty
        for s, e in rs:
            assert s < e
        for (_, e1), (s2, _) in zip(rs, rs[1:]):
            assert e1 < s2
        assert rs == ranges_of(self.model)
        assert len(self.acks) == len(rs)
        assert self.acks.count() == len(self.model)


AckSetMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestAckSetStateful = AckSetMachine.TestCase


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "range", "remove", "trim"]), BIG,
                          st.integers(min_value=0, max_value=2**20)), max_size=40))
def test_large_offsets_against_interval_model(ops):
    """Wide offsets, where a set of ints is too big: compare against a list
    of ranges rebuilt with plain Python arithmetic."""
    acks = AckSet()
    model = []  # list of (s, e), canonical

    def norm(rs):
        rs = sorted(r for r in rs if r[0] < r[1])
        out = []
        for s, e in rs:
            if out and s <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], e))
            else:
                out.append((s, e))
        return out

    def covered(rs, a, b):
        return sum(max(0, min(e, b) - max(s, a)) for s, e in rs)

    for op, x, n in ops:
        if op == "add":
            want_new = covered(model, x, x + 1) == 0
            assert acks.add(x) == want_new
            model = norm(model + [(x, x + 1)])
        elif op == "range":
            want = n - covered(model, x, x + n)
            assert acks.add_range(x, x + n) == want
            model = norm(model + [(x, x + n)])
        elif op == "remove":
            had = covered(model, x, x + 1) == 1
            assert acks.remove(x) == had
            model = norm([(s, min(e, x)) for s, e in model] + [(max(s, x + 1), e) for s, e in model])
        else:
            acks.trim_below(x)
            model = norm([(max(s, x), e) for s, e in model])
        assert acks.ranges() == model
    assert acks.count() == sum(e - s for s, e in model)
    assert AckSet.from_bytes(acks.to_bytes()).ranges() == model


def test_grows_past_initial_capacity():
    acks = AckSet()
    for i in range(0, 2000, 2):          # 1000 separate ranges (> 16 initial)
        assert acks.add(i)
    assert len(acks) == 1000
    for i in range(1, 2000, 4):          # merge every other gap
        acks.add(i)
    assert len(acks) == 500
    # split ranges again by removing interior points
    for s, e in acks.ranges()[::2]:
        assert acks.remove(s + 1)
    assert acks.count() == 1500 - 250
    assert AckSet.from_bytes(acks.to_bytes()).ranges() == acks.ranges()


def test_empty_set():
    acks = AckSet()
    assert acks.ranges() == [] and len(acks) == 0 and acks.count() == 0
    assert acks.first_unacked(5) == 5
    assert acks.next_acked(0) is None
    assert not acks.contains(0) and not acks.remove(0)
    assert acks.to_bytes() == b"\0\0\0\0"
    assert AckSet.from_bytes(b"\0\0\0\0").ranges() == []
    assert acks.add_range(5, 5) == 0 and acks.add_range(5, 3) == 0
    assert repr(acks) == "AckSet([])"


@pytest.mark.parametrize("data", [
    b"", b"\x01", b"\x00\x00\x00",
    b"\x01\x00\x00\x00",                                   # count 1, no range
    b"\x00\x00\x00\x00" + bytes(16),                       # count 0, trailing bytes
    b"\x01\x00\x00\x00" + struct.pack("<qq", 5, 5),        # empty range
    b"\x01\x00\x00\x00" + struct.pack("<qq", 9, 2),        # reversed range
    b"\xff\xff\xff\xff" + bytes(32),                       # huge count
])
def test_from_bytes_rejects_malformed(data):
    with pytest.raises(ValueError):
        AckSet.from_bytes(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=80))
def test_from_bytes_garbage_is_value_error_or_valid(data):
    try:
        acks = AckSet.from_bytes(data)
    except ValueError:
        return
    # Accepted input must be the right size and describe non-empty ranges.
    n = struct.unpack_from("<I", data)[0]
    assert len(data) == 4 + 16 * n
    pairs = [struct.unpack_from("<qq", data, 4 + 16 * k) for k in range(n)]
    assert all(a < b for a, b in pairs)
    rs = acks.ranges()
    assert all(s < e for s, e in rs)
    assert all(e1 < s2 for (_, e1), (s2, _) in zip(rs, rs[1:]))
    for a, b in pairs:
        for x in (a, b - 1):
            assert acks.contains(x)


def test_add_many_sorts_merges_and_counts_new_offsets():
    from txmq._ackset import add_many
    s = AckSet()
    assert add_many(s, []) == 0 and add_many(s, [7]) == 1
    assert add_many(s, [5, 3, 4, 3, 10, 7]) == 4              # unsorted, with repeats and one known
    assert s.ranges() == [(3, 6), (7, 8), (10, 11)]
    assert add_many(s, list(range(0, 12))) == 7
    assert s.ranges() == [(0, 12)]
