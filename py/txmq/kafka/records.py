"""Record batches between Kafka's wire format (record batch v2) and txmq's
log: decompression of what producers send, and the batches a Fetch
returns. The byte layout and its checks are in the Cython codec
(``txmq._kafka_records``); this module adds compression and the mapping.

The mapping (docs/KAFKA.md): a Kafka record's key, value, headers and
timestamp are a txmq message's key, value, headers and event time; a
null value is stored as ``b""``; a null header value stays null (``None``). A
produced batch is decoded into txmq's columns in Cython and appended from
them (``BatchSpec.from_columns``): no Python object per record. One
Kafka batch is one txmq batch, so its producer id, epoch and base sequence
are the txmq batch's, and Kafka offsets are txmq offsets. A txmq COMMIT /
ABORT marker is returned as Kafka's control batch at its offset.
"""

from __future__ import annotations

import gzip

from txmq import _kafka_records
from txmq._batch import BatchSpec
from txmq.errors import KafkaProtocolError

NONE, GZIP, SNAPPY, LZ4, ZSTD = 0, 1, 2, 3, 4
CODEC_NAMES = {NONE: "none", GZIP: "gzip", SNAPPY: "snappy", LZ4: "lz4", ZSTD: "zstd"}
XERIAL_MAGIC = b"\x82SNAPPY\x00"   # the framing Java's snappy-java writes
XERIAL_HEADER_BYTES = 16


def _cramjam():
    try:
        import cramjam
    except ImportError:
        raise KafkaProtocolError("record batch", 0, "compressed batches need the cramjam package "
                                 "(pip install 'txmq[kafka]')") from None
    return cramjam


def decompress(codec: int, data: bytes, limit: int) -> bytes:
    """The records section of a batch compressed with ``codec``; at most
    ``limit`` bytes: a larger one raises (a zip bomb), and no codec writes
    more than ``limit + 1`` bytes on its way there."""
    try:
        if codec == GZIP:
            with gzip.GzipFile(fileobj=_Bytes(data)) as f:
                out = f.read(limit + 1)
        elif codec == SNAPPY:
            out = _snappy(data, limit)
        elif codec == LZ4:
            out = _bounded(_cramjam().lz4, data, limit)
        elif codec == ZSTD:
            out = _bounded(_cramjam().zstd, data, limit)
        else:
            raise KafkaProtocolError("record batch", 0, f"compression codec {codec}")
    except KafkaProtocolError:
        raise
    except Exception as e:                   # each library raises its own kinds
        raise KafkaProtocolError("record batch", 0, f"{CODEC_NAMES.get(codec, codec)} data: {e}") from None
    if len(out) > limit:
        raise _past(limit)
    return out


def _past(limit: int) -> KafkaProtocolError:
    return KafkaProtocolError("record batch", 0, f"decompresses past {limit} bytes")


def _bounded(codec, data: bytes, limit: int) -> bytes:
    """``codec.decompress(data)`` into a buffer that starts at 8x the input
    (64 KiB at least) and doubles while the output does not fit, never
    past ``limit + 1`` bytes: a frame that needs more is refused without
    ever being written whole."""
    size = min(limit + 1, max(64 * 1024, 8 * len(data)))
    while True:
        buf = bytearray(size)
        try:
            n = codec.decompress_into(data, buf)
        except Exception as e:
            if "whole buffer" not in str(e):         # cramjam: the output did not fit
                raise
            if size > limit:
                raise _past(limit) from None
            size = min(limit + 1, size * 2)
            continue
        return bytes(memoryview(buf)[:n])


class _Bytes:
    """A read-only file over bytes (gzip reads from a file object)."""
    def __init__(self, data: bytes):
        self._view = memoryview(data)
        self._pos = 0

    def read(self, n: int = -1) -> bytes:
        end = len(self._view) if n is None or n < 0 else self._pos + n
        out = bytes(self._view[self._pos:end])
        self._pos += len(out)
        return out


def _snappy(data: bytes, limit: int) -> bytes:
    """Raw snappy, or Kafka's xerial framing of raw blocks; every block's
    length (in its preamble) is checked before it is decompressed."""
    cj = _cramjam()
    if not data.startswith(XERIAL_MAGIC):
        if cj.snappy.decompress_raw_len(data) > limit:
            raise _past(limit)
        return bytes(cj.snappy.decompress_raw(data))
    out, pos, total = [], XERIAL_HEADER_BYTES, 0
    while pos < len(data):
        if pos + 4 > len(data):
            raise KafkaProtocolError("record batch", pos, "truncated xerial snappy block")
        n = int.from_bytes(data[pos:pos + 4], "big")
        pos += 4
        block = data[pos:pos + n]
        total += cj.snappy.decompress_raw_len(block)
        if total > limit:
            raise _past(limit)
        out.append(bytes(cj.snappy.decompress_raw(block)))
        pos += n
    return b"".join(out)


def compress(codec: int, data: bytes) -> bytes:
    """``data`` compressed as a Kafka producer would (raw snappy, LZ4
    frame, zstd frame, gzip)."""
    if codec == NONE:
        return data
    cj = _cramjam()
    if codec == GZIP:
        return bytes(cj.gzip.compress(data))
    if codec == SNAPPY:
        return bytes(cj.snappy.compress_raw(data))
    if codec == LZ4:
        return bytes(cj.lz4.compress(data))
    if codec == ZSTD:
        return bytes(cj.zstd.compress(data))
    raise ValueError(codec)


class ProducedBatch:
    """One record batch of a Produce request, decoded: its header fields
    and its records as :class:`txmq._kafka_records.RecordColumns`."""

    __slots__ = ("base_offset", "attributes", "producer_id", "producer_epoch", "base_sequence", "count",
                 "columns")

    @property
    def transactional(self) -> bool:
        return bool(self.attributes & _kafka_records.ATTR_TRANSACTIONAL)

    @property
    def control(self) -> bool:
        return bool(self.attributes & _kafka_records.ATTR_CONTROL)

    def spec(self) -> BatchSpec:
        """The txmq batch these records become (no per-record Python
        object: the columns are referenced as they are)."""
        c = self.columns
        return BatchSpec.from_columns(c.count, c.values, c.value_offsets, c.keys, c.key_offsets,
                                      c.key_validity, c.headers, c.header_offsets, c.event_deltas,
                                      c.first_timestamp)


def decode_produce(records, max_batch_bytes: int) -> list:
    """The batches of a Produce partition's ``records`` (bytes-like),
    checked and decompressed (:class:`KafkaProtocolError` when anything
    fails)."""
    out = []
    for (base, attrs, _last, base_ts, _max_ts, pid, epoch, seq, count,
         body) in _kafka_records.decode_batches(records):
        codec = attrs & _kafka_records.ATTR_COMPRESSION_MASK
        if codec:
            body = decompress(codec, bytes(body), max_batch_bytes)
        b = ProducedBatch()
        b.base_offset, b.attributes, b.producer_id, b.producer_epoch = base, attrs, pid, epoch
        b.base_sequence, b.count = seq, count
        b.columns = _kafka_records.decode_records(body, count, base_ts)
        out.append(b)
    return out


def encode_data_batch(info, messages: list) -> bytes:
    """A txmq batch (its ``BatchInfo`` and messages as (offset, key, value,
    headers, event time) tuples, all of the batch) as one Kafka batch."""
    first_ts = min(m[4] for m in messages)
    max_ts = max(m[4] for m in messages)
    attrs = _kafka_records.ATTR_TRANSACTIONAL if info.is_transactional else 0
    body = _kafka_records.encode_records(messages, info.base_offset, first_ts)
    return _kafka_records.encode_batch(info.base_offset, attrs, info.count - 1, first_ts, max_ts,
                               info.producer_id, info.producer_epoch, info.base_sequence, info.count, body)


def encode_marker(info, commit: bool) -> bytes:
    """A txmq COMMIT / ABORT marker as Kafka's control batch."""
    return _kafka_records.encode_control_batch(info.base_offset, info.producer_id, info.producer_epoch, commit,
                                       info.publish_time)
