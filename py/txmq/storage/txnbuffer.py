"""The transaction buffer of a partition (DESIGN.md §3): what one
transactional batch header does to it.

``ongoing`` (``_txn.OngoingQueue``) holds the open transactions with data
in the partition in order of their first offset; its head is
maxReadPosition. ``aborted`` (``_txn.AbortSet``) holds the aborted
transactions that still have data in retained segments. Its snapshot
(``txnbuffer.snap``) and the aborted-transaction index (``<base>.txnindex``)
are laid out in ``txmq.storage.layout``.

A transaction's first batch is entered in ``ongoing`` before its bytes
become readable, and an aborted one enters ``aborted`` before it leaves
``ongoing``, so a lock-free reader never sees an open or aborted batch
below maxReadPosition unmarked.
"""

from __future__ import annotations

from txmq._log import FLAG

MARKER_ABORT = FLAG["marker_abort"]
# The flags of a COMMIT (True) and an ABORT (False) marker batch.
MARKER_FLAGS = {True: FLAG["transactional"] | FLAG["control"] | FLAG["marker_commit"],
                False: FLAG["transactional"] | FLAG["control"] | FLAG["marker_abort"]}


def end_in_buffer(ongoing, aborted, hi: int, lo: int, commit: bool, marker_offset: int) -> int:
    """Transaction (hi, lo) ended at its marker: an aborted one enters
    ``aborted`` before it leaves ``ongoing`` (lock-free readers: the module
    docstring). Returns its first offset when it aborted, else -1."""
    first = -1
    if not commit:
        first = ongoing.first_offset_of(hi, lo)
        aborted.add(hi, lo, first, marker_offset)
    ongoing.remove(hi, lo)
    return first


def replay_txn_header(info, ongoing, aborted) -> int:
    """What one transactional batch header does to a transaction buffer
    when the log is replayed (recovery, and read-only views): a data batch
    opens its transaction unless it has aborted; a marker ends an open
    one. Returns the first offset of a transaction the marker aborted,
    else -1."""
    hi, lo = info.txn_hi, info.txn_lo
    if info.is_control:
        if ongoing.contains(hi, lo):
            return end_in_buffer(ongoing, aborted, hi, lo, not info.flags & MARKER_ABORT, info.base_offset)
    elif not aborted.contains(hi, lo):
        ongoing.add(hi, lo, info.base_offset, info.publish_time)
    return -1


