"""A subscription's pending acks: acks made inside a transaction, kept apart
from the subscription's dispatch as Pulsar keeps its pending-ack handle
apart from the subscription.

Per partition, the acks an open transaction holds are in the lane's
:class:`~txmq._txn.PendingAckTable`, and framed in ``pending-<p>.log``
(frames in docs/FORMAT.md) only when asked (ACK: ``Transaction.flush``, a
prepare, close; CUMULATIVE when made): a commit's decision record names
them instead. A transaction framed here gets COMMIT (after the cursor
frames it applied are synced) or ABORT when it ends.
Opening replays the log into the table (:func:`open_pending_log`).

:class:`PendingAcks` is the transaction participant for a subscription's
acks: the coordinator registers it, prepares it (the log synced), ends it
(commit: the acks go to the cursor; abort: the messages are redelivered)
and flushes it. The dispatch state it changes (outstanding deliveries,
redelivery) belongs to :mod:`txmq.dispatch.subscription`, which it asks.
"""

from __future__ import annotations

import bisect
import heapq
import struct

from txmq._redolog import RedoLog
from txmq._txn import PendingAckTable, ack_in
from txmq._txnlog import PA_ABORT, PA_ACK, PA_COMMIT, PA_CUMULATIVE, pack_txn, replay_pending
from txmq.dispatch import lane_invariant
from txmq.errors import BrokerClosedError, SubscriptionTypeError, TransactionConflictError
from txmq.message import MessageId
from txmq.storage.cursor import COMPACT_FRAMES
from txmq.transactions.records import TxnID, TxnState


def open_pending_log(path: str, fsync: str, problems: list):
    """The pending-ack table and log of one partition, replayed from
    ``path``; a cut tail is reported in ``problems`` (the cursor's). A frame
    that does not parse: CorruptLogError at its bad byte."""
    log = RedoLog(path, fsync)
    table = PendingAckTable()
    held = replay_pending(log.replay(positions=True), log.path)
    if log.dropped is not None:
        pos, reason, n = log.dropped
        problems.append(f"{log.path} at byte {pos}: {reason}; {n} bytes cut")
    for words, (offsets, cumulative) in held.items():
        txn_id = TxnID.from_words(*words)
        table.add(txn_id, offsets)
        if cumulative >= 0:
            table.add_cumulative(txn_id, cumulative)
    table.mark_logged()
    return table, log


class PendingAcks:
    """The pending-ack handle of one subscription: the transaction
    participant for the acks made in it inside transactions."""

    def __init__(self, subscription):
        self.subscription = subscription
        self.topic = subscription.topic      # (the coordinator logs the participant by topic and name)
        self.name = subscription.name
        self.lock = subscription.lock        # the participant lock a transaction's end takes
        self.key = (self.topic.name, self.name)   # (the coordinator's key of it: register_subscription)
        self._unwritten = set()      # lanes whose cursor log holds deferred frames (write_deferred)
        # What the compiled ack(m, txn=) reads (txmq._txn.ack_in), fixed for this object's life
        self.route = (self.topic.name, subscription, subscription.lanes, self.key, self.lock)

    def __repr__(self) -> str:
        return repr(self.subscription)

    def _refuse_conflict(self, meta, lane, conflict) -> None:
        """Raise TransactionConflictError for a conflict the pending-ack
        table found, if any."""
        if conflict is not None:
            off, reason, other = conflict
            raise TransactionConflictError(meta.id, MessageId(self.topic.name, lane.partition.index, off),
                                           reason, other)

    def ack_txn(self, meta, message_ids) -> int:
        """Acknowledge ``message_ids`` inside transaction ``meta``: checked
        against every conflict rule first (nothing changes on a conflict),
        then written to the pending-ack logs. Return how many were new."""
        sub = self.subscription
        return self._ack_txn_lanes(meta, sub._lanes_of(message_ids))

    def ack_range_txn(self, meta, partition: int, offsets) -> int:
        """:meth:`ack_txn` of sorted offsets (a list, or a range) of one
        partition (Arrow batches)."""
        sub = self.subscription
        lane = sub._lane_of(MessageId(self.topic.name, partition, offsets[-1]))
        sub._lane_of(MessageId(self.topic.name, partition, offsets[0]))
        return self._ack_txn_lanes(meta, [(lane, offsets)])

    def _ack_txn_lanes(self, meta, checked: list) -> int:
        sub = self.subscription
        if not checked:
            return 0
        if meta.subscriptions.get(self.key) is not self:
            sub.broker._coordinator_of(meta).register_subscription(meta, self)
        n = 0
        with sub.cond:
            meta.check_open("acknowledge")
            for lane, offsets in checked:
                if type(offsets) is range:        # a received run (group_offsets, Arrow batches)
                    conflict = lane.pending.conflict_range(meta.id, offsets.start, offsets.stop,
                                                           lane.cursor.mark_delete, lane.cursor.acked)
                else:
                    conflict = lane.pending.conflict_individual(meta.id, offsets, lane.cursor.mark_delete,
                                                                lane.cursor.acked)
                self._refuse_conflict(meta, lane, conflict)
            for lane, offsets in checked:
                # (framed only if a flush or a prepare asks: write_txn)
                if type(offsets) is range:
                    k = lane.pending.add_range(meta.id, offsets.start, offsets.stop)
                    if k:
                        sub._hold_span(lane, offsets.start, offsets.stop)
                    n += k
                    continue
                new = lane.pending.add(meta.id, offsets)
                if not new:
                    continue
                sub._hold(lane, new)
                n += len(new)
            if lane_invariant.DEBUG:
                for lane, _ in checked:
                    lane_invariant.changed(lane)
        return n

    def ack_one(self, meta, topic, partition, offset) -> None:
        """:meth:`ack_txn` of one message, given by the fields of its id
        (no id tuple is built): ``ack(m, txn=)``, the README's loop. The
        compiled ``ack_in`` records it (in memory: :meth:`write_txn`
        frames it if a flush or a prepare asks); this raises what is
        wrong with the id, registers the subscription with the transaction
        on its first ack here, and raises why ``ack_in`` refused."""
        sub = self.subscription
        lanes = sub.lanes
        if (topic != self.topic.name or type(partition) is not int or not 0 <= partition < len(lanes)
                or type(offset) is not int):
            sub._lane_of(MessageId(topic, partition, offset))    # raises what is wrong with it
        lane = lanes[partition]
        if not 0 <= offset < lane.partition._segments[-1].next_offset:
            sub._lane_of(MessageId(topic, partition, offset))
        if meta.subscriptions.get(self.key) is not self:
            sub.broker._coordinator_of(meta).register_subscription(meta, self)
        while not ack_in(self, meta, topic, partition, offset, TxnState.OPEN):
            with sub.lock:          # why it was refused (a conflict may have ended since: try again)
                if meta.state is not TxnState.OPEN:
                    raise meta.not_open("acknowledge")
                cursor = lane.cursor
                self._refuse_conflict(meta, lane, lane.pending.conflict_individual(
                    meta.id, (offset,), cursor.mark_delete, cursor.acked))
        if lane_invariant.DEBUG:
            with sub.lock:
                lane_invariant.changed(lane)

    def write_txn(self, txn_id) -> None:
        """Frame the acks ``txn_id`` made here that are not in the
        pending-ack logs yet: one ACK frame per lane, when
        ``Transaction.flush`` or a prepare asks (a commit needs none: its
        decision record names them)."""
        sub = self.subscription
        with sub.lock:
            if sub.closed:
                return
            for lane in sub.lanes:
                new = lane.pending.take_unlogged(txn_id)
                if new is not None:
                    lane.pending_log.append(PA_ACK, pack_txn(*txn_id.words) + struct.pack("<I", len(new))
                                            + new.astype("<i8").tobytes())

    def _write_lane(self, lane, txn_id) -> None:
        new = lane.pending.take_unlogged(txn_id)
        if new is not None:
            lane.pending_log.append(PA_ACK, pack_txn(*txn_id.words) + struct.pack("<I", len(new))
                                    + new.astype("<i8").tobytes())

    def txn_ack_ranges(self, txn_id) -> list:
        """``[[(start, end), ...] per lane]``: the offsets ``txn_id``
        acknowledged individually on each partition, as ranges."""
        sub = self.subscription
        with sub.cond:
            return [lane.pending.ranges_of(txn_id) for lane in sub.lanes]

    def ack_cumulative_txn(self, meta, message_id) -> None:
        """Cumulative ack inside transaction ``meta`` (exclusive / failover)."""
        sub = self.subscription
        if sub.type == "shared":
            raise SubscriptionTypeError(sub.name, sub.type, "exclusive or failover (ack_cumulative)")
        lane = sub._lane_of(message_id)
        coordinator = sub.broker._coordinator_of(meta)
        coordinator.register_subscription(meta, self)
        coordinator.log_participants(meta)      # (before its CUMULATIVE frame)
        with sub.cond:
            meta.check_open("acknowledge")
            self._refuse_conflict(meta, lane, lane.pending.conflict_cumulative(
                meta.id, message_id.offset, lane.cursor.mark_delete))
            lane.pending_log.append(PA_CUMULATIVE, pack_txn(*meta.words) + struct.pack("<q", message_id.offset))
            lane.pending.add_cumulative(meta.id, message_id.offset)
            sub._hold(lane, [o for o in lane.outstanding if o <= message_id.offset])
            if lane.ranges:
                lane.ranges = [[max(s, message_id.offset + 1), e, cid] for s, e, cid in lane.ranges
                               if e > message_id.offset + 1]
            if lane_invariant.DEBUG:
                lane_invariant.changed(lane)

    def pending_txns(self) -> set:
        """TxnIDs with acks pending on any partition of this subscription."""
        sub = self.subscription
        with sub.cond:
            return set().union(*(lane.pending.txns() for lane in sub.lanes))

    def prepare_txn(self, txn_id) -> None:
        """Make the pending acks of ``txn_id`` durable. A commit no longer
        needs it (its decision record holds the acks as ranges); kept for
        callers that want the pending-ack log itself durable."""
        sub = self.subscription
        logs = []
        with sub.cond:
            for lane in sub.lanes:
                if txn_id in lane.pending.txns():
                    self._write_lane(lane, txn_id)
                    logs.append((lane.pending_log, lane.pending_log.written))
        for plog, mark in logs:
            plog.sync_to(mark)

    def commit_ranges(self, txn_id) -> list:
        """What committing ``txn_id`` applies here, per partition, for its
        decision record: ``[(partition, cumulative or -1, [(start, end)])]``.
        Read without the subscription's lock: the transaction has left OPEN
        and its last ack has finished (the coordinator took this
        participant's lock after), so nothing changes its entries; a
        concurrent change to other transactions' entries is one dict
        operation under the GIL."""
        out = []
        for lane in self.subscription.lanes:
            pending = lane.pending
            ranges, cumulative = pending.ranges_of(txn_id), pending.peek_cumulative(txn_id)
            if ranges or cumulative >= 0:
                out.append((lane.partition.index, cumulative, ranges))
        return out

    def redo_commit(self, partition: int, cumulative: int, ranges: list) -> None:
        """Recovery: apply the acks a logged commit made on ``partition``
        (its decision record's ranges; those already in the cursor change
        nothing), below the partition's end, and make the cursor durable:
        the coordinator log forgets the decision once recovery is done."""
        sub = self.subscription
        with sub.cond:
            for lane in self._lanes_on(partition):
                end = lane.partition.end_offset
                offsets = [o for s, e in ranges for o in range(s, min(e, end))]
                sub._apply_acks(lane, offsets, min(cumulative, end - 1), sync=False)
                if sub.broker.fsync != "never" and not lane.cursor.log.closed:
                    lane.cursor.log.sync()

    def _lanes_on(self, partition: int) -> list:
        """The lane of partition index ``partition`` (none when the topic
        has no such partition any more)."""
        return [lane for lane in self.subscription.lanes if lane.partition.index == partition]

    def redo_prepare(self, txn_id, partition: int, cumulative: int, ranges: list) -> None:
        """Recovery: hold again the acks a PREPARED transaction's decision
        record names on ``partition`` that its pending-ack log lost (a
        power loss), and frame them there, so the transaction still holds
        exactly what it prepared."""
        sub = self.subscription
        with sub.cond:
            for lane in self._lanes_on(partition):
                end = lane.partition.end_offset
                for s, e in ranges:
                    lane.pending.add_range(txn_id, s, min(e, end))
                self._write_lane(lane, txn_id)
                cumulative = min(cumulative, end - 1)
                if cumulative > lane.pending.peek_cumulative(txn_id):
                    lane.pending_log.append(PA_CUMULATIVE, pack_txn(*txn_id.words) + struct.pack("<q", cumulative))
                    lane.pending.add_cumulative(txn_id, cumulative)

    def end_txn(self, txn_id, commit: bool) -> None:
        """Apply (commit) or drop (abort) the acks ``txn_id`` holds here. On
        abort the messages become deliverable again with redelivery count
        + 1. Ending twice changes nothing."""
        sub = self.subscription
        frame = pack_txn(*txn_id.words)
        with sub.lock:
            for lane in sub.lanes:
                # Taken out only once applied: a failure leaves them for the retry.
                ranges = lane.pending.ranges_of(txn_id)
                cumulative = lane.pending.peek_cumulative(txn_id)
                if not ranges and cumulative < 0:
                    continue
                framed = lane.pending.framed(txn_id)
                if commit:
                    # (acks never framed here need no frame now: the
                    # decision record names them all)
                    # Cursor frames wait for the cursor log's next write
                    # or sync (RedoLog.defer), and the COMMIT frame until
                    # they are synced (flush): until then the pending-ack
                    # log and the coordinator's decision can redo this.
                    sub._apply_ack_ranges(lane, ranges, cumulative, sync=False, defer=True)
                    lane.pending.drop(txn_id, ranges)
                    self._unwritten.add(lane)
                else:
                    offsets = lane.pending.take(txn_id)[0]
                    again = set(offsets)
                    if cumulative >= 0:
                        again.update(range(lane.cursor.mark_delete, cumulative + 1))
                    # Offsets still waiting in the read buffer go out from there,
                    # as do those out-of-order delivery parked or released.
                    read_up_to = (lane.buffer[lane.buf_i].offset if lane.buf_i < len(lane.buffer)
                                  else lane.read_offset)
                    waiting = starts = ()
                    if lane.parked or lane.released:
                        waiting = lane.waiting_spans()
                        starts = [a for a, _ in waiting]
                    # (settled() and _queue_redelivery(), inline: an abort
                    # makes every offset it held deliverable again at once)
                    md, acked, pending = lane.cursor.mark_delete, lane.cursor.acked, lane.pending
                    counts, outstanding, redeliver = lane.redelivery_count, lane.outstanding, lane.redeliver
                    for off in sorted(again):
                        if waiting:
                            i = bisect.bisect_right(starts, off) - 1
                            if i >= 0 and off < waiting[i][1]:
                                continue
                        if (off < read_up_to and off >= md and not acked.contains(off)
                                and not (len(pending) and pending.is_pending(off)) and off not in outstanding):
                            counts[off] = counts.get(off, 0) + 1
                            heapq.heappush(redeliver, (0.0, off))
                if commit:      # (None: nothing to frame, the cursor's sync is still owed)
                    lane.unsynced_commits.append(frame if framed else None)
                elif framed:
                    lane.pending_log.append(PA_ABORT, frame)
                if lane.pending_log.compact_due(COMPACT_FRAMES):
                    self.sync_commits(lane)
                    # Housekeeping: a full disk defers it, the log stays valid.
                    if lane.pending_log.try_compact(lane.pending.to_bytes()):
                        lane.pending.mark_logged()
                if lane_invariant.DEBUG:
                    lane_invariant.changed(lane)
            if not commit:
                sub.cond.notify_all()      # (a commit makes nothing deliverable)

    def flush(self) -> None:
        """Make the cursor frames of committed transactions durable, then
        log their COMMIT frames. The coordinator calls this before its log
        forgets their decisions."""
        sub = self.subscription
        with sub.cond:
            if sub.closed:
                raise BrokerClosedError(f"subscription {self.name!r} is closed")
            for lane in sub.lanes:
                self.sync_commits(lane)

    def write_deferred(self) -> None:
        """Write the cursor frames of committed transactions that wait for
        their log's next write (the coordinator's periodic timeout check
        calls it, so another process reading the cursor is not behind for
        long)."""
        sub = self.subscription
        with sub.lock:
            lanes = list(self._unwritten)
            self._unwritten.clear()
            for i, lane in enumerate(lanes):
                if lane.cursor.log.closed:
                    continue
                try:
                    lane.cursor.log.write_deferred()
                except BaseException:
                    self._unwritten.update(lanes[i:])     # (still waiting: the next check tries again)
                    raise

    def sync_commits(self, lane) -> None:
        if not lane.unsynced_commits:
            return
        if not lane.cursor.log.closed:
            lane.cursor.log.sync()             # (its deferred frames first)
            self._unwritten.discard(lane)
        frames = [(PA_COMMIT, f) for f in lane.unsynced_commits if f is not None]
        if frames:
            lane.pending_log.append_many(frames)
        lane.unsynced_commits = []
