"""A partition opened and only read closes without rewriting or syncing
anything: its opening left it as its last close did (a broker closing a
subscription's thousands of idle partitions must not take minutes)."""

from __future__ import annotations

import os

from txmq._batch import BatchSpec
from txmq.storage.partition import Partition

OPTIONS = dict(fsync="commit", segment_bytes_max=1 << 20)


def _files(path):
    return {n: (os.stat(os.path.join(path, n)).st_mtime_ns, open(os.path.join(path, n), "rb").read())
            for n in sorted(os.listdir(path)) if n != "readview"}


def test_an_idle_partition_closes_without_writing(tmp_path):
    path = str(tmp_path / "p")
    p = Partition(path, "t", 0, **OPTIONS)
    for i in range(50):
        p.append(BatchSpec([b"%d" % i * 300]))
    p.close()
    before = _files(path)
    p = Partition(path, "t", 0, **OPTIONS)
    assert [m[2] for m in p.read(0, 100)] == [b"%d" % i * 300 for i in range(50)]
    opened = _files(path)
    p.close()
    assert _files(path) == opened           # closing wrote nothing
    assert {n: v[1] for n, v in opened.items()} == {n: v[1] for n, v in before.items()}
    p = Partition(path, "t", 0, **OPTIONS)  # and it opens as before
    assert p.end_offset == 50 and not p.dropped
    p.append(BatchSpec([b"more"]))
    p.close()
    assert _files(path) != opened            # a changed one is sealed and snapshotted
    p = Partition(path, "t", 0, **OPTIONS)
    assert p.end_offset == 51 and [m[2] for m in p.read(50, 1)] == [b"more"]
    assert os.path.getsize(p.segments[-1].path) == p.segments[-1].size
    p.close()


def test_a_partition_recovered_after_a_crash_is_sealed_on_close(tmp_path):
    """Opened after a crash, its active file still holds its reservation
    past the batches: closing trims it even though nothing was appended."""
    path = str(tmp_path / "p")
    p = Partition(path, "t", 0, **OPTIONS)
    p.append(BatchSpec([b"x" * 100]))
    seg = p.segments[-1].path
    assert os.path.getsize(seg) > p.segments[-1].size       # reserved ahead, not yet sealed
    del p                                                     # "crash": never closed
    p = Partition(path, "t", 0, **OPTIONS)
    assert p.end_offset == 1
    p.close()
    p = Partition(path, "t", 0, **OPTIONS)
    assert os.path.getsize(seg) == p.segments[-1].size and p.end_offset == 1
    p.close()
