"""The framed redo log (pyx/_redolog.pyx, docs/FORMAT.md): known-good bytes,
replay, torn and corrupt tails, compaction, bad file headers."""
import os
import struct

import pytest

from txmq import _budget, _redolog
from txmq._crc32c import crc32c_of
from txmq._redolog import FILE_HEADER, SNAPSHOT, RedoLog, frame, parse
from txmq.errors import CorruptLogError


def expected_frame(t, payload):
    body = bytes([t]) + payload
    return struct.pack("<II", len(body), crc32c_of(body)) + body


def test_file_header_known_good():
    assert FILE_HEADER == b"TXRL\x01\x00\x00\x00"
    assert SNAPSHOT == 1


def test_frame_known_good_bytes():
    assert frame(2, b"hello") == expected_frame(2, b"hello")
    # Fully literal: length 6, crc32c(b"\x02hello"), type, payload.
    f = frame(2, b"hello")
    assert f[:4] == b"\x06\x00\x00\x00"
    assert f[4:8] == struct.pack("<I", crc32c_of(b"\x02hello"))
    assert f[8:] == b"\x02hello"
    # Empty payload: length 1, CRC of the type byte alone.
    assert frame(255, b"") == b"\x01\x00\x00\x00" + struct.pack("<I", crc32c_of(b"\xff")) + b"\xff"
    # The one fully hand-checked vector: crc32c("123456789") with type '1'.
    assert frame(ord("1"), b"23456789") == b"\x09\x00\x00\x00" + struct.pack("<I", 0xE3069283) + b"123456789"
    assert frame(3, bytearray(b"ab")) == expected_frame(3, b"ab")
    assert frame(3, memoryview(b"ab")) == expected_frame(3, b"ab")


@pytest.mark.parametrize("t", [0, 256, -1])
def test_frame_type_out_of_range(t):
    with pytest.raises(ValueError):
        frame(t, b"x")


def test_file_bytes_known_good(tmp_path):
    path = tmp_path / "a.log"
    log = RedoLog(path)
    log.append(2, b"one")
    log.append_many([(3, b""), (4, b"three" * 10)])
    log.close()
    assert log.closed
    want = FILE_HEADER + expected_frame(2, b"one") + expected_frame(3, b"") + expected_frame(4, b"three" * 10)
    assert path.read_bytes() == want


def test_replay_round_trip(tmp_path):
    path = tmp_path / "a.log"
    log = RedoLog(path)
    assert log.replay() == []
    frames = [(2 + i % 200, os.urandom(i * 7)) for i in range(50)]
    for t, p in frames[:20]:
        log.append(t, p)
    log.append_many(frames[20:])
    log.close()
    again = RedoLog(path)
    assert again.replay() == frames
    assert again.dropped is None
    assert again.frames_since_snapshot == 50
    # Appending after a replay continues the file.
    again.append(9, b"more")
    again.close()
    third = RedoLog(path)
    assert third.replay() == frames + [(9, b"more")]
    third.close()


def test_parse_reports_positions():
    data = FILE_HEADER + expected_frame(2, b"a") + expected_frame(3, b"bc")
    frames, end, reason = parse(data)
    assert frames == [(2, b"a", 8), (3, b"bc", 8 + 10)]
    assert end == len(data) and reason is None
    assert parse(FILE_HEADER) == ([], 8, None)
    frames, end, reason = parse(data + b"\x05\x00")
    assert len(frames) == 2 and end == len(data) and reason == "torn frame header"


@pytest.mark.parametrize("cut", range(1, 16))
def test_torn_last_frame_is_truncated(tmp_path, cut):
    path = tmp_path / "a.log"
    log = RedoLog(path)
    log.append(2, b"first")
    log.append(3, b"second!")     # frame of 9 + 7 = 16 bytes
    log.close()
    good_end = 8 + 9 + 5
    full = path.read_bytes()
    assert len(full) == good_end + 16
    path.write_bytes(full[:good_end + cut])
    log = RedoLog(path)
    assert log.replay() == [(2, b"first")]
    pos, reason, dropped = log.dropped
    assert pos == good_end and dropped == cut
    assert reason in ("torn frame header", "torn frame")
    assert os.path.getsize(path) == good_end      # cut on disk
    log.append(4, b"after")
    log.close()
    log = RedoLog(path)
    assert log.replay() == [(2, b"first"), (4, b"after")]
    assert log.dropped is None
    log.close()


@pytest.mark.parametrize("where", ["crc", "type", "payload", "length"])
def test_crc_flip_truncates(tmp_path, where):
    path = tmp_path / "a.log"
    log = RedoLog(path)
    log.append(2, b"keep me")
    log.append(3, b"corrupt me")
    log.append(4, b"lost with it")
    log.close()
    second = 8 + 9 + 7
    off = {"length": 0, "crc": 5, "type": 8, "payload": 12}[where]
    data = bytearray(path.read_bytes())
    data[second + off] ^= 0x10
    path.write_bytes(bytes(data))
    log = RedoLog(path)
    assert log.replay() == [(2, b"keep me")]
    assert log.dropped[0] == second
    assert log.dropped[2] == len(data) - second
    assert log.dropped[1] in ("frame CRC mismatch", "torn frame", "bad frame length")
    assert os.path.getsize(path) == second
    log.close()


def test_frame_type_zero_with_valid_crc_is_rejected(tmp_path):
    path = tmp_path / "a.log"
    path.write_bytes(FILE_HEADER + expected_frame(2, b"ok") + expected_frame(0, b"zero"))
    log = RedoLog(path)
    assert log.replay() == [(2, b"ok")]
    assert log.dropped == (8 + 11, "frame type 0", 13)
    log.close()


def test_compaction_and_replay_from_last_snapshot(tmp_path):
    path = tmp_path / "a.log"
    log = RedoLog(path)
    for i in range(10):
        log.append(2, b"%d" % i)
    log.compact(b"state@10")
    assert not os.path.exists(str(path) + ".compact")
    assert path.read_bytes() == FILE_HEADER + expected_frame(SNAPSHOT, b"state@10")
    assert log.frames_since_snapshot == 1
    log.append(2, b"10")
    log.close()
    log = RedoLog(path)
    assert log.replay() == [(SNAPSHOT, b"state@10"), (2, b"10")]
    # A snapshot frame appended in-line (not compacted) also starts replay.
    log.append(2, b"11")
    log.append(SNAPSHOT, b"state@12")
    log.append(3, b"12")
    log.close()
    log = RedoLog(path)
    assert log.replay() == [(SNAPSHOT, b"state@12"), (3, b"12")]
    assert log.frames_since_snapshot == 2
    log.close()


def test_compact_never_mode(tmp_path):
    path = tmp_path / "a.log"
    log = RedoLog(path, fsync="never")
    log.append(5, b"x")
    log.sync()                       # no-op in "never" mode, must not fail
    log.compact(b"")
    log.append(5, b"y")
    log.sync(force=True)
    log.close()
    log = RedoLog(path)
    assert log.replay() == [(SNAPSHOT, b""), (5, b"y")]
    log.close()


def test_bad_magic_raises_with_path_and_position(tmp_path):
    path = tmp_path / "bad.log"
    path.write_bytes(b"XXRL\x01\x00\x00\x00" + expected_frame(2, b"a"))
    log = RedoLog(path)
    with pytest.raises(CorruptLogError) as ei:
        log.replay()
    assert ei.value.path == str(path)
    assert ei.value.position == 0
    assert "magic" in ei.value.reason
    assert path.read_bytes()[:4] == b"XXRL"       # nothing rewritten
    log.close()


def test_bad_version_raises(tmp_path):
    path = tmp_path / "bad.log"
    path.write_bytes(b"TXRL\x02\x00\x00\x00")
    log = RedoLog(path)
    with pytest.raises(CorruptLogError) as ei:
        log.replay()
    assert ei.value.position == 4 and ei.value.path == str(path)
    log.close()


@pytest.mark.parametrize("n", range(1, 8))
def test_torn_file_header(tmp_path, n):
    path = tmp_path / "a.log"
    path.write_bytes(FILE_HEADER[:n])
    log = RedoLog(path)
    assert log.replay() == []
    assert log.dropped == (0, "torn file header", n)
    log.append(2, b"z")
    log.close()
    assert path.read_bytes() == FILE_HEADER + expected_frame(2, b"z")


def test_zeroed_short_header_is_not_reported(tmp_path):
    path = tmp_path / "a.log"
    path.write_bytes(b"\0\0\0")
    log = RedoLog(path)
    assert log.replay() == []
    assert log.dropped is None
    log.close()
    assert path.read_bytes() == FILE_HEADER


def test_module_constants():
    assert _redolog.FILE_HEADER[:4] == struct.pack("<I", 0x4C525854)


def test_logs_share_a_budget_of_descriptors(tmp_path):
    """Redo logs open through one budget (txmq._budget, as segments do):
    past its limit the least recently used idle log closes its descriptor,
    and its next append or replay reopens it, losing nothing."""
    budget = _budget.LogBudget(2)
    logs = [RedoLog(tmp_path / f"l{i}.log", "never", budget=budget) for i in range(3)]
    for i, log in enumerate(logs):
        log.append(7, b"first-%d" % i)
    assert budget.stats()["open"] <= 2 and budget.parked >= 1
    parked = [log for log in logs if log.parked]
    assert parked and all(not log.closed for log in logs)
    for i, log in enumerate(logs):
        log.append(7, b"second-%d" % i)                 # reopens a parked one
    assert budget.stats()["open"] <= 2
    for i, log in enumerate(logs):
        assert [p for _, p in log.replay()] == [b"first-%d" % i, b"second-%d" % i]
    for log in logs:
        log.close()
    assert budget.stats()["open"] == 0
    with pytest.raises(ValueError, match="open logs"):
        _budget.LogBudget(0)


def test_a_compaction_a_full_disk_refuses_leaves_the_log_as_it_was(tmp_path, monkeypatch):
    """compact() raises StorageFullError (never a bare OSError) and leaves no
    temporary file; try_compact() returns False, the log still replays what
    it held, and it is not due again until COMPACT_RETRY_FRAMES frames later."""
    import errno
    from txmq.errors import StorageFullError

    log = RedoLog(tmp_path / "l.log", "commit")
    for i in range(10):
        log.append(7, b"f%d" % i)
    real_write = os.write

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(StorageFullError):
        log.compact(b"snap")
    assert not os.path.exists(str(tmp_path / "l.log") + ".compact")
    assert log.compact_due(5)
    assert log.try_compact(b"snap") is False
    assert not log.compact_due(5)
    monkeypatch.setattr(os, "write", real_write)
    assert [p for _, p in log.replay()] == [b"f%d" % i for i in range(10)]
    for i in range(_redolog.COMPACT_RETRY_FRAMES - 1):
        log.append(7, b"g")
    assert not log.compact_due(5)
    log.append(7, b"g")
    assert log.compact_due(5) and log.try_compact(b"snap") is True
    assert [p for _, p in log.replay()] == [b"snap"]
    monkeypatch.setattr(os, "write", full)              # refused again, then an explicit compact succeeds:
    assert log.try_compact(b"snap2") is False           # the wait the refusal set ends with it
    monkeypatch.setattr(os, "write", real_write)
    log.compact(b"snap3")
    for i in range(5):
        log.append(7, b"h")
    assert log.compact_due(5)
    log.close()


@pytest.mark.parametrize("fsync,preallocate", [("never", 0), ("commit", 4096)])
def test_compaction_is_due_by_bytes_since_the_last_snapshot(tmp_path, fsync, preallocate):
    """``compact_due(frames, nbytes)``: due after ``nbytes`` bytes of frames
    following the last SNAPSHOT frame (its own bytes not counted), whatever
    the frame count; counted again from a compaction and from the last
    snapshot a reopened log replays; zeros written ahead never count."""
    frame_bytes = _redolog.FRAME_HEADER_BYTES + 100
    log = RedoLog(tmp_path / "l.log", fsync, preallocate)
    for i in range(9):
        log.append(7, b"x" * 100)
    assert log.bytes_since_snapshot == 9 * frame_bytes
    assert not log.compact_due(1000, 10 * frame_bytes) and not log.compact_due(10)
    log.append(7, b"x" * 100)
    assert log.compact_due(1000, 10 * frame_bytes) and log.compact_due(1000, -1) is False
    log.compact(b"s" * 5000)                       # (a big snapshot counts for nothing)
    assert log.bytes_since_snapshot == 0 and not log.compact_due(1000, 1)
    for i in range(3):
        log.append(7, b"y" * 100)
    log.close()
    again = RedoLog(tmp_path / "l.log", fsync, preallocate)
    assert [p[:1] for _, p in again.replay()] == [b"s", b"y", b"y", b"y"]
    assert again.bytes_since_snapshot == 3 * frame_bytes
    assert again.compact_due(1000, 3 * frame_bytes) and not again.compact_due(1000, 3 * frame_bytes + 1)
    again.close()
    fresh = RedoLog(tmp_path / "m.log", fsync, preallocate)     # no snapshot: counted from the header
    fresh.append(7, b"z")
    fresh.close()
    fresh = RedoLog(tmp_path / "m.log", fsync, preallocate)
    fresh.replay()
    assert fresh.bytes_since_snapshot == _redolog.FRAME_HEADER_BYTES + 1
    fresh.close()


def test_a_deferred_frame_goes_out_at_the_front_of_the_next_write(tmp_path, monkeypatch):
    """defer() writes nothing; the next write carries the deferred frames
    first, in the same pwrite; close() writes what is still deferred."""
    log = RedoLog(tmp_path / "l.log", "never")
    writes = []
    real_pwrite = _redolog.pwrite_all

    def counted(fd, data, pos):
        writes.append(bytes(data))
        return real_pwrite(fd, data, pos)

    monkeypatch.setattr(_redolog, "pwrite_all", counted)
    log.append(2, b"a")
    log.defer(7, b"done-1")
    log.defer(7, b"done-2")
    assert len(writes) == 1 and os.path.getsize(tmp_path / "l.log") == len(FILE_HEADER) + len(frame(2, b"a"))
    log.append(3, b"b")
    assert writes[1] == frame(7, b"done-1") + frame(7, b"done-2") + frame(3, b"b")
    log.defer(7, b"done-3")
    log.close()
    assert len(writes) == 3 and writes[2] == frame(7, b"done-3")
    monkeypatch.undo()
    again = RedoLog(tmp_path / "l.log", "never")
    assert again.replay() == [(2, b"a"), (7, b"done-1"), (7, b"done-2"), (3, b"b"), (7, b"done-3")]
    assert again.frames_since_snapshot == 5
    again.close()


def test_deferred_frames_survive_a_refused_write_and_a_compaction_drops_them(tmp_path, monkeypatch):
    """A write the disk refuses keeps the deferred frames for the next one;
    a compaction drops them (its snapshot holds what they said); DEFER_MAX
    of them are written at once."""
    import errno
    from txmq.errors import StorageFullError

    log = RedoLog(tmp_path / "l.log", "commit")
    log.defer(7, b"done")
    real_pwrite = _redolog.pwrite_all

    def full(fd, data, pos):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_redolog, "pwrite_all", full)
    with pytest.raises(StorageFullError):
        log.append(2, b"x")
    monkeypatch.setattr(_redolog, "pwrite_all", real_pwrite)
    log.append(2, b"y")
    assert log.replay() == [(7, b"done"), (2, b"y")]
    log.defer(7, b"gone")
    log.compact(b"snap")
    log.append(2, b"z")
    assert log.replay() == [(SNAPSHOT, b"snap"), (2, b"z")]
    for i in range(_redolog.DEFER_MAX):
        log.defer(7, b"%d" % i)
    assert [p for _, p in log.replay()][2:] == [b"%d" % i for i in range(_redolog.DEFER_MAX)]
    log.close()


@pytest.mark.parametrize("n", [10, 70_000])
def test_pwrite_all_writes_every_byte_with_or_without_the_gil(tmp_path, n):
    """A small frame is written holding the GIL, a large one (a snapshot)
    releasing it; both whole, at their position; a bad descriptor is an
    OSError naming its errno, as os.pwrite's."""
    import errno
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        data = bytes(range(256)) * (n // 256) + b"x" * (n % 256)
        _redolog.pwrite_all(fd, data, 5)
        assert open(path, "rb").read() == b"\0" * 5 + data
    finally:
        os.close(fd)
    with pytest.raises(OSError) as e:
        _redolog.pwrite_all(fd, b"x", 0)
    assert e.value.errno == errno.EBADF
