"""Recovery of transaction state without a crash harness: lost coordinator
logs, transaction-buffer snapshots, damaged files, retention of aborted
data."""

from __future__ import annotations

import os
import shutil

import pytest

import txmq
from txmq.storage import log as log_mod, txnbuffer as txnbuffer_mod
from txmq.errors import CorruptLogError


def drain(consumer, timeout=0.2):
    out = []
    while got := consumer.receive_many(10_000, timeout):
        out += got
    return [m.value for m in out]


def test_transaction_unknown_to_its_coordinator_is_aborted(tmp_path):
    """A partition and a subscription know a transaction whose coordinator
    log lost it (power loss before the log reached the disk): opening aborts
    it everywhere, and its sequence is never handed out again."""
    path = tmp_path / "d"
    with txmq.Broker(path, num_coordinators=1) as b:
        b.create_topic("t")
        b.producer("t").send(b"in")
        c = b.subscribe("t", "s", initial_position="earliest")
        m = c.receive(0.5)
        txn = b.new_transaction()
        b.producer("t").send(b"ghost", txn=txn)
        c.ack(m, txn=txn)
        lost = txn.id
    os.unlink(path / "coordinator" / "tc-0.log")
    with txmq.Broker(path, num_coordinators=1) as b:
        assert b.stats()["transactions"]["recovered"]["aborted"] == 1
        c = b.subscribe("t", "s")
        got = c.receive_many(10, 0.3)
        assert [x.value for x in got] == [b"in"]           # the ack was dropped
        assert b.new_transaction().id.sequence > lost.sequence
        ru = b.subscribe("t", "u", isolation="read_uncommitted", initial_position="earliest")
        assert drain(ru) == [b"in", b"ghost"]               # the aborted data stays readable uncommitted


def test_decided_transaction_is_completed_on_open(tmp_path):
    """The decision is logged, the markers are not (a crash in between):
    opening commits it everywhere."""
    path = tmp_path / "d"
    with txmq.Broker(path, num_coordinators=1) as b:
        b.create_topic("t", partitions=2)
        b.producer("t").send(b"in", partition=0)
        c = b.subscribe("t", "s", initial_position="earliest")
        m = c.receive(0.5)
        txn = b.new_transaction()
        b.producer("t").send(b"out0", partition=0, txn=txn)
        b.producer("t").send(b"out1", partition=1, txn=txn)
        c.ack(m, txn=txn)
        tc = b._coordinators[0]
        tc.record_decision(txn.id.words, True)     # step 2 only: as if the process died here
        tc.log.sync(force=True)
    with txmq.Broker(path, num_coordinators=1) as b:
        assert b.stats()["transactions"]["recovered"]["committed"] == 1
        c = b.subscribe("t", "s")
        assert sorted(drain(c)) == [b"out0", b"out1"]       # "in" was acked by the commit


def _fill(b, n_txns, topic="t"):
    p = b.producer(topic)
    ids = []
    for i in range(n_txns):
        txn = b.new_transaction()
        p.send(b"%d" % i, txn=txn)
        if i % 3 == 0:
            txn.abort()
        elif i % 3 == 1:
            txn.commit()
        ids.append(txn)
    return ids


def test_snapshot_and_replay_equal_a_full_rebuild(tmp_path, monkeypatch):
    monkeypatch.setattr(txnbuffer_mod, "SNAPSHOT_EVERY_TXNS", 50)
    path = tmp_path / "d"
    with txmq.Broker(path, fsync="never", linger_ms=0) as b:    # (every send in the log at once)
        b.create_topic("t")
        txns = _fill(b, 230)
        p = b._topics["t"].partitions[0]
        state = (p.ongoing.entries(), p.aborted.entries(), p.max_read_position)
        assert len(p.ongoing) == 76 and len(p.aborted) == 77
        for t in txns:
            if t.state is txmq.TxnState.OPEN:
                b.abort_transaction(t.id)
        expect_after = (p.aborted.entries(), p.max_read_position)
    snap = path / "topics" / "t" / "0" / "txnbuffer.snap"
    assert snap.exists()
    shutil.copy(snap, tmp_path / "kept.snap")
    with txmq.Broker(path, fsync="never") as b:
        p = b._topics["t"].partitions[0]
        assert (p.aborted.entries(), p.max_read_position) == expect_after
        assert p.ongoing.entries() == []
    # The same without any snapshot: rebuilt from the log, same state.
    os.unlink(snap)
    with txmq.Broker(path, fsync="never") as b:
        p = b._topics["t"].partitions[0]
        assert (p.aborted.entries(), p.max_read_position) == expect_after
    assert state[2] < expect_after[1]


def test_damaged_snapshot_is_rebuilt(tmp_path):
    path = tmp_path / "d"
    with txmq.Broker(path, fsync="never") as b:
        b.create_topic("t")
        _fill(b, 12)
        for t in b.transactions():
            b.abort_transaction(t["id"])
        expect = b._topics["t"].partitions[0].aborted.entries()
    snap = path / "topics" / "t" / "0" / "txnbuffer.snap"
    raw = bytearray(snap.read_bytes())
    raw[20] ^= 0xFF
    snap.write_bytes(bytes(raw))
    with txmq.Broker(path, fsync="never") as b:
        part = b._topics["t"].partitions[0]
        assert part.aborted.entries() == expect
        assert any("snapshot unusable" in d for d in b.stats()["topics"]["t"]["partitions"][0]["truncated_on_open"])
        c = b.subscribe("t", "s", initial_position="earliest")
        assert drain(c) == [b"%d" % i for i in range(12) if i % 3 == 1]


def test_corrupt_coordinator_frame_is_reported(tmp_path):
    path = tmp_path / "d"
    with txmq.Broker(path, num_coordinators=1) as b:
        b.create_topic("t")
        txn = b.new_transaction()
        b.producer("t").send(b"x", txn=txn)
    log = path / "coordinator" / "tc-0.log"
    raw = log.read_bytes()
    log.write_bytes(raw + b"\x05\x00\x00\x00garbage")   # a torn frame at the tail
    with txmq.Broker(path, num_coordinators=1) as b:
        problems = b.stats()["transactions"]["coordinator_problems_on_open"]
        assert problems and "tc-0.log" in problems[0]
        assert b.stats()["transactions"]["recovered"]["aborted"] == 1
    log.write_bytes(b"JUNK" + log.read_bytes()[4:])
    with pytest.raises(CorruptLogError):
        txmq.Broker(path, num_coordinators=1)


def test_retention_trims_the_abort_set(tmp_path):
    path = tmp_path / "d"
    with txmq.Broker(path, fsync="never", segment_bytes_max=4096, retention_bytes=0, linger_ms=0) as b:
        b.create_topic("t")
        p = b.producer("t")
        for i in range(40):
            txn = b.new_transaction()
            p.send(b"x" * 200, txn=txn)
            txn.abort()
        part = b._topics["t"].partitions[0]
        assert len(part.aborted) == 40
        b.enforce_retention()
        assert part.start_offset > 0
        assert len(part.aborted) < 40
        for _, _, first, marker in part.aborted.entries():
            assert marker >= part.start_offset


def test_coordinator_log_is_compacted(tmp_path, monkeypatch):
    from txmq.transactions import coordinator
    monkeypatch.setattr(coordinator, "COMPACT_FRAMES", 100)
    monkeypatch.setattr(coordinator, "LIVE_FRAMES", 1)
    path = tmp_path / "d"
    with txmq.Broker(path, fsync="commit", num_coordinators=1) as b:
        b.create_topic("t")
        _fill(b, 300)
        open_ids = {t["id"] for t in b.transactions()}
        # (the log's frames: the file also holds zeros written ahead of them;
        # a decision record of one small batch carries its copy, ~250 bytes)
        size = b._coordinators[0].log.size
        assert size < 100 * 250 + 200 * 120      # bounded by live transactions, not 300 txns
    with txmq.Broker(path, num_coordinators=1) as b:
        assert b.stats()["transactions"]["recovered"]["aborted"] == len(open_ids)
        c = b.subscribe("t", "s", initial_position="earliest")
        assert drain(c) == [b"%d" % i for i in range(300) if i % 3 == 1]


def test_failed_fan_out_is_retried_until_it_succeeds(tmp_path, monkeypatch):
    """A participant failing to write its marker does not lose the commit:
    commit() returns once the decision is durable, and the broker's retry
    timer finishes the fan-out."""
    import time
    from txmq.storage.partition import Partition

    real = Partition.end_txn
    failures = {"left": 3}

    def flaky(self, words, commit):
        if self.index == 1 and failures["left"] > 0:
            failures["left"] -= 1
            raise OSError(28, "No space left on device")
        return real(self, words, commit)

    monkeypatch.setattr(Partition, "end_txn", flaky)
    with txmq.Broker(tmp_path / "d", fsync="never") as b:
        b.create_topic("t", partitions=2)
        c = b.subscribe("t", "s", initial_position="earliest")
        txn = b.new_transaction()
        for p in (0, 1):
            b.producer("t").send(b"p%d" % p, partition=p, txn=txn)
        txn.commit()                                   # the decision holds
        assert txn.state is txmq.TxnState.COMMITTING   # partition 1 still owes its marker
        assert [m.value for m in c.receive_many(10, 0.1)] == [b"p0"]
        deadline = time.monotonic() + 10
        while txn.state is not txmq.TxnState.COMMITTED and time.monotonic() < deadline:
            time.sleep(0.05)
        assert txn.state is txmq.TxnState.COMMITTED and failures["left"] == 0
        assert [m.value for m in c.receive_many(10, 0.5)] == [b"p1"]
        assert b.transactions() == []


def test_recovery_point_carries_a_buffer_snapshot(tmp_path, monkeypatch):
    """Opening replays the log only from the last recovery point, with or
    without transactions: each recovery point writes a buffer snapshot."""
    import struct
    monkeypatch.setattr(log_mod, "CHECKPOINT_BYTES", 8192)
    with txmq.Broker(tmp_path / "d", fsync="never") as b:
        b.create_topic("t")
        p = b.producer("t")
        for _ in range(100):
            p.send(b"x" * 1000)
        part = b._topics["t"].partitions[0]
        raw = (tmp_path / "d" / "topics" / "t" / "0" / "txnbuffer.snap").read_bytes()
        offset = struct.unpack_from("<q", raw, 8)[0]
        assert part.end_offset - 10 <= offset <= part.end_offset
