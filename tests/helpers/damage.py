"""Damage for the corruption tests: flip one byte of a file in place, and
find the batches of a segment file to aim at."""

from __future__ import annotations


def flip(path, at: int, mask: int = 0x5A) -> None:
    """XOR the byte at ``at`` of ``path`` with ``mask`` (never a no-op)."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ mask]))


def batch_positions(seg) -> list:
    """``(position, base offset, count)`` of each batch of segment file
    ``seg`` from byte 0, as far as their magics and lengths lead (docs/FORMAT.md)."""
    with open(seg, "rb") as f:
        raw = f.read()
    pos, out = 0, []
    while pos + 88 <= len(raw) and raw[pos:pos + 4] == b"TXMB":
        out.append((pos, int.from_bytes(raw[pos + 16:pos + 24], "little"),
                    int.from_bytes(raw[pos + 24:pos + 28], "little")))
        pos += int.from_bytes(raw[pos + 12:pos + 16], "little")
    return out
