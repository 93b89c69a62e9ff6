"""How the command line opens a data directory.

Every command that only reads (``topics list|describe``, ``consume``
without ``--subscription``, ``transactions list|describe``,
``subscriptions list|describe``, ``stats``) goes through
:func:`open_for_reading`, and nothing else: it is the one place that will
switch to ``txmq.readonly`` (a read-only view of a directory another
process holds, through its mmap'd ``readview`` files). For now it opens a
``txmq.Broker``, so a directory held by another process is refused with
the "directory locked" error (exit 3). Commands that change the directory
use :func:`open_for_writing`. ``txmq check`` opens no broker at all.
"""

from __future__ import annotations

import os

import txmq
from txmq.cli import exits, output
from txmq.errors import DataDirLockedError, TxmqError


def require_data_dir(path: str) -> str:
    """``path`` when it is an existing txmq data directory, else the
    "missing directory" error (exit 2) that says how to make one."""
    if not os.path.exists(path):
        raise exits.CliError(f"data directory {path} does not exist: check the path, or create it "
                             f"with `txmq topics create {path} TOPIC`")
    if not os.path.isdir(path):
        raise exits.CliError(f"{path} is not a directory: pass a txmq data directory")
    if not os.path.isdir(os.path.join(path, "topics")):
        raise exits.CliError(f"{path} is not a txmq data directory (it has no topics/ folder): "
                             f"check the path")
    return path


def open_for_reading(path: str, progress=None) -> txmq.Broker:
    """The data directory at ``path``, to read from (use it as a context
    manager). Raises CliError: missing directory (exit 2), locked by another
    process (exit 3), corrupt file (exit 4)."""
    require_data_dir(path)
    return _open(path, progress)


def open_for_writing(path: str, progress=None, create: bool = False) -> txmq.Broker:
    """The data directory at ``path``, to change; ``create`` makes a new one
    when ``path`` does not exist."""
    if not (create and not os.path.exists(path)):
        require_data_dir(path)
    return _open(path, progress)


def _open(path: str, progress) -> txmq.Broker:
    # Opening recovers the directory (scans segment tails, replays logs):
    # on a large directory that takes a while, so show that it is working.
    try:
        with output.Spinner(f"opening {path}", output.wants_progress(progress)):
            return txmq.Broker(path)
    except DataDirLockedError as e:
        raise exits.locked_error(e.path, e.holder) from None
    except TxmqError as e:
        raise exits.from_broker_error(e) from None
    except PermissionError as e:
        raise exits.CliError(f"cannot open data directory {path}: {e.strerror} ({e.filename}); "
                             f"run as a user who may write it") from None


def lock_holder(path: str) -> int | None:
    """The pid holding ``<path>/LOCK`` (flock), or None, found without
    taking the lock (a writer starting meanwhile must not fail): Linux lists
    flocks with their inode in /proc/locks."""
    lock = os.path.join(path, "LOCK")
    try:
        st = os.stat(lock)
        with open("/proc/locks") as f:
            entries = f.read().splitlines()
    except OSError:
        return None
    for line in entries:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF"
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[4].isdigit():
            dev_inode = fields[5].split(":")
            if len(dev_inode) == 3 and dev_inode[2].isdigit() and int(dev_inode[2]) == st.st_ino:
                return int(fields[4])
    return None
