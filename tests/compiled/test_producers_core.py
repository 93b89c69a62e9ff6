"""The Cython producer table against a small Python model of Kafka's rules."""

from __future__ import annotations

import random

import pytest

from txmq._producers import APPEND, DUPLICATE, FENCED, OUT_OF_ORDER, ProducerStates

MOD = 1 << 31


class Model:
    """pid -> [epoch, last seq, last ts, [(seq, count, offset)] newest last]."""

    def __init__(self):
        self.t = {}

    def next_sequence(self, pid, epoch):
        st = self.t.get(pid)
        if st is None:
            return 0
        if epoch < st[0]:
            return FENCED
        if epoch > st[0] or st[1] < 0:
            return 0
        return (st[1] + 1) % MOD

    def check(self, pid, epoch, seq, count):
        st = self.t.get(pid)
        if st is None:
            return APPEND
        if epoch < st[0]:
            return FENCED
        if epoch > st[0]:
            return APPEND if seq == 0 else OUT_OF_ORDER
        if st[1] < 0:
            return APPEND
        for s, c, off in st[3]:
            if (s, c) == (seq, count):
                return off
        if seq == (st[1] + 1) % MOD:
            return APPEND
        return DUPLICATE if (st[1] - seq) % MOD < MOD // 2 else OUT_OF_ORDER

    def record(self, pid, epoch, seq, count, offset, ts):
        st = self.t.get(pid)
        if st is None or st[0] != epoch:
            st = self.t[pid] = [epoch, -1, st[2] if st else 0, []]
        st[3] = (st[3] + [(seq, count, offset)])[-5:]
        st[1] = (seq + count - 1) % MOD
        st[2] = max(st[2], ts)

    def expire(self, before):
        old = [p for p, st in self.t.items() if st[2] < before]
        for p in old:
            del self.t[p]
        return len(old)

    def entries(self):
        return {p: (st[0], st[1], st[2], list(st[3])) for p, st in self.t.items()}


@pytest.mark.parametrize("seed", range(6))
def test_table_matches_model(seed):
    rng = random.Random(seed)
    t, m = ProducerStates(), Model()
    pids = [rng.randrange(1 << 40) for _ in range(rng.choice([3, 50, 3000]))]
    offset, ts = 0, 0
    for step in range(20_000):
        pid = rng.choice(pids)
        epoch = rng.choice([0, 0, 0, 1, 2])
        r = rng.random()
        if r < 0.45:
            seq = m.next_sequence(pid, epoch)
            assert t.next_sequence(pid, epoch) == seq
            if seq >= 0:
                count = rng.randint(1, 9)
                ts += rng.randint(0, 3)
                t.record(pid, epoch, seq, count, offset, ts)
                m.record(pid, epoch, seq, count, offset, ts)
                offset += count
        elif r < 0.9:
            st = m.t.get(pid)
            base = st[1] if st else 0
            seq = (base + rng.randint(-12, 3)) % MOD if rng.random() < 0.9 else rng.randrange(MOD)
            count = rng.randint(1, 9)
            assert t.check(pid, epoch, seq, count) == m.check(pid, epoch, seq, count)
        elif r < 0.995:
            assert t.last_sequence(pid) == (m.t[pid][1] if pid in m.t else -1)
            assert t.epoch_of(pid) == (m.t[pid][0] if pid in m.t else -1)
            assert (pid in t) == (pid in m.t) and len(t) == len(m.t)
        else:
            before = ts - rng.randint(0, 200)
            assert t.expire(before) == m.expire(before)
        if step % 2000 == 0:
            again, n = ProducerStates.from_bytes(t.to_bytes())
            assert n == len(t.to_bytes()) and again.entries() == m.entries() == t.entries()
            t = again                   # carry on with the reloaded one
    assert t.entries() == m.entries()


def test_from_bytes_rejects_bad_tables():
    t = ProducerStates()
    t.record(5, 0, 0, 1, 0, 1)
    raw = t.to_bytes()
    with pytest.raises(ValueError):
        ProducerStates.from_bytes(raw[:-1])
    with pytest.raises(ValueError):
        ProducerStates.from_bytes(raw[:4] + (-3).to_bytes(8, "little", signed=True) + raw[12:])
    twice = (2).to_bytes(4, "little") + raw[4:] + raw[4:]
    with pytest.raises(ValueError):
        ProducerStates.from_bytes(twice)
    assert 5 in t and -1 not in t and 6 not in t


def test_registry_frames_replay_and_snapshot():
    import struct

    from txmq import _txnlog as L

    i64 = struct.Struct("<q").pack
    frames = [(L.PR_BLOCK, i64(1024)), (L.PR_NAME, L.encode_text("svc-a") + i64(3)),
              (L.PR_NAME, L.encode_text("svc-b") + i64(5000)), (L.PR_BLOCK, i64(2048))]
    reserved, names = L.replay_registry(frames)
    assert (reserved, names) == (5001, {"svc-a": 3, "svc-b": 5000})
    snap = L.encode_registry_snapshot(reserved, names)
    assert L.replay_registry([(1, snap), (L.PR_NAME, L.encode_text("c") + i64(7))]) == \
        (5001, {"svc-a": 3, "svc-b": 5000, "c": 7})
    for bad in ([(L.PR_BLOCK, i64(1) + b"x")], [(L.PR_NAME, L.encode_text("n"))], [(9, b"")],
                [(L.PR_NAME, b"\x05\x00ab" + i64(1))]):
        with pytest.raises(ValueError):
            L.replay_registry(bad)
