"""A power-loss simulation for the tests: a test double of the file layer's
durability (TigerBeetle's fault-injecting storage habit).

While a :class:`PowerLoss` is active on a directory, every sync txmq makes
in it is observed: ``os.fsync`` / ``os.fdatasync`` (which the Python layers
and the compiled core call through the ``os`` module: the redo logs,
``files.write_atomic``, ``sync_dir``, segment seals) and the msync of a
mapped segment or table (``txmq._mapping.set_sync_hook``). Each sync copies
what it made durable into a shadow: a file's whole content for an
fsync/fdatasync, the synced byte range for an msync; an fsync of a directory
makes the names in it durable. :meth:`PowerLoss.materialise` writes the
directory a power loss at this instant would leave:

- a file whose content was synced (or that existed when the simulation
  began) holds exactly its last synced content; whatever was written after
  is gone;
- a file never synced whose name was made durable (a directory fsync) is
  empty; one whose name was not either is gone;
- renames (``os.replace`` / ``os.rename``) carry the synced content with
  the file and count as durable at once (ext4 orders a rename after the
  data of the file renamed over: a simplification, on the safe side of
  what txmq relies on), and a file deleted is gone.

Nothing is slowed down or changed when no simulation is active: the hooks
are installed by :meth:`PowerLoss.start` and removed by :meth:`stop`, and
the compiled msync path then costs one pointer test.

Usage::

    with PowerLoss(path) as sim:
        sim.on_sync = lambda n: ...        # called after the n-th sync, in the syncing thread
        ... run a broker on path ...
        sim.materialise(other_path)        # the directory after a power loss now

The shadow is updated under one lock, and ``on_sync`` is called under it,
so a snapshot taken there is the state at exactly that sync.
"""

from __future__ import annotations

import os
import stat
import threading

from txmq import _mapping

__all__ = ["PowerLoss"]


class _Shadow:
    """The durable content of one file, as of its last sync."""

    __slots__ = ("ino", "data")

    def __init__(self, ino: int, data: bytearray):
        self.ino = ino
        self.data = data


class PowerLoss:
    """The durable state of the files under ``root`` (module docstring)."""

    def __init__(self, root):
        self.root = os.path.realpath(os.fspath(root))
        self.lock = threading.RLock()
        self.syncs = 0                       # syncs observed under root so far
        self.on_sync = None                  # callback(number of syncs), under the lock
        self._files: dict[str, _Shadow] = {}
        self._names: set[str] = set()        # paths whose directory entry is durable
        self._saved: dict = {}

    # -- lifetime ------------------------------------------------------------------

    def start(self) -> "PowerLoss":
        """Take the directory as it is now as durable, and start observing."""
        if self._saved:
            raise RuntimeError("this power-loss simulation is already active")
        with self.lock:
            for dirpath, dirnames, filenames in os.walk(self.root):
                for name in dirnames:
                    self._names.add(os.path.join(dirpath, name))
                for name in filenames:
                    path = os.path.join(dirpath, name)
                    self._names.add(path)
                    try:
                        st = os.stat(path)
                        if stat.S_ISREG(st.st_mode):
                            with open(path, "rb") as f:
                                self._files[path] = _Shadow(st.st_ino, bytearray(f.read()))
                    except FileNotFoundError:
                        pass
        for name, make in (("fsync", self._synced_fd), ("fdatasync", self._synced_fd),
                           ("replace", self._renamed), ("rename", self._renamed),
                           ("unlink", self._removed), ("remove", self._removed)):
            real = getattr(os, name)
            self._saved[name] = real
            setattr(os, name, make(real))
        _mapping.set_sync_hook(self._msynced)
        return self

    def stop(self) -> None:
        """Stop observing (the shadow is kept: materialise still works)."""
        _mapping.set_sync_hook(None)
        for name, real in self._saved.items():
            setattr(os, name, real)
        self._saved.clear()

    def __enter__(self) -> "PowerLoss":
        return self.start()

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False

    # -- what is made durable --------------------------------------------------------

    def _mine(self, path: str) -> bool:
        return path == self.root or path.startswith(self.root + os.sep)

    def _path_of(self, fd: int):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return None
        return path if self._mine(path) else None

    def _synced(self) -> None:
        self.syncs += 1
        if self.on_sync is not None:
            self.on_sync(self.syncs)

    def _synced_fd(self, real):
        def synced(fd):
            result = real(fd)
            path = self._path_of(fd)
            if path is not None:
                with self.lock:
                    st = os.fstat(fd)
                    if stat.S_ISDIR(st.st_mode):
                        self._names.add(path)
                        for name in os.listdir(path):
                            self._names.add(os.path.join(path, name))
                    else:
                        self._files[path] = _Shadow(st.st_ino, bytearray(_read(fd, 0, st.st_size)))
                    self._synced()
            return result
        return synced

    def _msynced(self, fd: int, start: int, end: int) -> None:
        path = self._path_of(fd)
        if path is None:
            return
        with self.lock:
            st = os.fstat(fd)
            shadow = self._files.get(path)
            if shadow is None or shadow.ino != st.st_ino:
                shadow = self._files[path] = _Shadow(st.st_ino, bytearray())
            data = shadow.data
            # The size the sync needs to find the data is synced with it.
            if len(data) < st.st_size:
                data.extend(bytes(st.st_size - len(data)))
            else:
                del data[st.st_size:]
            end = min(end, st.st_size)
            if end > start:
                data[start:end] = _read(fd, start, end - start)
            self._synced()

    def _renamed(self, real):
        def renamed(src, dst, *args, **kwargs):
            result = real(src, dst, *args, **kwargs)
            if not args and not kwargs:
                src_path, dst_path = _abs(src), _abs(dst)
                if self._mine(src_path) or self._mine(dst_path):
                    with self.lock:
                        self._move(src_path, dst_path)
            return result
        return renamed

    def _move(self, src: str, dst: str) -> None:
        for table in (self._files,):
            for path in [p for p in table if p == dst or p.startswith(dst + os.sep)]:
                del table[path]
            for path in [p for p in table if p == src or p.startswith(src + os.sep)]:
                table[dst + path[len(src):]] = table.pop(path)
        for path in [p for p in self._names if p == src or p.startswith(src + os.sep)]:
            self._names.discard(path)
            self._names.add(dst + path[len(src):])

    def _removed(self, real):
        def removed(path, *args, **kwargs):
            result = real(path, *args, **kwargs)
            if not args and not kwargs:
                full = _abs(path)
                if self._mine(full):
                    with self.lock:
                        self._files.pop(full, None)
                        self._names.discard(full)
            return result
        return removed

    # -- after the power loss ------------------------------------------------------------

    def materialise(self, dest) -> str:
        """Write to ``dest`` (a directory that must not exist) what the
        directory would hold after a power loss now; return its path."""
        dest = os.fspath(dest)
        with self.lock:
            os.makedirs(dest)
            for dirpath, dirnames, filenames in os.walk(self.root):
                rel = os.path.relpath(dirpath, self.root)
                for name in dirnames:
                    if os.path.join(dirpath, name) in self._names:
                        os.makedirs(os.path.join(dest, rel, name), exist_ok=True)
                for name in filenames:
                    path = os.path.join(dirpath, name)
                    try:
                        st = os.lstat(path)
                    except FileNotFoundError:
                        continue
                    if not stat.S_ISREG(st.st_mode):
                        continue                     # the control socket
                    shadow = self._files.get(path)
                    if shadow is not None and shadow.ino == st.st_ino:
                        data = bytes(shadow.data)
                    elif path in self._names:
                        data = b""
                    else:
                        continue
                    out = os.path.join(dest, rel, name)
                    os.makedirs(os.path.dirname(out), exist_ok=True)
                    with open(out, "wb") as f:
                        f.write(data)
        return dest

    def durable_bytes(self, path) -> bytes | None:
        """The synced content of ``path`` (None: none synced)."""
        with self.lock:
            shadow = self._files.get(_abs(path))
            return None if shadow is None else bytes(shadow.data)


def _abs(path) -> str:
    path = os.fspath(path)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    return os.path.realpath(path) if os.path.exists(path) else os.path.join(
        os.path.realpath(os.path.dirname(path) or "."), os.path.basename(path))


def _read(fd: int, start: int, size: int) -> bytes:
    """``size`` bytes at ``start`` of the file open as ``fd`` (opened again
    for reading: the writer's descriptor may be write-only)."""
    with open(f"/proc/self/fd/{fd}", "rb") as f:
        f.seek(start)
        return f.read(size)
