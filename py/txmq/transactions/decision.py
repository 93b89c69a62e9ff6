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

from typing import NamedTuple

from txmq._txnlog import decode_decision, encode_decision, ranges_of

__all__ = ["REDO_COPY_MAX", "BatchRef", "AckRanges", "Decision", "encode", "decode", "offset_ranges"]

# The transaction's batches are copied into the record when they hold at
# most this many bytes in all: the copy costs a memcpy and the bytes of
# one larger write, a flush of the segment costs a second serial flush
# (docs/GUARANTEES.md). 64 KiB keeps the README's loop (100 x 100 B) and
# most request-sized outputs to one flush.
REDO_COPY_MAX = 64 * 1024


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


# Encoding runs once per commit, in the compiled core (no Python frame per
# batch): ``encode(partitions, acks)`` with ``partitions`` as [(topic,
# partition, [(base, count, crc, length, bytes or None)])] and ``acks`` as
# [(topic, subscription, partition, cumulative, [(start, end)])].
encode = encode_decision
offset_ranges = ranges_of


def decode(record: bytes, path=None, position: int = 0) -> Decision:
    """The Decision of a record (the payload after the transaction id). A
    record that does not parse raises CorruptLogError at its bad byte of
    ``path`` (ValueError without one)."""
    partitions, acks = decode_decision(record, path, position)
    return Decision({k: [BatchRef(*b) for b in v] for k, v in partitions.items()},
                    [AckRanges(*a) for a in acks])
