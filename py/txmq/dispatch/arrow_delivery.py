"""The Arrow fast path of a subscription (``Consumer.receive_batch``): a
run of one stored batch delivered as a pyarrow.RecordBatch whose key and
value columns are views of the log."""

from __future__ import annotations

import logging
import time
import weakref

from txmq._arrow_batch import record_batch_schema
from txmq._segment import SegmentClosedError
from txmq.dispatch import lane_invariant
from txmq.dispatch.lanes import _Lane

log = logging.getLogger("txmq.subscription")


class ArrowDelivery:
    """Subscription's ``receive_batch`` (a mixin: the lanes, locks and
    delivery state are the Subscription's)."""

    def receive_batch(self, consumer, max_messages: int, timeout: float | None):
        """A run of fresh messages of one batch as a pyarrow.RecordBatch whose
        key and value columns are views of the mapped segment."""
        import pyarrow as pa
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while True:
                self._check_receiving(consumer)
                now = time.monotonic()
                lanes = self._lanes_for(consumer)
                for i in range(len(lanes)):
                    lane = lanes[(consumer.rr + i) % len(lanes)]
                    self._expire(lane, now)
                    batch = None
                    if lane.released and not (lane.redeliver and lane.redeliver[0][0] <= now
                                              and lane.redeliver[0][1] < lane.released[0][0]):
                        batch = self._released_batch(lane, consumer, max_messages, now)
                    if batch is None:
                        batch = self._redelivered_batch(lane, consumer, max_messages, now, pa)
                    if batch is None:
                        batch = self._take_arrow(lane, consumer, max_messages, now)
                    if lane_invariant.DEBUG:
                        lane_invariant.changed(lane)
                    if batch is not None:
                        consumer.rr += i + 1
                        return batch
                if deadline is not None and deadline <= now:
                    return None
                wait = self._next_due(consumer, now)
                if deadline is not None:
                    wait = deadline - now if wait is None else min(wait, deadline - now)
                self.cond.wait(wait)

    def _redelivered_batch(self, lane: _Lane, consumer, max_messages: int, now: float, pa):
        """Due redeliveries of one partition as a RecordBatch (copied: they
        are scattered over the log)."""
        if not lane.redeliver or lane.redeliver[0][0] > now:
            return None
        msgs: list = []
        self._take_redeliveries(lane, consumer, max_messages, now, msgs)
        if not msgs:
            return None
        return pa.RecordBatch.from_arrays(
            [pa.array([m.key for m in msgs], pa.binary()), pa.array([m.value for m in msgs], pa.binary()),
             pa.array([m.offset for m in msgs], pa.int64()),
             pa.array([m.event_time for m in msgs], pa.timestamp("ms")),
             pa.array([m.publish_time for m in msgs], pa.timestamp("ms"))],
            schema=record_batch_schema(self.topic.name, lane.partition.index))

    def _take_arrow(self, lane: _Lane, consumer, max_messages: int, now: float):
        if lane.buf_i < len(lane.buffer):
            # Hand the buffered run back to the log.
            lane.read_offset = lane.buffer[lane.buf_i].offset
            lane.buffer = []
            lane.buf_i = 0
            lane.seg = None
        limit = self.limit(lane)
        while (info := self._current_batch(lane, limit, consumer.fail_on_data_loss)) is not None:
            start = max(lane.read_offset, info.base_offset)
            if start < lane.cursor.mark_delete:     # acknowledged ahead of delivery
                lane.read_offset = lane.cursor.mark_delete
                continue
            acked = lane.cursor.acked.next_acked(start)
            if acked is not None and acked[0] <= start:
                lane.read_offset = acked[1]
                continue
            end = min(info.next_offset, limit, start + max_messages)
            if acked is not None:
                end = min(end, acked[0])
            if len(lane.pending):
                held = lane.pending.next_pending(start)
                if held == start:
                    lane.read_offset = start + 1
                    continue
                if held > 0:
                    end = min(end, held)
            try:
                batch = _record_batch(self.topic.name, lane.partition.index, lane.seg, lane.pos,
                                      info.base_offset, start, end)
            except SegmentClosedError:
                lane.seg = None
                continue
            lane.read_offset = end
            self._deliver_range(lane, consumer.id, start, end, now)
            return batch
        return None


def _record_batch(topic: str, partition: int, seg, pos: int, base: int, start: int, end: int):
    """Offsets ``start`` .. ``end - 1`` of the batch of base offset ``base``
    at ``pos`` of ``seg`` as a RecordBatch whose key and value columns are
    views of the mapping, built in one compiled call
    (``Segment.record_batch``, through Arrow's C data interface), and
    remembered as a run (:func:`delivered_run`). Raises SegmentClosedError."""
    batch = seg.record_batch(pos, start - base, end - start, topic, partition)
    key = id(batch)

    def forget(ref, key=key):
        if _RUNS.get(key, (None,))[0] is ref:
            _RUNS.pop(key, None)

    _RUNS[key] = (weakref.ref(batch, forget), topic, partition, start, end)
    return batch


# id(batch) -> (weak reference, topic, partition, first offset, end offset)
# of every RecordBatch built from one run of the log and still alive: an
# ack of it reads its run here instead of from its schema and columns.
_RUNS: dict = {}


def delivered_run(batch):
    """``(topic, partition, first offset, end offset)`` of a RecordBatch
    ``receive_batch`` built from one run of consecutive offsets, or None
    (any other object: a slice, a concatenation, a redelivery's copy)."""
    entry = _RUNS.get(id(batch))
    if entry is not None and entry[0]() is batch:
        return entry[1:]
    return None
