"""Snapshot and restore the files of a data directory right after a kill,
so every round of a reopen benchmark opens the same state."""

from __future__ import annotations

import os


class DirSnapshot:
    """The files of a data directory right after the kill: the partition
    segments (``topics/<t>/<p>/<base>.log``) by size, since opening only
    trims or extends them (no transaction is left to end, so no marker is
    written), every other file by content (opening rewrites the coordinator
    logs, indexes, recovery point, transaction-buffer snapshot)."""

    def __init__(self, root: str):
        self.root = root
        self.sizes, self.contents = {}, {}
        for d, _, files in os.walk(root):
            for f in files:
                p = os.path.join(d, f)
                if not os.path.isfile(p):
                    continue                  # the killed owner's control socket: the next owner replaces it
                self.sizes[p] = os.path.getsize(p)
                if not self._segment(p):
                    with open(p, "rb") as fh:
                        self.contents[p] = fh.read()

    def _segment(self, p: str) -> bool:
        rel = os.path.relpath(p, self.root).split(os.sep)
        return rel[0] == "topics" and len(rel) == 4 and rel[3].endswith(".log") and rel[3][:-4].isdigit()

    def restore(self) -> None:
        for d, _, files in os.walk(self.root):
            for f in files:
                p = os.path.join(d, f)
                if p not in self.sizes:
                    os.unlink(p)
        for p, size in self.sizes.items():
            if p in self.contents:
                with open(p, "wb") as fh:
                    fh.write(self.contents[p])
            else:
                os.truncate(p, size)
        # The killed child had its active segment mapped and resident.
        for d in {os.path.dirname(p) for p in self.sizes if self._segment(p)}:
            active = max(f for f in os.listdir(d) if f.endswith(".log"))
            with open(os.path.join(d, active), "rb", buffering=0) as fh:
                buf = bytearray(1 << 20)
                while fh.readinto(buf):
                    pass
        os.sync()
