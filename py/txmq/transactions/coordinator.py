"""Transaction coordinators (docs/API.md, "Transaction").

Each coordinator owns a transaction log ``<data>/coordinator/tc-<id>.log``
(the shared framed redo log; docs/FORMAT.md has the frames) and a timeout
tracker. Ending a transaction is two-phase:

1. prepare: every participant's data and pending acks are durable;
2. decide: COMMITTING / ABORTING is appended to the log (and, for a commit,
   made durable: this is the commit point);
3. fan out: every partition writes its marker, every subscription applies or
   drops its pending acks; a participant that fails is retried by the
   broker's scheduler until it succeeds;
4. the final COMMITTED / ABORTED record; the transaction is forgotten.

The log also maps the transactional ids homed here to their (producer id,
epoch) (docs/FORMAT.md, "Idempotent producers"): a PRODUCER frame per opening, kept by compaction.

``commit()`` returns after step 3. Recovery (driven by the broker) redoes
step 3 for every decided transaction and aborts every other one.
"""

from __future__ import annotations

import heapq
import logging
import struct
import threading
import time

from txmq import crashpoints
from txmq._redolog import RedoLog
from txmq._txn import (ABORTING, COMMITTING, OPEN, TC_ABORTED, TC_ABORTING,
                       TC_ADD_PARTITION, TC_ADD_SUBSCRIPTION, TC_BEGIN, TC_COMMITTED, TC_COMMITTING,
                       TC_PRODUCER, encode_coordinator_snapshot, encode_producer, encode_text, pack_txn,
                       replay_coordinator)
from txmq.errors import BrokerClosedError
from txmq.transactions.records import TxnID, TxnMeta, TxnState

log = logging.getLogger("txmq.coordinator")

# The log is rewritten as a snapshot of the live transactions once it holds
# this many frames more than the live transactions need, so replay on open
# stays short however many ended, and the cost of a snapshot (proportional
# to the live transactions) is spread over as many frames.
COMPACT_FRAMES = 2_048
LIVE_FRAMES = 16
_TIMES = struct.Struct("<qq")


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class TransactionCoordinator:
    """One coordinator: its log, its live transactions, their timeouts."""

    def __init__(self, broker, coordinator_id: int, path: str, fsync: str):
        self.broker = broker
        self.id = coordinator_id
        self.fsync = fsync
        self.log = RedoLog(path, fsync)
        self.lock = threading.Lock()
        self.txns: dict[TxnID, TxnMeta] = {}
        self.tids: dict[str, tuple] = {}   # transactional id -> (producer id, epoch)
        self.next_seq = 1
        self._timeouts: list = []          # heap of (deadline, sequence)
        self._touched: dict = {}           # participants that applied outcomes since the last compaction
        self._retry: dict[TxnID, tuple] = {}  # transactions whose fan-out must be retried
        self.problems: list[str] = []
        self.stats = {"begun": 0, "committed": 0, "aborted": 0, "timed_out": 0}

    # -- recovery --------------------------------------------------------------

    def replay(self) -> dict:
        """The log's transactions as ``{(hi, lo): [state, timeout_ms,
        start_ms, partitions, subscriptions]}`` (see :func:`replay_coordinator`)."""
        frames = self.log.replay(positions=True)
        if self.log.dropped is not None:
            pos, reason, n = self.log.dropped
            self.problems.append(f"{self.log.path} at byte {pos}: {reason}; {n} bytes cut")
            log.warning("txmq: coordinator log %s", self.problems[-1])
        # A frame that does not parse: CorruptLogError at its bad byte.
        next_lo, txns, self.tids = replay_coordinator(frames, self.log.path)
        self.next_seq = max(self.next_seq, next_lo, 1)
        return txns

    def saw(self, sequence: int) -> None:
        """A participant knows ``sequence``: never hand it out again."""
        if sequence >= self.next_seq:
            self.next_seq = sequence + 1

    def record_decision(self, words: tuple, commit: bool) -> None:
        with self.lock:
            self.log.append(TC_COMMITTING if commit else TC_ABORTING, pack_txn(*words))

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
            self.next_seq += 1
            meta = TxnMeta(TxnID(self.id, seq), timeout, start, time.monotonic() + timeout)
            meta.owner = owner
            self.log.append(TC_BEGIN, pack_txn(*meta.words) + _TIMES.pack(int(timeout * 1000), start))
            self.txns[meta.id] = meta
            heapq.heappush(self._timeouts, (meta.deadline, seq))
            if len(self._timeouts) > 2 * len(self.txns) + 1024:
                self._timeouts = [(m.deadline, m.id.sequence) for m in self.txns.values()]
                heapq.heapify(self._timeouts)
            self.stats["begun"] += 1
            self._maybe_compact()
        return meta

    def register_partition(self, meta: TxnMeta, partition) -> None:
        """ADD_PARTITION, logged before the transaction's first append there."""
        key = (partition.topic, partition.index)
        with meta.lock:
            meta.check_open("send")
            if meta.partitions.get(key) is partition:
                return        # (a topic deleted and created again is a new participant)
            with self.lock:
                self.log.append(TC_ADD_PARTITION, pack_txn(*meta.words) + encode_text(partition.topic)
                                + struct.pack("<I", partition.index))
            meta.partitions[key] = partition

    def register_subscription(self, meta: TxnMeta, subscription) -> None:
        """ADD_SUBSCRIPTION, logged before the transaction's first ack there."""
        key = (subscription.topic.name, subscription.name)
        with meta.lock:
            meta.check_open("acknowledge")
            if meta.subscriptions.get(key) is subscription:
                return
            with self.lock:
                self.log.append(TC_ADD_SUBSCRIPTION, pack_txn(*meta.words) + encode_text(key[0])
                                + encode_text(key[1]))
            meta.subscriptions[key] = subscription

    # -- ending ----------------------------------------------------------------------

    def end(self, meta: TxnMeta, commit: bool, reason: str | None = None) -> None:
        """Commit or abort ``meta`` (the four steps of the module docstring).

        ``reason`` marks an abort the broker made ("timeout", "forced",
        "fenced"). A user's abort of a transaction already aborted (by an
        earlier abort, or by the broker) is a no-op: the caller's wish holds.
        """
        with meta.lock:
            if meta.state is not TxnState.OPEN:
                if not commit and reason is None and meta.state in (TxnState.ABORTING, TxnState.ABORTED):
                    return
                raise meta.not_open("commit" if commit else "abort")
            late = commit and time.monotonic() > meta.deadline
            if late:       # past its timeout, the timer not there yet: never commit it
                commit, reason = False, "timeout"
            meta.state = TxnState.COMMITTING if commit else TxnState.ABORTING
            if reason is not None:
                meta.reason = reason
        participants = list(meta.partitions.values()) + list(meta.subscriptions.values())
        # Operations that passed their check under a participant's lock have
        # finished once we hold that lock; later ones see the new state.
        for x in participants:
            with x.lock:
                pass
        if commit:
            try:
                self._prepare(meta, participants)
            except BaseException:
                # No decision is logged: the only way out is an abort.
                log.exception("txmq: prepare of %s failed; aborting it", meta.id)
                with meta.lock:
                    meta.state = TxnState.ABORTING
                    meta.reason = "prepare failed"
                self._decide_and_apply(meta, False, participants)
                raise
            crashpoints.reached("txn.prepared")
        self._decide_and_apply(meta, commit, participants)
        if late:
            with self.lock:
                self.stats["timed_out"] += 1
            raise meta.not_open("commit")

    def _prepare(self, meta: TxnMeta, participants: list) -> None:
        """Step 1: every participant's data and pending acks durable (a
        participant deleted meanwhile has nothing left to keep)."""
        if self.fsync == "never":
            return
        for x in participants:
            if self.broker._participant_exists(x):
                x.prepare_txn(meta.id)

    def _decide_and_apply(self, meta: TxnMeta, commit: bool, participants: list) -> None:
        """Steps 2 to 4."""
        with self.lock:
            self.log.append(TC_COMMITTING if commit else TC_ABORTING, pack_txn(*meta.words))
            meta.decided = commit
            mark = self.log.written
        if commit:
            self.log.sync_to(mark)         # the commit point
            crashpoints.reached("txn.decided")
        if self._apply(meta.id, commit, participants):
            self._finish(meta, commit)

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
            if i == 0:
                crashpoints.reached("txn.markers_half")
        crashpoints.reached("txn.applied")
        if failed:
            with self.lock:
                self._retry[txn_id] = (commit, failed)
            return False
        return True

    def _finish(self, meta: TxnMeta, commit: bool) -> None:
        with self.lock:
            self.log.append(TC_COMMITTED if commit else TC_ABORTED, pack_txn(*meta.words))
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
        """Abort every OPEN transaction past its timeout; return how many."""
        now = time.monotonic()
        due = []
        with self.lock:
            while self._timeouts and self._timeouts[0][0] <= now:
                _, seq = heapq.heappop(self._timeouts)
                meta = self.txns.get(TxnID(self.id, seq))
                if meta is not None and meta.state is TxnState.OPEN:
                    due.append(meta)
        n = 0
        for meta in due:
            try:
                self.end(meta, False, reason="timeout")
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
        if self.log.frames_since_snapshot >= COMPACT_FRAMES + LIVE_FRAMES * len(self.txns):
            self._compact()

    def _compact(self) -> None:
        """Rewrite the log as a snapshot of the live transactions (TC lock
        held). Markers written since the last compaction are made durable
        first: once the log forgets a decision, the partitions must not need
        it again."""
        touched, self._touched = self._touched, {}
        for x in touched.values():
            try:
                # Durable markers (unless fsync="never") and a recovery point
                # there, durable cursor frames of committed acks: reopening
                # then needs no decision this log forgets, and scans no more
                # log than one compaction cycle wrote.
                x.flush()
            except BrokerClosedError:
                pass
        live = {}
        for meta in self.txns.values():
            state = OPEN if meta.decided is None else COMMITTING if meta.decided else ABORTING
            live[meta.words] = [state, int(meta.timeout * 1000), meta.start_ms,
                                set(meta.partitions), set(meta.subscriptions)]
        self.log.compact(encode_coordinator_snapshot(self.next_seq, live, self.tids))

    def close(self) -> None:
        """Close the log. A transaction still open is aborted by the next
        open's recovery (nothing decided it), so from now on it reads
        ABORTED; its handle's later calls fail with BrokerClosedError."""
        for meta in list(self.txns.values()):
            with meta.lock:
                if meta.state is TxnState.OPEN:
                    meta.state = TxnState.ABORTED
                    meta.reason = "closed"
        self.log.close()
