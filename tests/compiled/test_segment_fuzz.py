"""Fuzz the decoders: corrupted or truncated segments,
redo logs and partitions give a valid prefix of what was written or a
CorruptLogError — never a crash, a hang or a wrong answer.

Every case is seeded; the whole module runs in a few seconds.
"""
import os
import random
import shutil
import struct

import pytest

from txmq._batch import BatchSpec
from txmq._segment import Segment
from txmq._redolog import FILE_HEADER, SNAPSHOT, RedoLog, frame
from txmq.errors import CorruptLogError
from txmq.storage.partition import Partition

CASES = 200
HEADER_SIZE = 88


# --------------------------------------------------------------------------
# Segments.

def _random_spec(rng, i):
    n = rng.randrange(1, 12)
    values = [rng.randbytes(rng.choice([0, 1, 5, 30, 200])) for _ in range(n)]
    kw = {}
    if rng.random() < 0.7:
        kw["keys"] = [None if rng.random() < 0.3 else rng.randbytes(rng.randrange(0, 12)) for _ in range(n)]
    if rng.random() < 0.5:
        kw["headers"] = [None if rng.random() < 0.4 else
                         [("h%d" % j, None if rng.random() < 0.2 else rng.randbytes(rng.randrange(0, 8)))
                          for j in range(rng.randrange(0, 3))] for _ in range(n)]
    if rng.random() < 0.5:
        t0 = rng.randrange(0, 2**40)
        kw["event_times"] = [t0 + rng.randrange(-10**6, 10**6) for _ in range(n)]
    return BatchSpec(values, **kw)


def _snapshot(seg, pos):
    """Everything a reader can observe about the batch at ``pos``."""
    b = seg.batch_at(pos)
    fields = (b.position, b.length, b.base_offset, b.count, b.flags, b.base_sequence, b.txn_hi,
              b.txn_lo, b.producer_id, b.producer_epoch, b.first_event_time, b.max_event_time,
              b.publish_time)
    bufs = seg.arrow_buffers(pos)
    arrow = tuple(None if bufs[k] is None else bytes(bufs[k])
                  for k in ("key_offsets", "keys", "validity", "value_offsets", "values", "event_deltas"))
    del bufs
    return fields, seg.messages(pos), arrow


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One segment of ~15 varied batches and what reading it gives."""
    d = tmp_path_factory.mktemp("seg")
    rng = random.Random(1234)
    path = d / "00000000000000000100.log"
    seg = Segment(path, 100, 1 << 20, True)
    assert seg.recover(0, 100) is None
    for i in range(15):
        flags = rng.choice([0, 0, 1, 1 | 2 | 4, 1 | 2 | 8])
        seg.append(_random_spec(rng, i), flags, rng.getrandbits(64) if flags else 0, rng.getrandbits(64),
                   rng.randrange(-1, 1000), rng.randrange(-1, 100), rng.randrange(-1, 10**6),
                   1_700_000_000_000 + i)
    expected, pos = [], 0
    while pos < seg.size:
        snap = _snapshot(seg, pos)
        expected.append(snap)
        pos = snap[0][0] + snap[0][1]
    next_offsets = [100] + [s[0][2] + s[0][3] for s in expected]
    seg.close()
    data = path.read_bytes()
    assert len(data) == pos
    return data, expected, next_offsets


def _read_all(seg):
    """Walk the recovered segment; stop at the first CorruptLogError."""
    got, pos = [], 0
    while pos < seg.size:
        try:
            snap = _snapshot(seg, pos)
        except CorruptLogError as e:
            assert e.path == seg.path and e.position == pos
            break
        got.append(snap)
        pos = snap[0][0] + snap[0][1]
    return got


def _flag_bytes(expected):
    # Every byte of a batch is checked (the CRC covers the flags too), so
    # no byte is exempt from the fuzzing.
    return set()


def _mutate(rng, data, skip):
    """A flipped byte or three, a truncation, or both; returns the new bytes
    and the first position that differs from ``data``."""
    buf = bytearray(data)
    first_bad = len(data)
    kind = rng.choice(["flip", "flip", "truncate", "both", "zero-tail-flip"])
    if kind in ("flip", "both"):
        for _ in range(rng.choice([1, 1, 2, 3])):
            while True:
                i = rng.randrange(len(buf))
                if i not in skip:
                    break
            buf[i] ^= rng.randrange(1, 256)
            first_bad = min(first_bad, i)
    if kind in ("truncate", "both"):
        t = rng.randrange(len(buf))
        del buf[t:]
        first_bad = min(first_bad, t)
    if kind == "zero-tail-flip":
        # A crash before the segment was trimmed: zeros after the last batch,
        # with a stray non-zero byte somewhere in them.
        extra = bytearray(rng.choice([8, 64, 4096]))
        extra[rng.randrange(len(extra))] = rng.randrange(1, 256)
        buf += extra
    return bytes(buf), first_bad


def _check_prefix(got, expected, first_bad, next_offsets, seg):
    k = len(got)
    assert got == expected[:k], "a batch read back differs from what was written"
    # Every batch wholly before the first damaged byte survives.
    intact = sum(1 for s in expected if s[0][0] + s[0][1] <= first_bad)
    assert k >= intact, (k, intact, first_bad)
    assert seg.next_offset == next_offsets[k]


@pytest.mark.parametrize("writable", [False, True])
def test_segment_fuzz(tmp_path, written, writable):
    data, expected, next_offsets = written
    rng = random.Random(99 + writable)
    skip = _flag_bytes(expected)
    reasons = set()
    cut_cases = 0
    for case in range(CASES):
        mutated, first_bad = _mutate(rng, data, skip)
        path = tmp_path / f"{case:04d}.log"
        path.write_bytes(mutated)
        seg = Segment(path, 100, 0, writable)
        bad = seg.recover(0, 100)
        if bad is not None:
            reasons.add(bad[1].split(" ")[0])
            assert 0 <= bad[0] <= len(mutated)
            assert bad[0] == seg.size
        got = _read_all(seg)
        # recover() already cut the damage: every batch it kept must read.
        assert sum(s[0][1] for s in got) == seg.size, case
        _check_prefix(got, expected, first_bad, next_offsets, seg)
        k = len(got)
        cut_cases += k < len(expected)
        seg.close()
        if writable:
            # The cut is on disk: reopening finds a clean log of the same prefix.
            assert os.path.getsize(path) == seg.size
            again = Segment(path, 100, 0, True)
            assert again.recover(0, 100) is None
            assert _read_all(again) == expected[:k]
            again.close()
        os.unlink(path)
    # The corpus exercised several distinct checks, not one, and most cases
    # really lost batches (a fuzz that never cuts proves nothing).
    assert len(reasons) >= 4, reasons
    assert cut_cases > CASES // 2, cut_cases


def test_segment_random_positions_never_crash(tmp_path, written):
    """batch_at/messages at arbitrary (non-boundary) positions of a fresh
    read-only segment raise CorruptLogError or return a written batch."""
    data, expected, _ = written
    path = tmp_path / "x.log"
    path.write_bytes(data)
    seg = Segment(path, 100, 0, False)
    assert seg.recover(0, 100) is None
    by_pos = {s[0][0]: s for s in expected}
    rng = random.Random(5)
    for pos in [-1, len(data), len(data) + 100] + [rng.randrange(len(data)) for _ in range(300)]:
        try:
            snap = _snapshot(seg, pos)
        except CorruptLogError as e:
            assert e.position == pos
            continue
        assert by_pos.get(pos) == snap
    seg.close()


def test_truncate_at_every_batch_boundary(tmp_path, written):
    data, expected, next_offsets = written
    for k, snap in enumerate(expected + [None]):
        end = snap[0][0] if snap else len(data)
        path = tmp_path / f"b{k}.log"
        path.write_bytes(data[:end])
        seg = Segment(path, 100, 0, False)
        assert seg.recover(0, 100) is None
        assert _read_all(seg) == expected[:k]
        assert seg.next_offset == next_offsets[k]
        seg.close()


def test_flag_flip_is_detected(tmp_path):
    path = tmp_path / "00000000000000000000.log"
    seg = Segment(path, 0, 1 << 16, True)
    seg.recover(0, 0)
    seg.append(BatchSpec([b"payment"], keys=[b"k"]), publish_time=1)
    seg.close()
    raw = bytearray(path.read_bytes())
    assert struct.unpack_from("<H", raw, 6)[0] == 0
    raw[6] ^= 0x02                                  # plain data -> "control batch"
    path.write_bytes(bytes(raw))
    ro = Segment(path, 0, 0, False)
    bad = ro.recover(0, 0)
    try:
        if bad is None:
            info = ro.batch_at(0)
            # Either the corruption is reported, or the data is unchanged.
            assert not info.is_control, "a flipped flag bit turned a data batch into a control batch"
    finally:
        ro.close()


# --------------------------------------------------------------------------
# Redo logs.

@pytest.fixture(scope="module")
def redo_written(tmp_path_factory):
    d = tmp_path_factory.mktemp("redo")
    rng = random.Random(77)
    frames = []
    for i in range(25):
        t = SNAPSHOT if i in (9, 17) else rng.randrange(2, 256)
        frames.append((t, rng.randbytes(rng.choice([0, 1, 7, 40, 300]))))
    path = d / "r.log"
    log = RedoLog(path, fsync="never")
    log.append_many(frames)
    log.close()
    data = path.read_bytes()
    assert data == FILE_HEADER + b"".join(frame(t, p) for t, p in frames)
    ends, pos = [], len(FILE_HEADER)
    for t, p in frames:
        pos += 9 + len(p)
        ends.append(pos)
    return data, frames, ends


def _from_last_snapshot(frames):
    last = max([i for i, f in enumerate(frames) if f[0] == SNAPSHOT], default=0)
    return frames[last:]


def test_redolog_fuzz(tmp_path, redo_written):
    data, frames, ends = redo_written
    rng = random.Random(4242)
    outcomes = {"prefix": 0, "corrupt": 0}
    for case in range(CASES):
        buf = bytearray(data)
        first_bad = len(buf)
        kind = rng.choice(["flip", "truncate", "both"])
        if kind != "truncate":
            for _ in range(rng.choice([1, 2])):
                i = rng.randrange(len(buf))
                buf[i] ^= rng.randrange(1, 256)
                first_bad = min(first_bad, i)
        if kind != "flip":
            t = rng.randrange(len(buf))
            del buf[t:]
            first_bad = min(first_bad, t)
        path = tmp_path / f"{case:04d}.log"
        path.write_bytes(bytes(buf))
        log = RedoLog(path)
        try:
            got = log.replay()
        except CorruptLogError as e:
            # Only a damaged magic or version byte may refuse the whole file.
            assert e.path == str(path) and e.position in (0, 4)
            assert first_bad < 5
            outcomes["corrupt"] += 1
            log.close()
            continue
        # Which frames survived: the longest prefix that ends at the cut.
        k = sum(1 for e in ends if e <= log.size)
        assert log.size == (ends[k - 1] if k else (len(FILE_HEADER)))
        assert got == _from_last_snapshot(frames[:k])
        intact = sum(1 for e in ends if e <= first_bad)
        if first_bad >= len(FILE_HEADER):
            assert k >= intact, (case, k, intact)
        if log.dropped is not None:
            assert log.dropped[0] == log.size
        assert os.path.getsize(path) == log.size
        log.close()
        outcomes["prefix"] += 1
        # Replaying again is stable and reports nothing new.
        again = RedoLog(path)
        assert again.replay() == got
        assert again.dropped is None
        again.close()
        os.unlink(path)
    assert outcomes["prefix"] > CASES // 2


# --------------------------------------------------------------------------
# Partitions.

def _fill(part, rng, n_batches):
    written = []
    for i in range(n_batches):
        n = rng.randrange(1, 6)
        vals = [b"p%d-%d-" % (i, j) + rng.randbytes(rng.randrange(0, 150)) for j in range(n)]
        keys = [None if rng.random() < 0.3 else b"k%d" % j for j in range(n)]
        base = part.append(BatchSpec(list(vals), keys=list(keys)))
        assert base == sum(len(w) for w in written)
        written.append(list(zip(keys, vals)))
    return written


def _messages(part):
    return [(m[0], m[1], m[2]) for m in part.read(0, max_messages=10**6)]


def _expected(written, n_offsets):
    out, off = [], 0
    for batch in written:
        for key, val in batch:
            out.append((off, key, val))
            off += 1
    return out[:n_offsets]


def _batch_ends(written):
    ends, off = [0], 0
    for batch in written:
        off += len(batch)
        ends.append(off)
    return ends


def _crash_copy(src, dst):
    """What a kill -9 leaves: the files as they are, nothing closed."""
    shutil.copytree(src, dst)


@pytest.mark.parametrize("seed", range(24))
def test_partition_reopen_after_torn_active_tail(tmp_path, seed):
    rng = random.Random(seed)
    # Even seeds: a writer that flushes (a flipped byte with sound batches
    # after it is damage: quarantined); odd: fsync="never", where nothing
    # past the recovery point was flushed, so any bad batch there ends the
    # log (a power loss may keep a later page and lose an earlier one).
    fsync = "commit" if seed % 2 == 0 else "never"
    live = tmp_path / "live"
    part = Partition(live, "t", 0, fsync=fsync, segment_bytes_max=4096, index_interval_bytes=256)
    written = _fill(part, rng, 40)
    assert len(part.segments) > 2
    active = part.active
    assert active.size > 0
    crashed = tmp_path / "crashed"
    _crash_copy(live, crashed)
    seg_file = crashed / os.path.basename(active.path)
    raw = bytearray(seg_file.read_bytes())
    # Damage the active segment after its first batch (the recovery point
    # of a fresh segment is at byte 0, so this is all past it).
    first_len = active.batch_at(0).length
    starts, pos = [], 0
    while pos < active.size:
        starts.append(pos)
        pos += active.batch_at(pos).length
    flag_bytes = set()  # the CRC covers the flags too
    truncated = not (active.size > first_len and rng.random() < 0.5)
    if not truncated:
        at = rng.choice([i for i in range(first_len, active.size) if i not in flag_bytes])
        raw[at] ^= 0xFF
    else:
        at = rng.randrange(0, active.size)
        del raw[at:]
    seg_file.write_bytes(bytes(raw))
    hit = max(p for p in starts if p <= at)          # the batch the damage is in
    want_end = active.batch_at(hit).base_offset
    if not truncated and hit != starts[-1] and fsync != "never":
        # Sound batches follow the flipped one: only its offsets are lost
        # (quarantined), the log keeps its end.
        lost = range(want_end, active.batch_at(hit).next_offset)
        reopened = Partition(crashed, "t", 0, fsync=fsync, segment_bytes_max=4096, index_interval_bytes=256)
        try:
            assert reopened.end_offset == active.next_offset
            (q,) = reopened.quarantined()
            assert (q.position, q.first_offset, q.end_offset) == (hit, lost.start, lost.stop)
            assert _messages(reopened) == [m for m in _expected(written, active.next_offset) if m[0] not in lost]
            assert any("quarantined" in d for d in reopened.stats()["truncated_on_open"])
        finally:
            reopened.close()
            part.close()
        return
    # A file cut exactly at a batch boundary is a clean end: nothing to report.
    want_report = not (truncated and at == hit)
    part_closed = part  # keep the live one open until the end (like a crash)
    reopened = Partition(crashed, "t", 0, fsync=fsync, segment_bytes_max=4096, index_interval_bytes=256)
    try:
        ends = _batch_ends(written)
        assert want_end in ends and want_end < ends[-1]
        assert reopened.end_offset == want_end
        got = _messages(reopened)
        assert got == _expected(written, reopened.end_offset)
        if want_report:
            assert len(reopened.dropped) == 1, reopened.dropped
            d = reopened.dropped[0]
            assert d.path == str(seg_file)
            assert d.position == hit and d.reason
            assert str(d).startswith(str(seg_file))
            assert str(seg_file) in reopened.stats()["truncated_on_open"][0]
        else:
            assert reopened.dropped == []
        # The partition is writable again at the cut, with dense offsets.
        base = reopened.append(BatchSpec([b"after"]))
        assert base == reopened.end_offset - 1
        assert reopened.read(base)[0][2] == b"after"
    finally:
        reopened.close()
        part_closed.close()
    # And a clean reopen keeps everything, reporting nothing.
    third = Partition(crashed, "t", 0, fsync="never", segment_bytes_max=4096)
    try:
        assert third.dropped == []
        assert _messages(third)[-1][2] == b"after"
    finally:
        third.close()


def test_partition_reopen_without_recovery_point_scans_and_cuts(tmp_path):
    """Lost recovery point + corrupt tail of the last segment: every segment
    is scanned, the tail is cut and reported."""
    rng = random.Random(11)
    part = Partition(tmp_path / "p", "t", 0, fsync="never", segment_bytes_max=4096)
    written = _fill(part, rng, 30)
    last = part.active
    last_path, last_base, last_size = last.path, last.base_offset, last.size
    second = last.locate(last.next_offset - 1)
    part.close()
    os.unlink(tmp_path / "p" / "recovery-point")
    raw = bytearray(open(last_path, "rb").read())
    assert len(raw) == last_size
    raw[second + 40] ^= 0x55                          # inside the CRC'd header of the last batch
    with open(last_path, "wb") as f:
        f.write(raw)
    part = Partition(tmp_path / "p", "t", 0, fsync="never", segment_bytes_max=4096)
    try:
        # The cut is exactly at the damaged (last) batch.
        assert part.end_offset == _batch_ends(written)[-2]
        assert [d.position for d in part.dropped if d.path == last_path] == [second]
        assert "CRC" in [d for d in part.dropped if d.path == last_path][0].reason
        assert _messages(part) == _expected(written, part.end_offset)
    finally:
        part.close()


def test_partition_corrupt_middle_segment_without_recovery_point(tmp_path):
    """A damaged last batch of a sealed segment (found by a full scan: no
    recovery point, so no fsync mode known that would excuse a hole) loses
    its own offsets only: they are quarantined and the later segments
    kept."""
    rng = random.Random(12)
    part = Partition(tmp_path / "p", "t", 0, fsync="never", segment_bytes_max=4096)
    written = _fill(part, rng, 40)
    segs = [(s.path, s.base_offset, s.size) for s in part.segments]
    assert len(segs) >= 3
    part.close()
    os.unlink(tmp_path / "p" / "recovery-point")
    victim_path, victim_base, victim_size = segs[1]
    raw = bytearray(open(victim_path, "rb").read())
    raw[victim_size - 3] ^= 0x01                      # the last batch of segment 1
    with open(victim_path, "wb") as f:
        f.write(raw)
    part = Partition(tmp_path / "p", "t", 0, fsync="never", segment_bytes_max=4096)
    try:
        ends = _batch_ends(written)
        assert part.end_offset == ends[-1]
        (q,) = part.quarantined()
        assert q.segment == victim_base and q.end_offset == segs[2][1] and q.end_position == victim_size
        assert q.first_offset in ends and victim_base < q.first_offset
        assert part.dropped[0].path == victim_path and len(part.dropped) == 1
        assert all(os.path.exists(p) for p, _, _ in segs[2:])
        lost = range(q.first_offset, q.end_offset)
        assert _messages(part) == [m for m in _expected(written, ends[-1]) if m[0] not in lost]
    finally:
        part.close()


def test_corrupt_index_entry_never_skips_messages(tmp_path):
    import numpy as np
    from txmq.storage.index import INDEX_ENTRY
    part = Partition(tmp_path / "p", "t", 0, fsync="never", segment_bytes_max=8192,
                     index_interval_bytes=128)
    for i in range(60):
        part.append(BatchSpec([b"m%d" % i, b"n%d" % i]))
    sealed = part.segments[0]
    index_path = sealed.path[:-len(".log")] + ".index"
    part.close()
    entries = np.fromfile(index_path, dtype=INDEX_ENTRY)
    assert entries["a"][:4].tolist() == [0, 2, 4, 6]        # one entry per 2-message batch
    # Entry 3 still increasing and in range, but names offset 5 for the batch of 6..7.
    entries["a"][3] = 5
    entries.tofile(index_path)
    part = Partition(tmp_path / "p", "t", 0, fsync="never", segment_bytes_max=8192,
                     index_interval_bytes=128)
    try:
        got = part.read(5, 3)
        assert [m[0] for m in got] == [5, 6, 7], "read(5) must start at offset 5"
    finally:
        part.close()
