"""The decision record's encoding (docs/FORMAT.md, "The decision record"):
the compiled encoder writes exactly the documented layout, which a
reference written from the documentation with ``struct`` reproduces, and
the decoder reads it back."""

from __future__ import annotations

import random
import struct

import pytest

from txmq import _txnlog


def text(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<H", len(b)) + b


def reference(partitions, acks) -> bytes:
    out = [struct.pack("<I", len(partitions))]
    for topic, index, batches in partitions:
        out.append(text(topic) + struct.pack("<II", index, len(batches)))
        for base, count, crc, length, data in batches:
            out.append(struct.pack("<qiIIB", base, count, crc, length, data is not None))
            if data is not None:
                out.append(data)
    out.append(struct.pack("<I", len(acks)))
    for topic, sub, index, cumulative, ranges in acks:
        out.append(text(topic) + text(sub) + struct.pack("<IqI", index, cumulative, len(ranges)))
        for s, e in ranges:
            out.append(struct.pack("<qq", s, e))
    return b"".join(out)


def random_record(rng: random.Random):
    partitions = []
    for p in range(rng.randrange(0, 4)):
        batches = []
        for _ in range(rng.randrange(1, 40)):
            data = None if rng.random() < 0.6 else rng.randbytes(rng.randrange(0, 300))
            length = len(data) if data is not None else rng.randrange(61, 1 << 31)
            batches.append((rng.randrange(0, 1 << 62), rng.randrange(1, 1 << 31), rng.randrange(0, 1 << 32),
                            length, data))
        partitions.append((rng.choice(["t", "out", "主题-ü", "x" * 300]), p * 1_000_000_000 + rng.randrange(1000),
                           batches))
    acks = []
    for _ in range(rng.randrange(0, 4)):
        ranges = sorted((s, s + rng.randrange(1, 100)) for s in rng.sample(range(0, 1 << 40, 1000), rng.randrange(0, 6)))
        acks.append((rng.choice(["in", "ü"]), rng.choice(["s", "sub-" * 20]), rng.randrange(0, 1 << 32),
                     rng.choice([-1, rng.randrange(0, 1 << 62)]), ranges))
    return partitions, acks


def test_the_encoder_writes_the_documented_layout_and_decodes_back():
    rng = random.Random(7)
    for _ in range(500):
        partitions, acks = random_record(rng)
        record = _txnlog.encode_decision(partitions, acks)
        assert record == reference(partitions, acks)
        decoded_partitions, decoded_acks = _txnlog.decode_decision(record)
        assert decoded_partitions == {(t, i): list(b) for t, i, b in partitions}
        assert decoded_acks == [(t, s, i, c, list(r)) for t, s, i, c, r in acks]


def test_an_empty_record_and_a_name_too_long():
    assert _txnlog.encode_decision([], []) == b"\0" * 8
    with pytest.raises(ValueError):
        _txnlog.encode_decision([("x" * 70_000, 0, [(0, 1, 2, 61, None)])], [])
