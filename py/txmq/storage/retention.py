"""Retention: which sealed segments at the start of a partition's log may
be deleted.

A segment goes whole, oldest first, when every offset in it lies below
``keep_from_offset`` (what the slowest subscription has acknowledged) and
it is older than ``retention_ms`` (its last batch's publish time) or the
log is larger than ``retention_bytes``. The active segment always stays.
The partition deletes them (``Partition.delete_segments``): it publishes
the new log start to readers before the files go.
"""

from __future__ import annotations


def deletable(segments, keep_from_offset: int, retention_ms: int | None, retention_bytes: int | None,
              now_ms: int) -> int:
    """How many of ``segments`` (the log's, in offset order) retention
    deletes, from the first."""
    total = sum(s.size for s in segments)
    n = 0
    while n < len(segments) - 1:
        seg = segments[n]
        if seg.next_offset > keep_from_offset:
            break
        too_old = retention_ms is not None and now_ms - seg.last_publish_time > retention_ms
        too_big = retention_bytes is not None and total > retention_bytes
        if not (too_old or too_big):
            break
        total -= seg.size
        n += 1
    return n
