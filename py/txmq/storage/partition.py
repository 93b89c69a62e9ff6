"""A partition: its log, transaction buffer and producer state, behind one
lock, and the read view it publishes for other processes.

Each concept has its module: ``txmq.storage.log`` (segments, indexes,
recovery point, durability, lock-free reads: :class:`Partition` is a
``SegmentLog``), ``txmq.storage.txnbuffer`` (open and aborted
transactions, ``.txnindex``), ``txmq.storage.producer_state`` (idempotent
producers), ``txmq.storage.retention`` (which segments may go). This
module composes them: an append checks the producer state,
enters a transaction in the buffer, writes the batch and publishes; a
checkpoint writes the recovery point and then both snapshots
(``txnbuffer.snap``, ``producers.snap``) as of the same log end; opening
loads the log, then the snapshots, and replays the batch headers after the
lower of their offsets.

``readview`` (docs/ARCHITECTURE.md, ``txmq.readonly``): log start, log end,
max_read_position, the active segment's base and size, published under the
partition lock after the bytes (and the .txnindex entry of an abort) it
vouches for.

Appends take the partition lock; reads take no lock (a reader only looks
below ``end_offset``, which moves after the bytes are in place).
"""

from __future__ import annotations

import os
import threading

from txmq._batch import FLAG, BatchSpec
from txmq._segment import SegmentClosedError, now_ms
from txmq._producers import FENCED
from txmq._readview import RV_CLOSED, RV_LIVE, RV_RECOVERING, ReadViewWriter
from txmq.errors import CorruptLogError, StorageFullError
from txmq.files import write_atomic
from txmq.storage import retention
from txmq.storage.delivery import never_delivered, undelivered
from txmq.storage.layout import (PRODUCERS_FILE, READVIEW_FILE, TXNBUF_FILE, is_leftover, read_producer_snapshot,
                                 read_txn_snapshot)
from txmq.storage.loader import Dropped
from txmq.storage.log import SegmentLog, log
from txmq.storage.producer_state import DEFAULT_PRODUCER_EXPIRATION_MS, ProducerState
from txmq.storage.txnbuffer import MARKER_FLAGS, TxnBuffer

TRANSACTIONAL = FLAG["transactional"]
# Offsets a power loss took from a partition before batches that a
# commit's decision record puts back (docs/FORMAT.md, "Gap batches"): a
# transactional control batch of no transaction and no marker kind, one
# offset per lost offset, never delivered.
GAP_FLAGS = FLAG["transactional"] | FLAG["control"]
# A commit's decision record carries a copy of the transaction's batches
# on a partition when they hold at most TXN_COPY_MAX bytes in all
# (txmq.transactions.decision.REDO_COPY_MAX, the same bound: storage does
# not import it, a test holds them equal). Unless fsync="never", a
# partition keeps that copy from the append on, so the commit reads
# nothing back, while the copies it holds for its open transactions stay
# within TXN_COPIES_HELD_MAX bytes (past it, a commit reads its batches
# back from the log). A bound that differed would cost speed, not
# correctness: a commit uses the copies only when all were kept.
TXN_COPY_MAX = 64 * 1024
TXN_COPIES_HELD_MAX = 1024 * 1024


class Partition(SegmentLog):
    """One partition. Thread-safe for appends; reads are lock-free."""

    def __init__(self, path, topic: str, index: int, *, fsync: str = "commit",
                 segment_bytes_max: int = 256 * 1024 * 1024, max_message_bytes: int = 5 * 1024 * 1024,
                 index_interval_bytes: int = 4096, clock=now_ms,
                 producer_expiration_ms: int = DEFAULT_PRODUCER_EXPIRATION_MS, budget=None):
        super().__init__(os.fspath(path), f"{topic}/{index}", fsync=fsync, segment_bytes_max=segment_bytes_max,
                         max_message_bytes=max_message_bytes, index_interval_bytes=index_interval_bytes, clock=clock,
                         budget=budget)
        self.topic = topic
        self.index = index
        self._sync_always = fsync == "always"
        self.txns = TxnBuffer(self.path, fsync)
        self.producer_state = ProducerState(topic, index, producer_expiration_ms)
        self._listeners = []             # called with no lock held after an append
        self._end_listeners = []         # called with no lock held after a transaction's marker
        # (hi, lo) -> [producer id, epoch, batches, length] of an open
        # transaction that began here through this object: the producer of
        # its first batch (what its marker carries), [(base offset, count,
        # crc, length, bytes or None)] of each batch it appended, in order
        # (what its commit's decision record names, known without reading
        # the log back: txn_batches), and their length in all. Either every
        # batch has its bytes (TXN_COPY_MAX) or none has.
        self._txn_appends = {}
        self._txn_copy_max = -1 if fsync == "never" else TXN_COPY_MAX
        self._txn_copies_held = 0        # bytes kept in _txn_appends
        os.makedirs(self.path, exist_ok=True)
        # Readers stop trusting the last opening's readview before recovery
        # cuts a tail or rewrites a .txnindex, and trust this one after.
        self._readview = ReadViewWriter(os.path.join(self.path, READVIEW_FILE))
        self._readview.publish(RV_RECOVERING, 0, 0, 0, 0, 0, 0)
        self._open()
        self._recover()
        with self.lock:
            self._publish(self.end_offset)

    # -- what is there (the buffer's, the producer table's) -----------------------

    @property
    def max_read_position(self) -> int:
        """Where READ_COMMITTED reads stop (Kafka's last stable offset): the
        first offset of the oldest transaction still open here, or the log
        end when none is."""
        end = self._segments[-1].next_offset     # read first: see txmq.storage.txnbuffer
        return self.txns.ongoing.max_read_position(end)

    @property
    def ongoing(self):
        """The open transactions (``_txn.OngoingQueue``)."""
        return self.txns.ongoing

    @property
    def aborted(self):
        """The aborted transactions with data in the log (``_txn.AbortSet``)."""
        return self.txns.aborted

    @property
    def producers(self):
        """The producer table (``_producers.ProducerStates``)."""
        return self.producer_state.table

    def published(self):
        """(state, log start, log end, maxReadPosition, active segment
        base, active size) as the readview has them now (the open
        partition's side of ``txmq.storage.topic.PartitionStub.published``);
        None once closed."""
        segs = self._segments
        if not segs:
            return None
        end = segs[-1].next_offset
        return (RV_LIVE, segs[0].base_offset, end, self.txns.ongoing.max_read_position(end),
                segs[-1].base_offset, segs[-1].size)

    def blocked_by(self):
        """(TxnID, first offset, since ms) of the open transaction holding
        ``max_read_position`` back, or None."""
        return self.txns.blocked_by()

    # -- appending -----------------------------------------------------------

    def add_listener(self, cb) -> None:
        self._listeners.append(cb)

    def remove_listener(self, cb) -> None:
        try:
            self._listeners.remove(cb)
        except ValueError:
            pass

    def add_end_listener(self, cb) -> None:
        """``cb(partition, hi, lo, commit)`` after the marker of transaction
        (hi, lo) is written here and the transaction has left ``ongoing``
        (no lock held, before the append listeners): what a reader that
        read past the open transaction waits for."""
        self._end_listeners.append(cb)

    def remove_end_listener(self, cb) -> None:
        """Forget an end listener (one never added: nothing to do)."""
        try:
            self._end_listeners.remove(cb)
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
        encoded = spec.encoded_size()
        if spec.max_message_bytes > self.max_message_bytes or encoded > self.segment_bytes_max:
            raise self._too_large_error(spec)
        retried = -1
        with self.lock:
            if not self._segments:
                raise self._closed_error()
            if producer_id >= 0:
                if fence is not None and fence.fenced:
                    raise fence.fenced_error()
                if base_sequence < 0:        # the next one (inline: the common case)
                    base_sequence = self.producer_state.table.next_sequence(producer_id, producer_epoch)
                    if base_sequence == FENCED:
                        raise self.producer_state.fenced(producer_id, producer_epoch)
                else:
                    retried = self._retried(spec, producer_id, producer_epoch, base_sequence, txn)
            if retried >= 0:
                base, end = retried, retried + spec.count
            else:                            # inline, not a method: the hot path of every send
                txn_hi = txn_lo = 0
                added = False
                batches = None
                if txn is not None:
                    txn.check_open("send")
                    key = txn.words
                    txn_hi, txn_lo = key
                    flags |= TRANSACTIONAL
                    entry = self._txn_appends.get(key)
                    if entry is not None:     # (in ongoing since its first batch here)
                        batches = entry[2]
                    else:
                        # Entered before its bytes are readable: see txmq.storage.txnbuffer
                        # (TxnBuffer.begin, inline: the hot path of every transactional send).
                        txns = self.txns
                        txns.seen = True
                        added = txns.ongoing.add(txn_hi, txn_lo, self._segments[-1].next_offset, self.clock())
                try:
                    # (_append_locked, inline for the active segment's common case)
                    now = self.clock()
                    if now < self.last_publish_time:
                        now = self.last_publish_time
                    base = self._segments[-1].append(spec, flags, txn_hi, txn_lo, producer_id, producer_epoch,
                                                     base_sequence, now)
                    if base < 0:             # full: roll
                        base = self._append_locked(spec, flags, txn_hi, txn_lo, producer_id, producer_epoch,
                                                   base_sequence)
                    else:
                        self.last_publish_time = now
                except BaseException:
                    if added:
                        self.txns.undo_begin(txn_hi, txn_lo)
                    raise
                if batches is not None:
                    # (copies only while every batch so far has one)
                    copy = self._copy_last(entry, encoded) if batches[0][4] is not None else None
                    batches.append((base, spec.count, self._segments[-1].last_crc, encoded, copy))
                    entry[3] += encoded
                elif added:          # (not added: it began here before this object opened the log)
                    copy = self._copy_last(None, encoded) if self._txn_copy_max >= 0 else None
                    self._txn_appends[key] = [producer_id, producer_epoch,
                                              [(base, spec.count, self._segments[-1].last_crc, encoded, copy)],
                                              encoded]
                if producer_id >= 0:         # (ProducerState.record, inline)
                    self.producer_state.table.record(producer_id, producer_epoch, base_sequence, spec.count, base,
                                                     self.last_publish_time)
                segs = self._segments
                active = segs[-1]
                if active.size >= self._due_pos:      # (a checkpoint or writeback due)
                    self._at_due()
                    segs = self._segments
                    active = segs[-1]
                end = active.next_offset
                txns = self.txns          # (_publish, inline)
                self._readview.publish(RV_LIVE, segs[0].base_offset, end, txns.ongoing.max_read_position(end),
                                       active.base_offset, active.size, txns.aborted.version)
        # A retry's answer waits for the sync too: the first send of that
        # batch may still be making it durable on another thread.
        if txn is None and (self._sync_always if sync is None else sync):
            self.sync_to(end)
        if self._listeners and retried < 0:
            for cb in self._listeners:
                cb(self)
        return base

    def _copy_last(self, entry, encoded: int):
        """A copy of the batch just appended for a transaction (``entry``,
        its _txn_appends record before this batch, every batch in it with
        its copy; None: its first batch here), for its decision record;
        None when it is not kept: the transaction's batches would pass
        TXN_COPY_MAX or the partition's copies TXN_COPIES_HELD_MAX, or
        reading it back failed (the commit then reads the log). A
        transaction that loses a copy gives back those it had: they would
        never be used (partition lock held)."""
        total = encoded if entry is None else entry[3] + encoded
        copy = None
        if total <= self._txn_copy_max and self._txn_copies_held + encoded <= TXN_COPIES_HELD_MAX:
            try:
                copy = self._segments[-1].last_batch()
            except Exception:            # (the batch is in the log: only the copy is lost)
                copy = None
        if copy is not None:
            self._txn_copies_held += encoded
        elif entry is not None:
            self._txn_copies_held -= entry[3]
            entry[2][:] = [b[:4] + (None,) for b in entry[2]]
        return copy

    def _retried(self, spec: BatchSpec, producer_id: int, epoch: int, seq: int, txn) -> int:
        """For an explicit sequence ``seq``: -1 when the batch is to be
        appended, or the base offset of the cached batch it retries
        (partition lock held)."""
        r = self.producer_state.table.check(producer_id, epoch, seq, spec.count)
        if r < -1:                          # (ProducerState.check raises for the code; inline: hot path)
            self.producer_state.check(producer_id, epoch, seq, spec.count)
        if r >= 0:
            if txn is not None:
                txn.check_open("send")       # a late retry never answers for an ended transaction
            seg, pos = self.segment_for(r)
            info = seg.batch_at(pos)
            if (info.txn_hi, info.txn_lo) != (txn.words if txn is not None else (0, 0)):
                # The sequence was spent in another transaction (or outside
                # one): answering with that batch would report this one sent.
                raise self.producer_state.duplicate(producer_id, epoch, seq)
        return r

    def last_sequence(self, producer_id: int) -> int:
        """The last sequence ``producer_id`` appended here, or -1."""
        with self.lock:
            return self.producer_state.table.last_sequence(producer_id)     # (inline: every half message)

    def _roll(self) -> None:
        """Roll the log (partition lock held), and write both snapshots as
        of the new recovery point."""
        super()._roll()
        self._write_snapshots()

    def _checkpoint(self) -> None:
        """A recovery point at the log end, then both snapshots as of it, so
        opening scans and replays only what came after (partition lock
        held). A batch's effects (producer table, transaction buffer) are
        recorded before it: a snapshot taken in between would claim the
        batch without them."""
        super()._checkpoint()
        self._write_snapshots()

    def _publish(self, end: int, state: int = RV_LIVE) -> None:
        """Publish the readview as of log end ``end`` (partition lock held).
        Called after the bytes below ``end`` are in the segment, a marker's
        transaction left ``ongoing`` and an abort's .txnindex entry is
        written: a reader that reads the readview first finds them all."""
        segs = self._segments
        active = segs[-1]
        self._readview.publish(state, segs[0].base_offset, end, self.txns.ongoing.max_read_position(end),
                               active.base_offset, active.size, self.txns.aborted.version)

    # -- as a transaction participant (the coordinator's interface) ---------------

    def prepare_txn(self, txn_id) -> None:
        """Commit step 1: every byte appended so far is durable."""
        self.sync_to(self.end_offset)

    def txn_batches(self, words: tuple, copy_max: int) -> list:
        """The batches the transaction of ``words`` (hi, lo) appended here,
        in offset order, as ``(base offset, count, crc, length, bytes or
        None)`` (a commit's decision record, txmq.transactions.decision),
        with their bytes when they hold at most ``copy_max`` bytes in all
        (-1: never). Read without the lock: the transaction has left OPEN,
        so no batch of it is appended any more. None when the partition is
        closed (its topic deleted meanwhile)."""
        hi, lo = words
        first = self.txns.ongoing.first_offset_of(hi, lo)
        segs = self._segments
        if first < 0 or not segs:
            return None if not segs else []
        entry = self._txn_appends.get((hi, lo))
        appended = None if entry is None else entry[2]
        if appended is not None and appended[0][0] == first and first >= segs[0].base_offset:
            # Known from the appends, with the copies kept there (no page of
            # the log read back); copies not kept are read below. (Once
            # retention deleted some of its batches, the scan below names
            # those left, and whether they are copied follows from their
            # size, as the caller's count of them does.)
            copied = appended[0][4] is not None
            if copy_max < 0 or entry[3] > copy_max:
                return [b[:4] + (None,) for b in appended] if copied else list(appended)
            if copied:
                return list(appended)
        i = len(segs) - 1
        while i > 0 and segs[i - 1].next_offset > first:
            i -= 1
        segs = segs[i:]                   # those holding the transaction's data: the last one or two
        out = []
        for seg in segs:
            out += seg.txn_batches(first, hi, lo, False)
        if copy_max >= 0 and out:
            size = 0
            for b in out:
                size += b[3]
            if size <= copy_max:       # small: read again, with the bytes (a scan in C)
                out = []
                for seg in segs:
                    out += seg.txn_batches(first, hi, lo, True)
        return out

    def repair(self, batches: list) -> list:
        """Recovery: check the batches that logged commits say this
        partition holds (``[(base offset, count, crc, length, bytes or
        None)]``, any order) and put back those a power loss took, at their
        offsets, from their copies; offsets lost before one of them (other
        writers' data that was never synced) become a gap batch. Returns
        what could not be repaired, as sentences (a batch with no copy, or
        another batch where one is named)."""
        problems = []
        with self.lock:
            for base, count, crc, length, data in sorted(batches):
                end = self.end_offset
                if base < self.start_offset:
                    continue                       # retention deleted it (it was durable)
                if base < end:
                    info = self.batch_starting_at(base)
                    if info is None or info.count != count or info.length != length or \
                            self._crc_at(base) != crc:
                        problems.append(f"{self.name}: offset {base} does not hold the batch a decided "
                                        f"commit names (crc {crc:#010x}); left as it is")
                    continue
                if data is None:
                    problems.append(f"{self.name}: batch at {base} of a decided commit is missing and the "
                                    f"record holds no copy of it")
                    continue
                if base > end:
                    self._append_gap(base - end)
                self._append_repaired(data)
            self._publish(self.end_offset)
        return problems

    def _crc_at(self, base: int) -> int:
        seg, pos = self.segment_for(base)
        return seg.crc_at(pos)

    def _append_gap(self, n: int) -> None:
        """A gap batch over the next ``n`` offsets (partition lock held)."""
        self.report(Dropped(self.active.path, self.active.size, f"offsets {self.end_offset}.."
                            f"{self.end_offset + n - 1} were lost; a gap batch holds their place"))
        base = self._append_locked(BatchSpec([b""] * n), GAP_FLAGS, 0, 0, -1, 0, -1)
        self.txns.seen = True
        assert self.end_offset == base + n

    def _append_repaired(self, data: bytes) -> None:
        """Put back one batch from a decision record's copy (partition lock
        held): written at the log end, which is its base offset, and
        replayed into the transaction buffer and the producer state."""
        seg = self._segments[-1]
        base = seg.append_encoded(data)
        if base < 0:
            self._roll()
            seg = self._segments[-1]
            base = seg.append_encoded(data)
        info = seg.batch_at(seg.locate(base))
        self.last_publish_time = max(self.last_publish_time, info.publish_time)
        self.txns.replay(info, seg.base_offset)
        self.producer_state.replay(info)

    def end_txn(self, txn_id, commit: bool) -> int:
        """Write the COMMIT / ABORT marker of ``txn_id`` and take it out of
        ``ongoing``; return the marker's offset, or -1 when the transaction
        has no open data here (already ended, or it never wrote here):
        ending twice changes nothing."""
        hi, lo = txn_id.words
        with self.lock:
            if not self._segments:
                raise self._closed_error()
            first = self.txns.ongoing.first_offset_of(hi, lo)
            if first < 0:
                return -1
            # The marker carries the producer of the transaction's first batch
            # here, as a Kafka marker does (read back from it when the
            # transaction began before this object opened the log).
            entry = self._txn_appends.pop((hi, lo), None)
            if entry is not None:
                pid, epoch = entry[0], entry[1]
                if entry[2][0][4] is not None:
                    self._txn_copies_held -= entry[3]
            else:
                info = self.batch_starting_at(first)
                pid, epoch = (-1, 0) if info is None else (info.producer_id, info.producer_epoch)
            base = self._append_locked(BatchSpec([b""]), MARKER_FLAGS[commit], hi, lo, pid, epoch, -1)
            # (an abort is also indexed in its marker's segment)
            snapshot = self.txns.ended(hi, lo, commit, base, pid, None if commit else self.segment_base(base))
            active = self._segments[-1]
            if active.size >= self._due_pos:      # (a checkpoint or writeback due)
                self._at_due()
            self._publish(active.next_offset)
        if snapshot:
            self.snapshot_txn_buffer()
        if self._end_listeners:
            for cb in list(self._end_listeners):
                cb(self, hi, lo, commit)
        if self._listeners:
            for cb in self._listeners:
                cb(self)
        return base

    def _producer_id_at(self, offset: int) -> int:
        """The producer id of the batch starting at ``offset``, or -1."""
        info = self.batch_starting_at(offset)
        return -1 if info is None else info.producer_id

    def aborted_transactions(self, from_offset: int, to_offset: int) -> list:
        """``[(producer id, first offset, last offset)]`` of the aborted
        transactions with data in [from_offset, to_offset), oldest first,
        read from the .txnindex of the segments (Kafka's Fetch response field;
        last offset is the ABORT marker's)."""
        with self.lock:
            return self.txns.aborted_transactions(self._segments, from_offset, to_offset)

    # -- what a reader is handed (txmq.storage.delivery) ---------------------------------

    def never_delivered(self, info, skip_aborted: bool) -> bool:
        """A marker, or (with ``skip_aborted``, READ_COMMITTED) a batch of
        an aborted transaction."""
        return never_delivered(info, self.txns.aborted, skip_aborted)

    def undeliverable(self, start: int, end: int, skip_aborted: bool, acked=None, skip_open: bool = False) -> int:
        """How many offsets in [start, end) are never delivered: markers,
        and with ``skip_aborted`` (READ_COMMITTED) aborted data; with
        ``skip_open`` (out-of-order delivery) the data of transactions
        still open too, not delivered yet; with ``acked`` (an AckSet) only
        those not in it (a reader passing them acknowledges them, so a
        cursor's backlog must not subtract them twice). Scans the batch
        headers of the range; 0 at once for a log that never held a
        transaction."""
        if not self.txns.seen or end <= start:
            return 0
        try:
            return undelivered(self.headers(start, end), start, end, self.txns.aborted, skip_aborted, acked,
                               self.txns.ongoing if skip_open else None)
        except SegmentClosedError:   # retention moved the start: count what is left
            return self.undeliverable(max(start, self.start_offset), end, skip_aborted, acked, skip_open)

    # -- snapshots: the transaction buffer and the producer table ------------------

    def snapshot_txn_buffer(self, if_changed: bool = False) -> bool:
        """Write ``txnbuffer.snap``: the buffer as of the log end. Opening
        then replays only the batches after it."""
        with self.lock:
            if not self._segments or (if_changed and not self.txns.changed()):
                return False
            self.txns.sync_txnindex()          # the snapshot's offset vouches for the entries below it
            raw = self.txns.snapshot_bytes(self.end_offset)
        self._write_snapshot(TXNBUF_FILE, raw)
        return True

    def expire_producers(self) -> int:
        """Forget the producer ids whose last batch here is older than
        ``producer_expiration_ms``; return how many (the broker's timer
        calls it; snapshots do it too)."""
        with self.lock:
            return self._expire_producers()

    def _expire_producers(self) -> int:
        """(partition lock held) See ``ProducerState.expire``: the oldest
        open transaction here keeps the producers that wrote since."""
        oldest = self.txns.ongoing.oldest()
        return self.producer_state.expire(self.clock, None if oldest is None else oldest[3])

    def _write_snapshots(self, sync: bool = True) -> None:
        """Both snapshots as of the log end, and the .txnindex entries so
        far durable: a recovery point may now trust all three (partition
        lock held). ``sync=False``: written, not synced."""
        if sync:
            self.txns.sync_txnindex()
        self._write_snapshot(TXNBUF_FILE, self.txns.snapshot_bytes(self.end_offset), sync)
        self._expire_producers()
        self._write_snapshot(PRODUCERS_FILE, self.producer_state.snapshot_bytes(self.end_offset), sync)

    def _write_snapshot(self, name: str, raw: bytes, sync: bool = True) -> None:
        # Any snapshot within the log is a correct starting point, so
        # writers need no order: each renames its own temporary file.
        try:
            write_atomic(os.path.join(self.path, name), raw, fsync=sync and self.fsync != "never",
                         tmp_suffix=f".{threading.get_ident()}.tmp")
        except StorageFullError as e:
            # Derived data: the older snapshot (or none) stays a correct
            # starting point, from which opening replays more of the log.
            log.warning("txmq: %s: snapshot %s not written: %s", self.name, name, e)

    def _read_snapshot(self, read, name: str):
        """What ``read`` (``layout.read_txn_snapshot``,
        ``read_producer_snapshot``) makes of snapshot ``name`` when its
        CRC, magic and version check and its offset (the last header
        field) lies in the log; otherwise None (a damaged one is reported)."""
        path = os.path.join(self.path, name)
        try:
            snap = read(path)
        except CorruptLogError as e:
            self.report(Dropped(path, e.position, f"snapshot unusable ({e.reason}); rebuilt from the log"))
            return None
        if snap is None or not self.start_offset <= snap[0][-1] <= self.end_offset:
            # Taken past a tail that recovery cut, or before retention
            # deleted what it starts from: rebuild from the log.
            return None
        return snap

    def _recover(self) -> None:
        """Load the transaction-buffer and producer snapshots and replay the
        batch headers after them; load the .txnindex files."""
        for name in os.listdir(self.path):
            if is_leftover(name):
                _unlink(os.path.join(self.path, name))      # a write a crash cut short
        found = [os.path.exists(os.path.join(self.path, n)) for n in (TXNBUF_FILE, PRODUCERS_FILE)]
        had_snapshots = all(found)
        txns, producers = self.txns, self.producer_state
        txns.replay_from = producers.replay_from = self.start_offset
        txn_snap = self._read_snapshot(read_txn_snapshot, TXNBUF_FILE)
        if txn_snap is not None:
            txns.restore(txn_snap)
        prod_snap = self._read_snapshot(read_producer_snapshot, PRODUCERS_FILE)
        if prod_snap is not None:
            producers.restore(prod_snap)
        txns.load_txnindex(self._segments, self._producer_id_at, self.report)
        seg, pos = self.segment_for(min(txns.replay_from, producers.replay_from))
        replayed = 0
        while seg is not None:
            replayed += 1
            info = seg.batch_at(pos)
            txns.replay(info, seg.base_offset)
            producers.replay(info)
            seg, pos = self.next_batch(seg, pos)
        txns.aborted.trim_below(self.start_offset)
        if not any(found) and not replayed and self.start_offset == self.end_offset:
            # A new partition: its snapshots say no more than its empty log,
            # so losing them costs nothing (and they are not synced).
            with self.lock:
                self._write_snapshots(sync=False)
            return
        if replayed or not had_snapshots or txn_snap is None or prod_snap is None:
            # A snapshot that was refused (or is behind) must not be found
            # again once the log grows past its offset: replace it now.
            with self.lock:
                self._write_snapshots()

    # -- retention -----------------------------------------------------------

    def delete_segments(self, keep_from_offset: int, retention_ms: int | None,
                        retention_bytes: int | None) -> int:
        """Delete whole sealed segments that retention allows
        (``txmq.storage.retention``) and that end at or below
        ``keep_from_offset``; return how many were deleted."""
        with self.lock:
            n = retention.deletable(self._segments, keep_from_offset, retention_ms, retention_bytes,
                                    self.clock())
            for _ in range(n):
                seg = self._detach_first()
                self._publish(self.end_offset)     # readers leave the segment before it goes
                self._delete_segment(seg)
                self.txns.forget_segment(seg.base_offset)
            if n:
                self.txns.aborted.trim_below(self.start_offset)
        return n

    # -- lifetime --------------------------------------------------------------

    def flush(self) -> None:
        """Write indexes and a recovery point for everything appended so far."""
        with self.lock:
            if not self._segments:
                raise self._closed_error()
            self._checkpoint()

    def close(self) -> None:
        with self.lock:
            if not self._segments:
                return
            try:
                # Another process removing or truncating the active file
                # is reported whether or not this one wrote.
                self._check_files()
                # A partition opened and left as it was (only read: a
                # subscription's, say) is as its opening wrote it: snapshots,
                # indexes and recovery point at its end, its active file ending
                # at its last batch. Rewriting and syncing them would make
                # closing a broker of thousands of partitions take minutes.
                if self.changed or self.active.file_size != self.active.size:
                    self._write_snapshots()
                    self._seal_active()
                else:
                    self._save_quarantine()     # ranges a read found (written only when new)
                self._publish(self.end_offset, RV_CLOSED)
            finally:
                # Files another process damaged stop the seal with an
                # error; the partition still lets go of them.
                self._close_segments()
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
            "quarantined": [q.as_dict() | {"path": self._file(q.segment, ".log")} for q in self.quarantined()],
            "lost_offsets": sum(q.end_offset - q.first_offset for q in self.quarantined()),
            "producer_ids": len(self.producer_state),
            "open": True,
        } | self.txn_stats()

    def txn_stats(self) -> dict:
        """max_read_position, open and aborted transaction counts, and the
        open transaction holding max_read_position back (and since when)."""
        if not self._segments:
            return {"max_read_position": None} | self.txns.stats() | {"blocked_by": None, "blocked_since_ms": None}
        return {"max_read_position": self.max_read_position} | self.txns.stats()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
