"""A partition: an append-only log of batches in rolling segment files.

Files in ``<data>/topics/<topic>/<p>/`` (docs/FORMAT.md has the bytes):

- ``<base>.log`` segments, ``<base>`` the 20-digit base offset;
- ``<base>.index`` (offset, position) and ``<base>.timeindex``
  (publish time, offset) sparse entries, appended as they are made durable;
- ``recovery-point``: the segment, position and next offset below which the
  log was checked and (in the fsync modes that promise it) made durable.
  Opening scans only from there, so reopening costs the same however long
  the log is.
- ``txnbuffer.snap``: the transaction buffer (open transactions, aborted
  ones) as of an offset; ``producers.snap``: the idempotent-producer table
  as of an offset. Opening loads both and replays the batch headers after
  the lower of the two offsets.
- ``<base>.txnindex``: the aborted transactions whose ABORT marker is in
  that segment, as (producer id, first offset, marker offset), Kafka's
  .txnindex: what :meth:`Partition.aborted_transactions` answers from.
- ``readview``: what another process may read without the lock (DESIGN.md
  §8, ``txmq.readonly``): log start, log end, max_read_position, the
  active segment's base and size. Published under the partition lock after
  the bytes (and the .txnindex entry of an abort) it vouches for.

The transaction buffer (DESIGN.md §3): ``ongoing`` holds the open
transactions with data here in order of their first offset, and its head is
``max_read_position``; ``aborted`` holds the aborted transactions that still
have data in retained segments. A transaction's first batch is entered in
``ongoing`` before its bytes become readable, and an aborted one enters
``aborted`` before it leaves ``ongoing``, so a lock-free reader never sees
an open or aborted batch below ``max_read_position`` unmarked.

Idempotence (DESIGN.md §4): a batch with a producer id is checked against
the producer table under the partition lock (``_producers.ProducerStates``):
the next sequence is appended, a retried one returns the original offsets,
anything else raises.

Appends take the partition lock; reads take no lock (a reader only looks
below ``end_offset``, which moves after the bytes are in place).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from dataclasses import dataclass

import numpy as np

from txmq._batch import FIELD_OFFSETS, FLAG, HEADER_SIZE_BYTES, MAGIC, VERSION, BatchSpec
from txmq._crc32c import crc32c_of
from txmq._segment import Segment, SegmentClosedError
from txmq._producers import DUPLICATE, FENCED, OUT_OF_ORDER, ProducerStates
from txmq._readview import RV_CLOSED, RV_LIVE, RV_RECOVERING, ReadViewWriter
from txmq._redolog import sync_dir
from txmq._txn import AbortSet, OngoingQueue
from txmq.errors import (BrokerClosedError, CorruptLogError, DuplicateSequenceError, MessageTooLargeError,
                         OutOfOrderSequenceError, ProducerFencedError)
from txmq.files import write_atomic
from txmq.txn import TxnID

log = logging.getLogger("txmq.partition")

SEGMENT_SUFFIX = ".log"
SEGMENT_FILES = (SEGMENT_SUFFIX, ".index", ".timeindex", ".txnindex")   # deleted together
INDEX_ENTRY = np.dtype([("a", "<i8"), ("b", "<i8")])
# index_problem reads these batch-header fields as 8-byte words of the
# mapping: magic and version share word 0, the others are words of their own.
_HEAD_WORD = MAGIC | VERSION << 32
_HEAD_MASK = 0xFF_FFFF_FFFF
_BASE_OFFSET_WORD = FIELD_OFFSETS["base_offset"] // 8
_PUBLISH_TIME_WORD = FIELD_OFFSETS["publish_time"] // 8
assert FIELD_OFFSETS["magic"] == 0 and FIELD_OFFSETS["version"] == 4
assert FIELD_OFFSETS["base_offset"] % 8 == 0 and FIELD_OFFSETS["publish_time"] % 8 == 0

# recovery-point: magic, version, 3 reserved, segment base, position,
# next offset, crc32c of the 32 bytes before it, 4 reserved.
RECOVERY_POINT = struct.Struct("<4sB3xqqqI4x")
RECOVERY_POINT_MAGIC = b"TXRP"
RECOVERY_POINT_VERSION = 1
assert RECOVERY_POINT.size == 40

# Bytes appended between two recovery points; bounds the scan on reopen.
CHECKPOINT_BYTES = 16 * 1024 * 1024

TRANSACTIONAL = FLAG["transactional"]
MARKER_FLAGS = {True: FLAG["transactional"] | FLAG["control"] | FLAG["marker_commit"],
                False: FLAG["transactional"] | FLAG["control"] | FLAG["marker_abort"]}
MARKER_ABORT = FLAG["marker_abort"]

# txnbuffer.snap: magic, version, flags, 2 reserved, replay-from offset, then
# the ongoing and aborted tables (_txn to_bytes), then crc32c of all before it.
TXNBUF_MAGIC = b"TXTB"
TXNBUF_VERSION = 1
TXNBUF_HEAD = struct.Struct("<4sBB2xq")
TXNBUF_HAS_TXN_DATA = 1      # flags: the log has held transactional batches
# A snapshot is written after this many transactions ended here (or as many
# as are open, if more), or by the broker's timer when anything changed.
SNAPSHOT_EVERY_TXNS = 1000

# producers.snap: magic, version, 3 reserved, replay-from offset, the
# producer table (_producers to_bytes), crc32c of all before it.
PRODUCERS_MAGIC = b"TXPS"
PRODUCERS_VERSION = 1
PRODUCERS_HEAD = struct.Struct("<4sB3xq")

# <base>.txnindex entry: txn hi, txn lo, producer id, first offset, marker
# offset, crc32c of the 40 bytes before it, 4 reserved.
TXNINDEX_ENTRY = struct.Struct("<QQqqqI4x")
assert TXNINDEX_ENTRY.size == 48

DEFAULT_PRODUCER_EXPIRATION_MS = 7 * 24 * 3600 * 1000


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass
class Dropped:
    """What opening a partition cut off: a torn or corrupt tail."""

    path: str
    position: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path} at byte {self.position}: {self.reason}"


class Partition:
    """One partition's log. Thread-safe for appends; reads are lock-free."""

    def __init__(self, path, topic: str, index: int, *, fsync: str = "commit",
                 segment_bytes_max: int = 256 * 1024 * 1024, max_message_bytes: int = 5 * 1024 * 1024,
                 index_interval_bytes: int = 4096, clock=now_ms,
                 producer_expiration_ms: int = DEFAULT_PRODUCER_EXPIRATION_MS):
        self.path = os.fspath(path)
        self.topic = topic
        self.index = index
        self.fsync = fsync
        self._sync_always = fsync == "always"
        self.segment_bytes_max = segment_bytes_max
        self.max_message_bytes = max_message_bytes
        self.index_interval_bytes = index_interval_bytes
        self.clock = clock
        self.lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._synced_offset = 0          # every offset below is durable ...
        self._synced_base = -1           # ... and so is this segment ...
        self._synced_pos = 0             # ... up to this position
        self._listeners = []             # called with no lock held after an append
        self.dropped: list[Dropped] = []  # what recovery cut off, for stats and logs
        self._segments: tuple = ()
        self._checkpoint_pos = 0         # position in the active segment of the last recovery point
        self._index_written = {}         # segment base -> (offset entries, time entries) on disk
        self.last_publish_time = 0
        self.ongoing = OngoingQueue()    # the transaction buffer (module docstring)
        self.aborted = AbortSet()
        self.txn_seen = False            # any transactional batch (so any marker) in the log
        self.producers = ProducerStates()   # idempotent producers (module docstring)
        self.producer_expiration_ms = producer_expiration_ms
        self._txnindex: dict = {}        # segment base -> [(hi, lo, producer id, first, marker)]
        self._txnindex_dirty: set = set()   # segment bases whose .txnindex changed since its fsync
        self._ended_since_snapshot = 0
        self._scrub_next = -1            # the segment scrub_indexes checked last
        os.makedirs(self.path, exist_ok=True)
        # Readers stop trusting the last opening's readview before recovery
        # cuts a tail or rewrites a .txnindex, and trust this one after.
        self._readview = ReadViewWriter(os.path.join(self.path, "readview"))
        self._readview.publish(RV_RECOVERING, 0, 0, 0, 0, 0, 0)
        self._open()
        self._recover_txn_buffer()
        with self.lock:
            self._publish(self.end_offset)

    # -- names ---------------------------------------------------------------

    def _file(self, base: int, suffix: str) -> str:
        return os.path.join(self.path, f"{base:020d}{suffix}")

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

    @property
    def max_read_position(self) -> int:
        """Where READ_COMMITTED reads stop (Kafka's last stable offset): the
        first offset of the oldest transaction still open here, or the log
        end when none is."""
        end = self._segments[-1].next_offset     # read first: see module docstring
        return self.ongoing.max_read_position(end)

    def blocked_by(self):
        """(TxnID, first offset, since ms) of the open transaction holding
        ``max_read_position`` back, or None."""
        oldest = self.ongoing.oldest()
        if oldest is None:
            return None
        hi, lo, first, since = oldest
        return TxnID.from_words(hi, lo), first, since

    def size_bytes(self) -> int:
        return sum(s.size for s in self._segments)

    # -- opening and recovery ------------------------------------------------

    def _open(self) -> None:
        bases = sorted(int(n[:-len(SEGMENT_SUFFIX)]) for n in os.listdir(self.path)
                       if n.endswith(SEGMENT_SUFFIX) and n[:-len(SEGMENT_SUFFIX)].isdigit())
        if not bases:
            seg = Segment(self._file(0, SEGMENT_SUFFIX), 0, self.segment_bytes_max, True,
                          self.index_interval_bytes)
            seg.recover(0, 0)
            _touch(self._file(0, ".txnindex"))
            self._segments = (seg,)
            self._write_recovery_point()
            return
        cp = self._read_recovery_point(bases)
        segments = []
        for i, base in enumerate(bases):
            last = i == len(bases) - 1
            next_base = bases[i + 1] if not last else None
            scan_from = None              # None: trust the file up to its size
            if cp is None:
                scan_from = (0, base)
            elif base == cp[0]:
                scan_from = (cp[1], cp[2])
            elif base > cp[0]:
                scan_from = (0, base)
            writable = last or scan_from is not None
            seg = Segment(self._file(base, SEGMENT_SUFFIX), base,
                          self.segment_bytes_max if last else 0, writable, self.index_interval_bytes)
            segments.append(seg)
            if scan_from is None:
                self._adopt_index(seg, seg.file_size, next_base)
                continue
            pos, next_offset = scan_from
            if pos and not self._adopt_index(seg, pos, next_offset, partial=True):
                pos, next_offset = 0, base
            bad = seg.recover(pos, next_offset)
            if bad is not None:
                self._report(Dropped(seg.path, bad[0], bad[1]))
                # Offsets must stay dense: nothing after a cut survives.
                for later in bases[i + 1:]:
                    self._report(Dropped(self._file(later, SEGMENT_SUFFIX), 0,
                                         "segment after a truncated one"))
                    for suffix in SEGMENT_FILES:
                        _unlink(self._file(later, suffix))
                if not last:
                    seg.close(trim=True)
                    segments[-1] = Segment(seg.path, base, self.segment_bytes_max, True,
                                           self.index_interval_bytes)
                    segments[-1].recover(0, base)
                self._rewrite_index(segments[-1])
                break
            if next_base is not None and seg.next_offset != next_base:
                raise CorruptLogError(seg.path, seg.size,
                                      f"segment ends at offset {seg.next_offset}, next one starts at {next_base}")
            self._rewrite_index(seg)
            if not last:
                seg.seal()
                if self.fsync != "never":
                    seg.sync_file()      # rescanned: durable before a recovery point trusts it
        self._segments = tuple(segments)
        self.last_publish_time = max((s.last_publish_time for s in segments), default=0)
        if self.fsync != "never":
            # What recovery kept may have lived only in the page cache of
            # the process that died: durable first, then claimed.
            self.active.sync()
        self._synced_offset = self.end_offset
        self._write_recovery_point()
        if os.environ.get("TXMQ_DEBUG") == "1":
            self.verify()

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
        name (:func:`index_problem`), and rebuild a wrong one. The broker
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
        self._report(Dropped(self._file(seg.base_offset, ".index"), 0, f"{reason}; index rebuilt"))
        seg.reindex()
        self._rewrite_index(seg)

    def _report(self, dropped: Dropped) -> None:
        self.dropped.append(dropped)
        log.warning("txmq: truncated %s", dropped)

    def _read_recovery_point(self, bases):
        path = os.path.join(self.path, "recovery-point")
        try:
            with open(path, "rb") as f:
                raw = f.read(RECOVERY_POINT.size)
        except OSError:
            return None
        try:
            base, pos, next_offset = parse_recovery_point(path, raw, bases)
        except CorruptLogError as e:
            if len(raw) == RECOVERY_POINT.size:      # shorter: its first write, cut short
                self._report(Dropped(path, e.position, f"invalid recovery point ({e.reason}); "
                                                       f"scanning every segment"))
            return None
        if pos > os.path.getsize(self._file(base, SEGMENT_SUFFIX)):
            return None
        return base, pos, next_offset

    def _write_recovery_point(self) -> None:
        seg = self.active
        body = RECOVERY_POINT.pack(RECOVERY_POINT_MAGIC, RECOVERY_POINT_VERSION,
                                   seg.base_offset, seg.size, seg.next_offset, 0)[:32]
        raw = body + struct.pack("<I4x", crc32c_of(body))
        fd = os.open(os.path.join(self.path, "recovery-point"), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, raw, 0)
        finally:
            os.close(fd)
        self._checkpoint_pos = seg.size

    # -- index files ---------------------------------------------------------

    def _adopt_index(self, seg: Segment, size: int, next_offset: int, partial: bool = False) -> bool:
        """Load the on-disk indexes of a segment known good up to ``size``
        (below ``next_offset``).

        A trusted segment whose indexes fail :func:`index_problem` (order,
        range, the first and last entries' batches; the background
        :meth:`scrub_indexes` checks every entry) is rescanned and its
        indexes rebuilt; one whose index file ends in a torn entry has them
        rewritten. For a ``partial`` adoption (the caller scans the rest
        and rewrites them) a failure returns False and the caller scans
        from byte 0."""
        index, timeindex = self._file(seg.base_offset, ".index"), self._file(seg.base_offset, ".timeindex")
        off = _load_entries(index)
        tix = _load_entries(timeindex)
        if partial:
            off = off[off["b"] < size] if off is not None else None
            if tix is not None and off is not None:
                limit = off["a"][-1] if len(off) else seg.base_offset
                tix = tix[tix["b"] <= limit]
        problem = None if off is not None and tix is not None else "missing"
        if problem is None:
            found = index_problem(seg, off["a"], off["b"], tix["a"], tix["b"], size, next_offset,
                                  every_header=False)
            if found is not None:
                problem = f"{found[0]} entry {found[1]}: {found[2]}"
        if problem is None:
            seg.load_index(off["a"], off["b"], tix["a"], tix["b"], size, next_offset)
            self._index_written[seg.base_offset] = (len(off), len(tix))
            if not partial and (_torn(index) or _torn(timeindex)):
                self._rewrite_index(seg)
            return True
        if partial:
            return False
        # Missing or damaged index of a segment we trust: rebuild by scanning.
        if (off is not None or tix is not None) or size:
            self._report(Dropped(index, 0, f"{problem}; index rebuilt from its segment"))
        bad = seg.recover(0, seg.base_offset)
        if bad is not None:
            raise CorruptLogError(seg.path, bad[0], bad[1])
        self._rewrite_index(seg)
        return True

    def _rewrite_index(self, seg: Segment) -> None:
        offs, poss, ts, toffs = seg.index_entries()
        _write_entries(self._file(seg.base_offset, ".index"), offs, poss, truncate=True)
        _write_entries(self._file(seg.base_offset, ".timeindex"), ts, toffs, truncate=True)
        self._index_written[seg.base_offset] = (len(offs), len(ts))

    def _append_index(self, seg: Segment) -> None:
        offs, poss, ts, toffs = seg.index_entries()
        n_off, n_ts = self._index_written.get(seg.base_offset, (0, 0))
        if n_off > len(offs) or n_ts > len(ts):
            return self._rewrite_index(seg)
        _write_entries(self._file(seg.base_offset, ".index"), offs[n_off:], poss[n_off:])
        _write_entries(self._file(seg.base_offset, ".timeindex"), ts[n_ts:], toffs[n_ts:])
        self._index_written[seg.base_offset] = (len(offs), len(ts))

    # -- appending -----------------------------------------------------------

    def add_listener(self, cb) -> None:
        self._listeners.append(cb)

    def remove_listener(self, cb) -> None:
        try:
            self._listeners.remove(cb)
        except ValueError:
            pass

    def append(self, spec: BatchSpec, flags: int = 0, txn=None,
               producer_id: int = -1, producer_epoch: int = 0, base_sequence: int = -1,
               sync: bool | None = None, fence=None) -> int:
        """Append one batch; return its base offset.

        ``txn`` (a coordinator's TxnMeta) makes it a batch of that
        transaction: refused unless the transaction is open, and entered in
        the transaction buffer. ``sync`` makes it durable before returning;
        by default it follows the fsync mode (only ``"always"`` syncs plain
        appends; a transaction's data is made durable by its commit). This
        is the hot path of every send: keep it lean.

        With ``producer_id`` >= 0 the batch is idempotent: ``base_sequence``
        -1 takes the producer's next sequence here; an explicit one must be
        the next (appended), or that of one of the producer's last 5
        batches (nothing appended: that batch's base offset is returned).
        Raises :class:`OutOfOrderSequenceError` (a gap),
        :class:`DuplicateSequenceError` (an older sequence) or
        :class:`ProducerFencedError` (a lower epoch than the partition has
        seen, or ``fence.fenced``: an instance a newer one replaced).
        """
        if spec.max_message_bytes > self.max_message_bytes or spec.encoded_size() > self.segment_bytes_max:
            self._too_large(spec)
        retried = -1
        with self.lock:
            if not self._segments:
                raise BrokerClosedError(f"partition {self.topic}/{self.index} is closed")
            if producer_id >= 0:
                if fence is not None and fence.fenced:
                    raise fence.fenced_error()
                if base_sequence < 0:        # the next one (inline: the common case)
                    base_sequence = self.producers.next_sequence(producer_id, producer_epoch)
                    if base_sequence == FENCED:
                        raise self._fenced(producer_id, producer_epoch)
                else:
                    seq = self._sequence_for(spec, producer_id, producer_epoch, base_sequence, txn)
                    if seq < 0:              # a retry: answered with its original offsets
                        retried = -seq - 1
                    base_sequence = seq
            if retried >= 0:
                base, end = retried, retried + spec.count
            else:                            # inline, not a method: the hot path of every send
                txn_hi = txn_lo = 0
                added = False
                if txn is not None:
                    txn.check_open("send")
                    txn_hi, txn_lo = txn.words
                    flags |= TRANSACTIONAL
                    self.txn_seen = True
                    # Entered before its bytes are readable: see the module docstring.
                    added = self.ongoing.add(txn_hi, txn_lo, self.end_offset, self.clock())
                try:
                    base = self._append_locked(spec, flags, txn_hi, txn_lo, producer_id, producer_epoch,
                                               base_sequence)
                except BaseException:
                    if added:
                        self.ongoing.remove(txn_hi, txn_lo)
                    raise
                if producer_id >= 0:
                    self.producers.record(producer_id, producer_epoch, base_sequence, spec.count, base,
                                          self.last_publish_time)
                self._maybe_checkpoint()
                end = self.end_offset
                self._publish(end)
        # A retry's answer waits for the sync too: the first send of that
        # batch may still be making it durable on another thread.
        if txn is None and (self._sync_always if sync is None else sync):
            self.sync_to(end)
        if self._listeners and retried < 0:
            for cb in self._listeners:
                cb(self)
        return base

    def _fenced(self, producer_id: int, epoch: int) -> ProducerFencedError:
        return ProducerFencedError(producer_id, epoch, f"epoch {self.producers.epoch_of(producer_id)} "
                                   f"of the producer id wrote to {self.topic}/{self.index}")

    def _sequence_for(self, spec: BatchSpec, producer_id: int, epoch: int, seq: int, txn) -> int:
        """For an explicit sequence ``seq``: ``seq`` when the batch is to be
        appended, or -1 - base offset of the cached batch it retries
        (partition lock held)."""
        table = self.producers
        r = table.check(producer_id, epoch, seq, spec.count)
        if r >= 0:
            if txn is not None:
                txn.check_open("send")       # a late retry never answers for an ended transaction
            seg, pos = self.segment_for(r)
            info = seg.batch_at(pos)
            if (info.txn_hi, info.txn_lo) != (txn.words if txn is not None else (0, 0)):
                # The sequence was spent in another transaction (or outside
                # one): answering with that batch would report this one sent.
                raise DuplicateSequenceError(self.topic, self.index, producer_id, seq,
                                             table.next_sequence(producer_id, epoch))
            return -r - 1
        if r == FENCED:
            raise self._fenced(producer_id, epoch)
        if r == OUT_OF_ORDER or r == DUPLICATE:
            expected = table.next_sequence(producer_id, epoch)
            cls = DuplicateSequenceError if r == DUPLICATE else OutOfOrderSequenceError
            raise cls(self.topic, self.index, producer_id, seq, expected)
        return seq

    def last_sequence(self, producer_id: int) -> int:
        """The last sequence ``producer_id`` appended here, or -1."""
        with self.lock:
            return self.producers.last_sequence(producer_id)

    def _append_locked(self, spec: BatchSpec, flags: int, txn_hi: int, txn_lo: int, producer_id: int,
                       producer_epoch: int, base_sequence: int) -> int:
        """Write one batch into the active segment, rolling to a new one when
        it is full (partition lock held). The caller records what the batch
        changes (producer table, transaction buffer), then calls
        :meth:`_maybe_checkpoint`: a snapshot taken in between would claim
        the batch without its effect."""
        now = max(self.clock(), self.last_publish_time)
        seg = self._segments[-1]
        base = seg.append(spec, flags, txn_hi, txn_lo, producer_id, producer_epoch, base_sequence, now)
        if base < 0:
            self._roll()
            seg = self._segments[-1]
            base = seg.append(spec, flags, txn_hi, txn_lo, producer_id, producer_epoch, base_sequence, now)
            assert base >= 0, "a batch within segment_bytes_max fits an empty segment"
        self.last_publish_time = now
        return base

    def _maybe_checkpoint(self) -> None:
        """Keep the recovery point near the log end (partition lock held)."""
        if self._segments[-1].size - self._checkpoint_pos >= CHECKPOINT_BYTES:
            self._checkpoint()

    def _publish(self, end: int, state: int = RV_LIVE) -> None:
        """Publish the readview as of log end ``end`` (partition lock held).
        Called after the bytes below ``end`` are in the segment, a marker's
        transaction left ``ongoing`` and an abort's .txnindex entry is
        written: a reader that reads the readview first finds them all."""
        segs = self._segments
        active = segs[-1]
        self._readview.publish(state, segs[0].base_offset, end, self.ongoing.max_read_position(end),
                               active.base_offset, active.size, self.aborted.version)

    # -- as a transaction participant (the coordinator's interface) ---------------

    def prepare_txn(self, txn_id) -> None:
        """Commit step 1: every byte appended so far is durable."""
        self.sync_to(self.end_offset)

    def end_txn(self, txn_id, commit: bool) -> int:
        """Write the COMMIT / ABORT marker of ``txn_id`` and take it out of
        ``ongoing``; return the marker's offset, or -1 when the transaction
        has no open data here (already ended, or it never wrote here):
        ending twice changes nothing."""
        hi, lo = txn_id.words
        with self.lock:
            if not self._segments:
                raise BrokerClosedError(f"partition {self.topic}/{self.index} is closed")
            first = self.ongoing.first_offset_of(hi, lo)
            if first < 0:
                return -1
            # The marker carries the producer of the transaction's first batch
            # here, as a Kafka marker does.
            pid, epoch = self._producer_at(first)
            base = self._append_locked(BatchSpec([b""]), MARKER_FLAGS[commit], hi, lo, pid, epoch, -1)
            self._ended(hi, lo, commit, base, pid)
            self._maybe_checkpoint()
            self._publish(self.end_offset)
            self._ended_since_snapshot += 1
            # A snapshot costs what the buffer holds: spread it over as many ends.
            snapshot = self._ended_since_snapshot >= max(SNAPSHOT_EVERY_TXNS, len(self.ongoing))
        if snapshot:
            self.snapshot_txn_buffer()
        if self._listeners:
            for cb in self._listeners:
                cb(self)
        return base

    def _ended(self, hi: int, lo: int, commit: bool, marker_offset: int, producer_id: int) -> None:
        """Transaction (hi, lo) ended at its marker: see :func:`end_in_buffer`;
        an aborted one is also entered in the .txnindex of the marker's
        segment."""
        first = end_in_buffer(self.ongoing, self.aborted, hi, lo, commit, marker_offset)
        if not commit:
            self._index_abort((hi, lo, producer_id, first, marker_offset))

    def _producer_at(self, offset: int):
        """(producer id, epoch) of the batch starting at ``offset``, or (-1, 0)
        (partition lock held)."""
        seg, pos = self.segment_for(offset)
        if seg is not None:
            info = seg.batch_at(pos)
            if info.base_offset == offset:
                return info.producer_id, info.producer_epoch
        return -1, 0

    # -- the aborted-transaction index (Kafka's .txnindex) ----------------------------

    def _index_abort(self, entry: tuple) -> None:
        """Record an aborted transaction in the .txnindex of the segment that
        holds its marker (partition lock held)."""
        base = self._segment_base(entry[4])
        with open(self._file(base, ".txnindex"), "ab") as f:
            f.write(_txnindex_bytes([entry]))
        self._txnindex.setdefault(base, []).append(entry)
        self._txnindex_dirty.add(base)

    def _segment_base(self, offset: int) -> int:
        segs = self._segments
        for seg in reversed(segs):
            if seg.base_offset <= offset:
                return seg.base_offset
        return segs[0].base_offset

    def _load_txnindex(self, replay_from: int) -> None:
        """Read every segment's .txnindex, keeping the entries whose marker
        lies below ``replay_from`` (replay adds the others again). A missing
        file below it is rebuilt from the abort set."""
        self._txnindex = {}
        self._txnindex_dirty = set()
        rebuild = []
        for seg in self._segments:
            path = self._file(seg.base_offset, ".txnindex")
            limit = min(replay_from, seg.next_offset)
            try:
                with open(path, "rb") as f:
                    raw = f.read()
            except FileNotFoundError:
                if seg.base_offset < replay_from:
                    rebuild.append(seg)
                else:
                    _touch(path)           # the replay writes what belongs in it
                continue
            keep, n = [], len(raw) // TXNINDEX_ENTRY.size
            entries, bad = _txnindex_entries(raw)
            for i, entry in enumerate(entries):
                if not seg.base_offset <= entry[4] < seg.next_offset:
                    bad = i
                    break
                if entry[4] < limit:
                    keep.append(entry)
            if bad is not None:
                self._report(Dropped(path, bad * TXNINDEX_ENTRY.size, "bad aborted-transaction index "
                                                                      "entry; cut there"))
            if len(keep) != n or len(raw) % TXNINDEX_ENTRY.size:
                self._write_txnindex(seg.base_offset, keep)
            if keep:
                self._txnindex[seg.base_offset] = keep
        for seg in rebuild:
            entries = [(hi, lo, self._producer_at(first)[0], first, marker)
                       for hi, lo, first, marker in self.aborted.overlapping(seg.base_offset, seg.next_offset)
                       if seg.base_offset <= marker < seg.next_offset]
            self._write_txnindex(seg.base_offset, entries)
            if entries:
                self._txnindex[seg.base_offset] = entries

    def _write_txnindex(self, base: int, entries: list) -> None:
        write_atomic(self._file(base, ".txnindex"), _txnindex_bytes(entries), fsync=self.fsync != "never")

    def _sync_txnindex(self) -> None:
        """fsync the .txnindex files written since the last call (partition
        lock held; not under fsync="never")."""
        dirty, self._txnindex_dirty = self._txnindex_dirty, set()
        if self.fsync == "never":
            return
        for base in dirty:
            try:
                fd = os.open(self._file(base, ".txnindex"), os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def aborted_transactions(self, from_offset: int, to_offset: int) -> list:
        """``[(producer id, first offset, last offset)]`` of the aborted
        transactions with data in [from_offset, to_offset), oldest first,
        read from the .txnindex of the segments (Kafka's Fetch response field;
        last offset is the ABORT marker's)."""
        with self.lock:
            out = []
            for seg in self._segments:
                if seg.next_offset <= from_offset:
                    continue       # its markers all lie below from_offset
                for _, _, pid, first, last in self._txnindex.get(seg.base_offset, ()):
                    if first < to_offset and last >= from_offset:
                        out.append((pid, first, last))
        out.sort(key=lambda e: e[1])
        return out

    def never_delivered(self, info, skip_aborted: bool) -> bool:
        """A marker, or (with ``skip_aborted``, READ_COMMITTED) a batch of
        an aborted transaction."""
        return never_delivered(info, self.aborted, skip_aborted)

    def undeliverable(self, start: int, end: int, skip_aborted: bool, acked=None) -> int:
        """How many offsets in [start, end) are never delivered: markers,
        and with ``skip_aborted`` (READ_COMMITTED) aborted data; with
        ``acked`` (an AckSet) only those not in it (a reader passing them
        acknowledges them, so a cursor's backlog must not subtract them
        twice). Scans the batch headers of the range; 0 at once for a log
        that never held a transaction."""
        if not self.txn_seen or end <= start:
            return 0
        n = 0
        seg, pos = self.segment_for(start)
        try:
            while seg is not None:
                info = seg.batch_at(pos)
                if info.base_offset >= end:
                    break
                if self.never_delivered(info, skip_aborted):
                    a, b = max(start, info.base_offset), min(end, info.next_offset)
                    n += b - a - (acked.count_in(a, b) if acked is not None else 0)
                seg, pos = self.next_batch(seg, pos)
        except SegmentClosedError:   # retention moved the start: count what is left
            return self.undeliverable(max(start, self.start_offset), end, skip_aborted, acked)
        return n

    # -- snapshots: the transaction buffer and the producer table ------------------

    def snapshot_txn_buffer(self, if_changed: bool = False) -> bool:
        """Write ``txnbuffer.snap``: the buffer as of the log end. Opening
        then replays only the batches after it."""
        with self.lock:
            if not self._segments or (if_changed and not self._ended_since_snapshot):
                return False
            self._sync_txnindex()          # the snapshot's offset vouches for the entries below it
            body = self._txn_snapshot_body()
        self._write_snapshot("txnbuffer.snap", body)
        return True

    def _txn_snapshot_body(self) -> bytes:
        """The snapshot of the buffer as of the log end (partition lock held)."""
        flags = TXNBUF_HAS_TXN_DATA if self.txn_seen else 0
        self._ended_since_snapshot = 0
        return _sealed(TXNBUF_HEAD.pack(TXNBUF_MAGIC, TXNBUF_VERSION, flags, self.end_offset)
                       + self.ongoing.to_bytes() + self.aborted.to_bytes())

    def expire_producers(self) -> int:
        """Forget the producer ids whose last batch here is older than
        ``producer_expiration_ms``; return how many (the broker's timer
        calls it; snapshots do it too)."""
        with self.lock:
            return self._expire_producers()

    def _expire_producers(self) -> int:
        """(partition lock held) A producer that wrote while a transaction
        still open here began is kept whatever its age: a retry inside
        that transaction must still find its batches (Kafka never expires a
        producer with an ongoing transaction)."""
        if not len(self.producers):
            return 0
        before = self.clock() - self.producer_expiration_ms
        oldest = self.ongoing.oldest()
        if oldest is not None:
            before = min(before, oldest[3])
        return self.producers.expire(before)

    def _write_snapshots(self) -> None:
        """Both snapshots as of the log end, and the .txnindex entries so
        far durable: a recovery point may now trust all three (partition
        lock held)."""
        self._sync_txnindex()
        self._write_snapshot("txnbuffer.snap", self._txn_snapshot_body())
        self._expire_producers()
        self._write_snapshot("producers.snap", _sealed(
            PRODUCERS_HEAD.pack(PRODUCERS_MAGIC, PRODUCERS_VERSION, self.end_offset)
            + self.producers.to_bytes()))

    def _write_snapshot(self, name: str, raw: bytes) -> None:
        # Any snapshot within the log is a correct starting point, so
        # writers need no order: each renames its own temporary file.
        write_atomic(os.path.join(self.path, name), raw, fsync=self.fsync != "never",
                     tmp_suffix=f".{threading.get_ident()}.tmp")

    def _read_snapshot(self, name: str, magic: bytes, version: int, head: struct.Struct, parse):
        """``(header fields, parse(tables))`` of snapshot ``name`` when its
        CRC, magic and version check and its offset (the last header field)
        lies in the log; otherwise None (a damaged one is reported)."""
        path = os.path.join(self.path, name)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        try:
            fields, tables = parse_snapshot(path, raw, magic, version, head, parse)
        except CorruptLogError as e:
            self._report(Dropped(path, e.position, f"snapshot unusable ({e.reason}); rebuilt from the log"))
            return None
        if not self.start_offset <= fields[-1] <= self.end_offset:
            # Taken past a tail that recovery cut, or before retention
            # deleted what it starts from: rebuild from the log.
            return None
        return fields, tables

    def _recover_txn_buffer(self) -> None:
        """Load the transaction-buffer and producer snapshots and replay the
        batch headers after them; load the .txnindex files."""
        for name in os.listdir(self.path):
            if name.endswith(".tmp") and (name.startswith(("txnbuffer.snap.", "producers.snap."))
                                          or name.endswith((".index.tmp", ".timeindex.tmp", ".txnindex.tmp"))):
                _unlink(os.path.join(self.path, name))      # a write a crash cut short
        had_snapshots = all(os.path.exists(os.path.join(self.path, n))
                            for n in ("txnbuffer.snap", "producers.snap"))
        txn_snap = self._read_snapshot("txnbuffer.snap", TXNBUF_MAGIC, TXNBUF_VERSION, TXNBUF_HEAD,
                                       _parse_txn_tables)
        txn_from = prod_from = self.start_offset
        if txn_snap is not None:
            (_, _, flags, txn_from), (self.ongoing, self.aborted) = txn_snap
            self.txn_seen = bool(flags & TXNBUF_HAS_TXN_DATA)
        prod_snap = self._read_snapshot("producers.snap", PRODUCERS_MAGIC, PRODUCERS_VERSION,
                                        PRODUCERS_HEAD, _parse_producer_table)
        if prod_snap is not None:
            (_, _, prod_from), self.producers = prod_snap
        self._load_txnindex(txn_from)
        seg, pos = self.segment_for(min(txn_from, prod_from))
        ongoing, aborted, producers = self.ongoing, self.aborted, self.producers
        replayed = 0
        while seg is not None:
            replayed += 1
            info = seg.batch_at(pos)
            base = info.base_offset
            if info.flags & TRANSACTIONAL and base >= txn_from:
                self.txn_seen = True
                first = replay_txn_header(info, ongoing, aborted)
                if first >= 0:
                    self._index_abort((info.txn_hi, info.txn_lo, info.producer_id, first, base))
            if info.producer_id >= 0 and base >= prod_from and not info.is_control:
                producers.record(info.producer_id, info.producer_epoch, info.base_sequence, info.count,
                                 base, info.publish_time)
            seg, pos = self.next_batch(seg, pos)
        aborted.trim_below(self.start_offset)
        if replayed or not had_snapshots or txn_snap is None or prod_snap is None:
            # A snapshot that was refused (or is behind) must not be found
            # again once the log grows past its offset: replace it now.
            with self.lock:
                self._write_snapshots()

    def _too_large(self, spec: BatchSpec):
        if spec.max_message_bytes > self.max_message_bytes:
            raise MessageTooLargeError(spec.max_message_bytes, self.max_message_bytes)
        raise MessageTooLargeError(spec.encoded_size(), self.segment_bytes_max)

    def _roll(self) -> None:
        """Seal the active segment and start the next (partition lock held)."""
        old = self.active
        old.seal()
        if self.fsync != "never":
            old.sync_file()      # data and the trimmed size, before the roll is recorded
        self._rewrite_index(old)
        seg = Segment(self._file(old.next_offset, SEGMENT_SUFFIX), old.next_offset,
                      self.segment_bytes_max, True, self.index_interval_bytes)
        seg.recover(0, old.next_offset)
        _touch(self._file(old.next_offset, ".txnindex"))
        if self.fsync != "never":
            sync_dir(self.path)
        self._segments = self._segments + (seg,)
        self._write_recovery_point()
        self._write_snapshots()

    def _checkpoint(self) -> None:
        """Make the bytes so far durable (unless fsync="never") and record a
        recovery point there, and a transaction-buffer snapshot, so opening
        scans and replays only what came after (partition lock held)."""
        seg = self.active
        if self.fsync != "never":
            seg.sync(self._checkpoint_pos, seg.size)
        self._append_index(seg)
        self._write_recovery_point()
        self._write_snapshots()

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
                raise BrokerClosedError(f"partition {self.topic}/{self.index} is closed")
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
                raise BrokerClosedError(f"partition {self.topic}/{self.index} closed during a sync") from None
            self._synced_offset = end_offset
            self._synced_base, self._synced_pos = active.base_offset, end_pos

    # -- reading -------------------------------------------------------------

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
        """The (segment, position) after the batch at ``pos``."""
        end = pos + seg.batch_at(pos).length
        if end < seg.size:
            return seg, end
        segs = self._segments
        for i, s in enumerate(segs):
            if s is seg and i + 1 < len(segs):
                nxt = segs[i + 1]
                return (nxt, 0) if nxt.size else (None, -1)
        return None, -1

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
        for seg in self._segments:
            if seg.size and seg.last_publish_time >= timestamp_ms:
                off = seg.find_time(timestamp_ms)
                if off >= 0:
                    return off
        return self.end_offset

    # -- retention -----------------------------------------------------------

    def delete_segments(self, keep_from_offset: int, retention_ms: int | None,
                        retention_bytes: int | None) -> int:
        """Delete whole sealed segments that retention allows and that end at
        or below ``keep_from_offset``; return how many were deleted."""
        deleted = 0
        with self.lock:
            segs = list(self._segments)
            total = sum(s.size for s in segs)
            now = self.clock()
            while len(segs) > 1:
                seg = segs[0]
                if seg.next_offset > keep_from_offset:
                    break
                too_old = retention_ms is not None and now - seg.last_publish_time > retention_ms
                too_big = retention_bytes is not None and total > retention_bytes
                if not (too_old or too_big):
                    break
                segs.pop(0)
                total -= seg.size
                self._segments = tuple(segs)
                self._publish(self.end_offset)     # readers leave the segment before it goes
                seg.close(trim=False)
                for suffix in SEGMENT_FILES:
                    _unlink(self._file(seg.base_offset, suffix))
                self._index_written.pop(seg.base_offset, None)
                self._txnindex.pop(seg.base_offset, None)
                deleted += 1
            if deleted:
                self.aborted.trim_below(self.start_offset)
        return deleted

    # -- lifetime --------------------------------------------------------------

    def flush(self) -> None:
        """Write indexes and a recovery point for everything appended so far."""
        with self.lock:
            if not self._segments:
                raise BrokerClosedError(f"partition {self.topic}/{self.index} is closed")
            self._checkpoint()

    def close(self) -> None:
        with self.lock:
            if not self._segments:
                return
            self._write_snapshots()
            seg = self.active
            if self.fsync != "never":
                seg.sync()
            seg.seal()
            self._rewrite_index(seg)
            self._write_recovery_point()
            self._publish(self.end_offset, RV_CLOSED)
            for s in self._segments:
                s.close()
            self._segments = ()
            self._readview.close()

    def __repr__(self) -> str:
        return f"Partition({self.topic!r}, {self.index})"

    def stats(self) -> dict:
        segs = self._segments
        return {
            "start_offset": segs[0].base_offset if segs else None,
            "end_offset": segs[-1].next_offset if segs else None,
            "bytes": sum(s.size for s in segs),
            "segments": len(segs),
            "truncated_on_open": [str(d) for d in self.dropped],
            "producer_ids": len(self.producers),
        } | self.txn_stats()

    def txn_stats(self) -> dict:
        """max_read_position, open and aborted transaction counts, and the
        open transaction holding max_read_position back (and since when)."""
        blocked = self.blocked_by() if self._segments else None
        return {
            "max_read_position": self.max_read_position if self._segments else None,
            "open_transactions": len(self.ongoing),
            "aborted_transactions": len(self.aborted),
            "blocked_by": None if blocked is None else str(blocked[0]),
            "blocked_since_ms": None if blocked is None else blocked[2],
        }


def end_in_buffer(ongoing, aborted, hi: int, lo: int, commit: bool, marker_offset: int) -> int:
    """Transaction (hi, lo) ended at its marker: an aborted one enters
    ``aborted`` before it leaves ``ongoing`` (lock-free readers: the module
    docstring). Returns its first offset when it aborted, else -1."""
    first = -1
    if not commit:
        first = ongoing.first_offset_of(hi, lo)
        aborted.add(hi, lo, first, marker_offset)
    ongoing.remove(hi, lo)
    return first


def replay_txn_header(info, ongoing, aborted) -> int:
    """What one transactional batch header does to a transaction buffer
    when the log is replayed (recovery, and read-only views): a data batch
    opens its transaction unless it has aborted; a marker ends an open
    one. Returns the first offset of a transaction the marker aborted,
    else -1."""
    hi, lo = info.txn_hi, info.txn_lo
    if info.is_control:
        if ongoing.contains(hi, lo):
            return end_in_buffer(ongoing, aborted, hi, lo, not info.flags & MARKER_ABORT, info.base_offset)
    elif not aborted.contains(hi, lo):
        ongoing.add(hi, lo, info.base_offset, info.publish_time)
    return -1


def never_delivered(info, aborted, skip_aborted: bool) -> bool:
    """A marker, or (with ``skip_aborted``, READ_COMMITTED) a batch of an
    aborted transaction: what no subscription or reader delivers."""
    return bool(info.flags & TRANSACTIONAL) and (
        info.is_control or (skip_aborted and aborted.contains(info.txn_hi, info.txn_lo)))


def _sealed(body: bytes) -> bytes:
    """``body`` followed by its crc32c: a snapshot file's bytes."""
    return body + struct.pack("<I", crc32c_of(body))


def _txnindex_bytes(entries) -> bytes:
    """.txnindex entries (hi, lo, producer id, first, marker), each sealed
    with the CRC of its first 40 bytes."""
    out = []
    for entry in entries:
        body = TXNINDEX_ENTRY.pack(*entry, 0)[:40]
        out.append(body + struct.pack("<I4x", crc32c_of(body)))
    return b"".join(out)


def _txnindex_entries(raw: bytes):
    """(entries, bad) of .txnindex bytes: the entries (hi, lo, producer id,
    first, marker) up to the first that fails its CRC, and that one's
    number (None when every whole entry passes; a torn last one is left
    out). Whether an entry's marker is in its segment is the caller's
    question: opening cuts the file at the first that is not."""
    out = []
    size = TXNINDEX_ENTRY.size
    for i in range(len(raw) // size):
        *entry, crc = TXNINDEX_ENTRY.unpack_from(raw, i * size)
        if crc != crc32c_of(raw[i * size:i * size + 40]):
            return out, i
        out.append(tuple(entry))
    return out, None


def parse_recovery_point(path: str, raw: bytes, bases) -> tuple:
    """(segment base, position, next offset) of recovery-point bytes ``raw``
    of a partition whose segments start at ``bases``; CorruptLogError (at
    the byte it is about) when they are not a sound one. Whether the
    position lies in its segment is the caller's to check."""
    if len(raw) < RECOVERY_POINT.size:
        raise CorruptLogError(path, len(raw), f"{len(raw)} bytes, expected {RECOVERY_POINT.size}")
    magic, version, base, pos, next_offset, crc = RECOVERY_POINT.unpack_from(raw)
    if magic != RECOVERY_POINT_MAGIC:
        raise CorruptLogError(path, 0, f"bad magic {magic!r}")
    if version != RECOVERY_POINT_VERSION:
        raise CorruptLogError(path, 4, f"unknown version {version}")
    if crc != crc32c_of(raw[:32]):
        raise CorruptLogError(path, 32, "CRC mismatch")
    if base not in bases:
        raise CorruptLogError(path, 8, f"names segment {base}, which does not exist")
    if pos < 0 or next_offset < base:
        raise CorruptLogError(path, 16, f"position {pos} or next offset {next_offset} is out of range")
    return base, pos, next_offset


def parse_snapshot(path: str, raw: bytes, magic: bytes, version: int, head: struct.Struct, parse_tables):
    """(header fields, parse_tables(tables)) of the bytes ``raw`` of a
    snapshot file (txnbuffer.snap, producers.snap: ``head``, the tables,
    a crc32c of all before it); CorruptLogError (at the byte it is about)
    when they fail a check. Whether its offset, the last header field,
    lies in the log is the caller's to check."""
    if len(raw) < head.size + 8:
        raise CorruptLogError(path, len(raw), "shorter than its header and CRC")
    if struct.unpack_from("<I", raw, len(raw) - 4)[0] != crc32c_of(raw[:-4]):
        raise CorruptLogError(path, len(raw) - 4, "CRC mismatch")
    fields = head.unpack_from(raw)
    if fields[0] != magic:
        raise CorruptLogError(path, 0, f"bad magic {fields[0]!r}")
    if fields[1] != version:
        raise CorruptLogError(path, 4, f"unknown version {fields[1]}")
    try:
        return fields, parse_tables(raw[head.size:-4])
    except (ValueError, OverflowError, struct.error) as e:
        raise CorruptLogError(path, head.size, f"tables do not parse: {e}") from None


def _parse_txn_tables(body: bytes):
    ongoing, n = OngoingQueue.from_bytes(body)
    aborted, m = AbortSet.from_bytes(body[n:])
    if n + m != len(body):
        raise ValueError("stray bytes after the tables")
    return ongoing, aborted


def _parse_producer_table(body: bytes):
    table, n = ProducerStates.from_bytes(body)
    if n != len(body):
        raise ValueError("stray bytes after the producer table")
    return table


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
    """Create ``path`` empty (a segment's .txnindex starts so: a missing one
    means lost, and is rebuilt)."""
    open(path, "ab").close()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _load_entries(path: str):
    try:
        raw = np.fromfile(path, dtype=np.uint8)
    except (FileNotFoundError, ValueError):
        return None
    if len(raw) % INDEX_ENTRY.itemsize:
        raw = raw[: len(raw) - len(raw) % INDEX_ENTRY.itemsize]  # torn last entry
    return raw.view(INDEX_ENTRY)


def _write_entries(path: str, a, b, truncate: bool = False) -> None:
    """Append entries to an index file, or (``truncate``) replace it whole,
    atomically: a kill mid-rewrite must not leave it empty or short."""
    entries = np.empty(len(a), INDEX_ENTRY)
    entries["a"] = a
    entries["b"] = b
    if truncate:
        write_atomic(path, entries.tobytes(), fsync=False)   # derived data: rebuilt if lost
        return
    with open(path, "ab") as f:
        f.write(entries.tobytes())


def _torn(path: str) -> bool:
    """Whether an index file ends in part of an entry (a write cut short)."""
    try:
        return os.path.getsize(path) % INDEX_ENTRY.itemsize != 0
    except FileNotFoundError:
        return False


def index_problem(seg: Segment, offsets, positions, timestamps, time_offsets, size: int | None = None,
                  next_offset: int | None = None, every_header: bool = True):
    """The first wrong entry of a segment's offset index (``offsets``,
    ``positions``) or time index (``timestamps``, ``time_offsets``), as
    (".index" or ".timeindex", entry number, reason), or None when every
    entry names, in increasing order, a batch of ``seg`` below ``size``
    bytes and ``next_offset`` (default: the segment's) as it says: the
    batch header at that position holds that base offset (and that
    publish time), and a time entry's offset is one the offset index
    names (the broker makes both entries of a batch together).

    One predicate for ``Partition.verify``, ``Partition.scrub_indexes``
    (which rebuilds an index that has a problem, in the background) and
    ``txmq check`` (which calls it repairable). It reads the headers of the
    named batches through the segment's mapping in one vectorized pass,
    without their CRCs. Opening passes ``every_header=False``: order and
    range of every entry, the headers of the first and last only, so that
    opening touches a page or two of a sealed segment, not one every
    ``index_interval_bytes`` (reopening must not grow with the log). A read
    checks the batch an entry names before it uses it
    (``Segment._idx_entry_ok``) and bypasses an entry that fails."""
    size = seg.size if size is None else size
    next_offset = seg.next_offset if next_offset is None else next_offset
    offs, poss = np.asarray(offsets, np.int64), np.asarray(positions, np.int64)
    ts, toffs = np.asarray(timestamps, np.int64), np.asarray(time_offsets, np.int64)
    if not len(offs) and not len(ts):
        return None
    words = (np.frombuffer(seg.mapping, np.uint64, size // 8)
             if size >= HEADER_SIZE_BYTES and seg.mapping is not None else np.empty(0, np.uint64))
    try:
        wrong = ((offs < seg.base_offset) | (offs >= next_offset) | (poss < 0) | (poss % 8 != 0)
                 | (poss + HEADER_SIZE_BYTES > size))
        wrong[1:] |= (np.diff(offs) <= 0) | (np.diff(poss) <= 0)
        at = np.where(wrong, 0, poss // 8)
        look = _ends(len(offs), every_header)
        if len(words):
            wrong[look] |= (((words[at[look]] & _HEAD_MASK) != _HEAD_WORD)
                            | (words[at[look] + _BASE_OFFSET_WORD].view(np.int64) != offs[look]))
        if wrong.any():
            i = int(np.argmax(wrong))
            off, pos = int(offs[i]), int(poss[i])
            if i and not (off > offs[i - 1] and pos > poss[i - 1]):
                why = f"does not increase on the one before ({int(offs[i - 1])}, {int(poss[i - 1])})"
            elif pos + HEADER_SIZE_BYTES > size or off >= next_offset:
                why = f"points past the last batch (byte {size}, offset {next_offset})"
            else:
                why = "points away from the batch of that offset"
            return ".index", i, f"(offset {off}, position {pos}) {why}"
        named = np.minimum(np.searchsorted(offs, toffs), max(len(offs) - 1, 0))
        wrong = (toffs < seg.base_offset) | (toffs >= next_offset)
        wrong[1:] |= (np.diff(ts) <= 0) | (np.diff(toffs) < 0)
        if len(offs):
            wrong |= offs[named] != toffs
            if len(words):
                look = _ends(len(ts), every_header)
                at = np.where(wrong, 0, poss[named] // 8 + _PUBLISH_TIME_WORD)
                wrong[look] |= words[at[look]].view(np.int64) != ts[look]
        else:
            wrong[:] = True
        if wrong.any():
            i = int(np.argmax(wrong))
            t, off = int(ts[i]), int(toffs[i])
            if i and not (t > ts[i - 1] and off >= toffs[i - 1]):
                why = f"does not increase on the one before ({int(ts[i - 1])}, {int(toffs[i - 1])})"
            else:
                why = "names no indexed batch published at that time"
            return ".timeindex", i, f"(time {t}, offset {off}) {why}"
        return None
    finally:
        del words


def _ends(n: int, every: bool):
    """Which of ``n`` index entries :func:`index_problem` reads the header of."""
    return slice(None) if every or n <= 2 else np.array([0, n - 1])


def _monotone(entries) -> bool:
    return bool(np.all(np.diff(entries["a"]) > 0) and np.all(np.diff(entries["b"]) >= 0))


def _valid_entries(entries, base: int, size: int) -> bool:
    if not len(entries):
        return True
    a, b = entries["a"], entries["b"]
    return bool(a[0] >= base and b[0] >= 0 and b[-1] < size and np.all(np.diff(a) > 0)
                and np.all(np.diff(b) > 0))
