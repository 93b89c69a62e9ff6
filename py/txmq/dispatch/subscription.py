"""A subscription: a named cursor on every partition of a topic, and the
dispatch of its messages to the consumers attached to it.

Per partition a subscription keeps a *lane*: its cursor (mark-delete and
the individual acks above it), the acks held by open transactions, and
the dispatch state: what is outstanding at consumers (one by one in
``outstanding``, or as batch deliveries in ``ranges``), the read buffer
(decoded messages of one batch not yet handed out) and the redelivery
queue. ``read_offset`` is where the next read of the log starts; offsets
at or past it have not been read yet.

The lane invariant: every offset in ``[mark_delete, read_offset)`` is
either *settled* — acknowledged in the cursor, or pending in an open
transaction — or in exactly one dispatch state: outstanding at one
consumer (individually or in one batch delivery), waiting in the read
buffer, queued for redelivery, or (out-of-order delivery, below) parked
behind its open transaction or released by its commit. Transaction
markers, and aborted batches under read_committed, are never delivered:
the read passes over them by acknowledging them in the cursor. A settled
offset is outstanding nowhere (a pending one is in no batch delivery
either), but the read buffer, the redelivery queue and the parked and
released spans may still name it, as the queue may an offset delivered
again since it was queued: such an entry is dropped when it comes up. A
queued offset is never in a batch delivery or the read buffer as well
(it would be delivered twice). Offsets that retention deleted
need no state; offsets lost to quarantined bytes are in none either: the
read passes over them without acknowledging them, until
:meth:`Subscription.skip_lost` does. Nothing else is needed to deliver each message to one
consumer at a time. With ``TXMQ_DEBUG=1`` every change of a lane is
followed by a check of this (:mod:`txmq.dispatch.lane_invariant`).

Out-of-order delivery (``allow_out_of_order_delivery``, shared
read_committed subscriptions only): the lane reads up to the log end
instead of maxReadPosition. A batch of a transaction whose fate is known
is handled as above; a batch of a transaction still open (in the
partition's ``ongoing``, asked before ``aborted``: an aborting
transaction enters ``aborted`` before it leaves ``ongoing``) is *parked*:
its offsets wait in ``parked``, by transaction, delivered to no one. The
partition's end listener tells the lane when a transaction ends: a
committed one's parked spans move to ``released`` (a heap of spans due
now, delivered in offset order among the due redeliveries, redelivery
count 0), an aborted one's are passed over as acknowledged. A parked
offset is never acknowledged by the lane, so mark-delete stops below it.

Acks made inside a transaction do not touch the cursor: they are held in the
lane's pending-ack table and written to ``pending-<p>.log`` by the
subscription's pending-ack handle (:mod:`txmq.dispatch.pending_acks`, kept
apart from dispatch as Pulsar keeps its pending-ack handle apart from the
subscription). A pending offset is never delivered or redelivered until
its transaction ends: commit acknowledges it in the cursor, abort queues
it for redelivery (or leaves it to the read buffer, if it waits there).
"""

from __future__ import annotations

import heapq
import logging
import os
import threading
import time

from txmq._ackset import group_offsets
from txmq._segment import SegmentClosedError
from txmq.dispatch import lane_invariant
from txmq.dispatch.arrow_delivery import ArrowDelivery
from txmq.dispatch.lanes import _Lane, _changed, _cut_from_ranges, _min, _touches, _txn_id
from txmq.dispatch.out_of_order import OutOfOrderDelivery
from txmq.dispatch.pending_acks import PendingAcks, open_pending_log
from txmq.storage.cursor import Cursor
from txmq.files import sync_dir, write_json
from txmq.errors import (BrokerClosedError, DataLossError, NotAcknowledgeableError, SubscriptionBusyError,
                         SubscriptionTypeError, TransactionConflictError)
from txmq.message import MessageId
from txmq.storage.delivery import ISOLATIONS, READ_COMMITTED, TRANSACTIONAL, read_limit

log = logging.getLogger("txmq.subscription")

TYPES = ("exclusive", "shared", "failover")
# A run of at least this many fresh messages is delivered as one range
# (``_Lane.ranges``) rather than an entry per offset: its ack is then one
# range too. Shorter ones keep per-offset entries, so a consumer holding
# many single messages acks each in O(1).
RANGE_DELIVERY_MIN = 16
POSITIONS = ("latest", "earliest")


def config_problem(config: dict) -> str | None:
    """What is wrong with a ``subscription.json`` (docs/FORMAT.md), or
    None: a type, isolation and initial position it knows, and
    ``allow_out_of_order_delivery`` (missing: False) true only for a
    shared read_committed subscription."""
    for key, allowed in (("type", TYPES), ("isolation", ISOLATIONS), ("initial_position", POSITIONS)):
        if config.get(key) not in allowed:
            return f"\"{key}\" is {config.get(key)!r}, not one of {', '.join(allowed)}"
    ooo = config.get("allow_out_of_order_delivery", False)
    if type(ooo) is not bool:
        return f"\"allow_out_of_order_delivery\" is {ooo!r}, not true or false"
    if ooo and (config["type"], config["isolation"]) != ("shared", READ_COMMITTED):
        return (f"\"allow_out_of_order_delivery\" is true for a {config['type']} {config['isolation']} "
                f"subscription (only a shared read_committed one delivers out of order)")
    return None


class Subscription(OutOfOrderDelivery, ArrowDelivery):
    """Durable subscription state plus its live consumers. Thread-safe.

    ``allow_out_of_order_delivery`` (shared and read_committed only; the
    broker checks): committed batches past an open transaction are
    delivered at once, the open one's when it commits (module docstring)."""

    def __init__(self, broker, topic, name: str, path: str, *, type: str, isolation: str,
                 initial_position: str, ack_timeout: float | None, nack_delay: float,
                 allow_out_of_order_delivery: bool = False, created_ms: int | None = None):
        self.broker = broker
        self.topic = topic
        self.name = name
        self.path = path
        self.type = type
        self.isolation = isolation
        self.initial_position = initial_position
        self.out_of_order = bool(allow_out_of_order_delivery)
        self.ack_timeout = ack_timeout
        self.nack_delay = nack_delay
        # The subscription lock, taken as ``cond`` or, where nothing waits
        # or is woken, as the plain lock (no Python-level call).
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.consumers: list = []
        self._next_consumer_id = 0
        self.closed = False
        os.makedirs(path, exist_ok=True)
        self.created_ms = created_ms
        if not os.path.exists(os.path.join(path, "subscription.json")):
            self.created_ms = time.time_ns() // 1_000_000
            self.write_config()
        self.lanes: list[_Lane] = []
        self.pending_acks = PendingAcks(self)   # the transaction participant for its acks
        for p in topic.partitions:
            self._add_lane(p)
        if broker.fsync != "never":
            sync_dir(path)
            sync_dir(os.path.dirname(path))

    def write_config(self) -> None:
        """Write ``subscription.json``: type, isolation, initial position,
        ``allow_out_of_order_delivery`` and creation time (docs/FORMAT.md)."""
        config = {"type": self.type, "isolation": self.isolation, "initial_position": self.initial_position,
                  "allow_out_of_order_delivery": self.out_of_order}
        if self.created_ms is not None:
            config["created_ms"] = self.created_ms
        write_json(os.path.join(self.path, "subscription.json"), config)

    def _add_lane(self, partition) -> None:
        initial = partition.end_offset if self.initial_position == "latest" else partition.start_offset
        cursor = Cursor(os.path.join(self.path, f"cursor-{partition.index}.log"),
                        self.broker.fsync, initial, partition.start_offset)
        cursor.clamp(partition.end_offset)
        pending, pending_log = open_pending_log(os.path.join(self.path, f"pending-{partition.index}.log"),
                                                self.broker.fsync, cursor.problems)
        lane = _Lane(partition, cursor, pending, pending_log, self.isolation == READ_COMMITTED)
        self.lanes.append(lane)
        if self.out_of_order:
            partition.add_end_listener(self._on_txn_end)
        partition.add_listener(self._on_append)

    def _on_append(self, partition) -> None:
        with self.cond:
            self.cond.notify_all()

    # -- consumers -----------------------------------------------------------

    def attach(self, consumer) -> int:
        with self.cond:
            if self.type == "exclusive" and self.consumers:
                raise SubscriptionBusyError(self.topic.name, self.name)
            cid = self._next_consumer_id
            self._next_consumer_id += 1
            before = self._assignment()
            consumer.id = cid
            self.consumers.append(consumer)
            self._reassigned(before)
            return cid

    def detach(self, consumer) -> None:
        """Remove a consumer; its unacknowledged messages go to the others."""
        with self.cond:
            if consumer not in self.consumers:
                return
            before = self._assignment()
            self.consumers.remove(consumer)
            now = time.monotonic()
            for lane in self.lanes:
                self._release(lane, consumer.id, now)
            self._reassigned(before)
            self.cond.notify_all()

    def _assignment(self) -> list:
        """Failover: the active consumer id of each partition."""
        if self.type != "failover" or not self.consumers:
            return []
        ordered = sorted(self.consumers, key=lambda c: (c.name or "", c.id))
        return [ordered[i % len(ordered)].id for i in range(len(self.lanes))]

    def _reassigned(self, before: list) -> None:
        """After a consumer came or went (detach has released its lanes)."""
        after = self._assignment()
        now = time.monotonic()
        for i, lane in enumerate(self.lanes):
            if before and after and before[i] != after[i]:
                # A partition changed hands: the new active consumer gets
                # what the old one had not acknowledged.
                self._release(lane, before[i], now)
        if lane_invariant.DEBUG:
            _changed(self.lanes)

    def _lanes_for(self, consumer) -> list:
        if self.type == "failover":
            assignment = self._assignment()
            return [lane for i, lane in enumerate(self.lanes) if assignment[i] == consumer.id]
        return self.lanes

    def _release(self, lane: _Lane, consumer_id: int, now: float) -> None:
        """Queue for redelivery what ``consumer_id`` holds unacknowledged."""
        for off in [o for o, c in lane.outstanding.items() if c == consumer_id]:
            del lane.outstanding[off]
            self._queue_redelivery(lane, off, now)
        keep = []
        for start, end, cid in lane.ranges:
            if cid != consumer_id:
                keep.append([start, end, cid])
                continue
            for off in range(max(start, lane.cursor.mark_delete), end):
                if not lane.settled(off):
                    self._queue_redelivery(lane, off, now)
        lane.ranges = keep

    def _queue_redelivery(self, lane: _Lane, offset: int, ready: float, count: bool = True) -> None:
        if count:
            lane.redelivery_count[offset] = lane.redelivery_count.get(offset, 0) + 1
        if ready <= time.monotonic():
            # Due at once (an abort, an ack timeout, a consumer leaving):
            # ordered by offset with every other such message, whenever it
            # was queued, so an exclusive or failover consumer gets them in
            # order (two aborts in a row must not hand the later one's
            # first). Only a nack's delay puts a message behind them.
            ready = 0.0
        heapq.heappush(lane.redeliver, (ready, offset))

    # -- receiving -------------------------------------------------------------

    def limit(self, lane: _Lane) -> int:
        """Highest offset (exclusive) this subscription may deliver
        (``txmq.storage.delivery.read_limit``): the log end when it
        delivers out of order."""
        p = lane.partition
        if self.out_of_order:
            return p.end_offset
        return read_limit(self.isolation == READ_COMMITTED, p.max_read_position, p.end_offset)

    def receive(self, consumer, n: int, timeout: float | None) -> list:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while True:
                self._check_receiving(consumer)
                now = time.monotonic()
                out = self._take(consumer, n, now)
                if out:
                    return out
                wait = self._next_due(consumer, now)
                if deadline is not None:
                    left = deadline - now
                    if left <= 0:
                        return []
                    wait = left if wait is None else min(wait, left)
                self.cond.wait(wait)

    def _check_receiving(self, consumer) -> None:
        if consumer.closed or self.closed:
            raise BrokerClosedError(f"consumer of {self.name!r} is closed")

    def _next_due(self, consumer, now: float):
        due = None
        for lane in self._lanes_for(consumer):
            if lane.released:
                due = 0.0
            if lane.redeliver:
                due = _min(due, lane.redeliver[0][0] - now)
            if lane.deadlines:
                due = _min(due, lane.deadlines[0][0] - now)
        return None if due is None else max(due, 0.001)

    def _take(self, consumer, n: int, now: float) -> list:
        out: list = []
        lanes = self._lanes_for(consumer)
        if not lanes:
            return out
        k = consumer.rr % len(lanes)
        consumer.rr += 1
        for lane in lanes[k:] + lanes[:k]:
            self._expire(lane, now)
            if lane.released:
                self._take_due(lane, consumer, n, now, out)
            else:
                self._take_redeliveries(lane, consumer, n, now, out)
            self._take_fresh(lane, consumer, n, now, out)
            if lane_invariant.DEBUG:
                lane_invariant.changed(lane)
            if len(out) >= n:
                break
        return out

    def _expire(self, lane: _Lane, now: float) -> None:
        """Ack timeout: queue what was delivered before the deadline and is
        still unacknowledged by the consumer it went to."""
        while lane.deadlines and lane.deadlines[0][0] <= now:
            _, offsets, start, end, cid = lane.deadlines.popleft()
            if offsets is not None:
                for off in offsets:
                    if lane.outstanding.get(off) == cid:
                        del lane.outstanding[off]
                        self._queue_redelivery(lane, off, now)
                continue
            # The delivery may have been split by nacks: take every piece of it.
            expired = [r for r in lane.ranges if r[2] == cid and start <= r[0] and r[1] <= end]
            if expired:
                lane.ranges = [r for r in lane.ranges if not (r[2] == cid and start <= r[0] and r[1] <= end)]
            for s, e, _ in expired:
                for o in range(max(s, lane.cursor.mark_delete), e):
                    if not lane.settled(o):
                        self._queue_redelivery(lane, o, now)

    def _deliver(self, lane: _Lane, consumer, offsets: list, now: float) -> None:
        cid = consumer.id
        if type(offsets) is range and len(offsets) >= RANGE_DELIVERY_MIN:
            # A dense run is one batch delivery, as receive_batch makes, not
            # an entry per offset. (_deliver_range, inline: every receive_many.)
            start, end = offsets.start, offsets.stop
            lane.ranges.append([start, end, cid])
            if self.ack_timeout:
                lane.deadlines.append((now + self.ack_timeout, None, start, end, cid))
            return
        lane.outstanding.update(dict.fromkeys(offsets, cid))
        if self.ack_timeout:
            lane.deadlines.append((now + self.ack_timeout, list(offsets), 0, 0, cid))

    def _deliver_range(self, lane: _Lane, cid: int, start: int, end: int, now: float) -> None:
        """Offsets [start, end) go to consumer ``cid`` as one batch delivery."""
        lane.ranges.append([start, end, cid])
        if self.ack_timeout:
            lane.deadlines.append((now + self.ack_timeout, None, start, end, cid))

    def _take_redeliveries(self, lane: _Lane, consumer, n: int, now: float, out: list, below=None) -> None:
        """Due redeliveries (only those below offset ``below``, if given)."""
        while lane.redeliver and lane.redeliver[0][0] <= now and len(out) < n and (
                below is None or lane.redeliver[0][1] < below):
            _, off = heapq.heappop(lane.redeliver)
            if lane.settled(off) or off in lane.outstanding or off < lane.partition.start_offset:
                continue
            seg, pos = lane.partition.segment_for(off)
            if seg is None:
                continue
            info = seg.batch_at(pos)
            msgs = seg.read_messages(pos, off, 1, self.topic.name, lane.partition.index, MessageId,
                                     _txn_id(info))
            if not msgs or msgs[0].offset != off:
                continue
            m = msgs[0]
            m.redelivery_count = lane.redelivery_count.get(off, 0)
            self._deliver(lane, consumer, [off], now)
            out.append(m)

    def _take_fresh(self, lane: _Lane, consumer, n: int, now: float, out: list) -> None:
        cursor = lane.cursor
        while len(out) < n:
            if lane.buf_i >= len(lane.buffer):
                try:
                    if not self._fill(lane, consumer.fail_on_data_loss):
                        return
                except DataLossError:
                    if out:         # hand over what came before the loss; the next receive raises
                        return
                    raise
            i = lane.buf_i
            chunk = lane.buffer[i:i + n - len(out)]
            lane.buf_i = i + len(chunk)
            if chunk[0].offset < cursor.mark_delete or _touches(lane, chunk[0].offset, chunk[-1].offset):
                # Acknowledged (or pending in a transaction) while buffered, or before a restart.
                chunk = [m for m in chunk if not lane.settled(m.offset)]
                if not chunk:
                    continue
                offsets = [m.offset for m in chunk]
            else:  # one batch, nothing skipped: a dense run
                offsets = range(chunk[0].offset, chunk[-1].offset + 1)
            self._deliver(lane, consumer, offsets, now)
            out += chunk

    def _current_batch(self, lane: _Lane, limit: int, fail_on_data_loss: bool = False):
        """The header of the batch holding the lane's ``read_offset``, with
        (seg, pos) pointing at it, past consumed and control batches; None
        when nothing below ``limit`` is there yet. Offsets lost to
        quarantined bytes are passed over without being acknowledged (the
        cursor moves past them only through :meth:`skip_lost`), or, with
        ``fail_on_data_loss``, raise DataLossError while any is unacknowledged."""
        while lane.read_offset < limit:
            try:
                if lane.seg is None or lane.seg.closed:
                    if not lane.locate():
                        return None
                info = lane.seg.batch_at(lane.pos)
                if info.base_offset > lane.read_offset:
                    self._lost(lane, lane.read_offset, min(info.base_offset, limit), fail_on_data_loss)
                if info.next_offset <= lane.read_offset:
                    lane.seg, lane.pos = lane.partition.next_batch(lane.seg, lane.pos)
                    if lane.seg is None:
                        return None
                    continue
                if (self.out_of_order and info.flags & TRANSACTIONAL and not info.is_control
                        and lane.partition.ongoing.contains(info.txn_hi, info.txn_lo)):
                    # Out of order: read past an open transaction's batch,
                    # which waits in the lane until it ends. ``ongoing`` is
                    # asked before ``aborted`` (delivery.never_delivered).
                    if info.base_offset >= limit:
                        return None
                    self._park(lane, info)
                    lane.read_offset = max(lane.read_offset, info.next_offset)
                    lane.seg, lane.pos = lane.partition.next_batch(lane.seg, lane.pos)
                    if lane.seg is None:
                        return None
                    continue
                if lane.partition.never_delivered(info, self.isolation == "read_committed"):
                    # Markers, and aborted data under READ_COMMITTED, are
                    # never delivered: passed over as if acknowledged.
                    if info.base_offset >= limit:
                        return None
                    lane.cursor.skip(info.base_offset, info.next_offset)
                    lane.read_offset = max(lane.read_offset, info.next_offset)
                    lane.seg, lane.pos = lane.partition.next_batch(lane.seg, lane.pos)
                    if lane.seg is None:
                        return None
                    continue
            except SegmentClosedError:   # retention deleted it: find the offset again
                lane.seg = None
                continue
            return info if info.base_offset < limit else None
        return None

    def _lost(self, lane: _Lane, first: int, end: int, fail: bool) -> None:
        """Offsets [first, end) of the lane are gone (quarantined bytes):
        raise DataLossError when ``fail`` and any of them is not
        acknowledged; else note them for stats."""
        md = lane.cursor.mark_delete
        a = max(first, md)
        if a >= end or lane.cursor.acked.count_in(a, end) == end - a:
            return
        lost = lane.partition.lost_offsets(a, end)
        if fail:
            where = [q for q in lane.partition.quarantined() if q.first_offset < end and q.end_offset > a]
            q = where[0] if where else None
            raise DataLossError(self.topic.name, lane.partition.index, a, end,
                                f"offsets {a}..{end - 1} are quarantined (their bytes fail their checks)",
                                path=None if q is None else lane.partition.segment_path(q.segment),
                                position=None if q is None else q.position,
                                hint="skip them with Consumer.skip_data_loss() (txmq consume --skip-data-loss)")
        if (a, end) not in lane.lost_seen:
            lane.lost_seen.add((a, end))
            log.warning("txmq: subscription %r of %s/%d passes over lost offsets %s (quarantined); "
                        "they stay unacknowledged until skipped", self.name, self.topic.name,
                        lane.partition.index, lost)

    def skip_lost(self, partition: int | None = None) -> int:
        """Acknowledge the offsets of ``partition`` (None: every partition)
        that were lost to quarantined bytes, so the cursor moves past them;
        returns how many were acknowledged."""
        n = 0
        for lane in self.lanes:
            if partition is not None and lane.partition.index != partition:
                continue
            for first, end in lane.partition.lost_offsets(lane.cursor.mark_delete, lane.partition.end_offset):
                n += self.ack_range(lane.partition.index, first, end)
        return n

    def _fill(self, lane: _Lane, fail_on_data_loss: bool = False) -> bool:
        """Decode the next batch below the limit into the lane's buffer."""
        limit = self.limit(lane)
        while (info := self._current_batch(lane, limit, fail_on_data_loss)) is not None:
            try:
                msgs = lane.seg.read_messages(lane.pos, lane.read_offset, limit - lane.read_offset,
                                              self.topic.name, lane.partition.index, MessageId,
                                              _txn_id(info))
            except SegmentClosedError:
                lane.seg = None
                continue
            lane.buffer = msgs
            lane.buf_i = 0
            lane.read_offset = msgs[-1].offset + 1 if msgs else info.next_offset
            if msgs:
                return True
        return False

    # -- acknowledging ---------------------------------------------------------

    def _lane_of(self, message_id) -> _Lane:
        if message_id.topic != self.topic.name:
            raise NotAcknowledgeableError(message_id, f"it is not on topic {self.topic.name!r}")
        if type(message_id.partition) is not int or type(message_id.offset) is not int:
            raise NotAcknowledgeableError(message_id, "partition and offset must be ints")
        if not 0 <= message_id.partition < len(self.lanes):
            raise NotAcknowledgeableError(message_id, "no such partition")
        lane = self.lanes[message_id.partition]
        if not 0 <= message_id.offset < lane.partition.end_offset:
            raise NotAcknowledgeableError(message_id, "offset is not in the partition")
        return lane

    def _lanes_of(self, message_ids) -> list:
        """[(lane, offsets)] of message ids, every id checked."""
        try:
            groups = group_offsets(message_ids if type(message_ids) is list else list(message_ids))
        except TypeError as e:
            raise NotAcknowledgeableError(message_ids[0] if message_ids else None, str(e)) from None
        checked = []
        for (topic, partition), offsets in groups.items():
            # Every offset lies in [min, max]: checking both ends checks all.
            if type(offsets) is range:          # a run (group_offsets)
                lo, hi = offsets.start, offsets.stop - 1
            else:
                lo, hi = min(offsets), max(offsets)
            lane = self._lane_of(MessageId(topic, partition, hi))
            if lo != hi:
                self._lane_of(MessageId(topic, partition, lo))
            checked.append((lane, offsets))
        return checked

    def ack(self, message_ids) -> int:
        """Acknowledge individually; return how many were newly acknowledged.
        Refused whole if an open transaction holds any of them."""
        checked = self._lanes_of(message_ids)
        with self.cond:
            for lane, offsets in checked:
                if len(lane.pending):
                    self._refuse_held(lane, lane.pending.holder(offsets))
            n = sum(self._apply_acks(lane, offsets) for lane, offsets in checked)
            if lane_invariant.DEBUG:
                _changed([lane for lane, _ in checked])
            return n

    def _refuse_held(self, lane: _Lane, held) -> None:
        """A plain ack must not take a message an open transaction holds as
        a pending ack: that transaction's abort would leave it acknowledged
        although its outcome said otherwise (exactly-once, G6/G7)."""
        if held is not None:
            off, txn_id = held
            raise TransactionConflictError(None, MessageId(self.topic.name, lane.partition.index, off),
                                           "pending in an open transaction", txn_id)

    def _apply_acks(self, lane: _Lane, offsets, cumulative: int = -1, sync: bool = True) -> int:
        """Acknowledge ``offsets`` (and everything up to ``cumulative``) in
        the cursor and take them out of every dispatch state; return how
        many offsets were newly acknowledged individually (lock held)."""
        n = 0
        if cumulative >= 0:
            lane.cursor.ack_cumulative(cumulative, sync)
            md = lane.cursor.mark_delete
            for table in (lane.outstanding, lane.redelivery_count):
                for off in [o for o in table if o < md]:
                    del table[off]
        if offsets:
            if type(offsets) is range:
                # A delivery acked whole: one range, one cursor frame.
                n = lane.cursor.ack_range(offsets.start, offsets.stop, sync)
            else:
                n = len(lane.cursor.ack(offsets, sync))
            if lane.outstanding:
                pop = lane.outstanding.pop
                for off in offsets:
                    pop(off, None)
            if lane.redelivery_count:
                for off in offsets:
                    lane.redelivery_count.pop(off, None)
        if lane.ranges:
            self._trim_ranges(lane)
        return n

    def _apply_ack_ranges(self, lane: _Lane, ranges: list, cumulative: int = -1, sync: bool = True,
                          defer: bool = False) -> None:
        """:meth:`_apply_acks` of offsets given as sorted ``[(start, end)]``
        ranges (a transaction's pending acks): one cursor frame per range
        (lock held; ``defer``: frames with no write of their own,
        ``Cursor.ack_range``). The offsets left every dispatch state when
        they were acked in the transaction; only their redelivery counts
        remain."""
        if len(ranges) > 8:      # scattered: one frame of offsets beats many of ranges
            offsets = [o for a, b in ranges for o in range(a, b)]
            self._apply_acks(lane, offsets, cumulative, sync)
            return
        cursor = lane.cursor
        if cumulative >= 0:
            self._apply_acks(lane, (), cumulative, sync)
        for a, b in ranges:
            cursor.ack_range(a, b, sync, defer)
        counts = lane.redelivery_count
        if counts:
            pop = counts.pop
            for a, b in ranges:
                if b - a <= len(counts):
                    for off in range(a, b):
                        pop(off, None)
                else:
                    for off in [o for o in counts if a <= o < b]:
                        del counts[off]
        if lane.ranges:
            self._trim_ranges(lane)

    def ack_range(self, partition: int, start: int, end: int) -> int:
        """Acknowledge offsets [start, end) of one partition (Arrow batches)."""
        lane = self._lane_of(MessageId(self.topic.name, partition, max(start, end - 1)))
        with self.cond:
            if len(lane.pending):
                self._refuse_held(lane, lane.pending.holder_in(start, end))
            n = lane.cursor.ack_range(start, end)
            self._trim_ranges(lane)
            for table in (lane.outstanding, lane.redelivery_count):
                if table:
                    for off in [o for o in table if start <= o < end]:
                        del table[off]
            if lane_invariant.DEBUG:
                lane_invariant.changed(lane)
        return n

    def ack_cumulative(self, message_id) -> None:
        if self.type == "shared":
            raise SubscriptionTypeError(self.name, self.type, "exclusive or failover (ack_cumulative)")
        lane = self._lane_of(message_id)
        with self.cond:
            if len(lane.pending):
                self._refuse_held(lane, lane.pending.holder_in(lane.cursor.mark_delete, message_id.offset + 1))
            self._apply_acks(lane, (), message_id.offset)
            if lane_invariant.DEBUG:
                lane_invariant.changed(lane)

    def _trim_ranges(self, lane: _Lane) -> None:
        md = lane.cursor.mark_delete
        if lane.ranges:
            lane.ranges = [r for r in lane.ranges
                           if r[1] > md and lane.cursor.acked.count_in(max(r[0], md), r[1]) < r[1] - max(r[0], md)]

    def nack(self, message_ids, *, count: bool = True) -> None:
        """Queue what a consumer holds for redelivery: after ``nack_delay``
        with ``redelivery_count`` + 1, or (``count`` False, a release)
        at once and uncounted — the message was never processed."""
        now = time.monotonic()
        with self.cond:
            for mid in message_ids:
                lane = self._lane_of(mid)
                if lane.cursor.is_acked(mid.offset):
                    continue
                if lane.outstanding.pop(mid.offset, None) is None and not _cut_from_ranges(lane, [mid.offset]):
                    continue
                self._queue_redelivery(lane, mid.offset, now + self.nack_delay if count else now, count)
            if lane_invariant.DEBUG:
                _changed(self.lanes)
            self.cond.notify_all()

    # -- acks held by transactions (pending_acks asks) ---------------------------------

    def _hold(self, lane: _Lane, offsets) -> None:
        """Take offsets now pending in a transaction out of every dispatch
        state: no ack timeout, nack or consumer change redelivers them."""
        pop = lane.outstanding.pop
        missing = [off for off in offsets if pop(off, None) is None]
        if missing and lane.ranges:
            _cut_from_ranges(lane, sorted(missing))

    def _hold_span(self, lane: _Lane, start: int, end: int) -> None:
        """:meth:`_hold` of the offsets [start, end)."""
        if lane.outstanding:
            pop = lane.outstanding.pop
            for off in range(start, end):
                pop(off, None)
        if lane.ranges:
            out = []
            for s, e, cid in lane.ranges:
                if e <= start or s >= end:
                    out.append([s, e, cid])
                    continue
                if s < start:
                    out.append([s, start, cid])
                if e > end:
                    out.append([end, e, cid])
            lane.ranges = out

    # -- seeking -----------------------------------------------------------------

    def seek(self, partition: int | None, where) -> None:
        """Move the cursor of one or every partition; ``where`` is an offset,
        ``("time", ms)``, ``"earliest"`` or ``"latest"``."""
        with self.cond:
            for lane in self.lanes:
                if partition is not None and lane.partition.index != partition:
                    continue
                p = lane.partition
                if where == "earliest":
                    target = p.start_offset
                elif where == "latest":
                    target = p.end_offset
                elif isinstance(where, tuple):
                    target = p.find_time(where[1])
                else:
                    target = min(max(int(where), p.start_offset), p.end_offset)
                lane.cursor.reset(target)
                lane.redelivery_count.clear()
                lane.rewind(target)
            if lane_invariant.DEBUG:
                _changed(self.lanes)
            self.cond.notify_all()
        # (outside the lock: a compaction takes the coordinator's, then this one)
        self.broker._forget_applied(self.pending_acks)

    # -- state -------------------------------------------------------------------

    def mark_delete(self, partition: int) -> int:
        return self.lanes[partition].cursor.mark_delete

    def stats(self) -> dict:
        with self.cond:
            parts = []
            for lane in self.lanes:
                md = lane.cursor.mark_delete
                limit = self.limit(lane)
                # Out of order, the open transactions' offsets are no backlog
                # until they commit: those read past (parked) and those ahead.
                parked = self._parked_undecided(lane, md) if self.out_of_order else 0
                parts.append({
                    "partition": lane.partition.index,
                    "mark_delete": md,
                    "individually_acked": lane.cursor.acked.count(),
                    "backlog": max(0, limit - md) - lane.cursor.acked.count_in(md, limit) - parked
                               - lane.partition.undeliverable(max(md, lane.read_offset), limit,
                                                              self.isolation == "read_committed",
                                                              lane.cursor.acked, self.out_of_order),
                    "unacked": lane.outstanding_count(),
                    "pending_redelivery": len(lane.redeliver),
                    "parked_transactions": len(lane.parked),
                    "cursor_problems_on_open": list(lane.cursor.problems),
                    "lost_unacked": sum(e - f - lane.cursor.acked.count_in(f, e) for f, e in
                                        lane.partition.lost_offsets(md, lane.partition.end_offset)),
                })
            return {
                "type": self.type,
                "isolation": self.isolation,
                "allow_out_of_order_delivery": self.out_of_order,
                "consumers": [c.name or f"consumer-{c.id}" for c in self.consumers],
                "backlog": sum(p["backlog"] for p in parts),
                "unacked": sum(p["unacked"] for p in parts),
                "partitions": parts,
            }

    def __repr__(self) -> str:
        return f"Subscription({self.topic.name!r}, {self.name!r})"

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
            for lane in self.lanes:
                lane.partition.remove_listener(self._on_append)
                lane.partition.remove_end_listener(self._on_txn_end)
                # Acks of open transactions reach the log (the next open
                # aborts them), as their accumulated sends reach the partitions.
                for txn_id in lane.pending.unlogged_txns():
                    self.pending_acks._write_lane(lane, txn_id)
                self.pending_acks.sync_commits(lane)
                lane.cursor.close()
                lane.pending_log.close()
