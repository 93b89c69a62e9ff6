"""The staging directory (docs/FORMAT.md, "Staged ingest"):
``<data>/staging/<job>/<attempt>/<topic>/<partition>-<n>.seg``, written by
a requester (:mod:`txmq.requester.staged_ingest`), read and checked by the
owner (:mod:`txmq.broker.ingester`). Its names, the checks of a staged
attempt and of its segments, and the cleaning of leftovers live here.

Staged files are segments (docs/FORMAT.md) whose offsets start at 0; the
owner validates every batch (CRC included) before appending any.
"""

from __future__ import annotations

import os
import re
import shutil

from txmq._batch import FLAG
from txmq._segment import Segment
from txmq.batcharrow import batch_arrays
from txmq.errors import CorruptLogError, InvalidArgumentError, StagingError, TopicNotFoundError
from txmq.storage.topic import Topic, check_topic_name

STAGING = "staging"
COMPLETE = "COMPLETE"             # written last: the attempt's files are whole
ABORTED = ".aborted"              # <staging>/<job>.aborted: a tombstone late tasks of the job obey
STAGED_SEGMENT_BYTES = 64 * 1024 * 1024
# A tombstone only keeps a failed job's tasks still running from leaving
# staged files behind (nothing visible depends on it: an aborted job is
# never committed), so it lasts as long as such a task may: ten minutes.
# A staged job nothing touched for a day (its writer died before commit
# or abort) is removed too.
TOMBSTONE_AGE_S = 600.0
STAGED_AGE_S = 24 * 3600.0
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")



def check_name(what: str, value) -> str:
    if not isinstance(value, str) or not _NAME.match(value) or value in (".", ".."):
        raise InvalidArgumentError(what, value, "1-200 of ASCII letters, digits, '.', '_', '-'")
    return value


def staging_dir(data_dir, job: str, attempt: str | None = None) -> str:
    """Where ``job`` (or one attempt of it) stages its files."""
    parts = [os.fspath(data_dir), STAGING, check_name("job", job)]
    if attempt is not None:
        parts.append(check_name("attempt", attempt))
    return os.path.join(*parts)


def topic_partitions(data_dir, topic: str) -> int:
    """The partition count of ``topic``, read from its ``topic.json``
    without opening the directory (a name that is not a topic name is
    refused before any path is made of it)."""
    check_topic_name(topic)
    try:
        return int(Topic.load_config(os.path.join(os.fspath(data_dir), "topics", topic))["partitions"])
    except FileNotFoundError:
        raise TopicNotFoundError(topic) from None


def open_staged(path: str) -> Segment:
    """One staged segment file, every batch checked (CRC included)."""
    seg = Segment(path, 0, 0, False)
    bad = seg.recover(0, 0) if seg.capacity else None
    if bad is not None or seg.size != seg.capacity:
        seg.close(False)
        if bad is not None:
            raise CorruptLogError(path, bad[0], f"staged batch: {bad[1]}")
        raise CorruptLogError(path, seg.size, "bytes after the last staged batch")
    return seg


def staged_batches(seg: Segment):
    """Per batch of a checked staged segment, the arguments of
    ``Producer.send_batch`` (values, keys, headers, event_times): key and
    value arrays over the mapping, no copy until the append."""
    pos = 0
    while pos < seg.size:
        info = seg.batch_at(pos)
        keys, values, event_times = batch_arrays(seg.arrow_buffers(pos), info.first_event_time)
        if keys.null_count == len(keys):
            keys = None
        headers = None
        if info.flags & FLAG["headers"]:
            headers = [m[3] or None for m in seg.messages(pos)]
        yield values, keys, headers, event_times
        pos += info.length


def attempt_files(path: str):
    """(topic, partition, file) of one complete attempt, in a fixed order."""
    if not os.path.exists(os.path.join(path, COMPLETE)):
        raise StagingError(f"staged attempt {path} is missing or was not closed (no {COMPLETE} mark)")
    out = []
    for topic in sorted(os.listdir(path)):
        tdir = os.path.join(path, topic)
        if topic == COMPLETE or not os.path.isdir(tdir):
            continue
        for name in os.listdir(tdir):
            stem = name[:-4] if name.endswith(".seg") else ""
            part, _, n = stem.partition("-")
            if not (part.isdigit() and n.isdigit()):
                raise StagingError(f"unexpected file {os.path.join(tdir, name)} in a staged attempt")
            out.append((topic, int(part), int(n), os.path.join(tdir, name)))
    return [(t, p, f) for t, p, _, f in sorted(out)]


def clean_staging(data_dir, now: float, tombstone_age: float = TOMBSTONE_AGE_S,
                  staged_age: float = STAGED_AGE_S) -> int:
    """Remove tombstones older than ``tombstone_age`` seconds, and staged
    jobs nothing touched for ``staged_age`` (a writer that died without
    committing or aborting). Returns how many entries were removed."""
    root = os.path.join(os.fspath(data_dir), STAGING)
    removed = 0
    for name in os.listdir(root) if os.path.isdir(root) else ():
        path = os.path.join(root, name)
        try:
            newest = max([os.path.getmtime(path)] + [os.path.getmtime(os.path.join(d, f))
                                                    for d, _, fs in os.walk(path) for f in fs])
        except OSError:
            continue
        if now - newest > (tombstone_age if name.endswith(ABORTED) else staged_age):
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
            removed += 1
    return removed
