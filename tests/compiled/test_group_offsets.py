"""``group_offsets``, the ack path's bookkeeping, against a reference model:
``{(topic, partition): offsets}`` in input order, a ``range`` exactly when a
key's offsets are consecutive and ascending."""

from __future__ import annotations

import random

import pytest

from txmq._ackset import group_offsets
from txmq.message import Message, MessageId


def reference(ids) -> dict:
    groups: dict = {}
    for topic, partition, offset in ids:
        groups.setdefault((topic, partition), []).append(offset)
    out = {}
    for key, offsets in groups.items():
        run = offsets == list(range(offsets[0], offsets[0] + len(offsets)))
        out[key] = range(offsets[0], offsets[-1] + 1) if run else offsets
    return out


def as_input(rng: random.Random, ids: list) -> list:
    """The ids as a mix of Messages, MessageIds and plain tuples."""
    out = []
    for mid in ids:
        kind = rng.randrange(3)
        if kind == 0:
            out.append(Message(b"v", None, None, MessageId(*mid), 0, 0))
        elif kind == 1:
            out.append(MessageId(*mid))
        else:
            out.append(tuple(mid))
    return out


def random_ids(rng: random.Random) -> list:
    keys = [(t, p) for t in ("a", "b") for p in range(rng.randint(1, 3))]
    ids = []
    nexts = {k: rng.randrange(50) for k in keys}
    for _ in range(rng.randint(0, 60)):
        key = rng.choice(keys)
        step = rng.choice([1, 1, 1, 1, 2, 0, -3])       # mostly runs, sometimes a break
        nexts[key] = max(0, nexts[key] + step)
        ids.append((*key, nexts[key]))
        if step == 1 or rng.random() < 0.5:
            for _ in range(rng.randint(0, 5)):          # a stretch on the same key
                nexts[key] += 1
                ids.append((*key, nexts[key]))
    return ids


@pytest.mark.parametrize("seed", range(300))
def test_group_offsets_matches_the_reference(seed):
    rng = random.Random(seed)
    ids = random_ids(rng)
    got = group_offsets(as_input(rng, ids))
    want = reference(ids)
    assert list(got) == list(want)                        # keys in input order
    for key, offsets in want.items():
        assert type(got[key]) is type(offsets), (key, got[key], offsets)
        assert list(got[key]) == list(offsets)


def test_interleaved_runs_stay_ranges():
    ids = [("t", p, o) for o in range(10, 20) for p in (0, 1)]
    got = group_offsets(ids)
    assert got == {("t", 0): range(10, 20), ("t", 1): range(10, 20)}


def test_a_run_broken_after_switching_keys_becomes_a_list():
    ids = [("t", 0, 1), ("t", 0, 2), ("t", 1, 5), ("t", 0, 7), ("t", 0, 8), ("t", 1, 6)]
    assert group_offsets(ids) == {("t", 0): [1, 2, 7, 8], ("t", 1): range(5, 7)}


def test_an_offset_that_is_not_an_int_is_refused():
    with pytest.raises(TypeError):
        group_offsets([("t", 0, 1.0)])
