"""The data directory itself: what makes a folder one, and which of its
folders opening may remove.

A data directory is marked by ``<data>/txmq.json`` (docs/FORMAT.md, "Data
directory"), written by the first broker that opens it. A broker opens a
marked folder, an empty or missing one (and marks it), or a folder of a
release that wrote no marker: one whose entries are all txmq's own
(:data:`DATA_DIR_ENTRIES`), which it then marks. Anything else is refused,
so a mistyped path never gets ``LOCK``, ``topics/`` and a control socket
written into a user's folder.

Opening removes only what it can prove is a leftover of its own unfinished
step, and keeps and reports everything else:

- ``topics/<name>~deleted-<n>`` and ``subscriptions/.../<name>~deleted-<n>``:
  a delete renames the folder to such a name first (``~`` is not allowed
  in topic or subscription names, so no user topic is named so), then
  removes it; a leftover of a deleted topic also takes the topic's
  ``subscriptions/<name>/`` with it.
- a topic folder without ``topic.json`` whose partitions hold no batch (a
  create writes ``topic.json`` last, before any message can be appended;
  a ``topic.json.tmp`` there is that write, killed before its rename)
  and a subscription folder without ``subscription.json`` that holds no
  cursor or pending-ack log (a subscribe writes ``subscription.json``
  first).

A topic folder without ``topic.json`` that holds segment data, or a
subscription folder with logs but no ``subscription.json``, is kept: the
broker does not serve it, says so in ``stats()["problems_on_open"]``, and
``txmq check`` reports it; ``txmq check --repair`` restores a topic's
``topic.json`` from its partition folders (:func:`rebuild_topic_config`).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time

from txmq.errors import DataDirError, DataDirLockedError
from txmq.files import sync_dir, write_json

MARKER = "txmq.json"
MARKER_FORMAT = 1
# Every top-level entry of a data directory: what txmq check knows, what
# the demo may replace, and what a folder of a release that wrote no marker
# holds.
DATA_DIR_ENTRIES = frozenset({MARKER, "LOCK", "topics", "subscriptions", "coordinator", "producers.log",
                              "half", "control.sock", "staging", "flight.token", "flight.json"})
DELETED = "~deleted-"            # the infix of a folder a delete renamed, to be removed
TOPIC_CONFIG = "topic.json"
SUBSCRIPTION_CONFIG = "subscription.json"
# Names a partition folder holds (segment files end in these after a
# 20-digit base offset).
PARTITION_FILES = frozenset({"recovery-point", "txnbuffer.snap", "producers.snap", "readview"})
SEGMENT_ENDINGS = (".log", ".index", ".timeindex", ".txnindex")
_ZERO_PROBE = 4096               # a segment without a batch is zeros from byte 0


def resolve(path) -> str:
    """The absolute ``str`` path of a data directory argument: a ``str``,
    ``bytes`` (decoded as the file system does) or ``os.PathLike``; an
    empty path is refused (it would mean the current directory)."""
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    elif isinstance(path, os.PathLike):
        path = os.fspath(path)
        if isinstance(path, bytes):
            path = os.fsdecode(path)
    if not isinstance(path, str):
        raise DataDirError(path, "the path must be a str, bytes or os.PathLike naming a directory")
    if not path or "\0" in path:
        raise DataDirError(path, "the path must be a non-empty directory name (use '.' for the current "
                                 "directory)" if not path else "the path holds a NUL character")
    return os.path.abspath(path)


def prepare(path: str) -> bool:
    """Make ``path`` ready to be opened as a data directory: create it when
    missing; refuse a file, a path through a file, and a folder that is
    not a data directory. Returns whether the marker is still to be
    written (:func:`mark`, once the lock is held)."""
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        raise DataDirError(path, "it is a file, not a directory") from None
    except NotADirectoryError:
        raise DataDirError(path, "a part of the path is a file, not a directory") from None
    except PermissionError as e:
        raise DataDirError(path, f"cannot create it: {e.strerror}") from None
    except OSError as e:
        raise DataDirError(path, f"cannot create it: {e.strerror or e}") from None
    try:
        entries = set(os.listdir(path))
    except NotADirectoryError:
        raise DataDirError(path, "it is a file, not a directory") from None
    except OSError as e:
        raise DataDirError(path, f"cannot list it: {e.strerror or e}") from None
    if MARKER in entries:
        read_marker(path)
        return False
    foreign = sorted(entries - DATA_DIR_ENTRIES)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise DataDirError(path, f"it is not a txmq data directory (no {MARKER}) and not empty (it holds "
                                 f"{shown}); pass an empty or new directory")
    return True


def read_marker(path: str) -> dict:
    """The marker's fields; :class:`DataDirError` when it is not one this
    release reads."""
    marker = os.path.join(path, MARKER)
    try:
        with open(marker, "rb") as f:
            fields = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise DataDirError(path, f"{MARKER} is unreadable ({e}); it marks a txmq data directory: "
                                 f"restore it or write {{\"format\": {MARKER_FORMAT}}} into it") from None
    if not isinstance(fields, dict) or fields.get("format") != MARKER_FORMAT:
        raise DataDirError(path, f"{MARKER} says format {fields.get('format') if isinstance(fields, dict) else fields!r}; "
                                 f"this release reads format {MARKER_FORMAT}")
    return fields


def mark(path: str, fsync: bool) -> None:
    """Write the marker (the lock is held)."""
    write_json(os.path.join(path, MARKER), {"format": MARKER_FORMAT, "created_ms": time.time_ns() // 1_000_000},
               sync_parent=fsync)


# -- the one-writer lock ----------------------------------------------------------------------

LOCK = "LOCK"


class DirLock:
    """The lock that makes one process a data directory's owner: an
    ``flock`` on the directory itself, which nothing done inside it can
    delete, rename or replace (deleting ``LOCK`` under a running owner
    must not let a second writer in), and one on ``<data>/LOCK``, which
    holds the owner's pid for others to name and is what earlier releases
    lock. Raises :class:`DataDirLockedError` when another process holds
    either."""

    def __init__(self, path: str):
        self.path = path
        self._fds: list[int] = []
        try:
            self._take(os.open(path, os.O_RDONLY | os.O_DIRECTORY))
            fd = os.open(os.path.join(path, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
            self._take(fd)
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        except BaseException:
            self.release()
            raise

    def _take(self, fd: int) -> None:
        self._fds.append(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _lock_pid(self.path)
            raise DataDirLockedError(self.path, pid and f"pid {pid}") from None

    def release(self) -> None:
        """Give the directory up (closing the descriptors drops the locks)."""
        while self._fds:
            os.close(self._fds.pop())


def _lock_pid(path: str) -> str | None:
    try:
        with open(os.path.join(path, LOCK), "rb") as f:
            return f.read(64).decode(errors="replace").strip() or None
    except OSError:
        return None


def lock_files(path: str) -> list:
    """What an owner of ``path`` flocks: the directory, then ``LOCK``
    (for :func:`txmq.readonly.writer_pid`, which finds their holder
    without taking the lock)."""
    return [path, os.path.join(path, LOCK)]


# -- what opening may remove ---------------------------------------------------------------


def deleted_name(name: str) -> str:
    """The name a delete renames the folder ``name`` to before removing it."""
    return f"{name}{DELETED}{time.time_ns()}"


def rename_deleted(folder: str, fsync: bool) -> str:
    """Rename ``folder`` to its deleted name (a delete's commit point:
    from then on opening removes it); returns the new path."""
    gone = os.path.join(os.path.dirname(folder), deleted_name(os.path.basename(folder)))
    os.rename(folder, gone)
    if fsync:
        sync_dir(os.path.dirname(folder))
    return gone


def remove_renamed(folder: str, fsync: bool) -> None:
    """Delete ``folder`` so that a crash at any moment leaves it whole or
    marked deleted: rename it (:func:`rename_deleted`), then remove it."""
    shutil.rmtree(rename_deleted(folder, fsync), ignore_errors=True)


def clean_topics(root: str, fsync: bool) -> tuple[list, list]:
    """Remove the leftovers of stopped topic creates and deletes under
    ``root`` (the data directory). Returns (topic names to open, problems:
    folders kept but not served, as sentences)."""
    topics_dir = os.path.join(root, "topics")
    subs_dir = os.path.join(root, "subscriptions")
    names, problems = [], []
    entries = sorted(os.listdir(topics_dir))
    for name in entries:
        tdir = os.path.join(topics_dir, name)
        if DELETED in name:
            # The rename was the delete: its subscriptions go too, unless
            # the name was created again since.
            topic = name.split(DELETED, 1)[0]
            if topic not in entries and os.path.isdir(os.path.join(subs_dir, topic)):
                remove_renamed(os.path.join(subs_dir, topic), fsync)
            shutil.rmtree(tdir, ignore_errors=True)
        elif not os.path.isdir(tdir):
            problems.append(f"{tdir}: not a folder; kept, not a topic")
        elif os.path.exists(os.path.join(tdir, TOPIC_CONFIG)):
            names.append(name)
        elif is_unused_topic(tdir):
            shutil.rmtree(tdir, ignore_errors=True)     # a create that stopped before topic.json
        else:
            problems.append(f"{tdir}: {orphan_topic_reason(tdir)}")
    return names, problems


def orphan_topic_reason(tdir: str) -> str:
    """What to say of a topic folder without ``topic.json`` that is kept."""
    try:
        rebuild_topic_config(tdir)
    except DataDirError as e:
        return f"no {TOPIC_CONFIG} and not a topic's folder ({e.reason}); kept, not served"
    return (f"no {TOPIC_CONFIG} but partition data; kept, not served: `txmq check --repair "
            f"{os.path.dirname(os.path.dirname(tdir))}` restores {TOPIC_CONFIG}")


def clean_subscriptions(sdir: str) -> tuple[list, list]:
    """Remove the leftovers of stopped subscribes and unsubscribes in one
    topic's ``subscriptions/<topic>/`` folder. Returns (subscription names
    to open, problems)."""
    names, problems = [], []
    for name in sorted(os.listdir(sdir)) if os.path.isdir(sdir) else ():
        path = os.path.join(sdir, name)
        if DELETED in name:
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(os.path.join(path, SUBSCRIPTION_CONFIG)):
            names.append(name)
        elif os.path.isdir(path) and all(n.endswith(".tmp") for n in os.listdir(path)):
            shutil.rmtree(path, ignore_errors=True)     # a subscribe that stopped before its config
        else:
            problems.append(f"{path}: no {SUBSCRIPTION_CONFIG}; kept, not served (subscribing to "
                            f"{name!r} again takes its cursors over)")
    return names, problems


def is_unused_topic(tdir: str) -> bool:
    """Whether ``tdir`` is what a topic create leaves before it writes
    ``topic.json``: partition folders of txmq's own files, every segment
    without a batch. Anything else (a user's file, one byte of data) makes
    it not provably unused. ``topic.json.tmp`` is the config a create was
    killed while writing (it becomes ``topic.json`` by a rename)."""
    for entry in os.listdir(tdir):
        if entry == TOPIC_CONFIG + ".tmp":
            continue
        pdir = os.path.join(tdir, entry)
        if not entry.isdigit() or not os.path.isdir(pdir):
            return False
        for name in os.listdir(pdir):
            if name in PARTITION_FILES or name.endswith(".tmp"):
                continue
            stem, dot, ending = name.partition(".")
            if not (stem.isdigit() and dot and f".{ending}" in SEGMENT_ENDINGS):
                return False
            if ending == "log" and not _zero_start(os.path.join(pdir, name)):
                return False
    return True


def _zero_start(path: str) -> bool:
    with open(path, "rb") as f:
        return not any(f.read(_ZERO_PROBE))


def rebuild_topic_config(tdir: str) -> dict:
    """The ``topic.json`` a topic folder's partition folders imply:
    ``partitions`` = the number of folders ``0 .. n-1`` (all present);
    retention unknown (None: the broker's defaults). Raises
    :class:`DataDirError` when the folder does not look like a topic's."""
    entries = os.listdir(tdir)
    parts = sorted(int(e) for e in entries if e.isdigit() and os.path.isdir(os.path.join(tdir, e)))
    others = sorted(e for e in entries if not (e.isdigit() and os.path.isdir(os.path.join(tdir, e)))
                    and not e.endswith(".tmp"))
    if not parts:
        raise DataDirError(tdir, "no partition folders (0, 1, ...)")
    if parts != list(range(len(parts))):
        missing = sorted(set(range(parts[-1] + 1)) - set(parts))
        raise DataDirError(tdir, f"partition folders {missing[:5]} are missing")
    if others:
        raise DataDirError(tdir, f"it holds {', '.join(others[:3])}, which no topic has")
    return {"partitions": len(parts), "retention_ms": None, "retention_bytes": None}
