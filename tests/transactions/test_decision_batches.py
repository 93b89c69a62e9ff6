"""The batches a commit's decision record names (docs/FORMAT.md, "Decision
record"): base offset, count, CRC and length of each batch the transaction
appended to a partition, known from the appends themselves, so a commit
reads no page of the log back. They must be the batches the log holds."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest

import txmq
from txmq.storage import partition as partition_mod
from txmq.transactions import decision


def read_back(part, words, copy_max: int = -1) -> list:
    """The transaction's batches as a scan of the log finds them (with
    their bytes read from the log when they hold at most ``copy_max``)."""
    kept = part._txn_appends.pop(words)
    try:
        return part.txn_batches(words, copy_max)
    finally:
        part._txn_appends[words] = kept


def file_bytes(part, base: int, length: int) -> bytes:
    seg, pos = part.segment_for(base)
    with open(seg.path, "rb") as f:
        f.seek(pos)
        return f.read(length)


def send_everything(b, txn, n: int = 40) -> None:
    p = b.producer("out")
    for i in range(n):
        p.send(os.urandom(50 + i), partition=0, txn=txn)
        p.send(b"k", key=b"key%d" % i, headers={"h": b"%d" % i}, event_time=1000 + i, partition=0, txn=txn)
        p.send_batch(pa.array([os.urandom(200) for _ in range(30)], pa.binary()), partition=0, txn=txn)
        p.send_batch([os.urandom(3000)] * 3, keys=[b"a", None, "c"], partition=0, txn=txn)


@pytest.mark.parametrize("fsync", ["never", "commit"])
def test_the_batches_a_commit_names_are_those_the_log_holds(tmp_path, fsync):
    """Across segment rolls, with keys, headers, event times, Arrow and
    list batches, sends accumulated into batches: the record names the
    same batches, in order, as a scan of the log finds (and, with copies,
    the same bytes)."""
    with txmq.Broker(tmp_path / "d", fsync=fsync, segment_bytes_max=256 * 1024) as b:
        b.create_topic("out", 1)
        part = b._topics["out"].partitions[0]
        b.producer("out").send(b"before")
        txn = b.new_transaction()
        send_everything(b, txn)
        for acc in list(txn._accumulators):        # (what the commit appends first)
            b._batching.flush(acc)
        words = txn._meta.words
        recorded = part.txn_batches(words, -1)
        assert len(part._segments) >= 3, "the transaction should span segment rolls"
        assert recorded == read_back(part, words)
        assert len(recorded) > 100 and all(data is None for *_, data in recorded)
        txn.commit()
        named = decision.decode(txn._meta.record).partitions[("out", 0)]
        assert [tuple(r)[:4] for r in named] == [r[:4] for r in recorded]
        assert words not in part._txn_appends, "kept after the transaction ended"


def test_a_small_transaction_copied_into_its_record_reads_its_bytes(tmp_path):
    """Under fsync="commit" a small transaction's batches are copied into
    the decision record: the copies are the bytes in the log."""
    with txmq.Broker(tmp_path / "d", fsync="commit") as b:
        b.create_topic("out", 1)
        txn = b.new_transaction()
        b.producer("out").send_batch([b"a" * 100, b"b" * 200], partition=0, txn=txn)
        b.producer("out").send_batch([b"c"], partition=0, txn=txn)
        txn.commit()
        named = decision.decode(txn._meta.record).partitions[("out", 0)]
        part = b._topics["out"].partitions[0]
        assert [(r.base_offset, r.count) for r in named] == [(0, 2), (2, 1)]
        for r in named:
            seg, pos = part.segment_for(r.base_offset)
            assert r.crc == seg.crc_at(pos) and r.length == seg.batch_at(pos).length
            assert r.data == file_bytes(part, r.base_offset, r.length)


def test_a_partition_keeps_copies_up_to_the_decision_records_bound():
    assert partition_mod.TXN_COPY_MAX == decision.REDO_COPY_MAX


def test_copies_are_kept_from_the_append_and_are_the_logs_bytes(tmp_path):
    """Under fsync="commit" a partition keeps a copy of each batch of a
    small transaction as it appends it (a batch stored into the mapping, a
    larger one written with pwritev, the small one right after it): the
    commit reads none back, and the copies equal what a scan of the log
    reads."""
    with txmq.Broker(tmp_path / "d", fsync="commit") as b:
        b.create_topic("out", 1)
        part = b._topics["out"].partitions[0]
        p = b.producer("out")
        p.send(b"before", partition=0)
        txn = b.new_transaction()
        p.send_batch([b"a" * 100, b"b" * 200], partition=0, txn=txn)                  # stored
        p.send_batch([os.urandom(5000), b"c"], keys=[b"k", None], partition=0, txn=txn)  # pwritev
        p.send_batch([b"d"], partition=0, txn=txn)                                     # small after it
        p.send_batch(pa.array([os.urandom(300) for _ in range(20)], pa.binary()), partition=0, txn=txn)
        words = txn._meta.words
        entry = part._txn_appends[words]
        assert all(b[4] is not None for b in entry[2])
        assert entry[3] == sum(b[3] for b in entry[2]) == part._txn_copies_held
        kept = part.txn_batches(words, decision.REDO_COPY_MAX)
        assert kept == read_back(part, words, decision.REDO_COPY_MAX)
        assert all(data == file_bytes(part, base, length) for base, _, _, length, data in kept)
        # A bound the copies do not fit (another partition of the
        # transaction took the rest): named without them.
        assert part.txn_batches(words, entry[3] - 1) == [b[:4] + (None,) for b in kept]
        txn.commit()
        named = decision.decode(txn._meta.record).partitions[("out", 0)]
        assert [tuple(r) for r in named] == kept
        assert part._txn_copies_held == 0 and part._txn_appends == {}


def test_copies_held_for_open_transactions_stay_within_their_bound(tmp_path, monkeypatch):
    """Past TXN_COPIES_HELD_MAX bytes of copies for the open transactions of
    a partition, a transaction's batches are not kept: its commit reads
    them back, with the same record."""
    monkeypatch.setattr(partition_mod, "TXN_COPIES_HELD_MAX", 5000)
    with txmq.Broker(tmp_path / "d", fsync="commit") as b:
        b.create_topic("out", 1)
        part = b._topics["out"].partitions[0]
        p = b.producer("out")
        txns = [b.new_transaction() for _ in range(4)]
        for i, txn in enumerate(txns):
            p.send_batch([bytes([65 + i]) * 1900], partition=0, txn=txn)
            p.send_batch([b"x%d" % i], partition=0, txn=txn)
        entries = [part._txn_appends[t._meta.words] for t in txns]
        # (a copy refused: none kept, none after)
        assert [[b[4] is not None for b in e[2]] for e in entries] == [[True, True], [True, True],
                                                                      [False, False], [False, False]]
        assert part._txn_copies_held <= 5000
        for txn in txns:
            words = txn._meta.words
            expected = read_back(part, words, decision.REDO_COPY_MAX)
            assert all(data is not None for *_, data in expected)
            txn.commit()
            named = decision.decode(txn._meta.record).partitions[("out", 0)]
            assert [tuple(r) for r in named] == expected
        assert part._txn_copies_held == 0


def test_a_transaction_begun_before_a_reopen_is_named_from_the_log(tmp_path):
    """A prepared transaction outlives its broker: the one that opens the
    directory again has no record of its appends and scans the log."""
    path = tmp_path / "d"
    with txmq.Broker(path, fsync="commit") as b:
        b.create_topic("out", 1)
        txn = b.new_transaction()
        b.producer("out").send_batch([b"x" * 70_000, b"y"], partition=0, txn=txn)
        b.producer("out").send_batch([b"z" * 70_000], partition=0, txn=txn)
        txn.prepare("xid-1")
        txn_id = txn.id
    with txmq.Broker(path, fsync="commit") as b:
        part = b._topics["out"].partitions[0]
        assert part._txn_appends == {}
        b.commit_prepared(txn_id)
        c = b.subscribe("out", "s", initial_position="earliest")
        assert [len(m.value) for m in c.receive_many(10, 1.0)] == [70_000, 1, 70_000]


def test_a_commit_after_retention_took_some_of_its_batches_copies_those_left(tmp_path):
    """Retention may delete an open transaction's first segment (no
    subscription holds it). The commit names the batches left, and
    whether they are copied into its record follows from their size: a
    record that named them without copies and without a sync would leave
    them unrepairable after a power loss."""
    with txmq.Broker(tmp_path / "d", fsync="commit", segment_bytes_max=90_000, retention_bytes=1,
                     retention_check_interval=3600.0) as b:
        b.create_topic("out", 1)
        part = b._topics["out"].partitions[0]
        p = b.producer("out")
        txn = b.new_transaction()
        for size in (40_000, 5_000, 40_000):                            # (85 KB: one segment)
            p.send_batch([os.urandom(size)], partition=0, txn=txn)
        p.send_batch([os.urandom(40_000)], partition=0, txn=txn)        # (the next one)
        b.enforce_retention()
        assert part.start_offset == 3, "retention should have taken the first segment"
        txn.commit()
        named = decision.decode(txn._meta.record).partitions[("out", 0)]
        assert [r.base_offset for r in named] == [3]
        assert named[0].data == file_bytes(part, 3, named[0].length)
