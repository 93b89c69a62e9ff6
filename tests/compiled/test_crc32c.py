"""CRC-32C (Castagnoli): RFC 3720 (iSCSI) B.4 vectors on the default path
and on the table-driven software path, incremental continuation, and the
hardware path against the software path over random lengths/alignments."""
import random

import pytest

from txmq._crc32c import crc32c_hardware, crc32c_of

# RFC 3720 appendix B.4, plus the common check value of "123456789".
VECTORS = [
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
    # iSCSI SCSI Read (10) command PDU from RFC 3720 B.4.
    (bytes.fromhex(
        "01c00000000000000000000000000000"
        "14000000000004000000001400000018"
        "28000000000000000200000000000000"), 0xD9963A56),
]


def _bitwise_crc32c(data: bytes, crc: int = 0) -> int:
    """Independent reference: the textbook bit-at-a-time reflected CRC."""
    crc ^= 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


@pytest.mark.parametrize("data,expected", VECTORS, ids=lambda v: v.hex()[:16] if isinstance(v, bytes) else hex(v))
def test_rfc3720_vectors_default_path(data, expected):
    assert crc32c_of(data) == expected


@pytest.mark.parametrize("data,expected", VECTORS, ids=lambda v: v.hex()[:16] if isinstance(v, bytes) else hex(v))
def test_rfc3720_vectors_software_path(data, expected):
    assert crc32c_of(data, software=True) == expected


def test_reference_model_agrees_with_vectors():
    # Guards the reference used by the random tests below.
    for data, expected in VECTORS:
        assert _bitwise_crc32c(data) == expected


def test_empty_input_returns_the_running_crc():
    assert crc32c_of(b"") == 0
    assert crc32c_of(b"", software=True) == 0
    assert crc32c_of(b"", 0xDEADBEEF) == 0xDEADBEEF
    assert crc32c_of(b"", 0xDEADBEEF, software=True) == 0xDEADBEEF


def test_accepts_bytes_like_objects():
    data = b"123456789"
    assert crc32c_of(bytearray(data)) == 0xE3069283
    assert crc32c_of(memoryview(data)) == 0xE3069283
    assert crc32c_of(memoryview(b"xx123456789yy")[2:-2]) == 0xE3069283


def test_hardware_flag_is_bool():
    assert crc32c_hardware() in (True, False)


@pytest.mark.parametrize("software", [False, True])
def test_incremental_equals_one_shot(software):
    rng = random.Random(3720)
    for _ in range(200):
        data = rng.randbytes(rng.randrange(0, 300))
        whole = crc32c_of(data, software=software)
        # Split into up to 4 random pieces and continue the CRC through them.
        cuts = sorted(rng.randrange(0, len(data) + 1) for _ in range(rng.randrange(0, 4)))
        crc, prev = 0, 0
        for c in cuts + [len(data)]:
            crc = crc32c_of(data[prev:c], crc, software=software)
            prev = c
        assert crc == whole, (len(data), cuts)


def test_incremental_vector():
    assert crc32c_of(b"6789", crc32c_of(b"12345")) == 0xE3069283
    assert crc32c_of(b"6789", crc32c_of(b"12345", software=True), software=True) == 0xE3069283


def test_hardware_equals_software_random_lengths_and_alignments():
    rng = random.Random(0xC5C)
    buf = rng.randbytes(8192 + 64)
    for _ in range(500):
        start = rng.randrange(0, 64)           # every alignment mod 8
        n = rng.choice([rng.randrange(0, 80), rng.randrange(0, 8192)])
        view = memoryview(buf)[start:start + n]
        seed = rng.choice([0, rng.getrandbits(32)])
        hw = crc32c_of(view, seed)
        sw = crc32c_of(view, seed, software=True)
        assert hw == sw, (start, n, seed)


def test_against_bitwise_reference_small_inputs():
    rng = random.Random(7)
    for n in list(range(0, 70)) + [127, 128, 129, 255, 256, 1000]:
        data = rng.randbytes(n)
        ref = _bitwise_crc32c(data)
        assert crc32c_of(data) == ref, n
        assert crc32c_of(data, software=True) == ref, n


def test_large_buffer_releases_gil_path_matches():
    # >= 64 KiB takes the nogil branch in crc32c_of.
    rng = random.Random(64)
    data = rng.randbytes(200_003)
    one = crc32c_of(data)
    assert one == crc32c_of(data, software=True)
    assert one == crc32c_of(data[100_000:], crc32c_of(data[:100_000]))


def test_hardware_equals_software_across_the_three_stream_blocks():
    """Long inputs are taken three blocks at a time (3 x 8 KiB, then
    3 x 256 B) and the blocks' CRCs joined: every length around those
    block sizes, at every alignment, with a running CRC, gives the
    table-driven result."""
    rng = random.Random(0x3C)
    buf = rng.randbytes(4 * 3 * 8192 + 64)
    lengths = set()
    for block in (256, 8192):
        for k in (1, 2, 3):
            for d in (-9, -8, -1, 0, 1, 7, 8, 9):
                lengths.add(3 * block * k + d)
    lengths |= {3 * 8192 + 3 * 256 + 5, 3 * 8192 * 2 + 3 * 256 * 3 + 7 + 8, len(buf) - 64}
    for n in sorted(lengths):
        start = rng.randrange(0, 64)
        view = memoryview(buf)[start:start + n]
        seed = rng.getrandbits(32)
        assert crc32c_of(view, seed) == crc32c_of(view, seed, software=True), (start, n)
        assert crc32c_of(view) == crc32c_of(view, software=True), (start, n)


def test_a_long_input_matches_the_bitwise_reference():
    data = random.Random(11).randbytes(3 * 8192 + 3 * 256 + 13)
    assert crc32c_of(data) == _bitwise_crc32c(data)
