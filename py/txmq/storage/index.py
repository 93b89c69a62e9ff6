"""A segment's sparse offset index (``<base>.index``) and time index
(``<base>.timeindex``): headerless arrays of 16-byte entries::

    .index       i64 offset,        i64 position   (strictly increasing)
    .timeindex   i64 publish time,  i64 offset     (both increasing)

Derived data: appended as the log is checkpointed, rewritten atomically
when a segment is sealed or an index is rebuilt, rebuilt from the segment
when lost or wrong. :func:`index_problem` is the one predicate for "wrong".
"""

from __future__ import annotations

import logging
import os

import numpy as np

from txmq._batch import FIELD_OFFSETS, HEADER_SIZE_BYTES, MAGIC, VERSION
from txmq._segment import Segment
from txmq.files import is_full, write_atomic
from txmq.storage.layout import INDEX_SUFFIX, TIMEINDEX_SUFFIX, segment_file

log = logging.getLogger("txmq.partition")

INDEX_ENTRY = np.dtype([("a", "<i8"), ("b", "<i8")])
assert INDEX_ENTRY.itemsize == 16
# index_problem reads these batch-header fields as 8-byte words of the
# mapping: magic and version share word 0, the others are words of their own.
_HEAD_WORD = MAGIC | VERSION << 32
_HEAD_MASK = 0xFF_FFFF_FFFF
_BASE_OFFSET_WORD = FIELD_OFFSETS["base_offset"] // 8
_PUBLISH_TIME_WORD = FIELD_OFFSETS["publish_time"] // 8
# batches_end reads the length and count, which share word 1 and word 3.
_LENGTH_WORD, _LENGTH_SHIFT = FIELD_OFFSETS["length"] // 8, FIELD_OFFSETS["length"] % 8 * 8
_COUNT_WORD, _COUNT_SHIFT = FIELD_OFFSETS["count"] // 8, FIELD_OFFSETS["count"] % 8 * 8
assert FIELD_OFFSETS["magic"] == 0 and FIELD_OFFSETS["version"] == 4
assert FIELD_OFFSETS["base_offset"] % 8 == 0 and FIELD_OFFSETS["publish_time"] % 8 == 0
assert FIELD_OFFSETS["length"] % 8 == 4 and FIELD_OFFSETS["count"] % 8 == 0


def load_entries(path: str):
    """The whole entries of an index file (a torn last one left out), or
    None when it is missing."""
    try:
        raw = np.fromfile(path, dtype=np.uint8)
    except (FileNotFoundError, ValueError):
        return None
    if len(raw) % INDEX_ENTRY.itemsize:
        raw = raw[: len(raw) - len(raw) % INDEX_ENTRY.itemsize]  # torn last entry
    return raw.view(INDEX_ENTRY)


def write_entries(path: str, a, b, truncate: bool = False) -> None:
    """Append entries to an index file, or (``truncate``) replace it whole,
    atomically: a kill mid-rewrite must not leave it empty or short."""
    entries = np.empty(len(a), INDEX_ENTRY)
    entries["a"] = a
    entries["b"] = b
    if truncate:
        write_atomic(path, entries.tobytes(), fsync=False)   # derived data: rebuilt if lost
        return
    with open(path, "ab") as f:
        f.write(entries.tobytes())


def rewrite_index(directory: str, seg: Segment) -> tuple:
    """Replace both index files of ``seg`` with its in-memory indexes;
    returns (offset entries, time entries) written ((0, 0) when a full
    disk refused them: :func:`_not_written`)."""
    offs, poss, ts, toffs = seg.index_entries()
    try:
        write_entries(segment_file(directory, seg.base_offset, INDEX_SUFFIX), offs, poss, truncate=True)
        write_entries(segment_file(directory, seg.base_offset, TIMEINDEX_SUFFIX), ts, toffs, truncate=True)
    except OSError as e:
        return _not_written(directory, seg, e)
    return len(offs), len(ts)


def append_index(directory: str, seg: Segment, written: tuple) -> tuple:
    """Append the entries of ``seg`` past ``written`` (offset entries, time
    entries already on disk); returns the new counts."""
    offs, poss, ts, toffs = seg.index_entries()
    n_off, n_ts = written
    if n_off > len(offs) or n_ts > len(ts):
        return rewrite_index(directory, seg)
    try:
        write_entries(segment_file(directory, seg.base_offset, INDEX_SUFFIX), offs[n_off:], poss[n_off:])
        write_entries(segment_file(directory, seg.base_offset, TIMEINDEX_SUFFIX), ts[n_ts:], toffs[n_ts:])
    except OSError as e:
        return _not_written(directory, seg, e)
    return len(offs), len(ts)


def _not_written(directory: str, seg: Segment, e: OSError) -> tuple:
    """A full disk refused an index write. Indexes are derived: drop both
    files (opening rebuilds a missing index from its segment) and return
    (0, 0), so the next checkpoint writes them whole; any other error is
    raised."""
    if not is_full(e):
        raise e
    for suffix in (INDEX_SUFFIX, TIMEINDEX_SUFFIX):
        try:
            os.unlink(segment_file(directory, seg.base_offset, suffix))
        except FileNotFoundError:
            pass
    log.warning("txmq: indexes of %s not written (%s); written again later", seg.path, e)
    return 0, 0


def torn(path: str) -> bool:
    """Whether an index file ends in part of an entry (a write cut short)."""
    try:
        return os.path.getsize(path) % INDEX_ENTRY.itemsize != 0
    except FileNotFoundError:
        return False


def index_problem(seg: Segment, offsets, positions, timestamps, time_offsets, size: int | None = None,
                  next_offset: int | None = None, every_header: bool = True):
    """The first wrong entry of a segment's offset index (``offsets``,
    ``positions``) or time index (``timestamps``, ``time_offsets``), as
    (".index" or ".timeindex", entry number, reason), or None when every
    entry names, in increasing order, a batch of ``seg`` below ``size``
    bytes and ``next_offset`` (default: the segment's) as it says: the
    batch header at that position holds that base offset (and that
    publish time), and a time entry's offset is one the offset index
    names (the broker makes both entries of a batch together).

    One predicate for opening (``txmq.storage.loader``), the partition's
    ``verify`` and ``scrub_indexes`` (which rebuild an index that has a
    problem, in the background) and ``txmq check`` (which calls it
    repairable). It reads the headers of the named batches through the
    segment's mapping in one vectorized pass, without their CRCs. Opening
    passes ``every_header=False``: order and range of every entry, the
    headers of the first and last only, so that opening touches a page or
    two of a sealed segment, not one every ``index_interval_bytes``
    (reopening must not grow with the log). A read checks the batch an
    entry names before it uses it (``Segment._idx_entry_ok``) and bypasses
    an entry that fails."""
    size = seg.size if size is None else size
    next_offset = seg.next_offset if next_offset is None else next_offset
    offs, poss = np.asarray(offsets, np.int64), np.asarray(positions, np.int64)
    ts, toffs = np.asarray(timestamps, np.int64), np.asarray(time_offsets, np.int64)
    if not len(offs) and not len(ts):
        return None
    words = _words(seg, size)
    try:
        wrong = ((offs < seg.base_offset) | (offs >= next_offset) | (poss < 0) | (poss % 8 != 0)
                 | (poss + HEADER_SIZE_BYTES > size))
        wrong[1:] |= (np.diff(offs) <= 0) | (np.diff(poss) <= 0)
        at = np.where(wrong, 0, poss // 8)
        look = _ends(len(offs), every_header)
        if len(words):
            wrong[look] |= (((words[at[look]] & _HEAD_MASK) != _HEAD_WORD)
                            | (words[at[look] + _BASE_OFFSET_WORD].view(np.int64) != offs[look]))
        if wrong.any():
            i = int(np.argmax(wrong))
            off, pos = int(offs[i]), int(poss[i])
            if i and not (off > offs[i - 1] and pos > poss[i - 1]):
                why = f"does not increase on the one before ({int(offs[i - 1])}, {int(poss[i - 1])})"
            elif pos + HEADER_SIZE_BYTES > size or off >= next_offset:
                why = f"points past the last batch (byte {size}, offset {next_offset})"
            else:
                why = "points away from the batch of that offset"
            return INDEX_SUFFIX, i, f"(offset {off}, position {pos}) {why}"
        named = np.minimum(np.searchsorted(offs, toffs), max(len(offs) - 1, 0))
        wrong = (toffs < seg.base_offset) | (toffs >= next_offset)
        wrong[1:] |= (np.diff(ts) <= 0) | (np.diff(toffs) < 0)
        if len(offs):
            wrong |= offs[named] != toffs
            if len(words):
                look = _ends(len(ts), every_header)
                at = np.where(wrong, 0, poss[named] // 8 + _PUBLISH_TIME_WORD)
                wrong[look] |= words[at[look]].view(np.int64) != ts[look]
        else:
            wrong[:] = True
        if wrong.any():
            i = int(np.argmax(wrong))
            t, off = int(ts[i]), int(toffs[i])
            if i and not (t > ts[i - 1] and off >= toffs[i - 1]):
                why = f"does not increase on the one before ({int(ts[i - 1])}, {int(toffs[i - 1])})"
            else:
                why = "names no indexed batch published at that time"
            return TIMEINDEX_SUFFIX, i, f"(time {t}, offset {off}) {why}"
        return None
    finally:
        del words


def batches_end(seg: Segment, size: int, from_pos: int = 0, from_offset: int | None = None) -> tuple:
    """(position, next offset) where the batches of ``seg`` stop, walking
    their headers from ``from_pos`` (a batch boundary holding
    ``from_offset``, default the segment's base) while each is a batch
    header whose base offset follows on the one before and whose length
    stays below ``size``. No CRC is checked: this is how opening learns
    the end offset of a segment it trusts, reading a page or two from its
    last index entry on."""
    words = _words(seg, size)
    try:
        pos, expected = from_pos, seg.base_offset if from_offset is None else from_offset
        while pos % 8 == 0 and pos + HEADER_SIZE_BYTES <= size:
            w = pos // 8
            if (int(words[w]) & _HEAD_MASK) != _HEAD_WORD or int(words[w + _BASE_OFFSET_WORD]) != expected:
                break
            length = int(words[w + _LENGTH_WORD]) >> _LENGTH_SHIFT & 0xFFFF_FFFF
            count = int(words[w + _COUNT_WORD]) >> _COUNT_SHIFT & 0xFFFF_FFFF
            if length < HEADER_SIZE_BYTES or pos + length > size or not 0 < count < 1 << 31:
                break
            pos += length
            expected += count
        return pos, expected
    finally:
        del words


def _words(seg: Segment, size: int):
    if size >= HEADER_SIZE_BYTES and seg.mapping is not None:
        return np.frombuffer(seg.mapping, np.uint64, size // 8)
    return np.empty(0, np.uint64)


def _ends(n: int, every: bool):
    """Which of ``n`` index entries :func:`index_problem` reads the header of."""
    return slice(None) if every or n <= 2 else np.array([0, n - 1])
