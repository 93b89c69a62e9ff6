"""Small-file durability shared by the storage objects."""

from __future__ import annotations

import errno
import json
import os

from txmq._redolog import sync_dir
from txmq.errors import CorruptLogError, StorageFullError

__all__ = ["write_atomic", "write_json", "read_json", "sync_dir", "is_full"]


def is_full(e: OSError) -> bool:
    """Whether ``e`` says the file system is full (or the quota spent)."""
    return isinstance(e, StorageFullError) or e.errno in (errno.ENOSPC, errno.EDQUOT)


def write_atomic(path: str, data: bytes, *, fsync: bool = True, sync_parent: bool = False,
                 tmp_suffix: str = ".tmp") -> None:
    """Replace ``path`` with ``data`` atomically: a reader sees the old file
    or the new one, never a mix, also after a crash. Writers that may race
    pass distinct ``tmp_suffix``es."""
    tmp = path + tmp_suffix
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fdatasync(f.fileno())
    except OSError as e:
        # The old file stays whole; the partial new one is not left behind.
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if is_full(e):
            raise StorageFullError(path, len(data), e.errno) from None
        raise
    os.replace(tmp, path)
    if sync_parent:
        sync_dir(os.path.dirname(path))


def write_json(path: str, obj, *, sync_parent: bool = False) -> None:
    """:func:`write_atomic` of ``obj`` as JSON, always synced."""
    write_atomic(path, json.dumps(obj).encode(), sync_parent=sync_parent)


def read_json(path: str) -> dict:
    """The JSON object in the file at ``path``; CorruptLogError naming the
    byte where it stops being one (a flipped byte in a config file is
    damage, reported like any other, not a crash)."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptLogError(path, e.start, "not UTF-8") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise CorruptLogError(path, len(text[:e.pos].encode()), f"not valid JSON: {e.msg}") from None
    if not isinstance(value, dict):
        raise CorruptLogError(path, 0, "not a JSON object")
    return value
