"""Open segments are a budget (txmq._budget.SegmentBudget): idle ones are
parked (descriptor closed, mapping dropped) and reopened by their next use;
a value a caller holds over a mapping stays valid through any eviction;
the active segment reserves its blocks as it grows, from 64 KiB up."""

from __future__ import annotations

import os
import random

import numpy as np
import pyarrow as pa
import pytest

from txmq._batch import BatchSpec
from txmq._budget import SegmentBudget
from txmq._segment import Segment, SegmentClosedError
from txmq._segment_file import RESERVE_MIN_BYTES
from txmq.batcharrow import batch_arrays
from txmq.errors import CorruptLogError
from txmq.storage.partition import Partition

MiB = 1024 * 1024


def _open_fds(paths) -> int:
    """How many of this process's descriptors point at one of ``paths``."""
    wanted = {os.path.realpath(p) for p in paths}
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") in wanted:
                n += 1
        except OSError:
            pass
    return n


def _segments(tmp_path, n, budget, capacity=MiB):
    return [Segment(str(tmp_path / f"{i:020d}.log"), 0, capacity, True, 4096, budget) for i in range(n)]


def test_round_robin_over_more_segments_than_the_budget_keeps_at_most_the_budget_open(tmp_path):
    budget = SegmentBudget(4)
    segs = _segments(tmp_path, 20, budget)
    paths = [s.path for s in segs]
    model = [[] for _ in segs]
    rng = random.Random(7)
    for round_ in range(30):
        for i in rng.sample(range(len(segs)), len(segs)):
            value = f"{i}-{round_}".encode() * rng.randint(1, 300)   # small and large (pwritev) batches
            segs[i].append(BatchSpec([value]))
            model[i].append(value)
            assert _open_fds(paths) <= 4
    assert budget.parked > 0 and budget.open_count <= 4
    for i in rng.sample(range(len(segs)), len(segs)):          # read back, each read reopening
        seg = segs[i]
        got, pos = [], 0
        while pos < seg.size:
            got += [m[2] for m in seg.messages(pos)]
            pos += seg.batch_at(pos).length
        assert got == model[i]
        assert _open_fds(paths) <= 4
    for s in segs:
        s.close()
    assert _open_fds(paths) == 0 and budget.open_count == 0


def test_eviction_never_invalidates_a_view_a_caller_holds(tmp_path):
    budget = SegmentBudget(1)
    a, b = _segments(tmp_path, 2, budget)
    values = [b"v%05d" % i * 40 for i in range(100)]
    a.append(BatchSpec(values))
    keys, arrow_values, _ = batch_arrays(a.arrow_buffers(0), 0)   # memoryviews over a's mapping
    words = np.frombuffer(a.mapping, np.uint8, a.size)             # a numpy view of it
    b.append(BatchSpec([b"x"]))                                    # a is parked ...
    assert a.parked and not b.parked
    assert arrow_values.to_pylist() == values                      # ... its views still read
    assert bytes(words[:4]) == b"TXMB"
    a.append(BatchSpec([b"after"]))                                # reopened; b parked
    assert b.parked and [m[2] for m in a.messages(a.batch_at(0).length)] == [b"after"]
    a.close()                                                      # closed for good (retention)
    assert arrow_values.to_pylist() == values and bytes(words[:4]) == b"TXMB"
    with pytest.raises(SegmentClosedError):
        a.batch_at(0)
    del keys, arrow_values, words
    b.close()


def test_a_segment_in_use_is_not_parked(tmp_path):
    """A budget whose every segment is in use runs over rather than close
    one under its user; it comes back within the limit when they finish."""
    budget = SegmentBudget(1)
    a, b = _segments(tmp_path, 2, budget)
    a.append(BatchSpec([b"a" * 100]))
    b.append(BatchSpec([b"b" * 100]))
    it = iter(pa.array([1]))      # (unrelated; keeps the interpreter honest about refcounts)
    del it
    for _ in range(3):
        assert [m[2] for m in a.messages(0)] == [b"a" * 100]
        assert [m[2] for m in b.messages(0)] == [b"b" * 100]
    assert budget.open_count == 1
    a.close()
    b.close()


def test_the_reservation_starts_small_and_doubles_as_the_segment_fills(tmp_path):
    seg = Segment(str(tmp_path / "s.log"), 0, 256 * MiB, True)
    assert os.path.getsize(seg.path) == 0                   # nothing reserved up front
    seg.append(BatchSpec([b"x" * 100]))
    assert os.path.getsize(seg.path) == RESERVE_MIN_BYTES
    reserved = [RESERVE_MIN_BYTES]
    while seg.size < 3 * MiB:
        seg.append(BatchSpec([os.urandom(1000)] * 30))
        size = os.path.getsize(seg.path)
        if size != reserved[-1]:
            reserved.append(size)
        assert seg.size <= size <= max(2 * seg.size, RESERVE_MIN_BYTES)
    assert reserved[:6] == [RESERVE_MIN_BYTES << i for i in range(6)]
    st = os.stat(seg.path)
    assert st.st_blocks * 512 >= st.st_size                 # reserved, not a sparse hole
    with open(seg.path, "rb") as f:                         # zeros past the batches: the clean end
        f.seek(seg.size)
        assert not f.read().strip(b"\0")
    seg.close()
    assert os.path.getsize(seg.path) == seg.size            # trimmed to its batches


def test_an_idle_partition_holds_at_most_a_mebibyte_of_disk(tmp_path):
    def allocated(path):
        return sum(os.stat(os.path.join(path, n)).st_blocks * 512 for n in os.listdir(path))

    p = Partition(str(tmp_path / "p"), "t", 0, fsync="never")
    assert allocated(p.path) <= MiB
    p.append(BatchSpec([b"hello"]))
    assert allocated(p.path) <= MiB
    p.close()
    assert allocated(p.path) <= MiB


def test_a_partition_reads_and_appends_through_a_budget_smaller_than_its_segments(tmp_path):
    budget = SegmentBudget(2)
    p = Partition(str(tmp_path / "p"), "t", 0, fsync="never", segment_bytes_max=8192, budget=budget)
    sent = []
    for i in range(400):
        value = b"%05d" % i * 20
        p.append(BatchSpec([value]))
        sent.append(value)
    assert len(p.segments) > 10 and budget.open_count <= 2
    assert [m[2] for m in p.read(0, 10_000)] == sent
    p.close()
    p = Partition(str(tmp_path / "p"), "t", 0, fsync="never", segment_bytes_max=8192, budget=budget)
    assert [m[2] for m in p.read(0, 10_000)] == sent and budget.open_count <= 2
    p.close()


# -- with the damage handling: quarantine and the mapping guard survive parking ----------


def _three_batches(path, n=100):
    seg = Segment(path, 0, MiB, True, 4096, SegmentBudget(4))
    positions = []
    for v in (b"a" * n, b"b" * n, b"c" * n):
        positions.append(seg.size)
        seg.append(BatchSpec([v]))
    seg.close()
    return positions


def test_a_parked_segment_keeps_its_quarantined_ranges(tmp_path):
    path = str(tmp_path / f"{0:020d}.log")
    positions = _three_batches(path)
    with open(path, "r+b") as f:                      # a flipped byte inside the middle batch
        f.seek(positions[1] + 60)
        byte = f.read(1)
        f.seek(positions[1] + 60)
        f.write(bytes([byte[0] ^ 0xFF]))
    budget = SegmentBudget(1)
    seg = Segment(path, 0, 0, False, 4096, budget)
    assert seg.recover(0, 0, True) is None
    (q,) = seg.quarantined()
    assert q[:4] == (positions[1], positions[2], 1, 2)
    other = Segment(str(tmp_path / f"{9:020d}.log"), 9, MiB, True, 4096, budget)   # parks seg
    assert seg.parked
    assert seg.quarantined() == [q]
    got, pos = [], seg.first_position()
    while pos < seg.size:                             # each step reopens it past the range
        got += [m[2] for m in seg.messages(pos)]
        pos = seg.next_position(pos)
    assert got == [b"a" * 100, b"c" * 100]
    assert seg.find_batch(positions[1] + 8, 2) == (positions[2], 2)
    assert seg.check_at(positions[1], 1) is not None and seg.check_at(positions[2], 2) is None
    other.close()
    seg.close()


def test_a_segment_that_shrank_while_parked_is_refused_on_reopen(tmp_path):
    budget = SegmentBudget(1)
    path = str(tmp_path / f"{0:020d}.log")
    seg = Segment(path, 0, MiB, True, 4096, budget)
    seg.recover(0, 0)
    for i in range(20):
        seg.append(BatchSpec([b"%d" % i * 50]))
    other = Segment(str(tmp_path / f"{99:020d}.log"), 99, MiB, True, 4096, budget)   # parks seg
    assert seg.parked
    os.truncate(path, seg.size // 2)                  # another process cuts the file meanwhile
    with pytest.raises(CorruptLogError, match="changed under its mapping"):
        seg.check_mapping()                           # what the owner checks at a roll or close
    with pytest.raises(CorruptLogError, match="while its descriptor was parked"):
        seg.messages(0)
    other.close()
    seg.close(trim=False)


def test_a_mapping_that_faulted_is_remembered_through_parking(tmp_path):
    budget = SegmentBudget(1)
    path = str(tmp_path / f"{0:020d}.log")
    positions = _three_batches(path, 5000)
    seg = Segment(path, 0, 0, False, 4096, budget)
    assert seg.recover(0, 0) is None
    size = seg.size
    os.truncate(path, positions[2] // 4096 * 4096)    # the last batch's pages go
    with pytest.raises(CorruptLogError, match="changed under its mapping"):
        seg.messages(positions[2])                    # a fault, read as zeros, not a SIGBUS
    other = Segment(str(tmp_path / f"{9:020d}.log"), 9, MiB, True, 4096, budget)   # parks seg
    assert seg.parked
    os.truncate(path, size)                           # the file is long again, its bytes are not
    with pytest.raises(CorruptLogError, match="changed under its mapping"):
        seg.messages(0)
    other.close()
    seg.close()
