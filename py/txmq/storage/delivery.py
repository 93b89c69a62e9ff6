"""What a reader may see at a position: the one delivery rule that the
subscriptions and the read-only view both apply.

- A COMMIT / ABORT marker is never delivered (it takes an offset).
- Under ``read_committed`` a batch of an aborted transaction is never
  delivered, and nothing at or past maxReadPosition (Kafka's last stable
  offset) is readable; under ``read_uncommitted`` everything below the log
  end is, aborted data included.
- Under ``read_committed`` with out-of-order delivery (a shared
  subscription's ``allow_out_of_order_delivery``) everything below the log
  end is readable but the batches of transactions still open (``ongoing``)
  and of aborted ones: an open transaction's batches wait until it ends.

A batch that is never delivered is passed over as if acknowledged; a
batch of an open transaction is not delivered *yet*.
"""

from __future__ import annotations

from txmq._batch import FLAG

READ_COMMITTED = "read_committed"
READ_UNCOMMITTED = "read_uncommitted"
ISOLATIONS = (READ_COMMITTED, READ_UNCOMMITTED)
TRANSACTIONAL = FLAG["transactional"]


def read_limit(read_committed: bool, max_read_position: int, log_end: int, end: int | None = None,
               out_of_order: bool = False) -> int:
    """The offset a reader stops before: maxReadPosition under
    read_committed (the log end with ``out_of_order``), the log end
    otherwise, and at most ``end``."""
    top = max_read_position if read_committed and not out_of_order else log_end
    return top if end is None else min(end, top)


def never_delivered(info, aborted, read_committed: bool, ongoing=None) -> bool:
    """A marker, or (``read_committed``) a batch of a transaction in the
    AbortSet ``aborted``: what no subscription or reader delivers; with
    ``ongoing`` (anything with ``contains(hi, lo)``: the open transactions
    of an out-of-order reader) a batch of an open transaction too, which
    is not delivered *now*. ``ongoing`` is asked first: a transaction that
    aborts enters ``aborted`` before it leaves ``ongoing``."""
    if not info.flags & TRANSACTIONAL:
        return False
    if info.is_control:
        return True
    if ongoing is not None and ongoing.contains(info.txn_hi, info.txn_lo):
        return True
    return read_committed and aborted.contains(info.txn_hi, info.txn_lo)


def undelivered(batches, start: int, end: int, aborted, read_committed: bool, acked=None, ongoing=None) -> int:
    """How many offsets in [start, end) of the batch headers ``batches``
    (those holding an offset of the range, in order) are never delivered
    (with ``ongoing``: or not yet, see :func:`never_delivered`); with
    ``acked`` (an AckSet) only those not in it: a reader passing them
    acknowledges them, so a backlog must not subtract them twice."""
    n = 0
    for info in batches:
        if never_delivered(info, aborted, read_committed, ongoing):
            a, b = max(start, info.base_offset), min(end, info.next_offset)
            n += b - a - (acked.count_in(a, b) if acked is not None else 0)
    return n


def backlog(batches, start: int, end: int, aborted, read_committed: bool, acked, ongoing=None) -> int:
    """The deliverable offsets in [start, end) not in ``acked``: the range,
    less what is acknowledged, less what is never delivered (or, with
    ``ongoing``, not yet) and not acknowledged (offsets are dense, so
    ``batches`` cover the range)."""
    if end <= start:
        return 0
    return (end - start) - acked.count_in(start, end) - undelivered(batches, start, end, aborted,
                                                                    read_committed, acked, ongoing)


class OpenSet:
    """Transactions (hi, lo) taken as open: the ``ongoing`` of
    :func:`never_delivered` for a reader that decides from batch headers
    rather than from a live transaction buffer (the read-only view)."""

    __slots__ = ("txns",)

    def __init__(self, txns=()):
        self.txns = set(txns)

    def contains(self, hi: int, lo: int) -> bool:
        return (hi, lo) in self.txns

    def __len__(self) -> int:
        return len(self.txns)


def open_transactions(batches) -> OpenSet:
    """The transactions with a data batch among the headers ``batches``
    (in offset order) and no marker after it among them: those open as of
    the end of the range the headers cover."""
    txns: set = set()
    for info in batches:
        if info.flags & TRANSACTIONAL:
            key = (info.txn_hi, info.txn_lo)
            if info.is_control:
                txns.discard(key)
            elif key != (0, 0):
                txns.add(key)
    return OpenSet(txns)
