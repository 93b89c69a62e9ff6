"""What a reader may see at a position: the one delivery rule that the
subscriptions and the read-only view both apply.

- A COMMIT / ABORT marker is never delivered (it takes an offset).
- Under ``read_committed`` a batch of an aborted transaction is never
  delivered, and nothing at or past maxReadPosition (Kafka's last stable
  offset) is readable; under ``read_uncommitted`` everything below the log
  end is, aborted data included.

A batch that is never delivered is passed over as if acknowledged.
"""

from __future__ import annotations

from txmq._batch import FLAG

READ_COMMITTED = "read_committed"
READ_UNCOMMITTED = "read_uncommitted"
ISOLATIONS = (READ_COMMITTED, READ_UNCOMMITTED)
TRANSACTIONAL = FLAG["transactional"]


def read_limit(read_committed: bool, max_read_position: int, log_end: int, end: int | None = None) -> int:
    """The offset a reader stops before: maxReadPosition under
    read_committed, the log end otherwise, and at most ``end``."""
    top = max_read_position if read_committed else log_end
    return top if end is None else min(end, top)


def never_delivered(info, aborted, read_committed: bool) -> bool:
    """A marker, or (``read_committed``) a batch of a transaction in the
    AbortSet ``aborted``: what no subscription or reader delivers."""
    return bool(info.flags & TRANSACTIONAL) and (
        info.is_control or (read_committed and aborted.contains(info.txn_hi, info.txn_lo)))


def undelivered(batches, start: int, end: int, aborted, read_committed: bool, acked=None) -> int:
    """How many offsets in [start, end) of the batch headers ``batches``
    (those holding an offset of the range, in order) are never delivered;
    with ``acked`` (an AckSet) only those not in it: a reader passing them
    acknowledges them, so a backlog must not subtract them twice."""
    n = 0
    for info in batches:
        if never_delivered(info, aborted, read_committed):
            a, b = max(start, info.base_offset), min(end, info.next_offset)
            n += b - a - (acked.count_in(a, b) if acked is not None else 0)
    return n


def backlog(batches, start: int, end: int, aborted, read_committed: bool, acked) -> int:
    """The deliverable offsets in [start, end) not in ``acked``: the range,
    less what is acknowledged, less what is never delivered and not
    acknowledged (offsets are dense, so ``batches`` cover the range)."""
    if end <= start:
        return 0
    return (end - start) - acked.count_in(start, end) - undelivered(batches, start, end, aborted,
                                                                    read_committed, acked)
