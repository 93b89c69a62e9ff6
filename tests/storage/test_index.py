"""The offset and time indexes of a segment (storage/index.py, docs/FORMAT.md,
"Indexes"): a read or a walk starts only from an entry that passed its
check, each index grows on its own count, and a rewrite is atomic."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import txmq.storage.index as index_file
from txmq._batch import BatchSpec
from txmq.storage.index import INDEX_ENTRY
from txmq.storage.partition import Partition


def test_index_entry_into_message_bytes_cannot_read_outside_the_batch(tmp_path):
    """A damaged index entry pointing at a fake header inside a message value
    (already CRC-checked as part of its real batch) must not steer a read
    outside the mapping. Runs in a subprocess, so a wild read fails this
    test rather than killing pytest."""
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


def test_a_wrong_last_index_entry_neither_shortens_nor_ages_a_segment(tmp_path):
    """The walk to a segment's true end and last publish time starts only
    from an index entry that passed its check."""
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
    part = Partition(tmp_path / "p", "t", 0, fsync="never", index_interval_bytes=64)
    for i in range(50):
        part.append(BatchSpec([b"v" * 100]))
    part.flush()
    before = (tmp_path / "p" / "00000000000000000000.index").read_bytes()
    assert before

    def killed(path, data, **kw):
        raise KeyboardInterrupt("killed mid-rewrite")

    monkeypatch.setattr(index_file, "write_atomic", killed)
    with pytest.raises(KeyboardInterrupt):
        part._rewrite_index(part.active)
    assert (tmp_path / "p" / "00000000000000000000.index").read_bytes() == before
    monkeypatch.undo()
    part.close()
    # What a kill mid-rewrite leaves behind is removed on open.
    (tmp_path / "p" / "00000000000000000000.index.tmp").write_bytes(b"\0" * 7)
    Partition(tmp_path / "p", "t", 0, fsync="never").close()
    assert not any(n.endswith(".tmp") for n in os.listdir(tmp_path / "p"))
