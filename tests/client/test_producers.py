"""Idempotent and named producers (docs/FORMAT.md, "Idempotent producers"; docs/GUARANTEES.md G5, the named half of G9)
and the Kafka-facing view of a partition. The SIGKILL test of a named
producer is in test_producer_crash.py; the property test of the Kafka view
in tests/storage/test_kafka_view.py."""

from __future__ import annotations

import os
import random
import threading

import pytest

import txmq
from txmq._batch import BatchSpec
from txmq.errors import (DuplicateSequenceError, InvalidArgumentError, InvalidTxnStateError,
                         OutOfOrderSequenceError, ProducerFencedError)
from txmq.storage.partition import Partition


@pytest.fixture
def broker(tmp_path):
    b = txmq.Broker(tmp_path / "data", fsync="never")
    yield b
    b.close()


def log_values(broker, topic, partition=0):
    """Every data message of a partition, straight from the log."""
    part = broker._topic(topic).partitions[partition]
    return [m[2] for m in part.read(part.start_offset, 10**9)]


def offsets(mids):
    return [m.offset for m in mids]


# -- the rules of one partition --------------------------------------------------------


def test_retry_of_a_cached_batch_returns_its_ids_and_appends_nothing(broker):
    broker.create_topic("t")
    p = broker.producer("t")
    first = p.send_batch([b"a", b"b"], partition=0, sequence=0)
    single = p.send(b"c", partition=0, sequence=2)
    assert p.last_sequence == {0: 2}
    assert offsets(p.send_batch([b"a", b"b"], partition=0, sequence=0)) == offsets(first) == [0, 1]
    assert p.send(b"c", partition=0, sequence=2) == single
    assert log_values(broker, "t") == [b"a", b"b", b"c"]
    # Without sequence= the next one is taken.
    assert p.send(b"d", partition=0).offset == 3 and p.last_sequence == {0: 3}


def test_gap_raises_out_of_order_and_appends_nothing(broker):
    broker.create_topic("t")
    p = broker.producer("t")
    p.send_batch([b"a", b"b"], partition=0, sequence=0)
    with pytest.raises(OutOfOrderSequenceError) as e:
        p.send(b"x", partition=0, sequence=3)
    assert (e.value.sequence, e.value.expected, e.value.producer_id) == (3, 2, p.producer_id)
    assert not isinstance(e.value, DuplicateSequenceError)
    assert log_values(broker, "t") == [b"a", b"b"]


def test_sequence_older_than_the_cache_is_a_duplicate_error(broker):
    broker.create_topic("t")
    p = broker.producer("t")
    for s in range(7):
        p.send(bytes([65 + s]), partition=0, sequence=s)
    for s in (2, 3, 4, 5, 6):                       # the last 5 batches: answered
        assert p.send(bytes([65 + s]), partition=0, sequence=s).offset == s
    for s in (0, 1):
        with pytest.raises(DuplicateSequenceError):
            p.send(b"again", partition=0, sequence=s)
    # A cached base sequence with another batch size is not that batch.
    with pytest.raises(DuplicateSequenceError):
        p.send_batch([b"x", b"y"], partition=0, sequence=5)
    assert len(log_values(broker, "t")) == 7


def test_sequences_are_per_partition_and_per_producer(broker):
    broker.create_topic("t", partitions=2)
    a, b = broker.producer("t"), broker.producer("t")
    assert a.producer_id != b.producer_id
    a.send(b"a0", partition=0, sequence=0)
    a.send(b"a1", partition=1, sequence=0)
    b.send(b"b0", partition=0, sequence=0)
    assert a.last_sequence == {0: 0, 1: 0} and b.last_sequence == {0: 0, 1: -1}
    assert log_values(broker, "t", 0) == [b"a0", b"b0"]


def test_sequence_wraps_at_int32(broker):
    broker.create_topic("t")
    p = broker.producer("t")
    top = 2**31 - 1
    p.send_batch([b"a", b"b", b"c"], partition=0, sequence=top - 1)   # top-1, top, 0
    assert p.last_sequence == {0: 0}
    assert p.send(b"d", partition=0).offset == 3 and p.last_sequence == {0: 1}
    assert offsets(p.send_batch([b"a", b"b", b"c"], partition=0, sequence=top - 1)) == [0, 1, 2]


def test_bad_sequence_arguments(broker):
    broker.create_topic("t", partitions=2)
    p = broker.producer("t")
    for bad in (-1, 2**31, 1.0, "0", True):
        with pytest.raises(InvalidArgumentError):
            p.send(b"x", sequence=bad)
    with pytest.raises(InvalidArgumentError):
        p.send_batch([b"a", b"b"], keys=[b"k1", b"k2"], sequence=0)      # spread over partitions
    # Round-robin would take a resend to the other partition, where its
    # sequence is new: a sequence needs a fixed partition.
    with pytest.raises(InvalidArgumentError):
        p.send(b"x", sequence=0)
    with pytest.raises(InvalidArgumentError):
        p.send_batch([b"x"], sequence=0)
    assert broker.high_watermark("t", 0) == broker.high_watermark("t", 1) == 0
    keyed = p.send(b"x", key=b"k", sequence=0)
    assert p.send(b"x", key=b"k", sequence=0) == keyed


def test_epochs_of_a_producer_id_at_the_partition(tmp_path):
    part = Partition(tmp_path / "p", "t", 0, fsync="never")
    spec = BatchSpec([b"v"])
    assert part.append(spec, producer_id=7, producer_epoch=0, base_sequence=0) == 0
    assert part.append(spec, producer_id=7, producer_epoch=0) == 1
    with pytest.raises(OutOfOrderSequenceError):        # a new epoch starts at 0
        part.append(spec, producer_id=7, producer_epoch=1, base_sequence=2)
    assert part.append(spec, producer_id=7, producer_epoch=1, base_sequence=0) == 2
    with pytest.raises(ProducerFencedError):            # the older epoch is fenced
        part.append(spec, producer_id=7, producer_epoch=0, base_sequence=2)
    with pytest.raises(ProducerFencedError):
        part.append(spec, producer_id=7, producer_epoch=0)
    # The old epoch's cached batches are gone with it: seq 0 of epoch 1 is cached.
    assert part.append(spec, producer_id=7, producer_epoch=1, base_sequence=0) == 2
    assert part.end_offset == 3
    part.close()


def test_retry_inside_a_transaction(broker):
    broker.create_topic("t")
    p = broker.producer("t")
    txn = broker.new_transaction()
    mid = p.send(b"a", partition=0, sequence=0, txn=txn)
    assert p.send(b"a", partition=0, sequence=0, txn=txn) == mid
    txn.commit()
    # A late retry that names the ended transaction is refused, not answered.
    with pytest.raises(InvalidTxnStateError):
        p.send(b"a", partition=0, sequence=0, txn=txn)
    assert log_values(broker, "t") == [b"a"]


# -- retry storm -------------------------------------------------------------------------


def test_retry_storm(broker):
    """New batches interleaved with resends of random earlier ones: each
    message is appended once; a resend answers with the original ids (or,
    once older than the cache, DuplicateSequenceError)."""
    broker.create_topic("t")
    p = broker.producer("t", name="storm")
    rng = random.Random(5)
    sent = []                      # (base sequence, values, offsets)
    seq = 0
    answered = refused = 0
    for k in range(3000):
        if sent and rng.random() < 0.6:
            i = rng.randrange(max(0, len(sent) - 8), len(sent))
            base, vals, offs = sent[i]
            try:
                got = p.send_batch(vals, partition=0, sequence=base)
            except DuplicateSequenceError:
                assert i < len(sent) - 5
                refused += 1
            else:
                assert i >= len(sent) - 5 and offsets(got) == offs
                answered += 1
        else:
            vals = [f"{k}:{j}".encode() for j in range(rng.randint(1, 4))]
            offs = offsets(p.send_batch(vals, partition=0, sequence=seq))
            sent.append((seq, vals, offs))
            seq += len(vals)
    expected = [v for _, vals, _ in sent for v in vals]
    assert log_values(broker, "t") == expected
    assert p.last_sequence == {0: seq - 1}
    assert answered > 500 and refused > 100


def test_retry_storm_threads(broker):
    """Threads resending one producer's recent batches while another thread
    sends new ones: nothing is appended twice."""
    broker.create_topic("t")
    p = broker.producer("t")
    sent, lock, stop = [], threading.Lock(), threading.Event()
    errors = []

    def resend(seed):
        rng = random.Random(seed)
        while not stop.is_set():
            with lock:
                if not sent:
                    continue
                base, vals, offs = sent[rng.randrange(max(0, len(sent) - 6), len(sent))]
            try:
                got = p.send_batch(vals, partition=0, sequence=base)
                if offsets(got) != offs:
                    errors.append((base, offsets(got), offs))
            except DuplicateSequenceError:
                pass

    threads = [threading.Thread(target=resend, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    seq = 0
    try:
        for k in range(2000):
            vals = [f"{k}:{j}".encode() for j in range(1 + k % 3)]
            offs = offsets(p.send_batch(vals, partition=0, sequence=seq))
            with lock:
                sent.append((seq, vals, offs))
            seq += len(vals)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == []
    assert log_values(broker, "t") == [v for _, vals, _ in sent for v in vals]


# -- named producers ---------------------------------------------------------------------


@pytest.mark.parametrize("damage", [None, "no snapshot", "bad snapshot"])
def test_named_producer_continues_across_restart(tmp_path, damage):
    path = tmp_path / "data"
    with txmq.Broker(path, fsync="never") as b:
        b.create_topic("t", partitions=2)
        p = b.producer("t", name="svc-a")
        pid = p.producer_id
        first = [p.send_batch([f"{i}".encode()] * 2, partition=i % 2) for i in range(10)]
        assert p.last_sequence == {0: 9, 1: 9}
    snap = path / "topics" / "t" / "0" / "producers.snap"
    if damage == "no snapshot":
        os.remove(snap)
    elif damage == "bad snapshot":
        raw = bytearray(snap.read_bytes())
        raw[20] ^= 0xFF
        snap.write_bytes(bytes(raw))
    with txmq.Broker(path, fsync="never") as b:
        b.high_watermark("t", 0)             # partitions open (and recover) on first use
        if damage == "bad snapshot":
            assert any("producers.snap" in d for d in b.stats()["topics"]["t"]["partitions"][0]["truncated_on_open"])
        p = b.producer("t", name="svc-a")
        assert p.producer_id == pid and p.last_sequence == {0: 9, 1: 9}
        # The last 5 batches of each partition are answered after the restart ...
        for i in range(5, 10):
            again = p.send_batch([f"{i}".encode()] * 2, partition=i % 2, sequence=(i // 2) * 2)
            assert offsets(again) == offsets(first[i])
        # ... and new sends continue the sequence.
        p.send(b"next", partition=0)
        assert p.last_sequence == {0: 10, 1: 9}
        assert b.producer("t").producer_id not in (pid,)
        assert log_values(b, "t", 0)[-1] == b"next" and len(log_values(b, "t", 0)) == 11


def test_producer_ids_are_never_reused(tmp_path):
    path = tmp_path / "data"
    seen, named_ids = set(), set()
    for _ in range(3):
        with txmq.Broker(path, fsync="never") as b:
            if "t" not in b.topics():
                b.create_topic("t")
            for _ in range(50):
                pid = b.producer("t").producer_id
                assert pid not in seen
                seen.add(pid)
            named = b.producer("t", name="n").producer_id
            assert named not in seen
            named_ids.add(named)
    assert len(seen) == 150 and len(named_ids) == 1


def test_named_producer_reopened_fences_the_older_instance(broker):
    broker.create_topic("t")
    old = broker.producer("t", name="svc")
    old.send(b"1", partition=0)
    new = broker.producer("t", name="svc")
    assert new.producer_id == old.producer_id
    for call in (lambda: old.send(b"x", partition=0), lambda: old.send_batch([b"x"], partition=0),
                 lambda: old.send(b"x", partition=0, sequence=1)):
        with pytest.raises(ProducerFencedError):
            call()
    assert new.send(b"2", partition=0).offset == 1
    assert log_values(broker, "t") == [b"1", b"2"]
    # Another topic's instance of the same name is not fenced.
    broker.create_topic("u")
    other = broker.producer("u", name="svc")
    assert other.send(b"u", partition=0).offset == 0 and new.send(b"3").offset == 2


def test_named_fence_races_with_sends(broker):
    """An instance being replaced while it sends: every send either landed
    before the new instance took over or raised; the new instance continues
    the sequence without a gap or a duplicate."""
    broker.create_topic("t")
    old = broker.producer("t", name="race")
    landed, stop = [], threading.Event()

    def pump():
        i = 0
        while not stop.is_set():
            try:
                old.send(f"old{i}".encode(), partition=0)
                landed.append(f"old{i}".encode())
                i += 1
            except ProducerFencedError:
                return

    t = threading.Thread(target=pump)
    t.start()
    while len(landed) < 200:
        pass
    new = broker.producer("t", name="race")
    t.join(5)
    stop.set()
    new.send_batch([b"new0", b"new1"], partition=0)
    log = log_values(broker, "t")
    assert log == landed + [b"new0", b"new1"]
    assert new.last_sequence == {0: len(log) - 1}


# -- expiration --------------------------------------------------------------------------


def test_producer_state_expires(tmp_path):
    now = [1_000_000]
    part = Partition(tmp_path / "p", "t", 0, fsync="never", clock=lambda: now[0],
                     producer_expiration_ms=60_000)
    spec = BatchSpec([b"v"])
    part.append(spec, producer_id=1, base_sequence=0)
    now[0] += 30_000
    part.append(spec, producer_id=2, base_sequence=0)
    now[0] += 40_000                    # 1 is 70 s idle, 2 is 40 s
    part.flush()                        # snapshots drop the expired ids
    assert 1 not in part.producers and 2 in part.producers
    # An id the partition forgot may start anywhere (Kafka's rule).
    assert part.append(spec, producer_id=1, base_sequence=41) == 2
    part.close()
    part = Partition(tmp_path / "p", "t", 0, fsync="never", clock=lambda: now[0],
                     producer_expiration_ms=60_000)
    assert part.producers.last_sequence(1) == 41 and part.producers.last_sequence(2) == 0
    part.close()


def test_broker_option_producer_id_expiration(tmp_path):
    with pytest.raises(InvalidArgumentError):
        txmq.Broker(tmp_path / "x", producer_id_expiration=0)
    with txmq.Broker(tmp_path / "d", fsync="never", producer_id_expiration=0.001) as b:
        b.create_topic("t")
        p = b.producer("t")
        p.send(b"a", partition=0)
        import time
        time.sleep(0.01)
        b._snapshot_txn_buffers()                       # the broker's timer
        assert p.last_sequence == {0: -1}
        p.send(b"b", partition=0)
        time.sleep(0.01)
        b.flush()                                       # a recovery point
        assert p.last_sequence == {0: -1}


# -- the Kafka-facing view -----------------------------------------------------------------


def test_kafka_view_of_a_partition(broker):
    broker.create_topic("t")
    p = broker.producer("t")
    p.send(b"plain", partition=0)                                  # 0
    t1 = broker.new_transaction()
    p.send_batch([b"x1", b"x2"], partition=0, txn=t1)              # 1-2
    t2 = broker.new_transaction()
    p.send(b"y", partition=0, txn=t2)                              # 3
    p.flush()
    assert broker.last_stable_offset("t", 0) == 1 and broker.high_watermark("t", 0) == 4
    t1.abort()                                                     # marker 4
    assert broker.last_stable_offset("t", 0) == 3
    t2.commit()                                                    # marker 5
    assert broker.last_stable_offset("t", 0) == broker.high_watermark("t", 0) == 6
    aborted = broker.aborted_transactions("t", 0, 0)
    assert aborted == [txmq.AbortedTransaction(p.producer_id, 1, 4)]
    assert broker.aborted_transactions("t", 0, 0, 1) == []          # ends before it
    assert broker.aborted_transactions("t", 0, 2, 3) == aborted     # inside it
    assert broker.aborted_transactions("t", 0, 4, 6) == aborted     # its marker
    assert broker.aborted_transactions("t", 0, 5) == []
    with pytest.raises(InvalidArgumentError):
        broker.aborted_transactions("t", 0, -1)
    assert broker.aborted_transactions("t", 0, 3, 2) == broker.aborted_transactions("t", 0, 2, 2) == []
    with pytest.raises(txmq.errors.PartitionNotFoundError):
        broker.last_stable_offset("t", 3)


def test_txnindex_files_beside_segments_rebuilt_and_retained(tmp_path):
    path = tmp_path / "data"
    # Every send appended at once (linger_ms=0): aborted transactions leave data and markers.
    with txmq.Broker(path, fsync="never", segment_bytes_max=4096, linger_ms=0) as b:
        b.create_topic("t")
        p = b.producer("t")
        for i in range(60):
            txn = b.new_transaction()
            p.send(b"v" * 200, partition=0, txn=txn)
            (txn.abort if i % 3 == 0 else txn.commit)()
        t = [b.new_transaction() for _ in range(30)]
        for i, txn in enumerate(t):
            p.send(b"w" * 200, partition=0, txn=txn)
        for i, txn in enumerate(t):
            (txn.abort if i % 2 else txn.commit)()
        expected = b.aborted_transactions("t", 0, 0)
        assert len(expected) == 20 + 15
        pdir = path / "topics" / "t" / "0"
        idx = sorted(n for n in os.listdir(pdir) if n.endswith(".txnindex"))
        logs = sorted(n for n in os.listdir(pdir) if n.endswith(".log"))
        assert [n[:-9] for n in idx] == [n[:-4] for n in logs] and len(logs) > 2
    for n in idx[:2]:
        os.remove(pdir / n)                       # lost: rebuilt from the abort set
    with txmq.Broker(path, fsync="never", segment_bytes_max=4096) as b:
        assert b.aborted_transactions("t", 0, 0) == expected
    with txmq.Broker(path, fsync="never", segment_bytes_max=4096) as b:
        assert b.aborted_transactions("t", 0, 0) == expected


def test_consumer_lag_reaches_zero_past_markers(broker):
    broker.create_topic("t")
    p = broker.producer("t")
    rc = broker.subscribe("t", "rc", initial_position="earliest")
    ru = broker.subscribe("t", "ru", isolation="read_uncommitted", initial_position="earliest")
    with broker.transaction() as txn:
        p.send_batch([b"a", b"b"], partition=0, txn=txn)
    aborted = broker.new_transaction()
    p.send(b"gone", partition=0, txn=aborted)
    p.flush()                                           # in the log before the abort
    aborted.abort()
    open_txn = broker.new_transaction()
    p.send(b"open", partition=0, txn=open_txn)
    p.flush()
    assert broker.high_watermark("t", 0) == 6 and broker.last_stable_offset("t", 0) == 5
    assert broker.consumer_lag("t", "rc") == {0: 2}     # a, b; not the markers, not "gone"
    assert broker.consumer_lag("t", "ru") == {0: 4}     # a, b, gone, open
    rc.ack(rc.receive_many(10, 0.2))
    assert broker.consumer_lag("t", "rc") == {0: 0}
    open_txn.commit()
    assert broker.consumer_lag("t", "rc") == {0: 1}
    rc.ack(rc.receive_many(10, 0.2))
    ru.ack(ru.receive_many(10, 0.2))
    assert broker.consumer_lag("t", "rc") == {0: 0} == broker.consumer_lag("t", "ru")


# -- a checkpoint claims a batch only with its effects -----------------------------------


def test_checkpoint_after_the_batch_effects(tmp_path, monkeypatch):
    """A recovery point (and the snapshots written with it) taken by an
    append includes what that batch changed: the producer table and the end
    of a transaction. Opening a copy taken right after (as a crash would
    leave it) finds both."""
    import shutil

    import txmq.storage.log as L
    from txmq.transactions.records import TxnID

    monkeypatch.setattr(L, "CHECKPOINT_BYTES", 1)          # every append checkpoints
    part = Partition(tmp_path / "p", "t", 0, fsync="never")
    part.append(BatchSpec([b"a" * 100]), producer_id=3, base_sequence=0)

    class Meta:                                             # the coordinator's record, reduced
        words = TxnID(0, 1).words

        def check_open(self, doing):
            pass

    part.append(BatchSpec([b"t"]), txn=Meta(), producer_id=3)
    part.end_txn(TxnID(0, 1), True)
    shutil.copytree(tmp_path / "p", tmp_path / "crashed")
    again = Partition(tmp_path / "crashed", "t", 0, fsync="never")
    assert again.producers.last_sequence(3) == 1
    assert len(again.ongoing) == 0 and again.max_read_position == again.end_offset == 3
    again.close()
    part.close()


def test_a_sequence_spent_in_another_transaction_is_not_a_retry(broker):
    broker.create_topic("t")
    p = broker.producer("t")
    t1 = broker.new_transaction()
    p.send(b"a", partition=0, sequence=0, txn=t1)
    t1.abort()
    t2 = broker.new_transaction()
    with pytest.raises(DuplicateSequenceError):       # would report t1's aborted batch as sent
        p.send(b"a", partition=0, sequence=0, txn=t2)
    with pytest.raises(DuplicateSequenceError):
        p.send(b"a", partition=0, sequence=0)
    p.send(b"a", partition=0, sequence=1, txn=t2)
    t2.commit()
    assert log_values(broker, "t") == [b"a", b"a"] and broker.aborted_transactions("t", 0, 0)[0][1:] == (0, 1)


def test_a_producer_in_an_open_transaction_never_expires(tmp_path):
    now = [1_000_000]
    part = Partition(tmp_path / "p", "t", 0, fsync="never", clock=lambda: now[0],
                     producer_expiration_ms=1_000)
    from txmq.transactions.records import TxnID

    class Meta:
        words = TxnID(0, 1).words

        def check_open(self, doing):
            pass

    first = part.append(BatchSpec([b"v"]), txn=Meta(), producer_id=9, base_sequence=0)
    now[0] += 60_000                               # long idle, the transaction still open
    assert part.expire_producers() == 0
    part.flush()
    assert part.append(BatchSpec([b"v"]), txn=Meta(), producer_id=9, base_sequence=0) == first
    part.end_txn(TxnID(0, 1), True)
    now[0] += 1
    assert part.expire_producers() == 1 and 9 not in part.producers
    part.close()


def test_a_retry_under_fsync_always_is_durable_before_it_returns(tmp_path, monkeypatch):
    with txmq.Broker(tmp_path / "d", fsync="always") as b:
        b.create_topic("t")
        p = b.producer("t")
        part = b._topic("t").partitions[0]
        first = p.send(b"a", partition=0, sequence=0)
        synced = []
        orig = part.sync_to
        monkeypatch.setattr(part, "sync_to", lambda offset: (synced.append(offset), orig(offset)))
        assert p.send(b"a", partition=0, sequence=0) == first
        assert synced == [1]


def test_the_timer_snapshot_syncs_the_txnindex_first(tmp_path, monkeypatch):
    """A transaction-buffer snapshot vouches for the .txnindex entries below
    its offset (they are not rebuilt on open): they are fsynced first."""
    with txmq.Broker(tmp_path / "d", fsync="commit") as b:
        b.create_topic("t")
        txn = b.new_transaction()
        b.producer("t").send(b"x", partition=0, txn=txn).offset    # appended (asking for it), then aborted
        txn.abort()
        part = b._topic("t").partitions[0]
        synced = []
        real_fsync = os.fsync
        monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")),
                                                     real_fsync(fd)))
        assert part.snapshot_txn_buffer()
        assert any(p.endswith(".txnindex") for p in synced)
        assert b.stats()["producers"]["registry_problems_on_open"] == []


def test_send_batch_ids_of_one_partition_read_as_those_of_several(broker):
    """``send_batch`` to one partition returns its ids as a run (base
    offset and count, arrays made on first use): they index, slice,
    compare and print as the ids of a keyed batch over several partitions."""
    import numpy as np
    from txmq.message import MessageIds
    broker.create_topic("runs", 3)
    p = broker.producer("runs")
    p.send_batch([b"a", b"b"], partition=2)
    ids = p.send_batch([b"x%d" % i for i in range(6)], partition=2)
    arrays = MessageIds("runs", np.full(6, 2, np.int32), np.arange(2, 8, dtype=np.int64))
    assert ids == arrays and len(ids) == 6 and repr(ids) == repr(arrays)
    assert [ids[i] for i in range(-6, 6)] == [arrays[i] for i in range(-6, 6)]
    assert list(ids[1:4]) == list(arrays[1:4]) and ids[np.int64(3)] == txmq.MessageId("runs", 2, 5)
    assert ids.offsets.tolist() == list(range(2, 8)) and ids.partitions.dtype == np.int32
    assert set(ids.partitions.tolist()) == {2}
    for bad in (6, -7):
        with pytest.raises(IndexError):
            ids[bad]
    got = broker.subscribe("runs", "s", initial_position="earliest").receive_many(10, 1.0)
    assert [(m.partition, m.offset) for m in got if m.value.startswith(b"x")] == [(2, o) for o in range(2, 8)]
