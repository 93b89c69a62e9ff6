# cython: boundscheck=False, wraparound=False
"""The framed redo log shared by every log that is not a message log
(cursors, pending acks, the coordinator log, the half-message log).

File layout (version 1)::

    off size
      0    4  magic "TXRL" (0x4C525854 little-endian)
      4    1  version (1)
      5    3  reserved, 0
      8       frames, back to back:
                u32 length   bytes after the CRC field: 1 + len(payload)
                u32 crc32c   of the type byte and the payload
                u8  type     1 = SNAPSHOT (reserved); callers use 2..255
                payload

Replay returns the frames from the last SNAPSHOT frame on, and cuts the
file at the first frame that is torn or fails its CRC. Compaction writes a
new file holding one SNAPSHOT frame and renames it over the old one.

A log opened with ``preallocate`` (the coordinator log) keeps zeros
written ahead of its end, in chunks of that many bytes, so that the sync
of a frame rewrites blocks the file already has and no inode (its size,
its extents) must go to the journal with it: one flush instead of data +
journal. There a frame length of zero followed by zeros to the end of the
file is the clean end of the log, not a torn frame.

A frame that replay can do without (the coordinator log's COMMITTED and
ABORTED, a transaction's BEGIN and ADD_PARTITION before it decides, a
cursor's frame of a committed transaction's acks) may be
*deferred*: it has no write of its own and goes out at the front of the
log's next write, at a sync, or at close; a compaction drops it.

What a payload holds is its log's business: each log's replay function
decodes the payloads through ``_reader.Reader``, given each frame's
position (``replay(positions=True)``, :func:`parse`), so a payload that does
not parse is reported at its bad byte. The layout constants live in
``_redo_layout.pxd``.

Descriptors are a budget (:class:`txmq._budget.LogBudget`): a subscription keeps two
logs per partition, so a topic of thousands of partitions would otherwise
hold thousands of descriptors. A log whose descriptor the budget closed
(the least recently used idle one) reopens it on its next write, sync or
replay; a log in use is never closed under its user.
"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport uint8_t, uint32_t
from libc.string cimport memcpy

import errno
import os
import threading

from txmq.errors import CorruptLogError, StorageFullError

from _bytes cimport load_u32, store_u32, crc32c, NOGIL_THRESHOLD, pwritev_all
from libc.errno cimport errno as c_errno
from posix.uio cimport iovec

from _redo_layout cimport *
from txmq._budget cimport Budgeted
from txmq._budget import default_log_budget

SNAPSHOT = 1
# Deferred frames (RedoLog.defer) written at once when this many wait.
DEFER_MAX = 64
# Bytes of a frame before its payload: a frame at byte p of the file has its
# payload at p + FRAME_HEADER_BYTES.
FRAME_HEADER_BYTES = FRAME_HEADER_SIZE
FILE_HEADER = REDO_MAGIC.to_bytes(4, "little") + bytes([REDO_VERSION, 0, 0, 0])
assert len(FILE_HEADER) == FILE_HEADER_SIZE and FRAME_HEADER_SIZE == 9


def pwrite_all(int fd, bytes buf, Py_ssize_t pos):
    """Write all of ``buf`` at ``pos`` of ``fd`` (a short write is carried
    on; OSError as ``os.pwrite`` raises it). A write below
    ``NOGIL_THRESHOLD`` bytes (every frame but a snapshot's) keeps the GIL:
    it lands in the page cache in about a microsecond, while handing the
    GIL to another thread and taking it back costs a switch each way, and
    under load a wait behind that thread's Python work."""
    _pwrite_buf(fd, buf, pos)


# What RedoLog writes through: ``pwrite_all`` as defined here is called
# in C; one a test put in its place (to count writes, or to fail them as a
# full disk would) is called as it is.
_PWRITE_ALL = pwrite_all


cdef int _pwrite_buf(int fd, bytes buf, Py_ssize_t pos) except -1:
    cdef iovec piece
    cdef ssize_t rc
    piece.iov_base = <void *>PyBytes_AS_STRING(buf)
    piece.iov_len = PyBytes_GET_SIZE(buf)
    if piece.iov_len >= NOGIL_THRESHOLD:
        with nogil:
            rc = pwritev_all(fd, &piece, 1, pos)
    else:
        rc = pwritev_all(fd, &piece, 1, pos)
    if rc < 0:
        raise OSError(c_errno, os.strerror(c_errno))
    return 0


def payload_position_of(tuple frame):
    """The file position of a frame's payload, for ``(type, payload,
    position)`` as :func:`parse` gives it; 0 for a ``(type, payload)`` pair
    (its bytes then count from the payload's first)."""
    return payload_position(frame)


cpdef bytes frame(int frame_type, payload):
    """One encoded frame."""
    cdef const uint8_t[::1] view = payload if len(payload) else b"\0"
    cdef Py_ssize_t n = len(payload)
    if not 1 <= frame_type <= 255:
        raise ValueError(f"frame type must be 1..255, not {frame_type}")
    if n >= MAX_FRAME_BYTES:   # replay would reject it and cut everything after
        raise ValueError(f"a frame holds less than {MAX_FRAME_BYTES} bytes, not {n}")
    out = PyBytes_FromStringAndSize(NULL, FRAME_HEADER_SIZE + n)
    cdef char *p = PyBytes_AS_STRING(out)
    store_u32(p + FRAME_LENGTH_OFFSET, <uint32_t>(1 + n))
    p[FRAME_TYPE_OFFSET] = <char>frame_type
    if n:
        memcpy(p + FRAME_HEADER_SIZE, &view[0], n)
    store_u32(p + FRAME_CRC_OFFSET, crc32c(p + FRAME_TYPE_OFFSET, 1 + n))
    return out


def parse(data, Py_ssize_t start=FILE_HEADER_SIZE, bint zero_end=False):
    """Frames of ``data`` from ``start``: ``(frames, end, reason)``.

    ``frames`` lists ``(type, payload, position)``; ``end`` is where the
    valid prefix stops; ``reason`` is None at a clean end, else why the frame
    at ``end`` was rejected. With ``zero_end`` (a preallocated log) zeros
    from a frame's first byte to the end of ``data`` are a clean end.
    """
    cdef const uint8_t[::1] view = data if len(data) else b"\0"
    cdef Py_ssize_t n = len(data), pos = start
    cdef const char *p = <const char *>&view[0]
    cdef uint32_t length
    frames = []
    reason = None
    while pos < n:
        if n - pos < FRAME_HEADER_SIZE:
            reason = "torn frame header"
            break
        length = load_u32(p + pos + FRAME_LENGTH_OFFSET)
        if length == 0 and zero_end and _zeros(p + pos, n - pos):
            break
        if length < 1 or length > MAX_FRAME_BYTES:
            reason = f"bad frame length {length}"
            break
        if n - pos - FRAME_TYPE_OFFSET < length:
            reason = "torn frame"
            break
        if crc32c(p + pos + FRAME_TYPE_OFFSET, length) != load_u32(p + pos + FRAME_CRC_OFFSET):
            reason = "frame CRC mismatch"
            break
        if <uint8_t>p[pos + FRAME_TYPE_OFFSET] == 0:
            reason = "frame type 0"
            break
        frames.append((<uint8_t>p[pos + FRAME_TYPE_OFFSET],
                       PyBytes_FromStringAndSize(p + pos + FRAME_HEADER_SIZE, length - 1), pos))
        pos += FRAME_TYPE_OFFSET + length
    return frames, pos, reason


cdef bint _zeros(const char *p, Py_ssize_t n) noexcept:
    cdef Py_ssize_t i
    for i in range(n):
        if p[i]:
            return False
    return True


# Frames a log takes after a full disk refused its compaction before it is
# due again (RedoLog.try_compact).
COMPACT_RETRY_FRAMES = 256

cdef class RedoLog(Budgeted):
    """An append-only framed log file.

    ``fsync`` is the broker's mode: with ``"never"`` :meth:`sync` does
    nothing (writes still reach the page cache, so ``kill -9`` loses
    nothing that ``append`` returned). ``preallocate`` > 0 keeps that many
    bytes of zeros written ahead of the end (module docstring; not under
    ``"never"``, which never syncs).

    Compiled, with typed fields: every commit, acknowledgement and half
    message appends here. Instances keep a ``__dict__``, so a test can put
    its own ``sync`` or ``sync_to`` on one log.
    """
    cdef public str path
    cdef public str fsync
    cdef public Py_ssize_t preallocate
    cdef public object dropped           # (position, reason, bytes) of a tail replay cut, or None
    cdef public object budget
    cdef public Py_ssize_t size          # bytes of frames in the file (the zeros ahead not counted)
    cdef public Py_ssize_t allocated     # the file's length: zeros from size to here
    cdef public Py_ssize_t frames_since_snapshot
    cdef Py_ssize_t _snapshot_end        # the file's byte after its last SNAPSHOT frame (or its header)
    cdef public Py_ssize_t written       # bytes appended by this object, ever
    cdef public Py_ssize_t synced_written  # ... of which durable
    cdef int _fd
    cdef bint _shut
    cdef Py_ssize_t _retry_at            # frames: compact_due waits for this many after a refused compaction
    cdef list _deferred                  # encoded frames that go out with the next write (defer)
    cdef object _sync_lock
    cdef dict __dict__

    def __init__(self, path, fsync="commit", preallocate=0, budget=None):
        self.path = os.fspath(path)
        self.fsync = fsync
        self.preallocate = preallocate if fsync != "never" else 0
        self.dropped = None
        self.budget = budget if budget is not None else default_log_budget()
        self._fd = -1
        self.users = 1                 # (held through the opening; slot, recent: txmq._budget.Budgeted)
        self._shut = False
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            self.size = os.fstat(fd).st_size
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.allocated = self.size
        self.budget.admit(self)
        self.frames_since_snapshot = 0
        self._retry_at = 0
        self.written = 0
        self._deferred = []
        self.synced_written = 0
        self._sync_lock = threading.Lock()
        try:
            if self.size == 0:
                self._write_header()
        finally:
            self.users -= 1

    cdef int _use(self) except -1:
        """The descriptor, reopened if the budget closed it; held until
        :meth:`_unuse`."""
        self.users += 1
        self.recent = True
        if self._fd < 0:
            try:
                if self._shut:
                    raise ValueError(f"{self.path}: log is closed")
                self._fd = os.open(self.path, os.O_RDWR)
                self.budget.admit(self)
            except BaseException:
                self.users -= 1
                raise
        return self._fd

    cdef inline void _unuse(self) noexcept:
        self.users -= 1

    cpdef park(self):
        """Close the descriptor (the budget's call, no use in progress)."""
        fd = self._fd
        self._fd = -1
        if fd >= 0:
            os.close(fd)

    @property
    def parked(self):
        """Whether the budget closed the descriptor (reopened by the next use)."""
        return self._fd < 0 and not self._shut

    def _write_header(self):
        fd = self._use()
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, FILE_HEADER, 0)
        finally:
            self._unuse()
        self.size = self.allocated = self._snapshot_end = FILE_HEADER_SIZE

    def replay(self, bint positions=False):
        """Frames from the last SNAPSHOT on, as ``[(type, payload)]``, or
        with ``positions`` as ``[(type, payload, position)]`` (the frame's
        byte in the file, as :func:`parse` gives it: what a decoder of the
        payloads needs to say where a bad one is).

        A torn or corrupt tail is cut off; ``self.dropped`` then holds
        ``(position, reason, bytes_dropped)``. A bad file header raises
        :class:`CorruptLogError`.
        """
        fd = self._use()
        try:
            data = _read_all(fd, self.size)
        finally:
            self._unuse()
        if len(data) < FILE_HEADER_SIZE:
            if data.strip(b"\0"):
                self.dropped = (0, "torn file header", len(data))
            self._write_header()
            return []
        if data[:4] != FILE_HEADER[:4]:
            raise CorruptLogError(self.path, 0, f"bad redo-log magic {data[:4].hex()}")
        if data[4] != REDO_VERSION:
            raise CorruptLogError(self.path, 4, f"unknown redo-log version {data[4]}")
        frames, end, reason = parse(data, FILE_HEADER_SIZE, self.preallocate > 0)
        if reason is not None:
            self.dropped = (end, reason, len(data) - end)
            fd = self._use()
            try:
                os.ftruncate(fd, end)
            finally:
                self._unuse()
            self.allocated = end
        self.size = end
        last = 0
        self._snapshot_end = FILE_HEADER_SIZE
        for i, f in enumerate(frames):
            if f[0] == SNAPSHOT:
                last = i
                self._snapshot_end = f[2] + FRAME_HEADER_SIZE + len(f[1])
        frames = frames[last:]
        self.frames_since_snapshot = len(frames)
        if positions:
            return frames
        return [(t, payload) for t, payload, _ in frames]

    def append(self, int frame_type, payload):
        """Append one frame (to the page cache)."""
        self._write(frame(frame_type, payload))
        self.frames_since_snapshot += 1

    def append_many(self, frames):
        """Append ``[(type, payload)]`` in one write."""
        buf = b"".join([frame(t, p) for t, p in frames])
        if buf:
            self._write(buf)
            self.frames_since_snapshot += len(frames)

    def defer(self, int frame_type, payload):
        """Keep a frame that replay can do without (a crash that loses it
        costs recovery some work, never an outcome) to go out at the front
        of the next write, of :meth:`write_deferred` or of :meth:`close`:
        no write of its own. A compaction drops it (its snapshot holds what
        the frame said); :data:`DEFER_MAX` of them are written at once."""
        if self._shut:
            raise ValueError(f"{self.path}: log is closed")      # (as append)
        self._deferred.append(frame(frame_type, payload))
        if len(self._deferred) >= DEFER_MAX:
            try:
                self.write_deferred()
            except OSError:
                pass               # (a full disk: they wait for a later write)

    def write_deferred(self):
        """Write the deferred frames now (one write; none, or the log
        closed: nothing)."""
        if self._deferred and not self._shut:
            self._write(b"")

    cdef _write(self, bytes buf):
        deferred = self._deferred
        if deferred:                     # (they go first, in the same write)
            self._deferred = []
            buf = b"".join(deferred) + buf
            self.frames_since_snapshot += len(deferred)
        try:
            self._write_now(buf)
        except BaseException:
            if deferred:
                self._deferred = deferred + self._deferred
                self.frames_since_snapshot -= len(deferred)
            raise

    cdef _write_now(self, bytes buf):
        cdef Py_ssize_t end = self.size + len(buf)
        cdef int fd = self._use()
        try:
            if self.preallocate and end > self.allocated:
                self._extend(end)
            if pwrite_all is _PWRITE_ALL:
                _pwrite_buf(fd, buf, self.size)
            else:
                pwrite_all(fd, buf, self.size)
        except OSError as e:
            # Nothing of a failed append stays: the next one starts where it
            # did (and writes its zeros ahead again).
            try:
                os.ftruncate(fd, self.size)
                self.allocated = self.size
            except OSError:
                pass
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StorageFullError(self.path, len(buf), e.errno) from None
            raise
        finally:
            self._unuse()
        if end > self.allocated:         # written past the zeros ahead (a full disk took them)
            self.allocated = end
        self.size += len(buf)
        self.written += len(buf)

    cdef _extend(self, Py_ssize_t end):
        """Write zeros from the file's end past ``end``, a whole chunk
        ahead: the next sync makes them (and the new size) durable once,
        and the syncs after it rewrite blocks the file has."""
        want = end + self.preallocate
        try:
            self.allocated += os.pwrite(self._fd, bytes(want - self.allocated), self.allocated)
        except OSError as e:
            # A full disk: no zeros ahead this time (what a short write
            # left is counted above); the frame alone extends the file, and
            # the append fails only if that does not fit either.
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise

    def sync_to(self, Py_ssize_t mark):
        """Make every byte appended up to ``mark`` (a value of ``written``)
        durable. Threads waiting here together share one fdatasync (group
        commit). Nothing to do under fsync="never"."""
        if self.fsync == "never" or self.synced_written >= mark:
            return
        with self._sync_lock:
            if self.synced_written >= mark:
                return
            target = self.written
            fd = self._use()
            try:
                os.fdatasync(fd)
            finally:
                self._unuse()
            self.synced_written = target

    def sync(self, force=False):
        """Write the deferred frames, then fdatasync unless the mode is
        ``"never"`` (``force`` syncs anyway)."""
        self.write_deferred()
        if force or self.fsync != "never":
            fd = self._use()
            try:
                os.fdatasync(fd)
            finally:
                self._unuse()

    def compact(self, snapshot_payload):
        """Replace the log with one SNAPSHOT frame, atomically; on a full
        disk StorageFullError, and the log is as it was."""
        with self._sync_lock:
            self._compact(snapshot_payload)
        self._retry_at = 0             # (a refused compaction's wait ends with any that succeeds)

    def compact_due(self, frames, Py_ssize_t nbytes=-1):
        """Whether ``frames`` frames since the last snapshot (or, with
        ``nbytes`` >= 0, that many bytes of frames after it) call for a
        compaction (:meth:`try_compact`), counting from the last one a
        full disk refused, if any, so a full disk is not retried per frame."""
        return ((self.frames_since_snapshot >= frames
                 or (nbytes >= 0 and self.size - self._snapshot_end >= nbytes))
                and self.frames_since_snapshot >= self._retry_at)

    @property
    def bytes_since_snapshot(self):
        """Bytes of frames after the last SNAPSHOT frame (or the header)."""
        return self.size - self._snapshot_end

    def defer_compaction(self, retry_frames=COMPACT_RETRY_FRAMES):
        """:meth:`compact_due` stays false for ``retry_frames`` more frames
        (the owner could not compact now: a full disk)."""
        self._retry_at = self.frames_since_snapshot + retry_frames

    def try_compact(self, snapshot_payload, retry_frames=COMPACT_RETRY_FRAMES):
        """:meth:`compact` as housekeeping: False (the log unchanged, still
        valid) when the disk is full, and :meth:`compact_due` stays false
        for ``retry_frames`` more frames."""
        try:
            self.compact(snapshot_payload)
        except StorageFullError:
            self.defer_compaction(retry_frames)
            return False
        self._retry_at = 0
        return True

    def _compact(self, snapshot_payload):
        tmp = self.path + ".compact"
        buf = FILE_HEADER + frame(SNAPSHOT, snapshot_payload)
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StorageFullError(tmp, len(buf), e.errno) from None
            raise
        try:
            n = 0
            view = memoryview(buf)
            while n < len(buf):
                n += os.write(fd, view[n:])
            if self.fsync != "never":
                os.fdatasync(fd)
        except BaseException as e:
            os.close(fd)
            os.unlink(tmp)
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StorageFullError(tmp, len(buf), e.errno) from None
            raise
        os.replace(tmp, self.path)
        if self.fsync != "never":
            sync_dir(os.path.dirname(self.path))
        self._use()                    # the log keeps its slot: the new file takes the old one's
        try:
            old, self._fd = self._fd, fd
            os.close(old)
        finally:
            self._unuse()
        self.size = self._snapshot_end = len(buf)
        self.allocated = len(buf)        # (the next append writes the zeros ahead)
        self.frames_since_snapshot = 1
        self._deferred = []              # (what they said, the snapshot holds)
        self.written += len(buf)
        if self.fsync != "never":
            self.synced_written = self.written

    def close(self):
        """Write the deferred frames (a full disk: left out, as a crash
        would) and close the file."""
        if self._shut:
            return
        try:
            self.write_deferred()
        except OSError:
            pass
        self._shut = True
        self.budget.leave(self)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    @property
    def closed(self):
        return self._shut


def _read_all(int fd, Py_ssize_t size):
    chunks = []
    pos = 0
    while pos < size:
        b = os.pread(fd, min(size - pos, 1 << 24), pos)
        if not b:
            break
        chunks.append(b)
        pos += len(b)
    return b"".join(chunks)


def sync_dir(path):
    """fsync a directory, so the names created or renamed in it are durable."""
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
