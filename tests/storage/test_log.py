"""A partition's log (storage/log.py over txmq._segment): an append takes
what its caller handed in at that moment, a segment left by a crash
reserves its blocks again before appends, and the last publish time
survives a reopen."""

import ctypes
import os
import time

import pytest

from txmq._batch import BatchSpec
from txmq import _segment, _segment_file
from txmq._segment import Segment
from txmq._segment_file import RESERVE_MIN_BYTES
from txmq.storage.log import WRITEBACK_BYTES
from txmq.storage.partition import Partition


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


def test_small_batches_after_large_ones_read_back_the_same_by_either_sink(tmp_path):
    """Large batches go by pwritev, small ones into the mapping unless they
    start in a page the last pwritev wrote (then by pwritev too): every
    batch reads back whole, from this object and after a reopen, which
    checks every CRC."""
    part = Partition(tmp_path / "p", "t", 0, fsync="never")
    sent = []
    for i in range(300):
        size = (3000, 10, 10, 5000, 1, 700)[i % 6]
        value = bytes([i % 251]) * size
        sent.append(value)
        part.append(BatchSpec([value, value[:1]]))

    def values(p):
        out = []
        for info in p.headers(0, p.end_offset):
            seg, pos = p.segment_for(info.base_offset)
            out += [m[2] for m in seg.messages(pos)]
        return out
    expected = [v for value in sent for v in (value, value[:1])]
    assert values(part) == expected
    part.close()
    part = Partition(tmp_path / "p", "t", 0, fsync="never")
    assert part.dropped == [] and values(part) == expected
    part.close()


def test_one_small_batch_after_a_large_one_goes_by_pwritev_and_the_next_into_the_mapping(tmp_path):
    """A small batch that starts in the page a large batch's pwritev ended
    in (a marker after a transaction's data) is written with pwritev: a
    store would fault on that page. The small batches after it share one
    fault of the mapping again."""
    part = Partition(tmp_path / "p", "t", 0, fsync="never")
    part.append(BatchSpec([b"warm"]))
    for _ in range(5):
        before = _segment.pwritev_count()
        part.append(BatchSpec([b"x" * 20_000]))
        for i in range(60):
            part.append(BatchSpec([b"small %d" % i]))
        assert _segment.pwritev_count() - before == 2      # the large batch and the first small one
    part.close()


def _dirty_pages(path, length):
    """Dirty pages of ``path``'s first ``length`` bytes in the page cache
    (the cachestat system call, Linux 6.5), or None where it is missing."""
    libc = ctypes.CDLL(None, use_errno=True)
    rng = (ctypes.c_uint64 * 2)(0, length)
    stat = (ctypes.c_uint64 * 5)()
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.syscall(451, fd, rng, stat, 0) != 0:
            return None
    finally:
        os.close(fd)
    return stat[1]


@pytest.mark.parametrize("fsync", ["commit", "never"])
def test_writeback_is_started_every_mib_unless_fsync_is_never(tmp_path, fsync):
    """Unless fsync="never", each WRITEBACK_BYTES appended start the
    writeback of the whole pages appended since the last start (the pages
    go to disk while appends go on; a later sync waits for less). At
    "never" the kernel alone decides when."""
    part = Partition(tmp_path / "p", "t", 0, fsync=fsync)
    big = BatchSpec([b"x" * 100_000])
    before = _segment_file.writeback_count()
    for _ in range(40):                  # ~4 MB: three MiB boundaries crossed
        part.append(big)
    started = _segment_file.writeback_count() - before
    if fsync == "never":
        assert started == 0
        part.close()
        return
    assert 3 <= started <= 4             # (the first append of a new log may start one at once)
    assert part._writeback_pos % 4096 == 0 and part._writeback_pos >= 3 * WRITEBACK_BYTES
    dirty = _dirty_pages(part.active.path, part._writeback_pos)
    if dirty is None:
        part.close()
        pytest.skip("no cachestat system call: the count above is all this kernel shows")
    deadline = time.monotonic() + 10
    while dirty and time.monotonic() < deadline:     # (written in the background: not at once)
        time.sleep(0.01)
        dirty = _dirty_pages(part.active.path, part._writeback_pos)
    assert dirty == 0, f"{dirty} pages of the started range are still dirty"
    part.close()
