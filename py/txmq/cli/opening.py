"""How the command line opens a data directory.

Every command that only reads (:data:`txmq.cli.exits.READ_ONLY_COMMANDS`) goes through
:func:`open_for_reading`, and nothing else: a
:class:`~txmq.cli.view.DirectoryView` over ``txmq.readonly``. It takes no
lock and writes nothing, so these commands work the same on a directory
another process holds open (they show what it has published) and on one
no process holds (they show the files as they are; nothing is recovered).
Commands that change the directory use :func:`open_for_writing`: a
``txmq.Broker``, which needs the directory free (else exit 3).
``txmq check`` opens no broker at all.
"""

from __future__ import annotations

import os

import txmq
from txmq.cli import exits, output
from txmq.cli.view import DirectoryView
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


def open_for_reading(path: str, progress=None) -> DirectoryView:
    """The data directory at ``path``, to read from (use it as a context
    manager), whether or not another process holds it. Raises CliError:
    missing directory (exit 2); the reads raise corrupt file (exit 4)."""
    require_data_dir(path)
    return DirectoryView(path, progress)


def open_for_writing(path: str, progress=None, create: bool = False) -> txmq.Broker:
    """The data directory at ``path``, to change; ``create`` makes a new one
    when ``path`` does not exist."""
    if not (create and (not os.path.exists(path) or (os.path.isdir(path) and not os.listdir(path)))):
        require_data_dir(path)
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

