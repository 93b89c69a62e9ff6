"""The transaction buffer of a partition (docs/API.md, "Transaction") and its
aborted-transaction index (Kafka's ``.txnindex``).

``ongoing`` (``_txn.OngoingQueue``) holds the open transactions with data
in the partition in order of their first offset; its head is
maxReadPosition. ``aborted`` (``_txn.AbortSet``) holds the aborted
transactions that still have data in retained segments. A transaction's
first batch is entered in ``ongoing`` before its bytes become readable, and
an aborted one enters ``aborted`` before it leaves ``ongoing``, so a
lock-free reader never sees an open or aborted batch below maxReadPosition
unmarked.

Files (laid out in ``txmq.storage.layout``): ``txnbuffer.snap``, the
buffer as of an offset (opening loads it and replays the batch headers
after it), and ``<base>.txnindex``, the aborted transactions whose ABORT
marker is in segment ``<base>``, as (txn, producer id, first offset,
marker offset): what :meth:`TxnBuffer.aborted_transactions` answers from.
An entry is appended when the marker is written; the files changed since
the last snapshot are fsynced before the next one vouches for them.

Every method that changes the buffer runs under the partition lock.
"""

from __future__ import annotations

import os

from txmq._batch import FLAG
from txmq._txn import AbortSet, OngoingQueue
from txmq.files import write_atomic
from txmq.storage.layout import (TXNBUF_HAS_TXN_DATA, TXNINDEX_ENTRY, TXNINDEX_SUFFIX, segment_file,
                                 txn_snapshot_bytes, txnindex_bytes, txnindex_entries)
from txmq.storage.loader import Dropped
from txmq.transactions.records import TxnID

TRANSACTIONAL = FLAG["transactional"]
MARKER_ABORT = FLAG["marker_abort"]
# The flags of a COMMIT (True) and an ABORT (False) marker batch.
MARKER_FLAGS = {True: FLAG["transactional"] | FLAG["control"] | FLAG["marker_commit"],
                False: FLAG["transactional"] | FLAG["control"] | FLAG["marker_abort"]}
# A snapshot is written after this many transactions ended here (or as many
# as are open, if more), or by the broker's timer when anything changed.
SNAPSHOT_EVERY_TXNS = 1000


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


class TxnBuffer:
    """One partition's open and aborted transactions and its ``.txnindex``
    files, in directory ``path``; ``fsync`` is the partition's mode."""

    def __init__(self, path: str, fsync: str):
        self.path = path
        self.fsync = fsync
        self.ongoing = OngoingQueue()
        self.aborted = AbortSet()
        self.seen = False                # any transactional batch (so any marker) in the log
        self.replay_from = 0             # opening: where the replay of batch headers begins
        self._txnindex: dict = {}        # segment base -> [(hi, lo, producer id, first, marker)]
        self._dirty: set = set()         # segment bases whose .txnindex changed since its fsync
        self._ended_since_snapshot = 0

    def max_read_position(self, end: int) -> int:
        """The first offset of the oldest open transaction, or ``end``."""
        return self.ongoing.max_read_position(end)

    def blocked_by(self):
        """(TxnID, first offset, since ms) of the oldest open transaction,
        or None."""
        oldest = self.ongoing.oldest()
        if oldest is None:
            return None
        hi, lo, first, since = oldest
        return TxnID.from_words(hi, lo), first, since

    # -- a transaction's batches and its end ---------------------------------------------

    def begin(self, hi: int, lo: int, offset: int, now_ms: int) -> bool:
        """A batch of (hi, lo) is about to be appended at ``offset``: enter
        the transaction in ``ongoing`` (before its bytes are readable) if
        it is not there yet; True when this entered it."""
        self.seen = True
        return self.ongoing.add(hi, lo, offset, now_ms)

    def undo_begin(self, hi: int, lo: int) -> None:
        """The append that :meth:`begin` entered (hi, lo) for failed."""
        self.ongoing.remove(hi, lo)

    def ended(self, hi: int, lo: int, commit: bool, marker_offset: int, producer_id: int,
              base: int | None) -> bool:
        """Transaction (hi, lo) ended at its marker: see :func:`end_in_buffer`;
        an aborted one is also entered in the .txnindex of its marker's
        segment ``base``. Returns whether a snapshot is due: ends are
        counted, and a snapshot's cost is what the buffer holds, so it is
        spread over as many ends."""
        first = end_in_buffer(self.ongoing, self.aborted, hi, lo, commit, marker_offset)
        if not commit:
            self._index_abort((hi, lo, producer_id, first, marker_offset), base)
        self._ended_since_snapshot += 1
        return self._ended_since_snapshot >= max(SNAPSHOT_EVERY_TXNS, len(self.ongoing))

    def changed(self) -> bool:
        """Whether a transaction ended since the last snapshot."""
        return bool(self._ended_since_snapshot)

    # -- the aborted-transaction index -----------------------------------------------------

    def _file(self, base: int) -> str:
        return segment_file(self.path, base, TXNINDEX_SUFFIX)

    def _index_abort(self, entry: tuple, base: int) -> None:
        """Append an aborted transaction to the .txnindex of segment ``base``,
        which holds its marker."""
        with open(self._file(base), "ab") as f:
            f.write(txnindex_bytes([entry]))
        self._txnindex.setdefault(base, []).append(entry)
        self._dirty.add(base)

    def load_txnindex(self, segments, producer_at, report) -> None:
        """Read every segment's .txnindex, keeping the entries whose marker
        lies below :attr:`replay_from` (the replay adds the others again)
        and cutting a file at its first entry that fails its CRC or whose
        marker is not in its segment (``report(Dropped)`` is told). A
        missing file below it, or one with such an entry, is rebuilt from
        the abort set;
        ``producer_at(offset)`` gives the producer id of a transaction's
        first batch."""
        self._txnindex = {}
        self._dirty = set()
        rebuild = []
        for seg in segments:
            path = self._file(seg.base_offset)
            limit = min(self.replay_from, seg.next_offset)
            try:
                with open(path, "rb") as f:
                    raw = f.read()
            except FileNotFoundError:
                if seg.base_offset < self.replay_from:
                    rebuild.append(seg)
                else:
                    open(path, "ab").close()     # the replay writes what belongs in it
                continue
            keep, n = [], len(raw) // TXNINDEX_ENTRY.size
            entries, bad = txnindex_entries(raw)
            for i, entry in enumerate(entries):
                if not seg.base_offset <= entry[4] < seg.next_offset:
                    bad = i
                    break
                if entry[4] < limit:
                    keep.append(entry)
            if bad is not None and seg.base_offset < self.replay_from:
                # The abort set (snapshot) holds what the damaged entries did.
                report(Dropped(path, bad * TXNINDEX_ENTRY.size, "bad aborted-transaction index entry; rebuilt "
                                                                "from the transaction-buffer snapshot"))
                rebuild.append(seg)
                continue
            if bad is not None:
                report(Dropped(path, bad * TXNINDEX_ENTRY.size, "bad aborted-transaction index entry; cut there "
                                                                "(the replay writes the rest again)"))
            if len(keep) != n or len(raw) % TXNINDEX_ENTRY.size:
                self._write_txnindex(seg.base_offset, keep)
            if keep:
                self._txnindex[seg.base_offset] = keep
        for seg in rebuild:
            entries = [(hi, lo, producer_at(first), first, marker)
                       for hi, lo, first, marker in self.aborted.overlapping(seg.base_offset, seg.next_offset)
                       if seg.base_offset <= marker < seg.next_offset]
            self._write_txnindex(seg.base_offset, entries)
            if entries:
                self._txnindex[seg.base_offset] = entries

    def _write_txnindex(self, base: int, entries: list) -> None:
        write_atomic(self._file(base), txnindex_bytes(entries), fsync=self.fsync != "never")

    def sync_txnindex(self) -> None:
        """fsync the .txnindex files written since the last call (not under
        fsync="never")."""
        dirty, self._dirty = self._dirty, set()
        if self.fsync == "never":
            return
        for base in dirty:
            try:
                fd = os.open(self._file(base), os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def aborted_transactions(self, segments, from_offset: int, to_offset: int) -> list:
        """``[(producer id, first offset, last offset)]`` of the aborted
        transactions with data in [from_offset, to_offset), oldest first,
        from the .txnindex of ``segments`` (last offset is the ABORT
        marker's)."""
        out = []
        for seg in segments:
            if seg.next_offset <= from_offset:
                continue       # its markers all lie below from_offset
            for _, _, pid, first, last in self._txnindex.get(seg.base_offset, ()):
                if first < to_offset and last >= from_offset:
                    out.append((pid, first, last))
        out.sort(key=lambda e: e[1])
        return out

    def forget_segment(self, base: int) -> None:
        """Segment ``base`` was deleted (its .txnindex with it)."""
        self._txnindex.pop(base, None)

    # -- snapshot and replay ------------------------------------------------------------------

    def snapshot_bytes(self, end_offset: int) -> bytes:
        """``txnbuffer.snap`` of the buffer as of ``end_offset`` (the log
        end); the .txnindex entries below it must be durable first
        (:meth:`sync_txnindex`)."""
        self._ended_since_snapshot = 0
        return txn_snapshot_bytes(TXNBUF_HAS_TXN_DATA if self.seen else 0, end_offset, self.ongoing, self.aborted)

    def restore(self, snapshot) -> None:
        """Take a checked ``layout.read_txn_snapshot`` result: the buffer
        as of its offset, from which the replay begins."""
        (_, _, flags, self.replay_from), (self.ongoing, self.aborted) = snapshot
        self.seen = bool(flags & TXNBUF_HAS_TXN_DATA)

    def replay(self, info, base: int) -> None:
        """What the batch header ``info`` (replayed in offset order at
        opening, in segment ``base``) does to the buffer: from
        :attr:`replay_from` on, see :func:`replay_txn_header`; an ABORT
        marker also enters its transaction in the segment's .txnindex."""
        if info.flags & TRANSACTIONAL and info.base_offset >= self.replay_from:
            self.seen = True
            first = replay_txn_header(info, self.ongoing, self.aborted)
            if first >= 0:
                self._index_abort((info.txn_hi, info.txn_lo, info.producer_id, first, info.base_offset), base)

    def stats(self) -> dict:
        """Open and aborted transaction counts, and the open transaction
        holding maxReadPosition back (and since when)."""
        blocked = self.blocked_by()
        return {
            "open_transactions": len(self.ongoing),
            "aborted_transactions": len(self.aborted),
            "blocked_by": None if blocked is None else str(blocked[0]),
            "blocked_since_ms": None if blocked is None else blocked[2],
        }
