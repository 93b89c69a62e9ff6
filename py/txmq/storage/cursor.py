"""A subscription's cursor on one partition: mark-delete plus the ranges
acknowledged individually above it, kept in a framed redo log.

Frames (payload little-endian; the redo log adds length, CRC and type):

- ``ACK`` (2): u32 n, then n i64 offsets acknowledged individually;
- ``MARK_DELETE`` (3): i64 offset, everything below is acknowledged;
- ``RESET`` (4): i64 offset, the cursor was moved there (seek), the
  individual acks are forgotten;
- ``ACK_RANGE`` (5): i64 start, i64 end: [start, end) acknowledged;
- ``SNAPSHOT`` (1): i64 mark-delete + the ack set's bytes (_ackset).

Frames are decoded through ``_reader.Reader``: a frame that does not parse
raises ``CorruptLogError`` at its first bad byte.
"""

from __future__ import annotations

import logging
import struct

import numpy as np

from txmq._ackset import AckSet, add_many
from txmq._reader import Reader
from txmq._redolog import FILE_HEADER, SNAPSHOT, RedoLog, payload_position_of

log = logging.getLogger("txmq.cursor")

ACK, MARK_DELETE, RESET, ACK_RANGE = 2, 3, 4, 5
_I64 = struct.Struct("<q")

# Replay cost stays bounded: a log with more frames than this is rewritten
# as one snapshot.
COMPACT_FRAMES = 10_000


class CursorState:
    """Mark-delete and the offsets acknowledged individually above it: what
    a cursor log's frames replay to (:func:`replay`)."""

    def __init__(self, mark_delete: int):
        self.mark_delete = mark_delete
        self.acked = AckSet()

    def _apply(self, kind: int, r: Reader) -> None:
        """Apply the frame of type ``kind`` whose payload ``r`` reads; the
        reader's error at the first bad byte when it is malformed."""
        if kind == SNAPSHOT:
            mark_delete = r.i64()
            acked = AckSet.read(r)
            r.done()
            self.mark_delete, self.acked = mark_delete, acked
        elif kind == ACK:
            n = r.u32()
            offs = np.frombuffer(r.read(n, 8), "<i8")
            r.done()
            add_many(self.acked, offs[offs >= self.mark_delete])
            self._advance()
        elif kind == MARK_DELETE:
            offset = r.i64()
            r.done()
            self._set_mark_delete(offset)
        elif kind == ACK_RANGE:
            start, end = r.i64(), r.i64()
            r.done()
            self.acked.add_range(max(start, self.mark_delete), end)
            self._advance()
        elif kind == RESET:
            offset = r.i64()
            r.done()
            self.mark_delete = offset
            self.acked.clear()
        else:
            r.fail(-1, "unknown frame type")

    def _replay(self, frames, path) -> None:
        """Apply ``frames`` (``(type, payload, position)`` as
        ``RedoLog.replay(positions=True)`` gives them, or ``(type, payload)``)
        of the cursor log at ``path``."""
        r = Reader(path, "cursor frame of type")
        for frame in frames:
            r.reset(frame[1], payload_position_of(frame), frame[0])
            self._apply(frame[0], r)

    def _advance(self) -> None:
        md = self.acked.first_unacked(self.mark_delete)
        if md != self.mark_delete:
            self.mark_delete = md
            self.acked.trim_below(md)

    def _set_mark_delete(self, offset: int) -> None:
        if offset > self.mark_delete:
            self.mark_delete = offset
            self.acked.trim_below(offset)
            self._advance()

    def is_acked(self, offset: int) -> bool:
        return offset < self.mark_delete or self.acked.contains(offset)


def replay(frames, initial_offset: int, path=None) -> CursorState:
    """The state cursor-log ``frames`` replay to from ``initial_offset``, as
    opening the log replays them (read-only readers and ``txmq check`` use
    it). ``frames`` are ``(type, payload, position)`` as
    ``_redolog.parse`` gives them (or ``(type, payload)`` pairs, whose bytes
    then count from each payload's first); a malformed frame raises
    CorruptLogError at its first bad byte of file ``path`` (ValueError
    without a path)."""
    state = CursorState(initial_offset)
    state._replay(frames, path)
    return state


class Cursor(CursorState):
    """Mark-delete + individual acks of one partition, durable per ``fsync``."""

    def __init__(self, path, fsync: str, initial_offset: int, lost_offset: int):
        """Open or create the cursor log at ``path``.

        A new cursor starts at ``initial_offset``. A cursor log that existed
        but kept no valid frame has lost its position: it restarts at
        ``lost_offset`` (the log start), so messages may come again but none
        is skipped, and ``problems`` says so.
        """
        self.log = RedoLog(path, fsync)
        existed = self.log.size > len(FILE_HEADER)
        super().__init__(initial_offset)
        self.problems: list[str] = []
        frames = self.log.replay(positions=True)
        if self.log.dropped is not None:
            pos, reason, n = self.log.dropped
            self._problem(f"{self.log.path} at byte {pos}: {reason}; {n} bytes cut")
        if not frames:
            if existed:
                self._problem(f"{self.log.path}: no valid frame left; cursor restarts at offset "
                              f"{lost_offset} (messages may be delivered again)")
                initial_offset = lost_offset
            self.mark_delete = initial_offset
            self.log.append(RESET, _I64.pack(initial_offset))
            self.log.sync()
        self._replay(frames, self.log.path)     # a malformed frame: CorruptLogError at its bad byte

    def _problem(self, text: str) -> None:
        self.problems.append(text)
        log.warning("txmq: cursor %s", text)

    def clamp(self, end_offset: int) -> None:
        """Forget acknowledgements at or past ``end_offset``: the log was
        cut there on open, and offsets past it will name new messages."""
        if self.mark_delete > end_offset:
            self._problem(f"{self.log.path}: mark-delete {self.mark_delete} is past the log end "
                          f"{end_offset}; moved back")
            self.reset(end_offset)
            return
        ranges = self.acked.ranges()
        if ranges and ranges[-1][1] > end_offset:
            self._problem(f"{self.log.path}: acknowledgements past the log end {end_offset} dropped")
            kept = AckSet()
            for a, b in ranges:
                if a < end_offset:
                    kept.add_range(a, min(b, end_offset))
            self.acked = kept
            self.log.compact(_I64.pack(self.mark_delete) + self.acked.to_bytes())

    def ack(self, offsets, sync: bool = True) -> list:
        """Acknowledge offsets individually; return those that were new.
        ``sync=False`` leaves the frame in the page cache (a transaction's
        commit: its pending-ack log can redo it)."""
        md = self.mark_delete
        if len(self.acked):
            contains = self.acked.contains
            new = [o for o in offsets if o >= md and not contains(o)]
        else:
            new = [o for o in offsets if o >= md]
        if not new:
            return new
        arr = np.asarray(new, "<i8")
        self.log.append(ACK, struct.pack("<I", len(arr)) + arr.tobytes())
        add_many(self.acked, arr)
        self._advance()
        self._persisted(sync)
        return new

    def ack_range(self, start: int, end: int, sync: bool = True, defer: bool = False) -> int:
        """Acknowledge [start, end) (the batch fast path); return how many
        were new. ``defer``: the frame has no write of its own (it goes out
        with the log's next write or sync: ``RedoLog.defer``), for a
        committed transaction's acks, which its decision record can redo."""
        start = max(start, self.mark_delete)
        if end <= start:
            return 0
        before = self.acked.count_in(start, end)
        if before == end - start:
            return 0
        write = self.log.defer if defer else self.log.append
        if start == self.mark_delete:
            write(MARK_DELETE, _I64.pack(end))
            self._set_mark_delete(end)
        else:
            write(ACK_RANGE, struct.pack("<qq", start, end))
            self.acked.add_range(start, end)
        self._persisted(sync)
        return (end - start) - before

    def ack_cumulative(self, offset: int, sync: bool = True) -> bool:
        """Everything up to and including ``offset`` is acknowledged."""
        if offset + 1 <= self.mark_delete:
            return False
        self.log.append(MARK_DELETE, _I64.pack(offset + 1))
        self._set_mark_delete(offset + 1)
        self._persisted(sync)
        return True

    def skip(self, start: int, end: int) -> None:
        """Count [start, end) as acknowledged: offsets that are never
        delivered (transaction markers, aborted batches under
        READ_COMMITTED). The frame is not synced: if it is lost, the reader
        passes those offsets again after a reopen and skips them again."""
        self.ack_range(start, end, sync=False)

    def reset(self, offset: int) -> None:
        """Move the cursor to ``offset`` (seek) and forget individual acks."""
        self.log.append(RESET, _I64.pack(offset))
        self.mark_delete = offset
        self.acked.clear()
        self._persisted()

    def _persisted(self, sync: bool = True) -> None:
        """Sync the frame just appended; compact from the in-memory state,
        which the caller has already brought up to date with that frame."""
        if sync:
            self.log.sync()
        if self.log.compact_due(COMPACT_FRAMES):
            # Housekeeping: the frame is durable, so a full disk only defers it.
            self.log.try_compact(_I64.pack(self.mark_delete) + self.acked.to_bytes())

    def close(self) -> None:
        self.log.close()
