"""The decision record: a commit's one durable write (docs/FORMAT.md,
"Coordinator log"; docs/GUARANTEES.md, "How a commit is made durable").

A commit is decided by one DECIDED frame in its coordinator's log, and the
fdatasync of that frame is the only flush the commit waits for. The frame
names everything the commit covers, so recovery can check the participants
against it and repair what a power loss took from them:

- for each partition, the transaction's batches there: base offset, count,
  the CRC-32C and the length of the batch's bytes, and, when the
  transaction's batches are small (:data:`REDO_COPY_MAX` bytes in all), a
  copy of the bytes themselves (a redo copy). Larger outputs are synced to
  their segments before the frame is written, and the frame only names them;
- for each subscription partition, the acknowledged offsets as ranges and
  the cumulative ack (or -1).

Payload (after the frame's u64 hi, u64 lo transaction id; little-endian)::

    u32 partitions
      text topic | u32 partition | u32 batches
        i64 base offset | i32 count | u32 crc | u32 length | u8 copied
        [length bytes: the batch, when copied = 1]
    u32 subscription partitions
      text topic | text subscription | u32 partition | i64 cumulative (-1: none)
        u32 ranges | (i64 start, i64 end exclusive) per range

``text`` is a u16 byte length and UTF-8. The frame's CRC covers all of it:
a torn frame is no decision, and its transaction is aborted.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

from txmq._reader import Reader
from txmq._txn import encode_text

# The transaction's batches are copied into the record when they hold at
# most this many bytes in all: the copy costs a memcpy and the bytes of
# one larger write, a flush of the segment costs a second serial flush
# (docs/GUARANTEES.md). 64 KiB keeps the README's loop (100 x 100 B) and
# most request-sized outputs to one flush.
REDO_COPY_MAX = 64 * 1024

_U32 = struct.Struct("<I")
_BATCH = struct.Struct("<qiIIB")
_SUB = struct.Struct("<IqI")
_RANGE = struct.Struct("<qq")


class BatchRef(NamedTuple):
    """One batch a commit covers: where it is, its CRC and length, and its
    bytes when the record holds a copy (else None)."""
    base_offset: int
    count: int
    crc: int
    length: int
    data: bytes | None


class AckRanges(NamedTuple):
    """The acks a commit applies on one subscription partition."""
    topic: str
    subscription: str
    partition: int
    cumulative: int
    ranges: list          # [(start, end)], end exclusive


class Decision(NamedTuple):
    """A decoded decision record: ``partitions`` maps (topic, partition)
    to its [BatchRef], ``acks`` lists AckRanges."""
    partitions: dict
    acks: list


def offset_ranges(offsets) -> list:
    """Sorted, merged [(start, end)] of the int offsets ``offsets``."""
    if not len(offsets):
        return []
    a = np.unique(np.asarray(offsets, np.int64))
    cut = np.flatnonzero(np.diff(a) != 1) + 1
    starts = np.concatenate(([a[0]], a[cut]))
    ends = np.concatenate((a[cut - 1], [a[-1]])) + 1
    return list(zip(starts.tolist(), ends.tolist()))


def encode(partitions: list, acks: list) -> bytes:
    """The payload after the transaction id: ``partitions`` is [(topic,
    partition, [BatchRef])], ``acks`` is [AckRanges]."""
    out = [_U32.pack(len(partitions))]
    for topic, index, batches in partitions:
        out.append(encode_text(topic) + _U32.pack(index) + _U32.pack(len(batches)))
        for b in batches:
            out.append(_BATCH.pack(b.base_offset, b.count, b.crc, b.length, b.data is not None))
            if b.data is not None:
                out.append(b.data)
    out.append(_U32.pack(len(acks)))
    for a in acks:
        out.append(encode_text(a.topic) + encode_text(a.subscription)
                   + _SUB.pack(a.partition, a.cumulative, len(a.ranges)))
        out.extend(_RANGE.pack(s, e) for s, e in a.ranges)
    return b"".join(out)


def decode(record: bytes, path=None, position: int = 0) -> Decision:
    """The Decision of a record (the payload after the transaction id). A
    record that does not parse raises CorruptLogError at its bad byte of
    ``path`` (ValueError without one)."""
    r = Reader(path, "decision record")
    r.reset(record, position)
    partitions = {}
    for _ in range(r.u32()):
        topic = r.text()
        index = r.u32()
        batches = []
        for _ in range(r.u32()):
            base, count, crc, length = r.i64(), r.i32(), r.u32(), r.u32()
            copied = r.u8()
            if copied > 1:
                r.fail(r.pos - 1, f"copied flag {copied}")
            batches.append(BatchRef(base, count, crc, length, r.read(length) if copied else None))
        partitions.setdefault((topic, index), []).extend(batches)
    acks = []
    for _ in range(r.u32()):
        topic, sub = r.text(), r.text()
        index, cumulative, n = r.u32(), r.i64(), r.u32()
        acks.append(AckRanges(topic, sub, index, cumulative, [(r.i64(), r.i64()) for _ in range(n)]))
    r.done()
    return Decision(partitions, acks)
