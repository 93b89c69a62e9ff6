"""Kafka's default partitioner (pyx/_partitioner.pyx): murmur2 vectors from
Kafka's UtilsTest, partition_for, and the vectorised Arrow path."""
import random

import numpy as np
import pyarrow as pa
import pytest

from txmq._partitioner import murmur2, partition_for, partitions_for_arrow

# org.apache.kafka.common.utils.UtilsTest#testMurmur2
KAFKA_VECTORS = {
    b"21": -973932308,
    b"foobar": -790332482,
    b"a-little-bit-long-string": -985981536,
    b"a-little-bit-longer-string": -1486304829,
    b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    b"abc": 479470107,
}


def murmur2_reference(data: bytes) -> int:
    """Straight transcription of Kafka's Utils.murmur2 (Java int arithmetic)."""
    M = 0x5BD1E995
    mask = 0xFFFFFFFF
    length = len(data)
    h = (0x9747B28C ^ length) & mask
    for i in range(length // 4):
        k = int.from_bytes(data[4 * i:4 * i + 4], "little")
        k = (k * M) & mask
        k ^= k >> 24
        k = (k * M) & mask
        h = (h * M) & mask
        h ^= k
    rest = length & ~3
    r = length % 4
    if r == 3:
        h ^= data[rest + 2] << 16
    if r >= 2:
        h ^= data[rest + 1] << 8
    if r >= 1:
        h ^= data[rest]
        h = (h * M) & mask
    h ^= h >> 13
    h = (h * M) & mask
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


@pytest.mark.parametrize("key,expected", KAFKA_VECTORS.items(), ids=lambda v: str(v)[:20])
def test_kafka_murmur2_vectors(key, expected):
    assert murmur2(key) == expected
    assert murmur2_reference(key) == expected


def test_murmur2_every_tail_length_and_bytes_like():
    rng = random.Random(2)
    for n in range(0, 70):
        data = rng.randbytes(n)
        assert murmur2(data) == murmur2_reference(data), n
        assert murmur2(bytearray(data)) == murmur2_reference(data)
        assert murmur2(memoryview(b"\x00" + data)[1:]) == murmur2_reference(data)
    # high bytes exercise sign handling of the tail (Java's & 0xff)
    for data in (b"\xff", b"\xff\xfe", b"\x80\x81\x82", b"\xff" * 7):
        assert murmur2(data) == murmur2_reference(data)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 12, 100, 2**31 - 1])
def test_partition_for_is_positive_murmur_mod_n(n):
    rng = random.Random(n)
    keys = list(KAFKA_VECTORS) + [rng.randbytes(rng.randrange(0, 40)) for _ in range(200)]
    for key in keys:
        p = partition_for(key, n)
        assert p == (murmur2(key) & 0x7FFFFFFF) % n
        assert 0 <= p < n


def test_partition_for_known_values():
    # Derived by hand from the Kafka vectors: (h & 0x7fffffff) % n.
    assert partition_for(b"21", 10) == (-973932308 & 0x7FFFFFFF) % 10 == 0
    assert partition_for(b"foobar", 7) == (-790332482 & 0x7FFFFFFF) % 7
    assert partition_for(b"abc", 3) == 479470107 % 3 == 0


def test_partitions_for_arrow_matches_scalar_and_nulls():
    rng = random.Random(9)
    keys = [None if rng.random() < 0.2 else rng.randbytes(rng.randrange(0, 30)) for _ in range(500)]
    keys[0] = None
    keys[1] = b""
    arr = pa.array(keys, pa.binary())
    for n in (1, 5, 16):
        out = partitions_for_arrow(arr, n)
        assert out.dtype == np.int32 and len(out) == len(keys)
        want = [-1 if k is None else partition_for(k, n) for k in keys]
        assert out.tolist() == want


@pytest.mark.parametrize("typ", [pa.binary(), pa.string(), pa.large_binary(), pa.large_string()])
def test_partitions_for_arrow_types_and_slices(typ):
    words = [None if i % 7 == 3 else "key-%d" % i for i in range(100)]
    conv = (lambda w: w) if typ in (pa.string(), pa.large_string()) else (lambda w: None if w is None else w.encode())
    arr = pa.array([conv(w) for w in words], typ)
    sliced = arr.slice(17, 50)
    assert sliced.offset == 17
    out = partitions_for_arrow(sliced, 12)
    want = [-1 if w is None else partition_for(w.encode(), 12) for w in words[17:67]]
    assert out.tolist() == want
    assert partitions_for_arrow(arr, 12).tolist()[17:67] == want


def test_partitions_for_arrow_all_empty_and_empty_array():
    arr = pa.array([b"", b"", None], pa.binary())
    assert partitions_for_arrow(arr, 4).tolist() == [partition_for(b"", 4)] * 2 + [-1]
    assert partitions_for_arrow(pa.array([], pa.binary()), 4).tolist() == []
