"""Transaction coordinators (docs/API.md, "Transaction").

Each coordinator owns a transaction log ``<data>/coordinator/tc-<id>.log``
(the shared framed redo log, kept zero-filled ahead of its end; docs/FORMAT.md
has the frames) and a timeout tracker. Ending a transaction is two-phase:

1. prepare: the coordinator reads what the commit covers from its
   participants (the transaction's batches in each partition, its acks in
   each subscription as ranges: txmq.transactions.decision). Nothing is
   synced here, except the segments of an output too large for the decision
   record to carry a copy of (more than ``decision.REDO_COPY_MAX`` bytes);
2. decide: a commit appends one DECIDED frame, which names all of that and
   carries the copies, and syncs the log: that one flush is the commit
   point. An abort defers ABORTING (no write of its own) and syncs nothing;
3. fan out: every partition writes its marker, every subscription applies or
   drops its pending acks, all in the page cache; a participant that fails
   is retried by the broker's scheduler until it succeeds;
4. the final COMMITTED / ABORTED record, which has no write of its own:
   it goes out at the front of the log's next write (another
   transaction's frame, the periodic :meth:`TransactionCoordinator.expire`,
   the close); the transaction is forgotten. A crash that loses it leaves
   a decided transaction, which recovery applies again.

Beginning writes nothing (sequences come from synced RESERVE blocks). A
transaction's BEGIN goes out with its first other frame: the ADD_PARTITION
of its first append somewhere, which has no write of its own (deferred,
as COMMITTED is: it goes out at the front of the log's next write, most
often the transaction's own DECIDED frame), else its DECIDED or PREPARED
frame, or the ADD_SUBSCRIPTION frames :meth:`log_participants` writes
before its acks are framed. One that never wrote a frame aborts without
any (``TxnMeta.logged``). A crash can lose a deferred ADD_PARTITION and
leave the transaction's data in a partition no log names: that partition
aborts it when it opens (txmq.broker.recovery), and since a sequence is
never handed out twice such a transaction is never taken for a live one.

Concurrent commits share the flush of step 2 (whoever syncs covers every
frame written before); :meth:`TransactionCoordinator.end` with a future
queues steps 2 (its sync) to 4 for the coordinator's flusher thread, so one
thread can pipeline commits (``Transaction.commit_async``).

The log also maps the transactional ids homed here to their (producer id,
epoch) (docs/FORMAT.md, "Idempotent producers"): a PRODUCER frame per opening, kept by compaction.

``commit()`` returns after step 3. Recovery (driven by the broker) checks
every partition and subscription against the decision records the log
holds and puts back what a power loss took, redoes step 3 for every decided
transaction and aborts every other one. Compaction makes the participants
durable before the log forgets their decisions.
"""

from __future__ import annotations

import collections
import heapq
import logging
import struct
import threading
import time

from txmq import crashpoints
from txmq._redolog import RedoLog
from txmq._txnlog import (ABORTED, ABORTING, COMMITTED, COMMITTING, OPEN, PREPARED, TC_ABORTED, TC_ABORTING,
                          TC_ADD_PARTITION, TC_ADD_SUBSCRIPTION, TC_BEGIN, TC_COMMITTED, TC_COMMITTING, TC_DECIDED,
                          TC_FORGET, TC_PREPARED, TC_PRODUCER, TC_RESERVE, encode_coordinator_snapshot, encode_prepared,
                          encode_producer, encode_text, pack_txn, replay_coordinator)
from txmq.errors import BrokerClosedError, InvalidTxnStateError, StorageFullError
from txmq.transactions import decision
from txmq.transactions.producer_ids import reserve_block
from txmq.transactions.records import TxnID, TxnMeta, TxnState

log = logging.getLogger("txmq.coordinator")

# The log is rewritten as a snapshot of the live transactions once it holds
# this many frames (or bytes of frames) more than the live transactions
# need, so replay on open stays short however many ended, and the cost of a
# snapshot (proportional to the live transactions, plus the sync of every
# partition and cursor the decisions since the last one touched) is spread
# over as many frames: about 4,000 transactions of the README's loop at
# fsync="never", 1,400 at "commit", whose decisions carry copies.
COMPACT_FRAMES = 16_384
LIVE_FRAMES = 16
COMPACT_BYTES = 16 * 1024 * 1024
LIVE_BYTES = 1024
# Zeros written ahead of the log's end (txmq._redolog): the sync of a
# decision then rewrites blocks the file has, with no inode to journal.
# The zeros cost the same per commit whatever the chunk (as many bytes as
# the records); a chunk's first sync also journals the new size, once per
# ~40 commits of the README's loop. 512 KiB, written from the first append
# after an open or a compaction, keeps an idle coordinator's log small.
PREALLOCATE_BYTES = 512 * 1024
# Sequences are handed out from blocks of this many, each block's RESERVE
# frame synced (unless fsync="never") before its first sequence is used. A
# transaction then needs no frame of its own until it first reaches a
# partition's files or decides, and no sequence is handed out twice,
# whatever a crash kept of the log: opening resumes past the last block.
RESERVE_BLOCK = 1024
_TIMES = struct.Struct("<qq")
# The outcomes of ended prepared transactions a log keeps until they are
# forgotten (forget_prepared): past this many, compaction drops the oldest.
PREPARED_OUTCOMES_MAX = 10_000
# What the outcome of a prepared transaction is called (prepared_outcome).
OUTCOMES = {PREPARED: TxnState.PREPARED, COMMITTED: TxnState.COMMITTED, ABORTED: TxnState.ABORTED}


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class TransactionCoordinator:
    """One coordinator: its log, its live transactions, their timeouts."""

    def __init__(self, broker, coordinator_id: int, path: str, fsync: str, prepared_timeout: float | None = None):
        self.broker = broker
        self.prepared_timeout = prepared_timeout   # seconds a PREPARED transaction may wait, None: for ever
        # Prepared transactions, live or ended and not yet forgotten, in the
        # order they were prepared: words -> [prepared_ms, xid, outcome].
        self.prepared: dict = {}
        self.id = coordinator_id
        self.fsync = fsync
        self.log = RedoLog(path, fsync, PREALLOCATE_BYTES)
        self.lock = threading.Lock()
        self.txns: dict[TxnID, TxnMeta] = {}
        self.tids: dict[str, tuple] = {}   # transactional id -> (producer id, epoch)
        self.next_seq = 1
        self.reserved = 0                  # sequences below it are reserved by a RESERVE frame this object wrote
        self._timeouts: list = []          # heap of (deadline, sequence)
        self._touched: dict = {}           # participants that applied outcomes since the last compaction
        self._retry: dict[TxnID, tuple] = {}  # transactions whose fan-out must be retried
        self.problems: list[str] = []
        self.stats = {"begun": 0, "committed": 0, "aborted": 0, "timed_out": 0, "prepared": 0}
        self._flusher = None               # the thread that finishes commit_async commits
        self._queued = collections.deque()  # (future, meta, participants, mark) for it
        self._queue_cond = threading.Condition(threading.Lock())
        self._closing = False

    # -- recovery --------------------------------------------------------------

    def replay(self, records: dict | None = None) -> dict:
        """The log's transactions as ``{(hi, lo): [state, timeout_ms,
        start_ms, partitions, subscriptions]}`` (see :func:`replay_coordinator`);
        ``records`` receives the decision records the log holds (of
        prepared transactions too), :attr:`prepared` the prepared ones."""
        frames = self.log.replay(positions=True)
        if self.log.dropped is not None:
            pos, reason, n = self.log.dropped
            self.problems.append(f"{self.log.path} at byte {pos}: {reason}; {n} bytes cut")
            log.warning("txmq: coordinator log %s", self.problems[-1])
        # A frame that does not parse: CorruptLogError at its bad byte.
        self.prepared = {}
        next_lo, txns, self.tids = replay_coordinator(frames, self.log.path, records, self.prepared)
        self.next_seq = max(self.next_seq, next_lo, 1)
        return txns

    def saw(self, sequence: int) -> None:
        """A participant knows ``sequence``: never hand it out again."""
        if sequence >= self.next_seq:
            self.next_seq = sequence + 1

    def record_decision(self, words: tuple, commit: bool) -> None:
        with self.lock:
            self.log.append(TC_COMMITTING if commit else TC_ABORTING, pack_txn(*words))

    def compact(self) -> None:
        """Rewrite the log as a snapshot now (participants made durable
        first): the decisions of ended transactions are forgotten."""
        with self.lock:
            self._compact()

    def forget_applied(self, participant) -> None:
        """``participant`` moved on (a subscription's seek, its removal):
        if it applied a commit since the last compaction, compact now, so
        that recovery does not apply that commit's decision to it again
        over the move (it redoes every decision the log still holds). A
        full disk leaves it for the next compaction."""
        with self.lock:
            if id(participant) in self._touched:
                self._compact(housekeeping=True)

    def finish_recovery(self) -> None:
        """Every recovered transaction is applied (the broker has made its
        markers and cursor frames durable): the log restarts as a snapshot."""
        with self.lock:
            self._compact()

    def record_producer(self, tid: str, producer_id: int, epoch: int) -> None:
        """Log, durably, that transactional id ``tid`` is now (producer id,
        epoch): the fence of every older instance."""
        with self.lock:
            self.log.append(TC_PRODUCER, encode_producer(tid, producer_id, epoch))
            self.tids[tid] = (producer_id, epoch)
            mark = self.log.written
            self._maybe_compact()
        self.log.sync_to(mark)

    # -- beginning and registering -------------------------------------------------

    def begin(self, timeout: float, owner=None) -> TxnMeta:
        """A new OPEN transaction; ``owner`` is the TransactionalProducer
        beginning it, if one is."""
        start = now_ms()
        with self.lock:
            seq = self.next_seq
            if seq >= self.reserved:
                self.reserved = reserve_block(self.log, TC_RESERVE, seq + RESERVE_BLOCK)
            self.next_seq += 1
            meta = TxnMeta(TxnID(self.id, seq), timeout, start, time.monotonic() + timeout)
            meta.owner = owner
            # (no frame yet: BEGIN goes out with the transaction's first, _log_with_begin)
            self.txns[meta.id] = meta
            heapq.heappush(self._timeouts, (meta.deadline, seq))
            if len(self._timeouts) > 2 * len(self.txns) + 1024:
                self._timeouts = [(m.deadline, m.id.sequence) for m in self.txns.values()]
                heapq.heapify(self._timeouts)
            self.stats["begun"] += 1
        return meta

    def _log_with_begin(self, meta: TxnMeta, frames: list, defer: bool = False) -> None:
        """Append ``frames`` of ``meta`` in one write, led by its BEGIN if
        the log does not have it yet (coordinator lock held). ``defer``:
        they go out at the front of the log's next write instead
        (``RedoLog.defer``), so BEGIN still precedes every later frame."""
        if not meta.logged:
            frames = [(TC_BEGIN, pack_txn(*meta.words) + _TIMES.pack(int(meta.timeout * 1000), meta.start_ms))
                      ] + frames
        if defer:
            for kind, payload in frames:
                self.log.defer(kind, payload)
        elif len(frames) == 1:
            self.log.append(*frames[0])
        else:
            self.log.append_many(frames)
        meta.logged = True

    def _unlogged_subscriptions(self, meta: TxnMeta) -> tuple:
        """``(keys, frames)``: the subscriptions of ``meta`` the log does not
        name yet and their ADD_SUBSCRIPTION frames (coordinator lock held;
        the caller counts them named once the frames are written)."""
        keys = [k for k in list(meta.subscriptions) if k not in meta.logged_subs]
        return keys, [(TC_ADD_SUBSCRIPTION, pack_txn(*meta.words) + encode_text(t) + encode_text(n))
                      for t, n in keys]

    def log_participants(self, meta: TxnMeta) -> None:
        """Log ``meta`` (BEGIN) and the subscriptions it acknowledged on
        that the log does not name yet (ADD_SUBSCRIPTION), before its acks
        are framed in pending-ack logs (``Transaction.flush``, a cumulative
        ack). A transaction no longer open is left alone."""
        with meta.lock:
            if meta.state is not TxnState.OPEN:
                return
            with self.lock:
                keys, frames = self._unlogged_subscriptions(meta)
                if frames:
                    self._log_with_begin(meta, frames)
                    meta.logged_subs.update(keys)
                else:
                    self.log.write_deferred()     # (its BEGIN and ADD_PARTITION frames)

    def register_partition(self, meta: TxnMeta, partition) -> None:
        """ADD_PARTITION (led by BEGIN when the log does not have it yet),
        deferred: it goes out at the front of the log's next write (the
        transaction's DECIDED frame, most often) or of the scheduler's
        timeout check, so a read-only view names the partition within that
        period. A crash that loses it leaves data no log names, which the
        partition aborts when it opens (module docstring)."""
        key = (partition.topic, partition.index)
        with meta.lock:
            if meta.state is not TxnState.OPEN:     # (check_open, inline: once per transaction and partition)
                raise meta.not_open("send")
            if meta.partitions.get(key) is partition:
                return        # (a topic deleted and created again is a new participant)
            with self.lock:
                self._log_with_begin(meta, [(TC_ADD_PARTITION, pack_txn(*meta.words) + encode_text(partition.topic)
                                             + struct.pack("<I", partition.index))], defer=True)
                meta.partitions[key] = partition     # (a compaction's snapshot, which drops the frame, names it)

    def register_subscription(self, meta: TxnMeta, subscription) -> None:
        """``subscription`` takes part in ``meta`` (before its first ack
        there). Nothing is logged: the acks are in memory until the
        decision record names them, or :meth:`log_participants` logs the
        subscription before they are framed."""
        key = (subscription.topic.name, subscription.name)
        with meta.lock:
            meta.check_open("acknowledge")
            if meta.subscriptions.get(key) is not subscription:
                meta.subscriptions[key] = subscription
                meta.logged_subs.discard(key)     # (a subscription deleted and created again: named anew)

    # -- ending ----------------------------------------------------------------------

    def end(self, meta: TxnMeta, commit: bool, reason: str | None = None, future=None) -> None:
        """Commit or abort ``meta`` (the four steps of the module docstring).

        ``reason`` marks an abort the broker made ("timeout", "forced",
        "fenced"). A user's abort of a transaction already aborted (by an
        earlier abort, or by the broker) is a no-op: the caller's wish holds.

        ``future`` (a commit only, ``concurrent.futures.Future``): return
        once the decision is written, and leave its sync and the fan-out to
        the flusher thread, which resolves the future after them (or sets
        the error). Errors before the decision are raised here.
        """
        prepared = late = False
        with meta.lock:
            if meta.state is not TxnState.OPEN:
                if (meta.state is TxnState.PREPARED and meta.prepared_ms is not None
                        and reason in (None, "prepared timeout")):
                    prepared = True          # (only its commit or abort, or its own timeout, ends it)
                elif not commit and reason is None and meta.state in (TxnState.ABORTING, TxnState.ABORTED):
                    return
                else:
                    raise meta.not_open("commit" if commit else "abort")
            else:
                late = commit and time.monotonic() > meta.deadline
                if late:       # past its timeout, the timer not there yet: never commit it
                    commit, reason = False, "timeout"
            meta.state = TxnState.COMMITTING if commit else TxnState.ABORTING
            if reason is not None:
                meta.reason = reason
        if prepared:
            self._end_prepared(meta, commit, future)
            return
        participants = list(meta.partitions.values()) + list(meta.subscriptions.values())
        # Operations that passed their check under a participant's lock have
        # finished once we hold that lock; later ones see the new state.
        for x in participants:
            with x.lock:
                pass
        if not commit:
            self._abort(meta, participants)
            if late:
                with self.lock:
                    self.stats["timed_out"] += 1
                raise meta.not_open("commit")
            return
        try:
            record = self._coverage(meta, participants)
            with self.lock:            # step 2 but the sync: the DECIDED frame (after BEGIN, in one write)
                self._log_with_begin(meta, [(TC_DECIDED, pack_txn(*meta.words) + record)])
                meta.decided = True
                meta.record = record
                mark = self.log.written
            if crashpoints.ARMED:
                crashpoints.reached("txn.recorded")
        except BaseException:
            self._prepare_failed(meta, participants)
            raise
        if future is not None:
            self._enqueue(future, meta, participants, mark)
            return
        self.log.sync_to(mark)             # the commit point
        if crashpoints.ARMED:
            crashpoints.reached("txn.decided")
        if self._apply(meta.id, True, participants):
            self._finish(meta, True)

    def _coverage(self, meta: TxnMeta, participants: list) -> bytes:
        """Step 1 of a commit (or a prepare): the decision record of what
        ``meta`` covers, its outputs too large to copy synced first."""
        copy = self.fsync != "never"
        outputs, acks = [], []
        size = 0
        for x in participants:
            if isinstance(x.topic, str):
                # (copies only while the transaction's batches fit the bound)
                batches = x.txn_batches(meta.words, decision.REDO_COPY_MAX - size if copy else -1)
                if batches:                # (None: the partition was deleted meanwhile)
                    outputs.append((x.topic, x.index, batches))
                    for b in batches:
                        size += b[3]
            else:
                topic = x.topic.name
                for p, cum, ranges in x.commit_ranges(meta.id):
                    acks.append((topic, x.name, p, cum, ranges))
        if copy and size > decision.REDO_COPY_MAX:
            # Too large to copy: durable in their segments before the decision.
            for x in participants:
                if isinstance(x.topic, str) and self.broker._participant_exists(x):
                    x.prepare_txn(meta.id)
            outputs = [(t, i, [b[:4] + (None,) for b in batches]) for t, i, batches in outputs]
        if crashpoints.ARMED:
            crashpoints.reached("txn.prepared")
        return decision.encode(outputs, acks)

    # -- prepared transactions ------------------------------------------------------

    def prepare(self, meta: TxnMeta, xid: str) -> None:
        """Make ``meta`` PREPARED (docs/API.md, "Prepared transactions"):
        its decision record, in a PREPARED frame with ``xid``, synced. From
        then on its outputs and acks are held as an open transaction's are,
        no timeout aborts it (but ``prepared_timeout``), and only a commit
        or an abort of it ends it. Errors before the frame is written
        abort the transaction and are raised."""
        with meta.lock:
            if meta.state is not TxnState.OPEN:
                raise meta.not_open("prepare")
            late = time.monotonic() > meta.deadline
            if not late:
                # (prepared_ms stays None until the frame is durable: no
                # commit or abort of it as a prepared transaction before)
                meta.state = TxnState.PREPARED
        if late:
            self.end(meta, False, reason="timeout")
            with self.lock:
                self.stats["timed_out"] += 1
            raise meta.not_open("prepare")
        participants = list(meta.partitions.values()) + list(meta.subscriptions.values())
        for x in participants:          # (as in end: operations in flight have finished)
            with x.lock:
                pass
        try:
            prepared_ms = now_ms()
            record = self._coverage(meta, participants)
            with self.lock:   # (BEGIN and ADD_SUBSCRIPTION too, as restoring it needs them)
                keys, frames = self._unlogged_subscriptions(meta)
                self._log_with_begin(meta, frames + [
                    (TC_PREPARED, pack_txn(*meta.words) + encode_prepared(prepared_ms, xid, record))])
                meta.logged_subs.update(keys)
                mark = self.log.written
                # From here a snapshot keeps it PREPARED, with its record
                # (_compact), as replaying the frame would.
                meta.record = record
                self.prepared[meta.words] = [prepared_ms, xid, PREPARED]
            if crashpoints.ARMED:
                crashpoints.reached("txn.prepare_recorded")
            self.log.sync_to(mark)
        except BaseException:
            with self.lock:
                kept = self.prepared.get(meta.words)
                if kept is not None and kept[2] == PREPARED:
                    kept[2] = ABORTED      # (what replaying the log says after the abort below)
            self._prepare_failed(meta, participants)
            raise
        with self.lock:
            meta.xid = xid
            self.stats["prepared"] += 1
        with meta.lock:
            meta.prepared_ms = prepared_ms
        if crashpoints.ARMED:
            crashpoints.reached("txn.prepare_synced")

    def _end_prepared(self, meta: TxnMeta, commit: bool, future=None) -> None:
        """Commit or abort a PREPARED transaction: the decision (COMMITTING,
        naming nothing more: the PREPARED frame's record covers it; or
        ABORTING) is synced in both cases, since recovery keeps a prepared
        transaction that has no decision; then the fan-out."""
        participants = list(meta.partitions.values()) + list(meta.subscriptions.values())
        with self.lock:
            self.log.append(TC_COMMITTING if commit else TC_ABORTING, pack_txn(*meta.words))
            meta.decided = commit
            mark = self.log.written
            kept = self.prepared.get(meta.words)
            if kept is not None:
                kept[2] = COMMITTED if commit else ABORTED
        if future is not None:
            self._enqueue(future, meta, participants, mark)
            return
        self.log.sync_to(mark)
        if crashpoints.ARMED:
            crashpoints.reached("txn.decided")
        if self._apply(meta.id, commit, participants):
            self._finish(meta, commit)

    def restore_prepared(self, words: tuple, entry: list, record: bytes, participants: list) -> TxnMeta:
        """Recovery: the PREPARED transaction ``words`` of the log (its
        replayed ``entry`` and decision ``record``) is live again, held by
        ``participants`` (the partitions and subscriptions' pending acks it
        names that still exist)."""
        prepared_ms, xid, _ = self.prepared[words]
        _, timeout_ms, start_ms, _, _ = entry
        timeout = timeout_ms / 1000.0
        meta = TxnMeta(TxnID.from_words(*words), timeout, start_ms, time.monotonic() + timeout)
        meta.state = TxnState.PREPARED
        meta.record = record
        meta.xid = xid
        meta.prepared_ms = prepared_ms
        meta.logged = True
        for x in participants:
            if isinstance(x.topic, str):
                meta.partitions[(x.topic, x.index)] = x
            else:
                meta.subscriptions[x.key] = x
                meta.logged_subs.add(x.key)
        with self.lock:
            self.txns[meta.id] = meta
        return meta

    def prepared_outcome(self, txn_id: TxnID):
        """PREPARED, COMMITTED or ABORTED for a prepared transaction this
        log keeps the outcome of, else None."""
        with self.lock:
            kept = self.prepared.get(txn_id.words)
        return None if kept is None else OUTCOMES[kept[2]]

    def forget_prepared(self, txn_id: TxnID) -> bool:
        """Stop keeping the outcome of an ended prepared transaction (a
        FORGET frame, not synced: a crash that loses it only keeps the
        outcome longer); False when it is not kept. A live prepared
        transaction is refused (InvalidTxnStateError)."""
        with self.lock:
            kept = self.prepared.get(txn_id.words)
            if kept is None:
                return False
            if kept[2] == PREPARED:
                raise InvalidTxnStateError(txn_id, "PREPARED", "forget its outcome (it has none yet)")
            self.log.append(TC_FORGET, pack_txn(*txn_id.words))
            del self.prepared[txn_id.words]
            self._maybe_compact()
        return True

    def _prepare_failed(self, meta: TxnMeta, participants: list) -> None:
        """Step 1 or 2 failed before a decision (or a PREPARED frame) was
        durable: the only way out is an abort."""
        log.exception("txmq: prepare of %s failed; aborting it", meta.id)
        with meta.lock:
            meta.state = TxnState.ABORTING
            meta.reason = "prepare failed"
        self._abort(meta, participants)

    def _abort(self, meta: TxnMeta, participants: list) -> None:
        """Steps 2 to 4 of an abort. Recovery aborts a transaction that has
        no decision logged, so ABORTING has no write of its own (it goes
        out with the log's next write, like the ABORTED frame after it: a
        full disk does not stop an abort), except after the PREPARED frame
        of a prepare whose sync failed, which recovery would otherwise
        restore: there it is written at once. A transaction the log does not know
        (it never reached a partition's files) needs no frame at all."""
        with self.lock:
            if meta.logged:
                if meta.record is None:
                    self.log.defer(TC_ABORTING, pack_txn(*meta.words))
                else:
                    self.log.append(TC_ABORTING, pack_txn(*meta.words))
            meta.decided = False
        if self._apply(meta.id, False, participants):
            self._finish(meta, False)

    # -- commit_async: the flusher -------------------------------------------------

    def _enqueue(self, future, meta: TxnMeta, participants: list, mark: int) -> None:
        with self._queue_cond:
            if self._flusher is None:
                self._flusher = threading.Thread(target=self._flush_loop, name=f"txmq-tc{self.id}-flusher",
                                                 daemon=True)
                self._flusher.start()
            self._queued.append((future, meta, participants, mark))
            self._queue_cond.notify()

    def _flush_loop(self) -> None:
        """Sync once for every decision queued so far, then fan each out
        and resolve its future, in the order they were decided."""
        while True:
            with self._queue_cond:
                while not self._queued and not self._closing:
                    self._queue_cond.wait()
                if not self._queued:
                    return
                todo = list(self._queued)
                self._queued.clear()
            try:
                self.log.sync_to(max(m for _, _, _, m in todo))
            except BaseException as e:      # the log is unusable: nothing here is known durable
                for future, *_ in todo:
                    future.set_exception(e)
                continue
            if crashpoints.ARMED:
                crashpoints.reached("txn.decided")
            for future, meta, participants, _ in todo:
                try:
                    if self._apply(meta.id, True, participants):
                        self._finish(meta, True)
                except BaseException as e:   # decided and durable: recovery or a retry applies it
                    log.exception("txmq: fan-out of %s failed", meta.id)
                    future.set_exception(e)
                    continue
                future.set_result(None)

    def drain(self) -> None:
        """Finish every queued commit_async commit and stop the flusher."""
        with self._queue_cond:
            self._closing = True
            self._queue_cond.notify()
            flusher = self._flusher
        if flusher is not None and flusher is not threading.current_thread():
            flusher.join()

    def _apply(self, txn_id: TxnID, commit: bool, participants: list) -> bool:
        """Step 3 (partitions first: their markers, then the acks); False
        when a participant failed (queued for a retry)."""
        failed = []
        for i, x in enumerate(participants):
            try:
                x.end_txn(txn_id, commit)
                with self.lock:
                    self._touched[id(x)] = x
            except Exception as e:     # retried by the scheduler until it succeeds
                if self.broker._participant_exists(x):
                    log.warning("txmq: %s of %s on %r failed, will retry: %s",
                                "commit" if commit else "abort", txn_id, x, e)
                    failed.append(x)
            if i == 0 and crashpoints.ARMED:
                crashpoints.reached("txn.markers_half")
        if crashpoints.ARMED:
            crashpoints.reached("txn.applied")
        if failed:
            with self.lock:
                self._retry[txn_id] = (commit, failed)
            return False
        return True

    def _finish(self, meta: TxnMeta, commit: bool) -> None:
        with self.lock:
            if meta.logged:
                # (no write of its own: it goes out with the log's next
                # write; a crash that loses it leaves a decided transaction,
                # which recovery applies again)
                self.log.defer(TC_COMMITTED if commit else TC_ABORTED, pack_txn(*meta.words))
            self.txns.pop(meta.id, None)
            self.stats["committed" if commit else "aborted"] += 1
            self._maybe_compact()
        with meta.lock:
            meta.state = TxnState.COMMITTED if commit else TxnState.ABORTED

    def retry_pending(self) -> None:
        """Run again the fan-out of transactions whose participants failed."""
        with self.lock:
            todo = list(self._retry.items())
        for txn_id, (commit, failed) in todo:
            with self.lock:
                self._retry.pop(txn_id, None)
            meta = self.txns.get(txn_id)
            if self._apply(txn_id, commit, failed) and meta is not None:
                self._finish(meta, commit)

    # -- timeouts ------------------------------------------------------------------

    def expire(self) -> int:
        """Abort every OPEN transaction past its timeout; return how many.
        Then :meth:`write_deferred` (the broker's scheduler calls this every
        timeout check, so a log names its ended transactions within one
        period)."""
        now = time.monotonic()
        due = []
        with self.lock:
            while self._timeouts and self._timeouts[0][0] <= now:
                _, seq = heapq.heappop(self._timeouts)
                meta = self.txns.get(TxnID(self.id, seq))
                if meta is not None and meta.state is TxnState.OPEN:
                    due.append((meta, "timeout"))
            if self.prepared_timeout is not None and self.prepared:
                oldest = now_ms() - self.prepared_timeout * 1000
                for words, (prepared_ms, _, outcome) in self.prepared.items():
                    if prepared_ms > oldest:
                        break               # (in the order they were prepared)
                    meta = self.txns.get(TxnID.from_words(*words)) if outcome == PREPARED else None
                    if meta is not None and meta.state is TxnState.PREPARED:
                        due.append((meta, "prepared timeout"))
        try:
            return self._end_due(due)
        finally:
            self.write_deferred()

    def write_deferred(self) -> None:
        """Write what waits for its log's next write: the final records
        (COMMITTED, ABORTED) of this log and the cursor frames of the acks
        its commits applied (``RedoLog.defer``). A write that fails (a
        full disk) leaves them waiting for a later one; nothing is raised."""
        with self.lock:
            touched = [x for x in self._touched.values() if not isinstance(x.topic, str)]
        for x in touched:          # (cursor frames first: a reader sees no commit ended before its acks)
            try:
                x.write_deferred()
            except (OSError, ValueError, BrokerClosedError) as e:
                log.debug("txmq: deferred cursor frames of %r not written: %s", x, e)
        with self.lock:
            try:
                self.log.write_deferred()
            except (OSError, ValueError) as e:     # (ValueError: the log is closed)
                log.debug("txmq: %s: deferred frames not written: %s", self.log.path, e)

    def _end_due(self, due: list) -> int:
        """Abort the transactions of ``due`` ([(meta, reason)]); how many."""
        n = 0
        for meta, reason in due:
            try:
                self.end(meta, False, reason=reason)
                n += 1
            except (BrokerClosedError,):
                return n
            except Exception as e:  # ended meanwhile by its owner
                log.debug("txmq: timeout of %s: %s", meta.id, e)
        if n:
            with self.lock:
                self.stats["timed_out"] += n
        return n

    # -- compaction ------------------------------------------------------------------

    def _maybe_compact(self) -> None:
        """Compact when due: housekeeping, so a full disk (StorageFullError)
        leaves the log as it is, to be compacted later, and fails nothing
        that called it (the decision it just logged stands)."""
        live = len(self.txns)
        if self.log.compact_due(COMPACT_FRAMES + LIVE_FRAMES * live, COMPACT_BYTES + LIVE_BYTES * live):
            self._compact(housekeeping=True)

    def _compact(self, housekeeping: bool = False) -> None:
        """Rewrite the log as a snapshot of the live transactions (TC lock
        held). Markers written since the last compaction are made durable
        first: once the log forgets a decision, the partitions must not need
        it again. ``housekeeping``: a full disk defers it (above); otherwise
        it raises StorageFullError."""
        touched, self._touched = self._touched, {}
        try:
            for x in touched.values():
                try:
                    # Durable markers (unless fsync="never") and a recovery point
                    # there, durable cursor frames of committed acks: reopening
                    # then needs no decision this log forgets, and scans no more
                    # log than one compaction cycle wrote.
                    x.flush()
                except BrokerClosedError:
                    pass
        except BaseException as e:
            # Not all of them are durable: the log forgets nothing, and they
            # are still to be made durable (and their deferred frames
            # written) by a later compaction.
            self._touched.update(touched)
            if housekeeping and isinstance(e, OSError):
                self.log.defer_compaction()
                log.warning("txmq: %s not compacted: a participant could not be made durable (%s); "
                            "compacted again later", self.log.path, e)
                return
            raise
        live, records = {}, {}
        for meta in self.txns.values():
            state = OPEN if meta.decided is None else COMMITTING if meta.decided else ABORTING
            if meta.decided is None and meta.record is not None:
                state = PREPARED               # (its PREPARED frame is written: prepare)
            live[meta.words] = [state, int(meta.timeout * 1000), meta.start_ms, set(meta.partitions),
                                set(meta.subscriptions)]
            if meta.record is not None and (meta.decided or state == PREPARED):
                # Decided, not yet applied everywhere, or prepared: the
                # snapshot keeps what it covers.
                records[meta.words] = meta.record
        ended = [w for w, kept in self.prepared.items() if kept[2] != PREPARED]
        for words in ended[:max(0, len(ended) - PREPARED_OUTCOMES_MAX)]:
            del self.prepared[words]        # the oldest outcomes nobody forgot
        snapshot = encode_coordinator_snapshot(max(self.next_seq, self.reserved), live, self.tids, records,
                                               self.prepared)
        if not housekeeping:
            self.log.compact(snapshot)
        elif not self.log.try_compact(snapshot):
            self._touched.update(touched)  # (still to be made durable by the next compaction)
            log.warning("txmq: %s not compacted: the disk is full; compacted again later", self.log.path)
            return
        for meta in self.txns.values():    # the snapshot names them from now on
            meta.logged = True
            meta.logged_subs.update(live[meta.words][4])

    def close(self) -> None:
        """Close the log (after :meth:`drain`). A transaction still open is
        aborted by the next open's recovery (nothing decided it), so from
        now on it reads ABORTED; its handle's later calls fail with
        BrokerClosedError. A PREPARED one stays PREPARED: the next open
        restores it."""
        self.drain()
        for meta in list(self.txns.values()):
            with meta.lock:
                if meta.state is TxnState.OPEN:
                    meta.state = TxnState.ABORTED
                    meta.reason = "closed"
        with self.lock:            # (it writes the deferred frames)
            self.log.close()
