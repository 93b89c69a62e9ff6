"""Small-file durability shared by the storage objects."""

from __future__ import annotations

import json
import os

from txmq._redolog import sync_dir

__all__ = ["write_json", "sync_dir"]


def write_json(path: str, obj, *, sync_parent: bool = False) -> None:
    """Replace ``path`` with ``obj`` as JSON atomically: a reader sees the
    old file or the new one, never a mix, also after a crash."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync_parent:
        sync_dir(os.path.dirname(path))
