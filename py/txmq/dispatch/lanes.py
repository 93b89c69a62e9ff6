"""A subscription's lane: its state for one partition (what is delivered,
outstanding, waiting for redelivery, parked), and the helpers over a
lane's delivered ranges (docs/ARCHITECTURE.md, "dispatch")."""

from __future__ import annotations

import bisect
from collections import deque

from txmq.dispatch import lane_invariant
from txmq.storage.cursor import Cursor
from txmq.storage.delivery import TRANSACTIONAL
from txmq.transactions.records import TxnID


class _Lane:
    """Dispatch state of one subscription on one partition."""

    __slots__ = ("partition", "cursor", "read_offset", "seg", "pos", "buffer", "buf_i", "outstanding",
                 "ranges", "redeliver", "redelivery_count", "deadlines", "pending", "pending_log",
                 "unsynced_commits", "debug_changes", "debug_next", "lost_seen", "parked", "released",
                 "read_committed")

    def __init__(self, partition, cursor: Cursor, pending, pending_log, read_committed: bool):
        self.partition = partition
        self.cursor = cursor
        self.read_committed = read_committed   # (what lane_invariant checks against)
        self.redelivery_count: dict[int, int] = {}
        self.pending = pending             # PendingAckTable and pending-<p>.log: see pending_acks
        self.pending_log = pending_log
        self.unsynced_commits: list = []   # committed txns whose COMMIT frame (None: none) waits for a cursor sync
        self.debug_changes = self.debug_next = 0   # lane_invariant's pacing under TXMQ_DEBUG
        self.lost_seen: set = set()        # lost (quarantined) runs already logged
        self.rewind(cursor.mark_delete)

    def settled(self, offset: int) -> bool:
        """Acknowledged, or pending in an open transaction: not deliverable."""
        return self.cursor.is_acked(offset) or (len(self.pending) and self.pending.is_pending(offset))

    def rewind(self, offset: int) -> None:
        self.read_offset = max(offset, self.partition.start_offset)
        self.seg = None
        self.pos = -1
        self.buffer: list = []                     # decoded Messages of one batch ...
        self.buf_i = 0                             # ... from this index on not yet dispatched
        self.outstanding: dict[int, int] = {}      # offset -> consumer id
        self.ranges: list = []                     # [start, end, consumer id] of batch deliveries
        self.redeliver: list = []                  # heap of (ready time, offset)
        self.deadlines: deque = deque()            # (deadline, offsets | None, start, end, consumer id)
        self.parked: dict = {}                     # (hi, lo) of an open transaction -> [[start, end], ...]
        self.released: list = []                   # heap of (start, end): a committed one's parked spans

    def waiting_spans(self) -> list:
        """Sorted ``[(start, end)]`` of what out-of-order delivery parked
        or released: offsets that go out from there, not from the
        redelivery queue."""
        spans = [(a, b) for ranges in self.parked.values() for a, b in ranges]
        spans += self.released
        spans.sort()
        return spans

    def locate(self) -> bool:
        """Point (seg, pos) at the batch holding ``read_offset``."""
        if self.read_offset < self.partition.start_offset:
            self.read_offset = self.partition.start_offset
        self.seg, self.pos = self.partition.segment_for(self.read_offset)
        return self.seg is not None

    def outstanding_count(self) -> int:
        n = len(self.outstanding)
        md = self.cursor.mark_delete
        for start, end, _ in self.ranges:
            if end > md:
                start = max(start, md)
                n += end - start - self.cursor.acked.count_in(start, end)
        return n


def _changed(lanes) -> None:
    """lane_invariant.changed() of each lane (TXMQ_DEBUG)."""
    for lane in lanes:
        lane_invariant.changed(lane)


def _touches(lane: _Lane, first: int, last: int) -> bool:
    """Whether an acknowledged or pending offset lies in [first, last]."""
    if len(lane.cursor.acked):
        nxt = lane.cursor.acked.next_acked(first)
        if nxt is not None and nxt[0] <= last:
            return True
    if len(lane.pending):
        held = lane.pending.next_pending(first)
        if 0 <= held <= last:
            return True
    return False


def _txn_id(info):
    """The TxnID of a batch header, or None outside transactions."""
    if info.flags & TRANSACTIONAL:
        return TxnID.from_words(info.txn_hi, info.txn_lo)
    return None


def _min(a, b):
    return b if a is None else min(a, b)


def _cut_from_ranges(lane: _Lane, offsets: list) -> bool:
    """Take sorted ``offsets`` out of the batch deliveries holding them, so
    each is in one dispatch state only; False when no delivery held any."""
    out = []
    cut = False
    for s, e, cid in lane.ranges:
        i = bisect.bisect_left(offsets, s)
        j = bisect.bisect_left(offsets, e)
        start = s
        cut = cut or i < j
        for off in offsets[i:j]:
            if start < off:
                out.append([start, off, cid])
            start = off + 1
        if start < e:
            out.append([start, e, cid])
    lane.ranges = out
    return cut
