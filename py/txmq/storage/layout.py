"""Every file of a partition directory, by name, and the fixed layouts of
its side files (docs/FORMAT.md has the bytes).

``<data>/topics/<topic>/<p>/``:

- ``<base:020d>.log``: a segment, ``<base>`` its first offset; with it
  ``<base>.index``, ``<base>.timeindex`` (``txmq.storage.index``) and
  ``<base>.txnindex``, created and deleted together (:data:`SEGMENT_FILES`);
- ``recovery-point`` (40 bytes)::

      0  4  magic b"TXRP"          16  8  position in that segment
      4  1  version 1               24  8  next offset at that position
      5  1  fsync mode of its writer 32  4  crc32c of bytes [0, 32)
      6  2  reserved                36  4  reserved
      8  8  segment base offset

  (fsync mode: 0 not recorded, 1 "never", 2 "commit", 3 "always");
- ``quarantine.json``: the quarantined ranges of the partition's segments
  (:func:`quarantine_bytes`);
- ``txnbuffer.snap``: ``<4s magic b"TXTB", u8 version 1, u8 flags,
  2 reserved, i64 replay-from offset>``, the ongoing and aborted tables
  (``_txn`` ``to_bytes``), crc32c of everything before it;
- ``producers.snap``: ``<4s magic b"TXPS", u8 version 1, 3 reserved,
  i64 replay-from offset>``, the producer table (``_producers``
  ``to_bytes``), crc32c of everything before it;
- ``<base>.txnindex``: 48-byte entries ``<u64 txn hi, u64 txn lo, i64
  producer id, i64 first offset, i64 marker offset, u32 crc32c of the 40
  bytes before it, 4 reserved>``;
- ``readview``: the read view (``_readview``).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

from txmq._crc32c import crc32c_of
from txmq._producers import ProducerStates
from txmq._readview import (READVIEW_BYTES, READVIEW_GEN_END, READVIEW_HEAD, READVIEW_MAGIC, READVIEW_SLOT,
                            READVIEW_SLOTS, READVIEW_VERSION, RV_CLOSED, RV_LIVE, RV_RECOVERING)
from txmq._txn import AbortSet, OngoingQueue
from txmq.errors import CorruptLogError

SEGMENT_SUFFIX = ".log"
INDEX_SUFFIX = ".index"
TIMEINDEX_SUFFIX = ".timeindex"
TXNINDEX_SUFFIX = ".txnindex"
SEGMENT_FILES = (SEGMENT_SUFFIX, INDEX_SUFFIX, TIMEINDEX_SUFFIX, TXNINDEX_SUFFIX)   # deleted together
RECOVERY_POINT_FILE = "recovery-point"
TXNBUF_FILE = "txnbuffer.snap"
PRODUCERS_FILE = "producers.snap"
READVIEW_FILE = "readview"
QUARANTINE_FILE = "quarantine.json"
PARTITION_FILES = (RECOVERY_POINT_FILE, TXNBUF_FILE, PRODUCERS_FILE, READVIEW_FILE, QUARANTINE_FILE)

RECOVERY_POINT = struct.Struct("<4sBB2xqqqI4x")
RECOVERY_POINT_MAGIC = b"TXRP"
RECOVERY_POINT_VERSION = 1
RP_VERSION_OFFSET = 4
RP_FSYNC_OFFSET = RP_VERSION_OFFSET + 1
RP_BASE_OFFSET = RP_VERSION_OFFSET + 4
RP_POSITION_OFFSET = RP_BASE_OFFSET + 8
RP_NEXT_OFFSET_OFFSET = RP_POSITION_OFFSET + 8
RP_CRC_OFFSET = RP_NEXT_OFFSET_OFFSET + 8
assert RECOVERY_POINT.size == 40 and RP_CRC_OFFSET == 32
# The writer's fsync mode, so every reader of a partition judges a hole
# or a gap between segments as the promise its data was written under.
FSYNC_CODES = {"never": 1, "commit": 2, "always": 3}

TXNBUF_MAGIC = b"TXTB"
TXNBUF_VERSION = 1
TXNBUF_HEAD = struct.Struct("<4sBB2xq")
TXNBUF_HAS_TXN_DATA = 1      # flags: the log has held transactional batches
assert TXNBUF_HEAD.size == 16

PRODUCERS_MAGIC = b"TXPS"
PRODUCERS_VERSION = 1
PRODUCERS_HEAD = struct.Struct("<4sB3xq")
assert PRODUCERS_HEAD.size == 16

TXNINDEX_ENTRY = struct.Struct("<QQqqqI4x")
TXNINDEX_CRC_OFFSET = 40
assert TXNINDEX_ENTRY.size == 48


# -- names ---------------------------------------------------------------------------

def segment_file(directory: str, base: int, suffix: str = SEGMENT_SUFFIX) -> str:
    """The path of segment ``base``'s file with ``suffix``."""
    return os.path.join(directory, f"{base:020d}{suffix}")


def segment_bases(directory: str, names=None) -> list:
    """The base offsets of the segments in ``directory`` (of ``names``,
    its listing, when given), sorted."""
    names = os.listdir(directory) if names is None else names
    n = len(SEGMENT_SUFFIX)
    return sorted(int(name[:-n]) for name in names if name.endswith(SEGMENT_SUFFIX) and name[:-n].isdigit())


def known_files(bases) -> set:
    """The names a partition directory with segments ``bases`` holds."""
    out = set(PARTITION_FILES)
    for base in bases:
        out |= {f"{base:020d}{suffix}" for suffix in SEGMENT_FILES}
    return out


def is_leftover(name: str) -> bool:
    """A temporary file of a write a crash cut short (opening removes it)."""
    return name.endswith(".tmp") and (name.startswith((TXNBUF_FILE + ".", PRODUCERS_FILE + "."))
                                      or name.endswith((".index.tmp", ".timeindex.tmp", ".txnindex.tmp")))


# -- recovery point --------------------------------------------------------------------

def recovery_point_bytes(base: int, position: int, next_offset: int, fsync: str | None = None) -> bytes:
    body = RECOVERY_POINT.pack(RECOVERY_POINT_MAGIC, RECOVERY_POINT_VERSION, FSYNC_CODES.get(fsync, 0), base,
                               position, next_offset, 0)
    return body[:RP_CRC_OFFSET] + struct.pack("<I4x", crc32c_of(body[:RP_CRC_OFFSET]))


def parse_recovery_point(path: str, raw: bytes, bases) -> tuple:
    """(segment base, position, next offset, fsync code) of recovery-point bytes ``raw``
    of a partition whose segments start at ``bases``; CorruptLogError (at
    the byte it is about) when they are not a sound one. Whether the
    position lies in its segment is the caller's to check."""
    if len(raw) < RECOVERY_POINT.size:
        raise CorruptLogError(path, len(raw), f"{len(raw)} bytes, expected {RECOVERY_POINT.size}")
    magic, version, fsync, base, pos, next_offset, crc = RECOVERY_POINT.unpack_from(raw)
    if magic != RECOVERY_POINT_MAGIC:
        raise CorruptLogError(path, 0, f"bad magic {magic!r}")
    if version != RECOVERY_POINT_VERSION:
        raise CorruptLogError(path, RP_VERSION_OFFSET, f"unknown version {version}")
    if crc != crc32c_of(raw[:RP_CRC_OFFSET]):
        raise CorruptLogError(path, RP_CRC_OFFSET, "CRC mismatch")
    if base not in bases:
        raise CorruptLogError(path, RP_BASE_OFFSET, f"names segment {base}, which does not exist")
    if pos < 0 or next_offset < base:
        raise CorruptLogError(path, RP_POSITION_OFFSET,
                              f"position {pos} or next offset {next_offset} is out of range")
    return base, pos, next_offset, fsync


# -- quarantine ------------------------------------------------------------------------

QUARANTINE_FORMAT = 1
QUARANTINE_FIELDS = ("segment", "position", "end_position", "first_offset", "end_offset", "reason")


def quarantine_bytes(entries) -> bytes:
    """The bytes of ``quarantine.json`` holding ``entries`` (objects with
    the attributes of :data:`QUARANTINE_FIELDS`)."""
    return json.dumps({"format": QUARANTINE_FORMAT,
                       "ranges": [{k: getattr(e, k) for k in QUARANTINE_FIELDS} for e in entries]},
                      indent=1).encode() + b"\n"


def read_quarantine(path: str) -> list:
    """The quarantined ranges of ``quarantine.json`` at ``path``, as
    ``txmq.storage.loader.Quarantined``-shaped namespaces (empty when the
    file is missing); CorruptLogError when it does not parse."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return []
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptLogError(path, getattr(e, "pos", 0) or 0, f"not valid JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != QUARANTINE_FORMAT or not isinstance(doc.get("ranges"), list):
        raise CorruptLogError(path, 0, "not a quarantine file of format 1")
    out = []
    for r in doc["ranges"]:
        if (not isinstance(r, dict) or not all(isinstance(r.get(k), int) for k in QUARANTINE_FIELDS[:-1])
                or not isinstance(r.get("reason", ""), str)):
            raise CorruptLogError(path, 0, f"bad range {r!r}")
        out.append(QuarantineRange(*(r.get(k, "") for k in QUARANTINE_FIELDS)))
    return out


class QuarantineRange(tuple):
    """(segment, position, end position, first offset, end offset, reason)."""

    __slots__ = ()

    def __new__(cls, *fields):
        return tuple.__new__(cls, fields)

    segment = property(lambda self: self[0])
    position = property(lambda self: self[1])
    end_position = property(lambda self: self[2])
    first_offset = property(lambda self: self[3])
    end_offset = property(lambda self: self[4])
    reason = property(lambda self: self[5])


# -- snapshots ---------------------------------------------------------------------------

def sealed(body: bytes) -> bytes:
    """``body`` followed by its crc32c: a snapshot file's bytes."""
    return body + struct.pack("<I", crc32c_of(body))


def parse_snapshot(path: str, raw: bytes, magic: bytes, version: int, head: struct.Struct, parse_tables):
    """(header fields, parse_tables(tables)) of the bytes ``raw`` of a
    snapshot file (txnbuffer.snap, producers.snap: ``head``, the tables,
    a crc32c of all before it); CorruptLogError (at the byte it is about)
    when they fail a check. Whether its offset, the last header field,
    lies in the log is the caller's to check."""
    if len(raw) < head.size + 8:
        raise CorruptLogError(path, len(raw), "shorter than its header and CRC")
    if struct.unpack_from("<I", raw, len(raw) - 4)[0] != crc32c_of(raw[:-4]):
        raise CorruptLogError(path, len(raw) - 4, "CRC mismatch")
    fields = head.unpack_from(raw)
    if fields[0] != magic:
        raise CorruptLogError(path, 0, f"bad magic {fields[0]!r}")
    if fields[1] != version:
        raise CorruptLogError(path, 4, f"unknown version {fields[1]}")
    try:
        return fields, parse_tables(raw[head.size:-4], path, head.size)
    except CorruptLogError:
        raise                            # at the byte the table's reader stopped at
    except (ValueError, OverflowError, struct.error) as e:
        raise CorruptLogError(path, head.size, f"tables do not parse: {e}") from None


def parse_txn_tables(body: bytes, path=None, base: int = 0):
    """(OngoingQueue, AbortSet) of a txnbuffer.snap's tables, which start at
    byte ``base`` of ``path`` (a bad byte raises CorruptLogError there)."""
    ongoing, n = OngoingQueue.from_bytes(body, path, base)
    aborted, m = AbortSet.from_bytes(body[n:], path, base + n)
    if n + m != len(body):
        if path is not None:
            raise CorruptLogError(path, base + n + m, "stray bytes after the tables")
        raise ValueError("stray bytes after the tables")
    return ongoing, aborted


def parse_producer_table(body: bytes, path=None, base: int = 0):
    """The ProducerStates of a producers.snap's table, which starts at byte
    ``base`` of ``path`` (a bad byte raises CorruptLogError there)."""
    table, n = ProducerStates.from_bytes(body, path, base)
    if n != len(body):
        if path is not None:
            raise CorruptLogError(path, base + n, "stray bytes after the producer table")
        raise ValueError("stray bytes after the producer table")
    return table


def txn_snapshot_bytes(flags: int, offset: int, ongoing, aborted) -> bytes:
    return sealed(TXNBUF_HEAD.pack(TXNBUF_MAGIC, TXNBUF_VERSION, flags, offset)
                  + ongoing.to_bytes() + aborted.to_bytes())


def producer_snapshot_bytes(offset: int, producers) -> bytes:
    return sealed(PRODUCERS_HEAD.pack(PRODUCERS_MAGIC, PRODUCERS_VERSION, offset) + producers.to_bytes())


def read_txn_snapshot(path: str):
    """``((magic, version, flags, offset), (ongoing, aborted))`` of the
    txnbuffer.snap at ``path``; None when it is missing, CorruptLogError
    when it fails a check."""
    return _read_snapshot(path, TXNBUF_MAGIC, TXNBUF_VERSION, TXNBUF_HEAD, parse_txn_tables)


def read_producer_snapshot(path: str):
    """``((magic, version, offset), producers)`` of the producers.snap at
    ``path``; None when it is missing, CorruptLogError when it fails a check."""
    return _read_snapshot(path, PRODUCERS_MAGIC, PRODUCERS_VERSION, PRODUCERS_HEAD, parse_producer_table)


def _read_snapshot(path, magic, version, head, parse):
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    return parse_snapshot(path, raw, magic, version, head, parse)


# -- the aborted-transaction index -----------------------------------------------------

def txnindex_bytes(entries) -> bytes:
    """.txnindex entries (hi, lo, producer id, first, marker), each sealed
    with the CRC of its first 40 bytes."""
    out = []
    for entry in entries:
        body = TXNINDEX_ENTRY.pack(*entry, 0)[:TXNINDEX_CRC_OFFSET]
        out.append(body + struct.pack("<I4x", crc32c_of(body)))
    return b"".join(out)


def txnindex_entries(raw: bytes):
    """(entries, bad) of .txnindex bytes: the entries (hi, lo, producer id,
    first, marker) up to the first that fails its CRC, and that one's
    number (None when every whole entry passes; a torn last one is left
    out). Whether an entry's marker is in its segment is the caller's
    question: opening cuts the file at the first that is not."""
    out = []
    size = TXNINDEX_ENTRY.size
    for i in range(len(raw) // size):
        *entry, crc = TXNINDEX_ENTRY.unpack_from(raw, i * size)
        if crc != crc32c_of(raw[i * size:i * size + TXNINDEX_CRC_OFFSET]):
            return out, i
        out.append(tuple(entry))
    return out, None


# -- the read view (written by txmq._readview) ---------------------------------------------

# A slot read as: closing generation, the eight fields, opening generation.
_GEN = struct.Struct("<Q")
_CRC_WORDS = struct.Struct("<QQQqqqqqQ")     # what a slot's CRC covers (the state word without it)
_FIELDS = struct.Struct("<" + READVIEW_SLOT.format[2:-1])
assert _FIELDS.size == READVIEW_SLOT.size - 16
READVIEW_TRIES = 64                   # rereads of a slot pair the writer keeps overwriting


@dataclass(frozen=True)
class ReadView:
    """One whole slot of a partition's ``readview`` file."""

    generation: int
    epoch: int
    state: int                  # RV_RECOVERING, RV_LIVE or RV_CLOSED
    log_start: int
    log_end: int
    max_read_position: int
    active_base: int
    active_size: int
    aborted_version: int


def read_readview(buf) -> ReadView | None:
    """The newest whole slot of readview bytes ``buf`` (a mapping or bytes),
    or None when the head is not a version-2 readview or no slot is whole
    and passes its CRC.

    Each slot is read closing generation first, fields next, opening
    generation last; the writer stores them in the opposite order, so equal
    generations mean the fields between are the ones they frame."""
    if len(buf) < READVIEW_BYTES:
        return None
    magic, version, slot_bytes, slots = READVIEW_HEAD.unpack_from(buf)
    if (magic, version, slot_bytes, slots) != (READVIEW_MAGIC, READVIEW_VERSION, READVIEW_SLOT.size,
                                                READVIEW_SLOTS):
        return None
    for _ in range(READVIEW_TRIES):
        best = None
        for i in range(READVIEW_SLOTS):
            off = READVIEW_HEAD.size + READVIEW_SLOT.size * i
            closing = _GEN.unpack_from(buf, off + READVIEW_GEN_END)[0]
            fields = _FIELDS.unpack_from(buf, off + 8)
            opening = _GEN.unpack_from(buf, off)[0]
            state, crc = fields[1] & 0xFFFFFFFF, fields[1] >> 32
            if opening == closing and opening and state in (RV_RECOVERING, RV_LIVE, RV_CLOSED) \
                    and crc == crc32c_of(_CRC_WORDS.pack(opening, fields[0], state, *fields[2:])):
                if best is None or opening > best.generation:
                    best = ReadView(opening, fields[0], state, *fields[2:])
        if best is not None:
            return best
    return None


def read_readview_file(path: str) -> ReadView | None:
    """:func:`read_readview` of the ``readview`` file at ``path`` (read
    with one pread, no descriptor kept); None when it is missing."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        for _ in range(READVIEW_TRIES):
            raw = os.pread(fd, READVIEW_BYTES, 0)
            rv = read_readview(raw)
            if rv is not None or len(raw) < READVIEW_BYTES or raw[:4] != READVIEW_MAGIC:
                return rv
            # Both slots torn: the writer is publishing its first; read again.
        return None
    finally:
        os.close(fd)
