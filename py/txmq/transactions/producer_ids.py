"""Producer ids and named producers of a data directory (docs/FORMAT.md, "Idempotent producers").

``<data>/producers.log`` is a framed redo log (docs/FORMAT.md):

- BLOCK (i64 end): producer ids below ``end`` may have been handed out.
  Ids are given out from blocks of :data:`ID_BLOCK`, each reserved durably
  before its first id is used, so an id is never given twice, also across a
  crash (a restart starts at the next block).
- NAME (text name, i64 id): the producer id a named producer keeps across
  restarts.
- SNAPSHOT (i64 end, u32 count, count x (text name, i64 id)): the state at a
  compaction.

Transactional ids map to (producer id, epoch) in the coordinator logs
instead (coordinator.py); their ids come from here too.
"""

from __future__ import annotations

import struct
import threading

from txmq._redolog import RedoLog
from txmq._txnlog import PR_BLOCK, PR_NAME, encode_registry_snapshot, encode_text, replay_registry

ID_BLOCK = 1024
COMPACT_FRAMES = 4096
_I64 = struct.Struct("<q")


def reserve_block(log: RedoLog, frame_type: int, end: int) -> int:
    """Reserve the ids below ``end`` in ``log``: a frame of ``frame_type``
    naming it (i64), synced before any of them is handed out, so an id is
    never handed out twice whatever a crash kept (the producer registry's
    BLOCK, a coordinator log's RESERVE). Returns ``end``."""
    log.append(frame_type, _I64.pack(end))
    log.sync()
    return end


class ProducerRegistry:
    """The persistent producer-id counter and the names of named producers.
    Thread-safe."""

    def __init__(self, path: str, fsync: str):
        self.log = RedoLog(path, fsync)
        self.lock = threading.Lock()
        self.problems: list[str] = []
        # reserved: ids below it may have been handed out. A frame that does
        # not parse: CorruptLogError at its bad byte.
        self.reserved, self.names = replay_registry(self.log.replay(positions=True), self.log.path)
        if self.log.dropped is not None:
            pos, reason, n = self.log.dropped
            self.problems.append(f"{path} at byte {pos}: {reason}; {n} bytes cut")
        self.next_id = self.reserved       # the last block may be partly used: skip it

    def allocate(self) -> int:
        """A producer id never handed out before."""
        with self.lock:
            return self._allocate()

    def _allocate(self) -> int:
        if self.next_id >= self.reserved:
            self.reserved = reserve_block(self.log, PR_BLOCK, self.next_id + ID_BLOCK)
            self._maybe_compact()
        pid = self.next_id
        self.next_id += 1
        return pid

    def id_of(self, name: str) -> int:
        """The producer id of named producer ``name`` (given and recorded
        durably on first use)."""
        with self.lock:
            pid = self.names.get(name)
            if pid is None:
                pid = self._allocate()
                self.log.append(PR_NAME, encode_text(name) + _I64.pack(pid))
                self.log.sync()
                self.names[name] = pid
                self._maybe_compact()
            return pid

    def reserve_above(self, producer_id: int) -> None:
        """Never hand out ``producer_id`` or any id below it: ids found in
        use elsewhere (partitions, coordinator logs) when this log lost
        frames to damage."""
        with self.lock:
            if producer_id >= self.next_id:
                self.problems.append(f"producer id {producer_id} is in use beyond the counter "
                                     f"({self.next_id}); skipping past it")
                self.next_id = producer_id + 1
                self.reserved = reserve_block(self.log, PR_BLOCK, max(self.reserved, self.next_id))

    def _maybe_compact(self) -> None:
        if self.log.compact_due(COMPACT_FRAMES + len(self.names)):
            # Housekeeping: a full disk defers it, the log stays valid.
            self.log.try_compact(encode_registry_snapshot(self.reserved, self.names))

    def close(self) -> None:
        self.log.close()

