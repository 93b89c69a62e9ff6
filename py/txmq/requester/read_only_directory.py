"""Read-only access to a data directory from another process (docs/ARCHITECTURE.md).

``txmq.readonly.open(path)`` maps the segments and the ``readview`` file of
each partition and reads exactly the committed prefix the writer has
published, without taking ``<data>/LOCK``, without writing, truncating or
creating a file, whether a writer holds the directory or not. The PySpark
source and CLI inspection build on it.

Where a partition's view comes from (docs/FORMAT.md, "Read view" and
"Opening a partition"):

1. A process holds the lock and the ``readview`` file's newest whole slot
   says LIVE or CLOSED: the slot. The reader takes the slot, then reads
   the ``.txnindex`` files (aborted transactions), then maps the segments,
   then reads the slot again: if the writer reopened the partition
   meanwhile (a new epoch, or RECOVERING) it starts over, since recovery
   may rewrite ``.txnindex`` files. Bytes and abort entries are published
   before the slot that vouches for them, so nothing read below the slot's
   log end is torn, and every aborted transaction with data below its
   maxReadPosition is in a ``.txnindex``. Files are never scanned under a
   live writer: it may trim a segment under the scan.
2. No process holds the lock (the writer closed, or died): the segments
   are walked as the next opening will walk them (``txmq.storage.loader``
   in read-only mode: from the recovery point, a torn or corrupt tail
   ends the view where opening would cut it, a gap raises
   :class:`~txmq.errors.CorruptLogError` as opening does). When the log so
   loaded holds everything a LIVE or CLOSED slot vouches for, the slot's
   transaction state is taken (no transaction open below its
   maxReadPosition, the aborted ones in the ``.txnindex`` files) and the
   batch headers after its maxReadPosition are replayed, so a transaction
   without a marker holds maxReadPosition back at its first offset, as the
   next writer would until it aborts it (``source``: "readview" after a
   clean close, "readview+scan" after a writer died). Otherwise (no file,
   a bad magic, RECOVERING: a writer died while opening; or a log cut
   short of the slot) the transaction buffer is rebuilt as opening
   rebuilds it, from ``txnbuffer.snap`` (when its CRC and offset check)
   plus a replay of the batch headers after it (``source``: "scan");
   ``.txnindex`` files are not trusted then: a writer that died in
   recovery may have left them half rewritten. Such a view is kept while
   the slot stays the same.
3. A process holds the lock and there is no usable slot (it is opening
   the partition): wait up to ``wait_s`` for a slot, then raise
   :class:`~txmq.errors.DataDirLockedError`.

Whether a process holds the lock is read from ``/proc/locks`` (the flock
on ``LOCK``'s inode), else from the pid written in ``LOCK``. Segments are
mapped read-only; a segment that retention deletes while it is mapped stays
readable until its last view (an Arrow array, a memoryview) is released.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from dataclasses import dataclass

from txmq._batch import FLAG
from txmq._segment import Segment
from txmq._redolog import FILE_HEADER, SNAPSHOT, parse as parse_frames
from txmq._txn import AbortSet, OngoingQueue
from txmq._txnlog import ABORTED, ABORTING, COMMITTED, COMMITTING, OPEN, PREPARED, replay_coordinator, replay_pending
from txmq.requester.arrow_scan import arrow_batches
from txmq.files import read_json
from txmq.storage.cursor import replay as replay_cursor
from txmq.storage.datadir import lock_files
from txmq.errors import (CorruptLogError, DataDirLockedError, DataLossError, InvalidArgumentError,
                         PartitionNotFoundError, TopicNotFoundError)
from txmq.message import MessageId
from txmq._readview import RV_CLOSED, RV_LIVE, RV_RECOVERING
from txmq.storage.delivery import ISOLATIONS, backlog, never_delivered, open_transactions, read_limit
from txmq.storage.layout import (QUARANTINE_FILE, READVIEW_FILE, TXNBUF_FILE, TXNINDEX_SUFFIX, READVIEW_TRIES, ReadView,
                                 read_quarantine, read_readview, read_readview_file, read_txn_snapshot, segment_bases,
                                 segment_file, txnindex_entries)
from txmq.storage.loader import READ_ONLY, LogLoader, Quarantined, open_read_only, published_segments
from txmq.storage.log import offset_for_time, segment_budget
from txmq.storage.topic import Topic
from txmq.options import open_files_option
from txmq.storage.txnbuffer import replay_txn_header
from txmq.transactions import decision
from txmq.transactions.records import TxnID

log = logging.getLogger("txmq.readonly")

__all__ = ["ReadOnlyDirectory", "ReadView", "open", "ISOLATIONS"]

GATHER_BELOW = 64      # rows: read_arrow copies a smaller batch together with its neighbours
builtin_open = open           # this module defines open(path): the reader's own verb
_POLL_S = 0.005               # between looks at a readview that is being recovered
HOLDER_TTL_S = 1.0            # how long a live owner seen stays taken as live (ReadOnlyDirectory.writer_live)
TRANSACTIONAL = FLAG["transactional"]
MARKER_ABORT = FLAG["marker_abort"]

def writer_pid(path) -> int | None:
    """The pid of the process that owns the data directory at ``path``
    (holds the flock on the directory or on its ``LOCK``, see
    :class:`txmq.storage.datadir.DirLock`; 0 when one does but its pid is not
    visible here), or None when none does. Never takes the lock: a failed
    try would make a starting writer fail."""
    ids = set()
    for name in lock_files(os.fspath(path)):
        try:
            st = os.stat(name)
        except FileNotFoundError:
            continue
        ids.add(f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}")
    if not ids:
        return None
    try:
        with builtin_open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return _pid_alive(os.path.join(os.fspath(path), "LOCK"))
    for line in lines:
        parts = line.split()
        if "->" in parts or len(parts) < 6 or parts[1] != "FLOCK":
            continue      # "->": a waiter, not a holder
        if parts[5] in ids:
            return int(parts[4]) if parts[4].isdigit() else 0
    return None


def _pid_alive(lock: str) -> int | None:
    try:
        with builtin_open(lock, "rb") as f:
            pid = int(f.read(64).strip() or 0)
    except (OSError, ValueError):
        return None
    if pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return pid



@dataclass
class _Seg:
    """A segment mapped for one view: read its batches below ``size``."""

    base: int
    segment: Segment
    size: int
    next_offset: int


class PartitionView:
    """One consistent view of a partition: its offsets, its mapped
    segments, and the aborted transactions with data in them.

    A view taken from a read view slot (``source`` "readview") has its
    offsets from the slot at once, and maps its segments and reads its
    aborted transactions when something first needs them (``segments``,
    ``aborted``, any read), as a fresh view of the partition would then
    find them, clipped to this view's range: so the offsets of thousands
    of partitions cost a read of their ``readview`` files and nothing
    more. Should the files then end short of the slot (damage after a
    clean close), the view ends where they do."""

    def __init__(self, topic: str, partition: int, log_start: int, log_end: int, max_read_position: int,
                 source: str, segments, aborted, epoch: int = 0, bases=None, directory: str = "", *, load=None,
                 published=None):
        self.topic = topic
        self.partition = partition
        self.log_start = log_start
        self.log_end = log_end
        self.max_read_position = max_read_position
        self.source = source                 # "readview", "readview+scan", "scan" or "empty"
        self.epoch = epoch
        self._segments = segments
        self._bases = bases if bases is not None or segments is None else [s.base for s in segments]
        self._aborted = aborted
        self._load = load                    # fills segments, bases and aborted on first need
        self._published = published          # the slot a lazy view was taken from
        self.directory = directory           # the partition's folder

    def _loaded(self) -> None:
        if self._load is not None:
            load, self._load = self._load, None
            load(self)

    @property
    def segments(self) -> list:
        self._loaded()
        return self._segments

    @property
    def bases(self) -> list:
        self._loaded()
        return self._bases

    @property
    def aborted(self) -> AbortSet:
        self._loaded()
        return self._aborted

    @aborted.setter
    def aborted(self, value: AbortSet) -> None:
        self._aborted = value

    def disk_usage(self) -> tuple:
        """(bytes, segments) of the log this view covers: from the mapped
        segments, or (a view not loaded yet) from the slot and the sizes of
        the sealed segment files, without mapping anything."""
        rv = self._published
        if self._load is None or rv is None:
            return sum(s.size for s in self.segments), len(self.segments)
        if rv.log_start == rv.active_base:
            return rv.active_size, 1
        sealed = [b for b in segment_bases(self.directory) if rv.log_start <= b < rv.active_base]
        return (rv.active_size + sum(os.path.getsize(segment_file(self.directory, b)) for b in sealed),
                len(sealed) + 1)

    def adopt(self, fresh: "PartitionView") -> None:
        """Take the segments and aborted transactions of ``fresh``, a view
        of the same partition taken now, keeping this view's range (clipped
        to where ``fresh`` ends, and to its log start: retention may have
        deleted segments since)."""
        self._segments, self._bases, self._aborted = fresh.segments, fresh.bases, fresh.aborted
        self.log_start = max(self.log_start, fresh.log_start)
        self.log_end = min(self.log_end, fresh.log_end)
        self.max_read_position = min(self.max_read_position, fresh.max_read_position)
        self.log_start = min(self.log_start, self.log_end)

    def __repr__(self) -> str:
        return (f"PartitionView({self.topic!r}, {self.partition}, {self.log_start}..{self.log_end}, "
                f"max_read_position={self.max_read_position}, source={self.source!r})")

    def batches(self, start: int, limit: int, lost_cb=None):
        """``(segment, position, BatchInfo)`` of every batch (markers too)
        that holds an offset in [start, limit), in offset order. Offsets in
        quarantined bytes are passed over: ``lost_cb(first, end, segment
        path, byte)`` is told of each such run in [start, limit)."""
        if start >= limit or not self.segments:
            return
        i = max(0, bisect.bisect_right(self.bases, start) - 1)
        expected = start
        for s in self.segments[i:]:
            if s.base >= limit:
                break
            seg = s.segment
            pos = seg.locate(max(start, s.base)) if s.size else -1
            while 0 <= pos < s.size:
                info = seg.batch_at(pos)
                if info.base_offset > expected and lost_cb is not None:
                    self._lost(seg, expected, min(info.base_offset, limit), lost_cb)
                if info.base_offset >= limit:
                    return
                yield seg, pos, info
                expected = info.next_offset
                pos = seg.next_position(pos)      # past quarantined bytes: their offsets are lost
        if expected < min(limit, self.log_end) and lost_cb is not None:
            self._lost(self.segments[-1].segment, expected, min(limit, self.log_end), lost_cb)

    def _lost(self, seg, first: int, end: int, lost_cb) -> None:
        where = [(s.segment.path, q[0]) for s in self.segments for q in s.segment.quarantined()
                 if q[2] < end and q[3] > first]
        path, pos = where[0] if where else (seg.path, None)
        lost_cb(first, end, path, pos)

    def quarantined(self) -> list:
        """The quarantined ranges of this partition as dicts (segment,
        position, end_position, first_offset, end_offset, reason, path):
        those its ``quarantine.json`` lists and those this view's reads and
        scans found, within the view's log. A lazy view not loaded yet
        reports the saved ones only (it maps nothing for this)."""
        found = {(q.segment, q.position): q for q in _saved_quarantine(self.directory)}
        for s in (self._segments if self._load is not None else self.segments) or ():
            for q in s.segment.quarantined():
                found[(s.base, q[0])] = Quarantined(s.base, *q)
        return [q.as_dict() | {"path": segment_file(self.directory, q.segment)}
                for _, q in sorted(found.items()) if self.log_start <= q.first_offset < self.log_end]

    def lost(self, start: int = 0, end: int | None = None) -> list:
        """[(first, end)] of the offsets in [start, end) this view's
        segments hold in quarantined bytes (found so far: by opening, or by
        a read that met them)."""
        end = self.log_end if end is None else end
        return [(max(q[2], start), min(q[3], end)) for s in self.segments for q in s.segment.quarantined()
                if q[2] < end and q[3] > start]

    def _loss_cb(self, fail: bool):
        def lost(first, end, path, pos):
            if fail:
                raise DataLossError(self.topic, self.partition, first, end, f"offsets {first}..{end - 1} are "
                                    f"quarantined (their bytes fail their checks)", path=path, position=pos,
                                    hint="read with fail_on_data_loss=False to skip them")
            log.warning("txmq: %s/%d: offsets %d..%d skipped: quarantined in %s at byte %s", self.topic,
                        self.partition, first, end - 1, path, pos)
        return lost

    def limit(self, isolation: str, end: int | None, out_of_order: bool = False) -> int:
        """Where a read stops: maxReadPosition under ``read_committed``, the
        log end under ``read_uncommitted`` or ``out_of_order``; at most ``end``."""
        return read_limit(isolation == "read_committed", self.max_read_position, self.log_end, end, out_of_order)

    def open_transactions(self, as_of: tuple | None = None):
        """The transactions that were open as of ``as_of``, the
        ``(max_read_position, log_end)`` of this view or of an earlier one
        of the partition (default: this view's): those with a batch at or
        past that maxReadPosition and no marker below that log end. Every
        transaction with data below it had ended by then. Scans the batch
        headers in between; anything with ``contains(hi, lo)``
        (``txmq.storage.delivery.OpenSet``)."""
        mrp, end = as_of if as_of is not None else (self.max_read_position, self.log_end)
        return open_transactions(info for _, _, info in self.batches(max(mrp, self.log_start),
                                                                     min(end, self.log_end)))

    def offset_for_time(self, timestamp_ms: int) -> int | None:
        """The first offset of this view published at or after
        ``timestamp_ms`` (from the segments' time indexes), None when every
        message in it was published before."""
        off = offset_for_time([s.segment for s in self.segments], timestamp_ms)
        return None if off is None or off >= self.log_end else max(off, self.log_start)

    def skipped(self, info, committed: bool, open_txns=None) -> bool:
        """A marker, or (``committed``) a batch of an aborted transaction,
        or (``open_txns``: an out-of-order read) of an open one."""
        return never_delivered(info, self.aborted, committed, open_txns)

    def _past_open(self, isolation: str, out_of_order: bool, as_of):
        """The open transactions an out-of-order read skips, or None."""
        _check_isolation(isolation)
        if not out_of_order:
            return None
        if isolation != "read_committed":
            raise InvalidArgumentError("allow_out_of_order_delivery", True, "False under read_uncommitted "
                                       "(which reads open transactions' data anyway)")
        return self.open_transactions(as_of)

    def read(self, start: int, end: int | None = None, isolation: str = "read_committed",
             fail_on_data_loss: bool = False, allow_out_of_order_delivery: bool = False, as_of=None):
        """:meth:`ReadOnlyDirectory.read` within this view."""
        open_txns = self._past_open(isolation, allow_out_of_order_delivery, as_of)
        return self._read(max(start, self.log_start), self.limit(isolation, end, open_txns is not None),
                          isolation == "read_committed", self._loss_cb(fail_on_data_loss), open_txns)

    def _read(self, start: int, limit: int, committed: bool, lost_cb=None, open_txns=None):
        for seg, pos, info in self.batches(start, limit, lost_cb):
            if self.skipped(info, committed, open_txns):
                continue
            first = max(start, info.base_offset)
            txn = TxnID.from_words(info.txn_hi, info.txn_lo) if info.flags & TRANSACTIONAL else None
            yield from seg.read_messages(pos, first, limit - first, self.topic, self.partition, MessageId, txn)

    def read_arrow(self, start: int, end: int | None = None, isolation: str = "read_committed",
                   max_rows: int = 65536, include_headers: bool = False, timestamp_unit: str = "ms",
                   gather_below: int = GATHER_BELOW, fail_on_data_loss: bool = False,
                   allow_out_of_order_delivery: bool = False, as_of=None):
        """:meth:`ReadOnlyDirectory.read_arrow` within this view."""
        open_txns = self._past_open(isolation, allow_out_of_order_delivery, as_of)
        if not isinstance(max_rows, int) or max_rows < 1:
            raise InvalidArgumentError("max_rows", max_rows, "an int >= 1")
        if timestamp_unit not in ("ms", "us"):
            raise InvalidArgumentError("timestamp_unit", timestamp_unit, "ms | us")
        limit = self.limit(isolation, end, open_txns is not None)
        start = max(start, self.log_start)
        return arrow_batches(self, start, limit, isolation == "read_committed", max_rows, include_headers,
                              timestamp_unit, gather_below, self._loss_cb(fail_on_data_loss), open_txns)


def _inode(path: str):
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


class _Shared:
    """What the partition readers of one :class:`ReadOnlyDirectory` share:
    its path, wait, descriptor budget and the owner last seen. The readers
    hold this, not the directory: no reference cycle, so a directory
    nobody holds closes its files at once, without a garbage collection."""

    def __init__(self, path: str, wait_s: float, budget):
        self.path = path
        self.wait_s = wait_s
        self.budget = budget
        self._holder_seen = (None, 0.0)      # (pid, monotonic time) of the last live owner seen

    def holder(self) -> int | None:
        """:func:`writer_pid` of this directory, read now."""
        pid = writer_pid(self.path)
        if pid is not None:
            self._holder_seen = (pid, time.monotonic())
        return pid

    def writer_live(self) -> bool:
        """Whether an owner holds the directory: a live one seen in the last
        :data:`HOLDER_TTL_S` is taken as live still (a view it feeds maps
        nothing until a read, which looks again), so viewing thousands of
        partitions reads ``/proc/locks`` about once a second."""
        pid, seen = self._holder_seen
        if pid is not None and time.monotonic() - seen < HOLDER_TTL_S:
            return True
        return self.holder() is not None


class _PartitionReader:
    """Builds :class:`PartitionView`s of one partition directory."""

    def __init__(self, directory: _Shared, topic: str, index: int):
        self.dir = directory
        self.topic = topic
        self.index = index
        self.path = os.path.join(directory.path, "topics", topic, str(index))
        self.inode = _inode(self.path)
        self._segs: dict = {}          # (base, size, next offset) -> Segment
        self._aborted_key = None
        self._aborted = None
        self._scanned = None           # (ReadView, PartitionView) of the last scan
        self._txnindex_damaged = False  # a .txnindex entry failed its CRC at the last read of them

    def readview(self) -> ReadView | None:
        # Read, not mapped: a view of thousands of partitions keeps no
        # descriptor or mapping per readview.
        return read_readview_file(os.path.join(self.path, READVIEW_FILE))

    def lazy_view(self) -> PartitionView:
        """A view of the partition now: from its read view slot when the
        slot is one to trust without reading the files (CLOSED: the writer
        closed the partition, and nothing has opened it since; LIVE under a
        live writer), its segments mapped when first needed
        (:class:`PartitionView`); else :meth:`view`."""
        if not os.path.isdir(self.path):
            # Never opened by a writer (its folder comes with its first
            # use): an empty partition.
            return PartitionView(self.topic, self.index, 0, 0, 0, "empty", [], AbortSet())
        rv = self.readview()
        if rv is not None and (rv.state == RV_CLOSED or (rv.state == RV_LIVE and self.dir.writer_live())):
            return PartitionView(self.topic, self.index, rv.log_start, rv.log_end, rv.max_read_position,
                                 "readview", None, None, rv.epoch, directory=self.path, load=self._fill,
                                 published=rv)
        return self.view()

    def _fill(self, view: PartitionView) -> None:
        view.adopt(self.view())

    def view(self) -> PartitionView:
        """A view with its segments mapped and its aborted transactions
        read (module docstring: where it comes from)."""
        if not os.path.isdir(self.path):
            return PartitionView(self.topic, self.index, 0, 0, 0, "empty", [], AbortSet())
        deadline = time.monotonic() + self.dir.wait_s
        moved = 0
        while True:
            rv = self.readview()
            holder = self.dir.holder()
            usable = rv is not None and rv.state != RV_RECOVERING
            if holder is None:
                # No writer: the files are what the next opening will load.
                view = self._scan(rv if usable else None)
                if self.readview() == rv:
                    return view
                continue           # a writer began opening the partition meanwhile
            if not usable:
                if time.monotonic() > deadline:
                    raise DataDirLockedError(self.dir.path, f"pid {holder}, which has not published "
                                             f"{self.topic}/{self.index} within {self.dir.wait_s} s")
                time.sleep(_POLL_S)
                continue
            try:
                view = self._from_readview(rv)
            except (FileNotFoundError, _Moved) as e:
                # Retention moved the log start under us: look again, but a
                # layout that stays wrong is damage, not a race.
                moved += 1
                if moved > READVIEW_TRIES:
                    raise CorruptLogError(self.path, 0, f"segments do not match the readview: {e!r}") from None
                continue
            again = self.readview()
            if again is not None and again.epoch == rv.epoch and again.state != RV_RECOVERING:
                return view

    # -- a view the writer published ---------------------------------------------

    def _from_readview(self, rv: ReadView) -> PartitionView:
        aborted = self._aborted_from_txnindex((rv.epoch, rv.aborted_version))
        bases = segment_bases(self.path)
        plan = published_segments(bases, rv.log_start, rv.active_base, rv.active_size, rv.log_end)
        if plan is None:
            raise _Moved(f"segments {bases[:1]}..{bases[-1:]}, readview {rv.log_start}..{rv.active_base}")
        segs = [self._segment(base, size, next_offset) for base, size, next_offset in plan]
        # Segments retention deleted since: dropped from the cache (a view
        # that holds one keeps it open until the view goes).
        kept = {s.base for s in segs}
        self._segs = {k: v for k, v in self._segs.items() if k[0] in kept}
        view = PartitionView(self.topic, self.index, rv.log_start, rv.log_end, rv.max_read_position,
                             "readview", segs, aborted, rv.epoch, [s.base for s in segs], self.path)
        if self._txnindex_damaged:
            # An entry fails its CRC (damage: the writer writes whole
            # entries before it publishes): the transaction state as
            # opening builds it, from the snapshot and the published log.
            ongoing, view.aborted, replay_from = self._txn_snapshot(rv.log_start, rv.log_end)
            for _, _, info in view.batches(max(replay_from, rv.log_start), rv.log_end):
                if info.flags & TRANSACTIONAL:
                    replay_txn_header(info, ongoing, view.aborted)
        return view

    def _segment(self, base: int, size: int, next_offset: int) -> _Seg:
        """Segment ``base`` known good up to ``size`` bytes (-1: the whole
        file, a sealed segment), adopting its on-disk indexes where they
        check (else the reads walk from byte 0)."""
        key = (base, size, next_offset)
        seg = self._segs.get(key)
        if seg is None:
            seg = open_read_only(self.path, base, size, next_offset, self.dir.budget)
            self._segs = {k: v for k, v in self._segs.items() if k[0] != base}   # one size per base
            self._segs[key] = seg
        return _Seg(base, seg, seg.size, next_offset)

    def _aborted_from_txnindex(self, key) -> AbortSet:
        """Every entry of every ``.txnindex`` up to its first bad one; cached
        while the writer's (epoch, aborted-set version) stays the same."""
        if key == self._aborted_key:
            return self._aborted
        aborted = AbortSet()
        self._txnindex_damaged = False
        # In segment order, so the set is in marker order (listdir's is arbitrary).
        names = sorted((n for n in os.listdir(self.path) if n.endswith(TXNINDEX_SUFFIX)),
                       key=lambda n: int(n[:-len(TXNINDEX_SUFFIX)]))
        for name in names:
            try:
                with builtin_open(os.path.join(self.path, name), "rb") as f:
                    raw = f.read()
            except FileNotFoundError:
                continue           # deleted by retention since listdir
            # Up to the first bad entry (one being appended, or damage): the
            # rest is not vouched for.
            entries, bad = txnindex_entries(raw)
            if bad is not None:
                self._txnindex_damaged = True
            for hi, lo, _, first, marker in entries:
                aborted.add(hi, lo, first, marker)
        self._aborted_key, self._aborted = key, aborted
        return aborted

    # -- a view from the files alone (no writer) ----------------------------------

    def _scan(self, rv: ReadView | None) -> PartitionView:
        """The partition as the next opening will load it, with no writer
        live (module docstring, cases 2 and 3): the writer's walk
        (``txmq.storage.loader``) without its writes, so the view ends
        where the writer's log will, and a gap between segments raises
        CorruptLogError as opening does. Cached while the read view stays
        the same (no writer has opened the partition since)."""
        if rv is not None and self._scanned is not None and self._scanned[0] == rv:
            return self._scanned[1]
        loader = LogLoader(self.path, READ_ONLY, min_base=rv.log_start if rv is not None else None,
                           budget=self.dir.budget)
        segs = [_Seg(s.base_offset, s, s.size, s.next_offset) for s in loader.load()]
        start = segs[0].base if segs else (rv.log_end if rv is not None else 0)
        end = segs[-1].next_offset if segs else start
        view = PartitionView(self.topic, self.index, start, end, end, "scan", segs, AbortSet(), 0,
                             [s.base for s in segs], self.path)
        below = self._aborted_below(end) if rv is not None else None
        if rv is not None and rv.log_start <= end and rv.log_end <= end and not self._txnindex_damaged:
            # The log holds all the read view vouches for: its transaction
            # state (no transaction open below its maxReadPosition, the
            # aborted ones in the .txnindex files) plus a replay after it.
            ongoing = OngoingQueue()
            aborted = view.aborted = below
            replay_from = rv.max_read_position
            view.source, view.epoch = ("readview" if rv.state == RV_CLOSED else "readview+scan"), rv.epoch
        else:
            # Cut short of it, or no read view: the writer's way, from the
            # transaction-buffer snapshot.
            ongoing, aborted, replay_from = self._txn_snapshot(start, end)
            view.aborted = aborted
        for _, _, info in view.batches(max(replay_from, start), end):
            if info.flags & TRANSACTIONAL:
                replay_txn_header(info, ongoing, aborted)
        view.max_read_position = ongoing.max_read_position(end)
        if rv is not None:
            self._scanned = (rv, view)
        return view

    def _aborted_below(self, end: int) -> AbortSet:
        """The aborted transactions of the ``.txnindex`` files whose ABORT
        marker lies below ``end`` (opening drops an entry past the log
        end), in a set of their own (the replay adds to it)."""
        aborted = AbortSet()
        for hi, lo, first, marker in self._aborted_from_txnindex(object()).entries():
            if marker < end:
                aborted.add(hi, lo, first, marker)
        return aborted

    def _txn_snapshot(self, start: int, end: int):
        """(ongoing, aborted, replay from) out of ``txnbuffer.snap`` when it
        checks and its offset lies in [start, end] (as opening takes it),
        else empty tables from the log start."""
        try:
            snap = read_txn_snapshot(os.path.join(self.path, TXNBUF_FILE))
        except (OSError, CorruptLogError):
            snap = None
        if snap is None or not start <= snap[0][-1] <= end:
            return OngoingQueue(), AbortSet(), start
        (_, _, _, offset), (ongoing, aborted) = snap
        return ongoing, aborted, offset


class _Moved(Exception):
    """The files changed under a view being built (retention): build again."""


class ReadOnlyDirectory:
    """A data directory opened read-only (docs/ARCHITECTURE.md; the module docstring
    says where each partition's view comes from).

    Every call takes a fresh view of the partitions it touches, so offsets
    move forward between calls as the writer publishes; one ``read`` /
    ``read_arrow`` iterates over the one view it took when called.
    ``wait_s`` bounds the wait for a writer that is opening a partition.
    ``open_files_max``: how many segment files the views keep open at once
    (``txmq.Broker``'s option of that name: None shares the process's
    budget); a parked segment reopens when read.
    """

    def __init__(self, path, *, wait_s: float = 10.0, open_files_max: int | None = None):
        self.path = os.path.abspath(os.fspath(path))
        open_files_max = open_files_option(open_files_max)
        if not os.path.isdir(os.path.join(self.path, "topics")):
            raise FileNotFoundError(f"{self.path} is not a txmq data directory (no topics/)")
        self.wait_s = wait_s
        self.budget = segment_budget(open_files_max)
        self._shared = _Shared(self.path, wait_s, self.budget)
        self._readers: dict = {}
        self._counts: dict = {}              # topic -> (topic.json's identity, partition count)

    def holder(self) -> int | None:
        """:func:`writer_pid` of this directory, read now."""
        return self._shared.holder()

    def writer_live(self) -> bool:
        """Whether an owner holds the directory (:meth:`_Shared.writer_live`)."""
        return self._shared.writer_live()

    # -- what is there -----------------------------------------------------------

    def topics(self) -> list:
        """Names of the topics, sorted (a topic exists when its topic.json does)."""
        root = os.path.join(self.path, "topics")
        return sorted(n for n in os.listdir(root) if os.path.exists(os.path.join(root, n, "topic.json")))

    def topic_config(self, topic: str) -> dict:
        """The topic's ``topic.json`` (partitions, retention)."""
        tdir = os.path.join(self.path, "topics", topic)
        if not os.path.exists(os.path.join(tdir, "topic.json")):
            raise TopicNotFoundError(topic)
        return Topic.load_config(tdir)       # CorruptLogError (path, byte) when damaged

    def _partition_count(self, topic: str) -> int:
        """``topic_config(topic)["partitions"]``, read again only when
        ``topic.json`` is another file (a view of each of thousands of
        partitions checks its number against it)."""
        try:
            st = os.stat(os.path.join(self.path, "topics", topic, "topic.json"))
        except FileNotFoundError:
            raise TopicNotFoundError(topic) from None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        known = self._counts.get(topic)
        if known is None or known[0] != key:
            known = self._counts[topic] = (key, self.topic_config(topic)["partitions"])
        return known[1]

    def partitions(self, topic: str) -> list:
        """The partition numbers of ``topic``: ``[0, .., N-1]``."""
        return list(range(self.topic_config(topic)["partitions"]))

    def view(self, topic: str, partition: int, *, lazy: bool = False) -> PartitionView:
        """A fresh consistent view of one partition (offsets, segments,
        aborted transactions); what every other call reads through.

        ``lazy``: take the offsets from the partition's read view slot
        where it can be trusted without the files (the owner closed the
        partition, or a live owner published it) and map the segments only
        when a read first needs them (:class:`PartitionView`): what a
        summary of many partitions wants (``txmq topics list``, ``stats``).
        A view of a clean close whose files were damaged since then shows
        the slot's offsets until a read maps them (``txmq check`` finds the
        damage); an eager view refuses or cuts at once, as opening would."""
        if type(partition) is not int or not 0 <= partition < self._partition_count(topic):
            raise PartitionNotFoundError(topic, partition)
        reader = self._readers.get((topic, partition))
        if reader is None or reader.inode != _inode(reader.path):
            # (a topic deleted and created again under its name since: its
            # readview and segments are other files now)
            reader = self._readers[(topic, partition)] = _PartitionReader(self._shared, topic, partition)
        return reader.lazy_view() if lazy else reader.view()

    def high_watermark(self, topic: str, partition: int) -> int:
        """The log end offset: the offset the next message will get."""
        return self.view(topic, partition).log_end

    def last_stable_offset(self, topic: str, partition: int) -> int:
        """maxReadPosition: where READ_COMMITTED reads stop."""
        return self.view(topic, partition).max_read_position

    def log_start_offset(self, topic: str, partition: int) -> int:
        """The first offset retention has kept."""
        return self.view(topic, partition).log_start

    def offsets(self, topic: str, partition: int) -> dict:
        """``{"log_start", "last_stable", "high_watermark", "source"}`` from
        one view (``source``: readview, readview+scan or scan)."""
        v = self.view(topic, partition)
        return {"log_start": v.log_start, "last_stable": v.max_read_position,
                "high_watermark": v.log_end, "source": v.source}

    # -- reading ----------------------------------------------------------------

    def read(self, topic: str, partition: int, start: int, end: int | None = None,
             isolation: str = "read_committed", fail_on_data_loss: bool = False,
             allow_out_of_order_delivery: bool = False, as_of=None):
        """Messages of one partition with offsets in [start, end), in offset
        order, as :class:`txmq.Message` (key, value, headers, message_id,
        event_time, publish_time, txn_id). ``end`` defaults to, and is
        capped by, maxReadPosition under ``read_committed`` and the log end
        under ``read_uncommitted``. Markers are never returned; batches of
        aborted transactions only under ``read_uncommitted``. A ``start``
        below the log start begins at the log start.

        ``allow_out_of_order_delivery`` (``read_committed`` only): read up
        to the log end, past open transactions, whose batches are skipped
        (as are aborted ones): every committed and plain message there.
        Which transactions count as open is fixed by ``as_of``, the
        ``(max_read_position, log_end)`` of an earlier view of the
        partition (:meth:`PartitionView.open_transactions`; default: this
        view's), so a read planned in one process and done in another
        returns the same messages.

        Offsets whose bytes failed their checks (quarantined: docs/FORMAT.md)
        are skipped and logged; with ``fail_on_data_loss`` the read raises
        :class:`txmq.errors.DataLossError` (path and byte) on reaching them
        instead."""
        return self.view(topic, partition).read(start, end, isolation, fail_on_data_loss,
                                                allow_out_of_order_delivery, as_of)

    def read_arrow(self, topic: str, partition: int, start: int, end: int | None = None,
                   isolation: str = "read_committed", max_rows: int = 65536, include_headers: bool = False,
                   timestamp_unit: str = "ms", gather_below: int = GATHER_BELOW, fail_on_data_loss: bool = False,
                   allow_out_of_order_delivery: bool = False, as_of=None):
        """``pyarrow.RecordBatch``es of the messages :meth:`read` would
        return, at most ``max_rows`` rows each, with the columns of Spark's
        Kafka source (:data:`arrow_schema`).

        An on-disk batch of ``gather_below`` rows or more becomes record
        batches of its own whose key and value columns are views of the
        mapped segment (no copy; the views keep the mapping alive after the
        segment is deleted). Runs of smaller batches are copied together
        (0: never). Offsets and timestamps are computed; headers are
        decoded. ``timestamp_unit``: "ms", or "us" for Spark (whose Arrow
        reader takes microsecond timestamps only).
        ``allow_out_of_order_delivery`` and ``as_of``: see :meth:`read`."""
        return self.view(topic, partition).read_arrow(start, end, isolation, max_rows, include_headers,
                                                      timestamp_unit, gather_below, fail_on_data_loss,
                                                      allow_out_of_order_delivery, as_of)

    # -- subscriptions and transactions (inspection) ---------------------------------

    def subscriptions(self, topic: str) -> list:
        """Names of the subscriptions of ``topic``, sorted."""
        root = os.path.join(self.path, "subscriptions", topic)
        if not os.path.isdir(root):
            return []
        return sorted(n for n in os.listdir(root) if os.path.exists(os.path.join(root, n, "subscription.json")))

    def subscription(self, topic: str, name: str, view_of=None) -> dict:
        """A subscription's settings and, per partition, its cursor
        (mark-delete, individually acknowledged offsets above it), the
        transactions holding pending acks there, and its backlog: the
        deliverable messages from mark-delete to the end its isolation
        reads to that are not acknowledged (with
        ``allow_out_of_order_delivery``: to the log end, the transactions
        open in the view not counted). Replays the cursor and
        pending-ack logs without truncating them. ``view_of(topic,
        partition)`` gives the partition views (default :meth:`view`, a
        fresh one each): a caller that already holds them passes its own."""
        root = os.path.join(self.path, "subscriptions", topic, name)
        settings = read_json(os.path.join(root, "subscription.json"))
        isolation = settings.get("isolation", "read_committed")
        committed = isolation == "read_committed"
        out_of_order = settings.get("allow_out_of_order_delivery") is True
        out = dict(settings, name=name, topic=topic, partitions={}, allow_out_of_order_delivery=out_of_order)
        view_of = view_of or self.view
        for p in self.partitions(topic):
            view = view_of(topic, p)
            cursor = _read_cursor(os.path.join(root, f"cursor-{p}.log"), view.log_start)
            pending_path = os.path.join(root, f"pending-{p}.log")
            pending = _read_redo(pending_path)
            held = replay_pending(pending, pending_path) if pending is not None else {}
            mark_delete = cursor.mark_delete if cursor is not None else None
            entry = {"mark_delete": mark_delete, "pending_transactions": len(held)}
            if cursor is not None:
                limit = view.limit(isolation, None, out_of_order)
                acked = sum(min(b, limit) - max(a, mark_delete) for a, b in cursor.acked.ranges()
                            if b > mark_delete and a < limit)
                entry["acked_above_mark_delete"] = acked
                # Out of order: committed data past open transactions is
                # backlog, the open ones' is not (yet).
                entry["backlog"] = _backlog(view, max(mark_delete, view.log_start), limit, committed,
                                            cursor.acked, view.open_transactions() if out_of_order else None)
            out["partitions"][p] = entry
        return out

    def transactions(self) -> list:
        """The transactions the coordinator logs hold unfinished (OPEN,
        PREPARED, COMMITTING, ABORTING) as dicts: id, state, timeout_ms,
        started_ms, partitions, subscriptions; a prepared one (also once
        decided) with its xid and prepared_ms. Replays the logs without
        truncating. A live broker writes a transaction's final record with
        its coordinator log's next write, at the latest at its next
        timeout check (50 ms): until then a transaction that just ended is
        listed COMMITTING or ABORTING."""
        root = os.path.join(self.path, "coordinator")
        names = {OPEN: "OPEN", PREPARED: "PREPARED", COMMITTING: "COMMITTING", ABORTING: "ABORTING"}
        out = []
        if not os.path.isdir(root):
            return out
        for name in sorted(os.listdir(root)):
            if not (name.startswith("tc-") and name.endswith(".log")):
                continue
            path = os.path.join(root, name)
            frames = _read_redo(path)
            if frames is None:
                continue
            prepared, records = {}, {}
            _, txns, _ = replay_coordinator(frames, path, records, prepared)   # a bad frame: CorruptLogError
            for (hi, lo), (state, timeout_ms, start_ms, parts, subs) in txns.items():
                if state in (COMMITTED, ABORTED):
                    continue
                if (hi, lo) in records:        # (a decision names what it covers: a commit logs no ADD_SUBSCRIPTION)
                    covered = decision.decode(records[(hi, lo)], path)
                    parts = set(parts or ()) | set(covered.partitions)
                    subs = set(subs or ()) | {(a.topic, a.subscription) for a in covered.acks}
                entry = {"id": str(TxnID.from_words(hi, lo)), "state": names[state],
                         "timeout_ms": timeout_ms, "started_ms": start_ms,
                         "partitions": sorted(f"{t}/{p}" for t, p in parts or ()),
                         "subscriptions": sorted(f"{t}/{s}" for t, s in subs or ())}
                if (hi, lo) in prepared:
                    entry["prepared_ms"], entry["xid"] = prepared[(hi, lo)][:2]
                out.append(entry)
        return out

    def close(self) -> None:
        """Drop the views this object caches (mappings live on while Arrow
        arrays or memoryviews still use them)."""
        self._readers.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open(path, *, wait_s: float = 10.0, open_files_max: int | None = None) -> ReadOnlyDirectory:  # noqa: A001
    """Open the data directory at ``path`` read-only (no lock, no writes).
    ``open_files_max``: see :class:`ReadOnlyDirectory`."""
    return ReadOnlyDirectory(path, wait_s=wait_s, open_files_max=open_files_max)


def _saved_quarantine(directory: str) -> list:
    """The ranges of a partition's ``quarantine.json`` (none when it is
    missing or does not parse: reads find the damage again)."""
    if not directory:
        return []                   # a partition never opened: no folder
    try:
        return [Quarantined(*q) for q in read_quarantine(os.path.join(directory, QUARANTINE_FILE))]
    except (OSError, CorruptLogError):
        return []


def _check_isolation(isolation: str) -> None:
    if isolation not in ISOLATIONS:
        raise InvalidArgumentError("isolation", isolation, " | ".join(ISOLATIONS))


def _backlog(view: PartitionView, start: int, limit: int, committed: bool, acked, open_txns=None) -> int:
    """The deliverable offsets in [start, limit) not in ``acked``
    (``txmq.storage.delivery.backlog``, the rule the subscriptions count by)."""
    return backlog((info for _, _, info in view.batches(start, limit)), start, limit, view.aborted, committed, acked,
                   open_txns)


def _read_redo(path: str):
    """Frames ``[(type, payload, position)]`` of a redo log from its last
    SNAPSHOT on, up to its first torn or bad frame (``position``: the
    frame's byte in the file); None when the file is missing
    or its header is not written yet. A header that is not a redo log's is
    refused, as the broker refuses it. Nothing is truncated."""
    try:
        with builtin_open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    if len(data) < len(FILE_HEADER):
        return None
    if data[:4] != FILE_HEADER[:4]:
        raise CorruptLogError(path, 0, f"bad redo-log magic {data[:4].hex()}")
    if data[4] != FILE_HEADER[4]:
        raise CorruptLogError(path, 4, f"unknown redo-log version {data[4]}")
    frames, _, _ = parse_frames(data, len(FILE_HEADER), True)   # (zeros: a coordinator log's preallocated end)
    last = max((i for i, fr in enumerate(frames) if fr[0] == SNAPSHOT), default=0)
    return frames[last:]


def _read_cursor(path: str, log_start: int):
    """The mark-delete and acks (:class:`txmq.storage.cursor.CursorState`) a cursor
    log replays to, as opening it replays them; None when it is missing."""
    frames = _read_redo(path)
    if frames is None:
        return None
    return replay_cursor(frames, log_start, path)      # a bad frame: CorruptLogError at its byte
