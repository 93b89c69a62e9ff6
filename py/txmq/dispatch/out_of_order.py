"""Out-of-order delivery (``allow_out_of_order_delivery``, docs/API.md):
the Subscription methods that park the batches of open transactions in a
lane, read past them, and release them when they commit."""

from __future__ import annotations

import heapq

from txmq._segment import SegmentClosedError
from txmq.dispatch import lane_invariant
from txmq.dispatch.arrow_delivery import _record_batch
from txmq.dispatch.lanes import _Lane, _txn_id
from txmq.message import MessageId


class OutOfOrderDelivery:
    """Subscription's out-of-order delivery (a mixin: the lanes, locks and
    delivery state are the Subscription's)."""

    def _park(self, lane: _Lane, info) -> None:
        """The batch ``info`` of a transaction still open is read past: its
        offsets from ``read_offset`` on wait in ``lane.parked`` until the
        transaction ends (lock held)."""
        key = (info.txn_hi, info.txn_lo)
        start = max(lane.read_offset, info.base_offset)
        spans = lane.parked.get(key)
        if spans is None:
            lane.parked[key] = [[start, info.next_offset]]
        elif spans[-1][1] == start:          # its batches back to back: one span
            spans[-1][1] = info.next_offset
        else:
            spans.append([start, info.next_offset])

    def _on_txn_end(self, partition, hi: int, lo: int, commit: bool) -> None:
        """The partition's end listener: transaction (hi, lo) ended there.
        What the lane parked of it is released (commit) or passed over as
        acknowledged (abort), and waiting consumers are woken."""
        with self.cond:
            if self.closed or partition.index >= len(self.lanes):
                return
            lane = self.lanes[partition.index]
            spans = lane.parked.pop((hi, lo), None)
            if spans is None:
                return
            if commit:
                for start, end in spans:
                    heapq.heappush(lane.released, (start, end))
                self.cond.notify_all()
            else:
                for start, end in spans:
                    lane.cursor.skip(start, end)
            if lane_invariant.DEBUG:
                lane_invariant.changed(lane)

    def _take_due(self, lane: _Lane, consumer, n: int, now: float, out: list) -> None:
        """Due redeliveries and released spans of ``lane``, lower offsets
        first (lock held)."""
        while len(out) < n:
            redo = lane.redeliver and lane.redeliver[0][0] <= now
            if not lane.released:
                if redo:
                    self._take_redeliveries(lane, consumer, n, now, out)
                return
            if not redo:
                self._take_released(lane, consumer, n, now, out)
                return
            if lane.redeliver[0][1] <= lane.released[0][0]:
                self._take_redeliveries(lane, consumer, n, now, out, lane.released[0][0] + 1)
            else:
                self._take_released(lane, consumer, n, now, out, lane.redeliver[0][1])

    def _next_released(self, lane: _Lane, most: int, below=None):
        """Pop the first unsettled run of the released spans, within one
        batch and at most ``most`` offsets (and below ``below``), putting
        back what follows it: ``(seg, pos, info, start, end)``, or None
        when no span is left (lock held). Settled offsets are dropped."""
        cursor = lane.cursor
        while lane.released:
            start, end = lane.released[0]
            if below is not None and start >= below:
                return None
            heapq.heappop(lane.released)
            start = max(start, cursor.mark_delete, lane.partition.start_offset)
            if start >= end:
                continue
            acked = cursor.acked.next_acked(start) if len(cursor.acked) else None
            if acked is not None and acked[0] <= start:
                if acked[1] < end:
                    heapq.heappush(lane.released, (acked[1], end))
                continue
            if len(lane.pending):
                held = lane.pending.next_pending(start)
                if held == start:
                    if start + 1 < end:
                        heapq.heappush(lane.released, (start + 1, end))
                    continue
            else:
                held = -1
            seg, pos = lane.partition.segment_for(start)
            if seg is None:
                continue
            try:
                info = seg.batch_at(pos)
            except SegmentClosedError:          # retention: found again from the log start
                heapq.heappush(lane.released, (start, end))
                continue
            if info.base_offset > start:       # lost to quarantined bytes: passed over, as a read does
                if info.base_offset < end:
                    heapq.heappush(lane.released, (info.base_offset, end))
                continue
            stop = min(end, info.next_offset, start + most)
            if below is not None:
                stop = min(stop, below)
            if acked is not None:
                stop = min(stop, acked[0])
            if held > 0:
                stop = min(stop, held)
            if stop < end:
                heapq.heappush(lane.released, (stop, end))
            return seg, pos, info, start, stop
        return None

    def _take_released(self, lane: _Lane, consumer, n: int, now: float, out: list, below=None) -> None:
        """Deliver released spans (a committed transaction's batches that
        were parked) as fresh messages: redelivery count 0, they were never
        delivered (lock held)."""
        while len(out) < n:
            run = self._next_released(lane, n - len(out), below)
            if run is None:
                return
            seg, pos, info, start, stop = run
            try:
                msgs = seg.read_messages(pos, start, stop - start, self.topic.name, lane.partition.index,
                                         MessageId, _txn_id(info))
            except SegmentClosedError:
                heapq.heappush(lane.released, (start, stop))
                continue
            if not msgs:
                continue
            self._deliver(lane, consumer, range(start, msgs[-1].offset + 1), now)
            out += msgs

    def _released_batch(self, lane: _Lane, consumer, max_messages: int, now: float):
        """The first unsettled run of the released spans as a RecordBatch
        over the mapped segment (no copy), or None."""
        while (run := self._next_released(lane, max_messages)) is not None:
            seg, pos, info, start, stop = run
            try:
                batch = _record_batch(self.topic.name, lane.partition.index, seg, pos,
                                      info.base_offset, start, stop)
            except SegmentClosedError:
                heapq.heappush(lane.released, (start, stop))
                continue
            self._deliver_range(lane, consumer.id, start, stop, now)
            return batch
        return None

    def _parked_undecided(self, lane: _Lane, md: int) -> int:
        """Unacknowledged offsets at or above ``md`` that the lane parked
        for transactions still open or aborted (not told yet): no backlog."""
        p = lane.partition
        acked = lane.cursor.acked
        n = 0
        for (hi, lo), spans in lane.parked.items():
            if p.ongoing.contains(hi, lo) or p.aborted.contains(hi, lo):
                for a, b in spans:
                    a = max(a, md)
                    if a < b:
                        n += b - a - acked.count_in(a, b)
        return n
