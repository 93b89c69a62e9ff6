"""A partition's log: its segments in offset order, their offset and time
indexes, the recovery point, durability and lock-free reads.

Files (``txmq.storage.layout``; docs/FORMAT.md has the bytes): the
``<base>.log`` segments with their ``<base>.index`` and
``<base>.timeindex`` (appended as the log is checkpointed, rewritten when a
segment is sealed), and ``recovery-point``: the segment, position and next
offset below which the log was checked and (in the fsync modes that
promise it) made durable. Opening (``txmq.storage.loader``, writer mode)
scans only from there, so reopening costs the same however long the log
is; the recovery point is rewritten every :data:`CHECKPOINT_BYTES`
appended, on every roll and on close.

:class:`SegmentLog` is the log alone; ``txmq.storage.partition.Partition``
extends it with the transaction buffer and the producer state, and drives
the methods marked "partition lock held". Reads take no lock: a reader
only looks below :attr:`SegmentLog.end_offset`, which moves after the bytes
are in place, and a read that retention raced is retried.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading

from txmq._batch import BatchSpec
from txmq._budget import SegmentBudget, default_budget
from txmq._segment import Segment, SegmentClosedError
from txmq._redolog import sync_dir
from txmq.errors import BrokerClosedError, CorruptLogError, MessageTooLargeError, StorageFullError
from txmq.storage.index import append_index, index_problem, rewrite_index
from txmq.files import write_atomic
from txmq.storage.layout import (INDEX_SUFFIX, QUARANTINE_FILE, RECOVERY_POINT_FILE, SEGMENT_FILES, SEGMENT_SUFFIX,
                                 TIMEINDEX_SUFFIX, TXNINDEX_SUFFIX, quarantine_bytes, recovery_point_bytes,
                                 segment_file)
from txmq.storage.loader import WRITER, Dropped, LogLoader, Quarantined

log = logging.getLogger("txmq.partition")

# Bytes appended between two recovery points; bounds the scan on reopen.
CHECKPOINT_BYTES = 16 * 1024 * 1024
# Unless fsync="never", writeback of the active segment is started (not
# waited for) each time this many bytes were appended since it last was, as
# SQLite's and PostgreSQL's writers do: the disk then writes while the
# producer goes on, and the sync of a checkpoint or a commit waits only for
# what is still in flight, not for every byte since the last sync.
WRITEBACK_BYTES = 1024 * 1024
PAGE_MASK = ~(mmap.PAGESIZE - 1)


class SegmentLog:
    """The segments of one partition directory, opened for writing.
    ``name`` ("topic/partition") names it in errors. What opening cuts off
    or rebuilds, and an index rebuilt later, is logged and kept in
    :attr:`dropped`."""

    def __init__(self, path: str, name: str, *, fsync: str, segment_bytes_max: int, max_message_bytes: int,
                 index_interval_bytes: int, clock, budget=None):
        self.path = path
        self.name = name
        self.fsync = fsync
        self.segment_bytes_max = segment_bytes_max
        self.max_message_bytes = max_message_bytes
        self.index_interval_bytes = index_interval_bytes
        self.clock = clock
        self.budget = budget             # the SegmentBudget its segments open through (None: the process's)
        self.lock = threading.Lock()     # the partition lock (module docstring)
        self._sync_lock = threading.Lock()
        self._synced_offset = 0          # every offset below is durable ...
        self._synced_base = -1           # ... and so is this segment ...
        self._synced_pos = 0             # ... up to this position
        self.dropped: list[Dropped] = []  # what recovery cut off, for stats and logs
        self._segments: tuple = ()
        self._checkpoint_pos = 0         # position in the active segment of the last recovery point
        self._writeback_pos = 0          # ... up to which writeback was started (or synced)
        self._due_pos = 0                # ... at which an append calls _at_due
        self._index_written = {}         # segment base -> (offset entries, time entries) on disk
        self._scrub_next = -1            # the segment scrub_indexes checked last
        self.last_publish_time = 0
        self._quarantine_saved: list = []   # the ranges quarantine.json holds
        # Folders created with this log whose entries are not durable yet:
        # synced before the first sync that claims anything in them.
        self.dirs_to_sync: tuple = ()
        self.changed = False             # appended to (or retention ran) since it was opened

    def _sync_new_dirs(self) -> None:
        dirs, self.dirs_to_sync = self.dirs_to_sync, ()
        for d in dirs:
            sync_dir(d)

    def _file(self, base: int, suffix: str) -> str:
        return segment_file(self.path, base, suffix)

    # -- what is there ----------------------------------------------------------

    @property
    def segments(self) -> tuple:
        return self._segments

    @property
    def active(self) -> Segment:
        return self._segments[-1]

    @property
    def start_offset(self) -> int:
        """The first offset still in the log (retention moves it up)."""
        return self._segments[0].base_offset

    @property
    def end_offset(self) -> int:
        """The log end offset: the offset the next message will get."""
        return self._segments[-1].next_offset

    def segment_base(self, offset: int) -> int:
        """The base offset of the segment holding ``offset`` (the first
        segment's for an offset below the log start)."""
        segs = self._segments
        for seg in reversed(segs):
            if seg.base_offset <= offset:
                return seg.base_offset
        return segs[0].base_offset

    # -- opening -----------------------------------------------------------------

    def _open(self) -> None:
        """Load the segments (``txmq.storage.loader``, writer mode: a torn
        tail is cut, a bad index rebuilt, a gap refused with
        CorruptLogError), then make what was kept durable and claim it with
        a recovery point. An empty directory gets segment 0."""
        os.makedirs(self.path, exist_ok=True)
        loader = LogLoader(self.path, WRITER, segment_bytes_max=self.segment_bytes_max,
                           index_interval_bytes=self.index_interval_bytes, fsync=self.fsync, report=self.report,
                           budget=self.budget)
        segments = loader.load()
        self._index_written = loader.index_written
        self._quarantine_saved = None if loader.saved or loader.quarantined else []
        if not segments:
            self._segments = (self._new_segment(0),)
            self._write_recovery_point()
            return
        self._segments = tuple(segments)
        self.last_publish_time = max((s.last_publish_time for s in segments), default=0)
        if self.fsync != "never":
            # What recovery kept past the recovery point may have lived only
            # in the page cache of the process that died: durable first,
            # then claimed. (Below it, the recovery point says it is.)
            resume = loader.resume
            start = resume[1] if resume is not None and resume[0] == self.active.base_offset else 0
            self.active.sync(start)
        self._synced_offset = self.end_offset
        self._write_recovery_point()
        self._save_quarantine()
        if os.environ.get("TXMQ_DEBUG") == "1":
            self.verify()

    def _new_segment(self, base: int) -> Segment:
        """Create segment ``base``, writable, with its empty indexes and
        .txnindex (a segment's files are created together: a missing one
        is a lost one, and is rebuilt)."""
        seg = Segment(self._file(base, SEGMENT_SUFFIX), base, self.segment_bytes_max, True,
                      self.index_interval_bytes, self.budget)
        seg.recover(0, base)
        for suffix in (INDEX_SUFFIX, TIMEINDEX_SUFFIX, TXNINDEX_SUFFIX):
            _touch(self._file(base, suffix))
        self._index_written[base] = (0, 0)
        return seg

    def verify(self) -> None:
        """O(n): re-check every batch of every segment and the indexes;
        raise CorruptLogError at the first fault. Run after every open when
        TXMQ_DEBUG=1 (the test suite sets it)."""
        prev_end = None
        for seg in self._segments:
            if prev_end is not None and seg.base_offset != prev_end:
                raise CorruptLogError(seg.path, 0, f"segment starts at {seg.base_offset}, previous ends at {prev_end}")
            bad = seg.verify()
            if bad is not None:
                raise CorruptLogError(seg.path, bad[0], bad[1])
            problem = index_problem(seg, *seg.index_entries())
            if problem is not None:
                self._repair_index(seg, f"{problem[0]} entry {problem[1]}: {problem[2]}")
            prev_end = seg.next_offset

    def scrub_indexes(self, limit: int | None = 1) -> int:
        """Check the indexes of ``limit`` segments (None: all), in turn
        from where the last call stopped, against every batch they
        name (``index.index_problem``), and rebuild a wrong one. The broker
        runs one segment per partition every few seconds, so a damaged
        index (what ``txmq check`` calls repairable) is rebuilt without
        making every open read the whole log. Returns how many it rebuilt."""
        repaired = 0
        with self.lock:
            segs = self._segments
            for _ in range(len(segs) if limit is None else min(limit, len(segs))):
                self._scrub_next = (self._scrub_next + 1) % len(segs)
                seg = segs[self._scrub_next]
                problem = index_problem(seg, *seg.index_entries())
                if problem is not None:
                    self._repair_index(seg, f"{problem[0]} entry {problem[1]}: {problem[2]}")
                    repaired += 1
        return repaired

    def _repair_index(self, seg: Segment, reason: str) -> None:
        self.report(Dropped(self._file(seg.base_offset, INDEX_SUFFIX), 0, f"{reason}; index rebuilt"))
        seg.reindex()
        self._rewrite_index(seg)

    def report(self, dropped: Dropped) -> None:
        """Keep and log what opening cut off or an index rebuild replaced."""
        self.dropped.append(dropped)
        log.warning("txmq: truncated %s", dropped)

    # -- quarantine ------------------------------------------------------------------

    def quarantined(self) -> list:
        """The quarantined ranges of the log (``loader.Quarantined``), in
        offset order: bytes that fail their checks in the middle of the log,
        whose offsets are lost and which readers skip. Found by opening, or
        by the first read below a recovery point that met them."""
        return [Quarantined(seg.base_offset, *q) for seg in self._segments for q in seg.quarantined()]

    def segment_path(self, base: int) -> str:
        """The path of segment ``base``'s file."""
        return self._file(base, SEGMENT_SUFFIX)

    def lost_offsets(self, start: int, end: int) -> list:
        """[(first, end)] of the quarantined offsets in [start, end)."""
        return [(max(q.first_offset, start), min(q.end_offset, end)) for q in self.quarantined()
                if q.first_offset < end and q.end_offset > start]

    def _save_quarantine(self) -> None:
        """Rewrite ``quarantine.json`` when the quarantined ranges changed
        (partition lock held, or opening/closing); a range found by a read
        is logged here, once."""
        now = self.quarantined()
        if now == self._quarantine_saved:
            return
        for q in now:
            if self._quarantine_saved is None or q not in self._quarantine_saved:
                log.warning("txmq: %s: quarantined %s at bytes %d..%d: offsets %d..%d lost (%s)", self.name,
                            self._file(q.segment, SEGMENT_SUFFIX), q.position, q.end_position, q.first_offset,
                            q.end_offset - 1, q.reason)
        path = os.path.join(self.path, QUARANTINE_FILE)
        if now:
            try:
                write_atomic(path, quarantine_bytes(now), fsync=self.fsync != "never")
            except StorageFullError as e:
                log.warning("txmq: %s: %s not written (%s); written again later", self.name, QUARANTINE_FILE, e)
                return
        else:
            _unlink(path)
        self._quarantine_saved = now

    # -- recovery point and index files (partition lock held) -----------------------

    def _write_recovery_point(self) -> None:
        seg = self.active
        raw = recovery_point_bytes(seg.base_offset, seg.size, seg.next_offset, self.fsync)
        fd = os.open(os.path.join(self.path, RECOVERY_POINT_FILE), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, raw, 0)
        finally:
            os.close(fd)
        self._checkpoint_pos = self._writeback_pos = seg.size
        self._set_due()

    def _set_due(self) -> None:
        due = self._checkpoint_pos + CHECKPOINT_BYTES
        if self.fsync != "never":
            due = min(due, self._writeback_pos + WRITEBACK_BYTES)
        self._due_pos = due

    def _rewrite_index(self, seg: Segment) -> None:
        self._index_written[seg.base_offset] = rewrite_index(self.path, seg)

    def _append_index(self, seg: Segment) -> None:
        self._index_written[seg.base_offset] = append_index(self.path, seg,
                                                            self._index_written.get(seg.base_offset, (0, 0)))

    # -- appending (partition lock held) -------------------------------------------

    def _too_large_error(self, spec: BatchSpec) -> MessageTooLargeError:
        """Why this log refuses ``spec``: a message above
        ``max_message_bytes``, or a batch larger than a segment."""
        if spec.max_message_bytes > self.max_message_bytes:
            return MessageTooLargeError(spec.max_message_bytes, self.max_message_bytes)
        return MessageTooLargeError(spec.encoded_size(), self.segment_bytes_max)

    def _closed_error(self) -> BrokerClosedError:
        return BrokerClosedError(f"partition {self.name} is closed")

    def _append_locked(self, spec: BatchSpec, flags: int, txn_hi: int, txn_lo: int, producer_id: int,
                       producer_epoch: int, base_sequence: int) -> int:
        """Write one batch into the active segment, rolling to a new one when
        it is full; return its base offset. Its publish time is now, but
        never before the last batch's. The caller records what the batch
        changes, then calls :meth:`_at_due` once the active segment reached
        ``_due_pos``."""
        now = max(self.clock(), self.last_publish_time)
        seg = self._segments[-1]
        base = seg.append(spec, flags, txn_hi, txn_lo, producer_id, producer_epoch, base_sequence, now)
        if base < 0:
            self._roll()
            seg = self._segments[-1]
            base = seg.append(spec, flags, txn_hi, txn_lo, producer_id, producer_epoch, base_sequence, now)
            assert base >= 0, "a batch within segment_bytes_max fits an empty segment"
        self.last_publish_time = now
        self.changed = True
        return base

    def _check_files(self) -> None:
        """Stop with CorruptLogError when another process removed the
        active segment or truncated it under its mapping: appending to it
        would lose data (partition lock held; at every roll, checkpoint
        and close)."""
        seg = self.active
        seg.check_mapping()
        if seg.removed:
            raise CorruptLogError(seg.path, 0, "the segment file was removed by another process while this "
                                               "broker had it open; the partition stops taking writes")

    def _roll(self) -> None:
        """Seal the active segment and start the next, with a recovery
        point there (a subclass extends it to write what it keeps as of
        the same log end)."""
        self._check_files()
        old = self.active
        old.seal()
        if self.fsync != "never":
            self._sync_new_dirs()
            old.sync_file()      # data and the trimmed size, before the roll is recorded
        self._rewrite_index(old)
        seg = self._new_segment(old.next_offset)
        if self.fsync != "never":
            sync_dir(self.path)
        self._segments = self._segments + (seg,)
        self._write_recovery_point()
        self._save_quarantine()

    def _at_due(self) -> None:
        """An append reached ``_due_pos`` (partition lock held): a
        checkpoint, or else the writeback of the whole pages appended since
        the last one started (the page the writer is in stays dirty, so its
        next store takes no fault). So the recovery point stays within
        :data:`CHECKPOINT_BYTES` of the log end and, unless fsync="never",
        writeback within :data:`WRITEBACK_BYTES`."""
        seg = self._segments[-1]
        if seg.size - self._checkpoint_pos >= CHECKPOINT_BYTES:
            self._checkpoint()
            return
        end = seg.size & PAGE_MASK
        if end > self._writeback_pos:    # (not yet a whole page past it: due again one interval on)
            seg.start_writeback(self._writeback_pos, end)
            self._writeback_pos = end
        self._set_due()

    def _checkpoint(self) -> None:
        """Make the bytes so far durable (unless fsync="never"), append
        their index entries and record a recovery point there (a subclass
        extends it to write what it keeps as of the same log end), so
        opening scans only what came after."""
        self._check_files()
        seg = self.active
        if self.fsync != "never":
            self._sync_new_dirs()
            seg.sync(self._checkpoint_pos, seg.size)
        self._append_index(seg)
        self._write_recovery_point()
        self._save_quarantine()

    def sync_to(self, offset: int) -> None:
        """Make every offset below ``offset`` durable. Threads that wait here
        together share one msync (group commit), and each msync covers only
        the bytes written since the previous one."""
        if self._synced_offset >= offset:
            return
        with self._sync_lock:
            if self._synced_offset >= offset:
                return
            segs = self._segments
            if not segs:
                raise self._closed_error()
            if self.dirs_to_sync:
                self._sync_new_dirs()
            active = segs[-1]
            end_offset, end_pos = active.next_offset, active.size
            try:
                for seg in reversed(segs[:-1]):
                    if seg.next_offset <= self._synced_offset:
                        break
                    if not seg.closed:        # deleted by retention: nothing to sync
                        seg.sync()
                start = self._synced_pos if self._synced_base == active.base_offset else 0
                active.sync(start, end_pos)
            except SegmentClosedError:
                raise BrokerClosedError(f"partition {self.name} closed during a sync") from None
            self._synced_offset = end_offset
            self._synced_base, self._synced_pos = active.base_offset, end_pos

    # -- reading (no lock) ---------------------------------------------------------

    def segment_for(self, offset: int):
        """(segment, position) of the batch holding ``offset`` or the first
        batch after it; (None, -1) when ``offset`` is at or past the end."""
        return _retrying(self._segment_for, offset)

    def _segment_for(self, offset: int):
        segs = self._segments
        lo, hi = 0, len(segs)
        while lo < hi:
            mid = (lo + hi) // 2
            if segs[mid].base_offset <= offset:
                lo = mid + 1
            else:
                hi = mid
        i = max(0, lo - 1)
        for seg in segs[i:]:
            pos = seg.locate(max(offset, seg.base_offset))
            if pos >= 0:
                return seg, pos
        return None, -1

    def next_batch(self, seg: Segment, pos: int):
        """The (segment, position) after the batch at ``pos``, past
        quarantined bytes (their offsets are lost)."""
        end = seg.next_position(pos)
        if end < seg.size:
            return seg, end
        segs = self._segments
        for i, s in enumerate(segs):
            if s is seg and i + 1 < len(segs):
                for nxt in segs[i + 1:]:
                    first = nxt.first_position()
                    if first < nxt.size:
                        return nxt, first
                return None, -1
        return None, -1

    def headers(self, start: int, end: int):
        """The headers of the batches holding an offset in [start, end)."""
        seg, pos = self.segment_for(start)
        while seg is not None:
            info = seg.batch_at(pos)
            if info.base_offset >= end:
                return
            yield info
            seg, pos = self.next_batch(seg, pos)

    def batch_starting_at(self, offset: int):
        """The header of the batch whose base offset is ``offset``, or None."""
        seg, pos = self.segment_for(offset)
        if seg is not None:
            info = seg.batch_at(pos)
            if info.base_offset == offset:
                return info
        return None

    def read(self, offset: int, max_messages: int = 1000, end_offset: int | None = None):
        """Messages from ``offset`` as (offset, key, value, headers,
        event_time, publish_time, batch) tuples, below ``end_offset``."""
        out = []
        limit = self.end_offset if end_offset is None else end_offset
        seg, pos = self.segment_for(offset)
        while seg is not None and len(out) < max_messages:
            info = seg.batch_at(pos)
            if info.base_offset >= limit:
                break
            if not info.is_control:
                take = min(max_messages - len(out), limit - max(offset, info.base_offset))
                for m in seg.messages(pos, offset, take):
                    out.append(m + (info.publish_time, info))
            seg, pos = self.next_batch(seg, pos)
        return out

    def find_time(self, timestamp_ms: int) -> int:
        """First offset published at or after ``timestamp_ms`` (end if none)."""
        return _retrying(self._find_time, timestamp_ms)

    def _find_time(self, timestamp_ms: int) -> int:
        off = offset_for_time(self._segments, timestamp_ms)
        return self.end_offset if off is None else off

    # -- removing and closing (partition lock held) -----------------------------------

    def _detach_first(self) -> Segment:
        """Take the first segment out of the log (readers stop finding it);
        :meth:`_delete_segment` it once the new log start is published."""
        seg, self._segments = self._segments[0], self._segments[1:]
        self.changed = True
        return seg

    def _delete_segment(self, seg: Segment) -> None:
        """Close a detached segment and delete its files."""
        seg.close(trim=False)
        for suffix in SEGMENT_FILES:
            _unlink(self._file(seg.base_offset, suffix))
        self._index_written.pop(seg.base_offset, None)

    def _seal_active(self) -> None:
        """Make the active segment durable, trim it, rewrite its indexes and
        record a recovery point at its end (closing)."""
        self._check_files()
        seg = self.active
        if self.fsync != "never":
            self._sync_new_dirs()
            seg.sync()
        seg.seal()
        self._rewrite_index(seg)
        self._write_recovery_point()
        self._save_quarantine()

    def _close_segments(self) -> None:
        """Unmap every segment; the log is closed after."""
        for s in self._segments:
            s.close()
        self._segments = ()


def segment_budget(open_files_max: int | None) -> SegmentBudget:
    """The budget of open segments for an ``open_files_max`` option
    (``txmq.options.open_files_option``): the process's shared one for
    None, else one of its own."""
    return default_budget() if open_files_max is None else SegmentBudget(open_files_max)


def _retrying(fn, arg):
    """Run a lock-free read again when retention closed a segment under it
    (the next attempt sees the new segment list)."""
    for _ in range(100):
        try:
            return fn(arg)
        except SegmentClosedError:
            continue
    return fn(arg)


def _touch(path: str) -> None:
    open(path, "ab").close()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def offset_for_time(segments, timestamp_ms: int) -> int | None:
    """The first offset published at or after ``timestamp_ms`` in
    ``segments`` (in offset order), through each one's time index; None
    when every batch was published before it (Kafka's offsetsForTimes
    answering null)."""
    for seg in segments:
        if seg.size and seg.last_publish_time >= timestamp_ms:
            off = seg.find_time(timestamp_ms)
            if off >= 0:
                return off
    return None
