"""Regression tests for faults found in review: each failed before its fix."""

import os
import struct
import subprocess
import sys
import textwrap

import pyarrow as pa
import pytest

import txmq
from txmq import errors
from txmq._batch import BatchSpec
from txmq._segment import RESERVE_MIN_BYTES, Segment
from txmq.storage.cursor import COMPACT_FRAMES, Cursor
from txmq.storage.index import write_entries as _write_entries
from txmq.storage.partition import Partition


def test_index_entry_into_message_bytes_cannot_read_outside_the_batch(tmp_path):
    """A damaged index entry pointing at a fake header inside a message value
    (already CRC-checked as part of its real batch) must not steer a read
    outside the mapping. Runs in a subprocess: the fault was a wild read."""
    code = textwrap.dedent(f"""
        import os, struct
        from txmq.storage.index import write_entries as _write_entries
        from txmq.storage.partition import Partition
        from txmq._batch import BatchSpec
        d = {str(tmp_path / "p")!r}
        fake = bytearray(112)
        struct.pack_into("<IBBH", fake, 0, 0x424D5854, 1, 0, 0)
        struct.pack_into("<I", fake, 12, 112)
        struct.pack_into("<qi", fake, 16, 1, 1)
        struct.pack_into("<ii", fake, 88, -100_000_000, 0)
        p = Partition(d, "t", 0, fsync="never")
        p.append(BatchSpec([bytes(fake)]))
        p.append(BatchSpec([b"real"]))
        p.close()
        _write_entries(os.path.join(d, "00000000000000000000.index"), [0, 1], [0, 120], truncate=True)
        p = Partition(d, "t", 0, fsync="never")
        assert [m[0] for m in p.read(0)] == [0, 1]
        got = p.read(1)
        assert [(m[0], m[2]) for m in got] == [(1, b"real")], got
        print("ok")
    """)
    env = {**os.environ, "TXMQ_DEBUG": "0"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stdout, r.stderr[-2000:])


def test_batchspec_is_not_changed_by_its_callers_list(tmp_path):
    part = Partition(tmp_path / "p", "t", 0, fsync="never", segment_bytes_max=1 << 16)
    values, keys = [b"a", b"b"], [b"k", None]
    spec = BatchSpec(values, keys)
    values[0] = b"x" * (1 << 20)      # a caller reusing its lists before the append
    keys[1] = 12
    part.append(spec)
    assert [(m[1], m[2]) for m in part.read(0)] == [(b"k", b"a"), (None, b"b")]
    part.close()


def test_a_crashed_segment_is_reserved_again_before_appends(tmp_path):
    """After a crash the active segment may be a sparse file (one of an
    earlier release, extended to full capacity at once); the appends that
    follow must reserve blocks (posix_fallocate) again, from the log end
    on, or a full disk turns a store into the mapping into SIGBUS."""
    path = str(tmp_path / "00000000000000000000.log")
    seg = Segment(path, 0, 64 << 20, True)
    seg.recover(0, 0)
    seg.append(BatchSpec([b"x" * 100]), publish_time=1)
    end = seg.size
    seg.close(trim=False)
    os.truncate(path, end)             # what a crash can leave: no blocks past the data ...
    os.truncate(path, 64 << 20)        # ... in a file at full capacity
    seg = Segment(path, 0, 64 << 20, True)
    assert seg.recover(0, 0) is None
    seg.append(BatchSpec([b"y" * 100]), publish_time=2)
    assert os.stat(path).st_blocks * 512 >= RESERVE_MIN_BYTES, "no blocks reserved past the log end"
    seg.close()


def test_last_publish_time_survives_reopen(tmp_path):
    part = Partition(tmp_path / "p", "t", 0, fsync="never", clock=iter([1000, 5000]).__next__)
    part.append(BatchSpec([b"a"]))
    part.append(BatchSpec([b"b"]))
    assert part.find_time(5000) == 1
    part.close()
    part = Partition(tmp_path / "p", "t", 0, fsync="never")
    assert part.find_time(5000) == 1 and part.last_publish_time == 5000
    part.close()


def test_cursor_compaction_keeps_the_frame_that_triggered_it(tmp_path):
    path = str(tmp_path / "cursor.log")
    c = Cursor(path, "never", 0, 0)
    for off in range(COMPACT_FRAMES + 5):
        c.ack([off])
    c.close()
    c = Cursor(path, "never", 0, 0)
    assert c.mark_delete == COMPACT_FRAMES + 5 and c.acked.count() == 0
    for _ in range(COMPACT_FRAMES):
        c.reset(5)
    c.close()
    assert Cursor(path, "never", 0, 0).mark_delete == 5


@pytest.fixture
def broker(tmp_path):
    b = txmq.Broker(tmp_path / "d", fsync="never")
    b.create_topic("t")
    yield b
    b.close()


def test_receive_batch_refuses_closed_consumers(broker):
    import threading
    c1 = broker.subscribe("t", "s", "shared", initial_position="earliest")
    c2 = broker.subscribe("t", "s", "shared")
    box = []

    def wait():
        try:
            box.append(c1.receive_batch(timeout=None))
        except errors.BrokerClosedError as e:
            box.append(e)

    th = threading.Thread(target=wait)
    th.start()
    import time
    time.sleep(0.2)
    c1.close()
    th.join(3)
    assert not th.is_alive() and isinstance(box[0], errors.BrokerClosedError)
    broker.producer("t").send_batch([b"a", b"b", b"c"])
    assert [m.value for m in c2.receive_many(10, timeout=1)] == [b"a", b"b", b"c"]


def test_receive_batch_needs_a_positive_count(broker):
    broker.producer("t").send_batch([b"%d" % i for i in range(10)])
    c = broker.subscribe("t", "s", initial_position="earliest")
    c.receive_many(5, timeout=1)
    for bad in (0, -3, 1.5, True):
        with pytest.raises(errors.InvalidArgumentError):
            c.receive_batch(bad, timeout=0)
    assert c.receive_batch(100, timeout=0).column("offset").to_pylist() == [5, 6, 7, 8, 9]


def test_unacked_counts_a_batch_straddling_mark_delete_once(broker):
    broker.producer("t").send_batch([b"%d" % i for i in range(10)])
    c = broker.subscribe("t", "s", initial_position="earliest")
    rb = c.receive_batch(timeout=1)
    c.ack([txmq.MessageId("t", 0, o) for o in range(5)])
    st = broker.stats()["topics"]["t"]["subscriptions"]["s"]
    assert st["unacked"] == 5 and st["backlog"] == 5
    c.ack(rb)
    assert broker.stats()["topics"]["t"]["subscriptions"]["s"]["unacked"] == 0


def test_nack_inside_a_batch_redelivers_once(broker):
    broker.producer("t").send_batch([b"%d" % i for i in range(4)])
    c = broker.subscribe("t", "s", "shared", initial_position="earliest", nack_delay=0)
    c.receive_batch(timeout=1)
    c.nack(txmq.MessageId("t", 0, 2))
    c.close()                                   # releases the rest of the batch
    c = broker.subscribe("t", "s", "shared")
    got = {m.offset: m.redelivery_count for m in c.receive_many(10, timeout=1)}
    assert got == {0: 1, 1: 1, 2: 1, 3: 1}


def test_acks_with_non_int_offsets_are_refused(broker):
    broker.producer("t").send_batch([b"a", b"b", b"c"])
    c = broker.subscribe("t", "s", initial_position="earliest")
    with pytest.raises(errors.NotAcknowledgeableError):
        c.ack([txmq.MessageId("t", 0, 0), txmq.MessageId("t", 0, 1.5), txmq.MessageId("t", 0, 2)])
    assert len(c.receive_many(10, timeout=1)) == 3


def test_size_limit_counts_the_key(tmp_path):
    with txmq.Broker(tmp_path / "d", fsync="never", max_message_bytes=1000) as b:
        b.create_topic("t")
        p = b.producer("t")
        p.send(b"v" * 900, key=b"k" * 100)
        with pytest.raises(errors.MessageTooLargeError):
            p.send(b"v" * 900, key=b"k" * 101)
        with pytest.raises(errors.MessageTooLargeError):
            p.send_batch(pa.array([b"v" * 900]), keys=pa.array([b"k" * 200]))
    with pytest.raises(errors.InvalidArgumentError):
        txmq.Broker(tmp_path / "e", segment_bytes_max=2**31)


def test_a_wrong_last_index_entry_neither_shortens_nor_ages_a_segment(tmp_path):
    """The walk to a segment's true end and last publish time starts only
    from an index entry that passed its check."""
    import numpy as np
    from txmq.storage.index import INDEX_ENTRY
    d = tmp_path / "p"
    part = Partition(d, "t", 0, fsync="never", segment_bytes_max=8192, index_interval_bytes=4096)
    for _ in range(20):
        part.append(BatchSpec([b"\0" * 1000]))
    assert len(part.segments) >= 3
    part.close()
    index = str(d / "00000000000000000000.index")
    entries = np.fromfile(index, dtype=INDEX_ENTRY)
    assert len(entries) >= 2
    entries["b"][-1] += 400                     # inside a message of zero bytes
    entries.tofile(index)
    env_debug = os.environ.pop("TXMQ_DEBUG", None)
    try:
        part = Partition(d, "t", 0, fsync="never", segment_bytes_max=8192, index_interval_bytes=4096)
        assert [m[0] for m in part.read(0, 100)] == list(range(20))
        assert all(seg.last_publish_time > 0 for seg in part.segments)
        assert part.delete_segments(part.end_offset, 3_600_000, None) == 0
        part.close()
    finally:
        if env_debug is not None:
            os.environ["TXMQ_DEBUG"] = env_debug


def test_ack_timeout_still_covers_a_batch_split_by_a_nack(broker):
    import time
    broker.producer("t").send_batch([b"%d" % i for i in range(4)])
    c = broker.subscribe("t", "s", "shared", initial_position="earliest", nack_delay=0,
                         ack_timeout=0.3)
    c.receive_batch(timeout=1)
    c.nack(txmq.MessageId("t", 0, 2))
    seen = set()
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and seen != {0, 1, 2, 3}:
        for m in c.receive_many(10, timeout=0.1):
            seen.add(m.offset)
            c.ack(m)
    assert seen == {0, 1, 2, 3}


def test_time_index_longer_than_offset_index_grows_on_its_own(tmp_path):
    """A kill between rewriting .index and .timeindex could leave the first
    short; appends then add entries to both, and each index must grow on
    its own count (it overflowed at the 64th entry)."""
    now = [1000]

    def clock():
        now[0] += 1
        return now[0]

    part = Partition(tmp_path / "p", "t", 0, fsync="never", index_interval_bytes=64, clock=clock)
    for i in range(200):
        part.append(BatchSpec([b"v" * 100]))
    part.close()
    (tmp_path / "p" / "00000000000000000000.index").write_bytes(b"")
    part = Partition(tmp_path / "p", "t", 0, fsync="never", index_interval_bytes=64, clock=clock)
    for i in range(300):
        part.append(BatchSpec([b"w" * 100]))
    assert part.end_offset == 500 and part.find_time(1) == 0
    part.close()


def test_index_rewrite_is_atomic(tmp_path, monkeypatch):
    """Rewriting an index file goes through a temporary file and a rename:
    a kill in the middle leaves the old file whole."""
    import txmq.storage.index as P

    part = Partition(tmp_path / "p", "t", 0, fsync="never", index_interval_bytes=64)
    for i in range(50):
        part.append(BatchSpec([b"v" * 100]))
    part.flush()
    before = (tmp_path / "p" / "00000000000000000000.index").read_bytes()
    assert before

    def killed(path, data, **kw):
        raise KeyboardInterrupt("killed mid-rewrite")

    monkeypatch.setattr(P, "write_atomic", killed)
    with pytest.raises(KeyboardInterrupt):
        part._rewrite_index(part.active)
    assert (tmp_path / "p" / "00000000000000000000.index").read_bytes() == before
    monkeypatch.undo()
    part.close()
    # What a kill mid-rewrite leaves behind is removed on open.
    (tmp_path / "p" / "00000000000000000000.index.tmp").write_bytes(b"\0" * 7)
    Partition(tmp_path / "p", "t", 0, fsync="never").close()
    assert not any(n.endswith(".tmp") for n in os.listdir(tmp_path / "p"))
