"""Damage for the corruption tests: flip one byte of a file in place."""

from __future__ import annotations


def flip(path, at: int, mask: int = 0x5A) -> None:
    """XOR the byte at ``at`` of ``path`` with ``mask`` (never a no-op)."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ mask]))
