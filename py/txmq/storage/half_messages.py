"""The half-message store (RocketMQ's transactional messages): the half
log, the state table and its redo log, commits, rollbacks and check-back.
The producer handle is :mod:`txmq.client.half_producer`.

A half producer stores a message as a **half message**, invisible to every
subscription, runs the application's local transaction, and then commits
the message (it is appended to its real topic, once), rolls it back, or
leaves it for the broker to ask about later (check-back).

Storage (``<data>/half/``, bytes in docs/FORMAT.md):

- ``log/0/``: the half log, an internal partition. A half message's offset
  there is its **half id** and the index of its state record. Its batch
  carries the producer id of its (topic, group), which a GROUP frame maps
  back to both.
- ``statetable``: one 28-byte record per half message (``txmq._half``),
  memory-mapped; the checker scans it with numpy.
- ``redo.log``: the shared framed redo log. Every write to a record is
  framed here first (RECORD, UPDATE), so opening rebuilds the table from
  the redo log and the half log, never trusting the table's bytes.

Exactly once (G10): a commit first frames the record as COMMITTING with the
partition and the sequence its message will be appended with (the producer
id of its topic and group, idempotent), then appends. A crash after the
frame is repaired on open by appending again with the same sequence: the
partition answers a duplicate with the original offsets, or refuses a
sequence it has long passed, and never appends twice. COMMITTING records
settle to COMMITTED in batches (one UPDATE frame for many). A half message
that a crash left without a record (its local transaction was running) is
found on open and checked like any PREPARED one.

Durability: under ``fsync="commit"`` / ``"always"`` the half message is
synced before the local transaction runs and a COMMITTING frame before the
message is appended, so a power loss never loses a committed half message
and never lets it be appended twice.
"""

from __future__ import annotations

import enum
import logging
import math
import os
import random
import threading
import time

import numpy as np

from txmq import _half, crashpoints
from txmq._half import (COMMITTED, COMMITTING, DISCARDED, DISCARDING, EMPTY, F_GROUP, F_RECORD, F_UPDATE,
                        PREPARED, ROLLED_BACK, STATE_NAMES, StateTable)
from txmq._batch import BatchSpec, Message
from txmq._crc32c import crc32c_of
from txmq._partitioner import partition_for
from txmq._redolog import RedoLog, sync_dir
from txmq.errors import (BrokerClosedError, DuplicateSequenceError, InvalidArgumentError,
                         InvalidHalfStateError, OutOfOrderSequenceError, TxmqError)
from txmq.message import MessageId
from txmq.storage.partition import Partition

log = logging.getLogger("txmq.half")

HALF_TOPIC = "txmq.half"                       # the internal partition's name (not a topic)
CHECK_MAX_TOPIC = "txmq.half-check-max"        # where given-up half messages go
SETTLE_BATCH = 256                             # COMMITTING records settled per UPDATE frame
COMPACT_MIN_FRAMES = 10_000
SEQUENCE_LIMIT = 2**31
_new = tuple.__new__               # a NamedTuple without its Python-level __new__ (the hot path)


class LocalTransactionState(enum.Enum):
    """What a local transaction (or a check of one) answers."""
    COMMIT = "commit"
    ROLLBACK = "rollback"
    UNKNOWN = "unknown"


def group_hash(group: str) -> int:
    """The int32 a state record stores for a producer group."""
    h = crc32c_of(group.encode("utf-8"))
    return h - (1 << 32) if h >= 1 << 31 else h


def as_local_state(answer) -> LocalTransactionState:
    if isinstance(answer, LocalTransactionState):
        return answer
    log.warning("a local transaction answered %r, not a LocalTransactionState: taken as UNKNOWN", answer)
    return LocalTransactionState.UNKNOWN


class HalfStore:
    """The half messages of one data directory (a storage object: the
    broker owns it and supplies topics and producer ids)."""

    def __init__(self, broker, path: str, fsync: str, partition_options: dict, *,
                 check_immunity: float, max_checks: int, retention: float, clock=time.time):
        self.broker = broker
        self.path = path
        self.fsync = fsync
        self.check_immunity = check_immunity
        self.max_checks = max_checks
        self.retention = retention
        self.clock = clock
        self.lock = threading.RLock()
        self.problems: list[str] = []
        self.stats_counts = {"checks": 0, "discarded": 0, "committed": 0, "rolled_back": 0,
                             "recommitted_on_open": 0, "found_on_open": 0, "table_records_rebuilt_on_open": 0}
        self._checkers: dict[int, list] = {}      # group hash -> live HalfProducers with a checker
        self._settle: list = []                    # (half id, partition): COMMITTING / DISCARDING, appended
        self.closed = False
        self._rr = 0
        os.makedirs(path, exist_ok=True)
        self.log = Partition(os.path.join(path, "log", "0"), HALF_TOPIC, 0, **partition_options)
        self.redo = RedoLog(os.path.join(path, "redo.log"), fsync)
        self.table = None
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    # -- opening -----------------------------------------------------------------

    def _open(self) -> None:
        redo_path = self.redo.path
        # A frame that does not parse: CorruptLogError at its bad byte.
        base, records, self.intents, self.immunities, self.groups = _half.replay(
            self.redo.replay(positions=True), path=redo_path)
        if self.redo.dropped is not None:
            pos, reason, n = self.redo.dropped
            self.problems.append(f"{redo_path} at byte {pos}: {reason}; {n} bytes cut")
        end = self.log.end_offset
        have = len(records) // _half.RECORD_SIZE
        if base + have > end:
            # Records of half messages the half log no longer has (lost to a
            # power failure under fsync="never"): nothing to commit from.
            lost = base + have - end
            self.problems.append(f"{lost} state records past the half log's end {end} dropped")
            records = records[:max(end - base, 0) * _half.RECORD_SIZE]
            for d in (self.intents, self.immunities):
                for index in [i for i in d if i >= end]:
                    del d[index]
        table_path = os.path.join(self.path, "statetable")
        if _half.read_header(table_path) != base and os.path.exists(table_path):
            self.problems.append(f"{table_path}: header missing or stale; rebuilt from the redo log")
        self.table = StateTable(table_path, base, max(end, base))
        rebuilt = self.table.load(bytes(records))
        if rebuilt:
            self.problems.append(f"{table_path}: {rebuilt} records differed from the redo log; rebuilt")
        self.stats_counts["table_records_rebuilt_on_open"] = rebuilt

    def recover(self) -> None:
        """Finish what a crash interrupted (the broker's topics are open):
        record half messages that have none, append COMMITTING / DISCARDING
        ones again (idempotently), settle them."""
        with self.lock:
            recs = self.table.records()
            for i in np.flatnonzero(recs["state"] == EMPTY):
                index = self.table.base + int(i)
                found = self._read(index)
                if found is None:
                    continue
                m, pid = found
                group = self.groups.get(pid, (None, None))[1]
                if group is None:
                    self.problems.append(f"half message {index}: producer id {pid} has no group; left unchecked")
                self._record(index, PREPARED, self._size_of(index), m.publish_time // 1000,
                             0 if group is None else group_hash(group), 0)
                self.stats_counts["found_on_open"] += 1
            for index in sorted(self.intents):
                part, seq = self.intents[index]
                state = self.table.state_of(index)
                self._finish_append(index, state, part, seq)
                self.stats_counts["recommitted_on_open"] += 1
            self._flush_settle()
            if self.fsync != "never":
                self.redo.sync()

    # -- reading half messages ---------------------------------------------------

    def _read(self, index: int):
        """(Message, producer id) of half message ``index``, or None."""
        if not self.log.start_offset <= index < self.log.end_offset:
            return None
        got = self.log.read(index, 1, index + 1)
        if not got:
            return None
        offset, key, value, headers, event_time, publish_time, info = got[0]
        m = Message(value, key, headers, MessageId(HALF_TOPIC, 0, offset), event_time, publish_time, 0, offset)
        return m, info.producer_id

    def _size_of(self, index: int) -> int:
        seg, pos = self.log.segment_for(index)
        return seg.batch_at(pos).length if seg is not None else 0

    # -- producers ----------------------------------------------------------------

    def register_group(self, producer_id: int, topic: str, group: str) -> None:
        """Map a (topic, group)'s producer id to both, durably, before its
        first half message."""
        with self.lock:
            if self.groups.get(producer_id) == (topic, group):
                return
            self.redo.append(F_GROUP, _half.group_frame(producer_id, topic, group))
            self.redo.sync()
            self.groups[producer_id] = (topic, group)

    def add_checker(self, ghash: int, producer) -> None:
        with self.lock:
            self._checkers.setdefault(ghash, []).append(producer)

    def remove_checker(self, ghash: int, producer) -> None:
        with self.lock:
            live = self._checkers.get(ghash, [])
            if producer in live:
                live.remove(producer)
            if not live:
                self._checkers.pop(ghash, None)

    # -- the life of a half message --------------------------------------------------

    def _record(self, index, state, size, store_s, ghash, checks, partition=-1, sequence=-1,
                immunity_ms=-1) -> None:
        """Frame, then write, a whole record (lock held)."""
        self.redo.append(F_RECORD, _half.record_frame(index, index, size, store_s, ghash, state, checks,
                                                      partition, sequence, immunity_ms))
        self.table.put(index, index, size, store_s, ghash, state, checks)
        _half.note(self.intents, self.immunities, index, state, partition, sequence, immunity_ms)

    def record_new(self, index: int, size: int, store_s: int, ghash: int, immunity_ms: int) -> None:
        """The PREPARED record of a half message with its own check
        immunity, written before its local transaction runs. (Any other
        half message is recorded after it, with the outcome: a crash in
        between leaves it without a record, and opening finds it.)"""
        with self.lock:
            self._check_open()
            self._record(index, PREPARED, size, store_s, ghash, 0, immunity_ms=immunity_ms)

    def end(self, index: int, state: LocalTransactionState, *, new=None, spec=None, key=None, topic=None,
            producer_id=None, expect_checks=None):
        """End half message ``index`` with ``state``: COMMIT appends it to its
        topic (returns its MessageId, or None if it was appended before),
        ROLLBACK drops it, UNKNOWN leaves it PREPARED for check-back.

        A half message just stored passes ``new`` = (size, store time in
        s, group hash) and its ``spec``, ``key``, ``topic`` and
        ``producer_id`` (it may have no record yet); otherwise they are
        read from the record and the half log. A check passes
        ``expect_checks``: its answer is dropped if the record changed
        meanwhile. Ending a half message again the same way does nothing;
        the other way raises :class:`InvalidHalfStateError`."""
        with self.lock:
            self._check_open()
            if new is not None and (index >= self.table.end or self.table.state_of(index) == EMPTY):
                size, store_s, ghash = new
                checks = 0
            else:
                _, size, store_s, ghash, current, checks = self._get(index)
                if expect_checks is not None and (current != PREPARED or checks != expect_checks):
                    return None        # a check's answer, overtaken by an end or another check
                if current != PREPARED:
                    done = {LocalTransactionState.COMMIT: (COMMITTING, COMMITTED),
                            LocalTransactionState.ROLLBACK: (ROLLED_BACK,)}.get(state, ())
                    if current in done or state is LocalTransactionState.UNKNOWN:
                        return None
                    raise InvalidHalfStateError(index, STATE_NAMES[current], state.value)
                if state is LocalTransactionState.UNKNOWN:
                    return None
                new = None
            if state is LocalTransactionState.UNKNOWN:
                self._record(index, PREPARED, size, store_s, ghash, 0)
                return None
            if state is LocalTransactionState.ROLLBACK:
                self._record(index, ROLLED_BACK, size, store_s, ghash, checks)
                self.stats_counts["rolled_back"] += 1
                return None
            if spec is None:
                found = self._read(index)
                if found is None:
                    raise InvalidHalfStateError(index, "missing from the half log", "commit")
                m, producer_id = found
                topic = self.groups[producer_id][0]
                spec, key = _spec_of(m), m.key
            t = self.broker._topics.get(topic)
            if t is None:
                if new is not None:
                    self._record(index, PREPARED, size, store_s, ghash, 0)
                self.problems.append(f"half message {index}: topic {topic!r} is gone; sent to {CHECK_MAX_TOPIC}")
                self._discard(index)
                return None
            return self._commit(index, t, spec, key, producer_id, size, store_s, ghash, checks)

    def commit_new(self, index, size, store_s, ghash, spec, key, topic, producer_id):
        """:meth:`end` with COMMIT for a half message just stored, whose
        local transaction committed (the hot path of send_in_transaction)."""
        with self.lock:
            self._check_open()
            t = self.broker._topics.get(topic)
            if t is None or (index < self.table.end and self.table.state_of(index) != EMPTY):
                return self.end(index, LocalTransactionState.COMMIT, new=(size, store_s, ghash), spec=spec,
                                key=key, topic=topic, producer_id=producer_id)
            return self._commit(index, t, spec, key, producer_id, size, store_s, ghash, 0)

    def _commit(self, index, t, spec, key, producer_id, size, store_s, ghash, checks):
        parts = t.partitions
        if key is not None and len(parts) > 1:
            p = parts[partition_for(key, len(parts))]
        else:
            self._rr += 1
            p = parts[self._rr % len(parts)]
        offset = self._send_once(index, COMMITTING, p, spec, producer_id, size, store_s, ghash, checks)
        self.stats_counts["committed"] += 1
        return None if offset is None else _new(MessageId, (t.name, p.index, offset))

    def _send_once(self, index, state, p, spec, producer_id, size, store_s, ghash, checks):
        """Append half message ``index`` to partition ``p`` exactly once
        (lock held): frame the record as ``state`` (COMMITTING or
        DISCARDING) with the partition and the sequence it goes with, make
        that durable, append, and leave the record to settle."""
        seq = (p.last_sequence(producer_id) + 1) % SEQUENCE_LIMIT
        self._record(index, state, size, store_s, ghash, checks, p.index, seq)
        if self.fsync != "never":
            self.redo.sync()
        if crashpoints.ARMED:
            crashpoints.reached("half.committing" if state == COMMITTING else "half.discarding")
        try:
            offset = self._append(p, spec, producer_id, seq)
        except BaseException:
            # Not appended: back to PREPARED (check-back or a later end
            # commits it), so its sequence is not taken for another message's.
            try:
                self._record(index, PREPARED, size, store_s, ghash, checks)
            except BaseException:
                self.closed = True    # the record may still say COMMITTING: nothing more until reopened
                raise
            raise
        if crashpoints.ARMED:
            crashpoints.reached("half.appended")
        self._settle.append((index, p))
        if len(self._settle) >= SETTLE_BATCH:
            self._flush_settle()
        return offset

    def _check_open(self) -> None:
        if self.closed:
            raise BrokerClosedError(f"half messages of {os.path.dirname(self.path)} are closed")

    def _get(self, index: int):
        if not self.table.base <= index < self.table.end:
            raise InvalidHalfStateError(index, "unknown", "end it")
        return self.table.get(index)

    def _append(self, p, spec, producer_id, seq):
        """Append a committed (or discarded) half message with its
        sequence: once, however often this runs. Its offset, or None when
        the partition has long passed that sequence (appended before)."""
        try:
            return p.append(spec, 0, None, producer_id, 0, seq, False)
        except DuplicateSequenceError:
            return None
        except OutOfOrderSequenceError as e:
            # The partition lost the appends before this one (a power
            # failure under fsync="never"): append after what it has.
            self.problems.append(f"{p.topic}/{p.index}: {e}; appended at the next sequence")
            return p.append(spec, 0, None, producer_id, 0, -1, False)

    def _finish_append(self, index, state, part, seq) -> None:
        """Open: append a COMMITTING / DISCARDING record's message again."""
        found = self._read(index)
        if found is None:
            self.problems.append(f"half message {index} ({STATE_NAMES[state]}) is missing from the half log")
            self._update([(index, DISCARDED, self.table.get(index)[5])])
            return
        m, pid = found
        spec = _spec_of(m) if state == COMMITTING else _dead_letter_spec(m, index, *self.groups.get(pid, ("?", "?")))
        topic = self.groups.get(pid, (None,))[0] if state == COMMITTING else CHECK_MAX_TOPIC
        t = self.broker._topics.get(topic) if topic is not None else None
        if t is None or part >= len(t.partitions):
            if state == COMMITTING:
                self.problems.append(f"half message {index}: topic {topic!r} is gone; sent to {CHECK_MAX_TOPIC}")
                self._discard(index)
                return
            t = self._check_max_topic()
        p = t.partitions[part]
        self._append(p, spec, pid, seq)
        self._settle.append((index, p))

    def _flush_settle(self) -> None:
        """COMMITTING -> COMMITTED and DISCARDING -> DISCARDED for every
        record whose message is appended: one UPDATE frame (lock held)."""
        if not self._settle:
            return
        if self.fsync != "never":
            # The frame forgets the intents: the messages must be durable
            # first, or a power loss leaves COMMITTED with no message.
            for p in {id(p): p for _, p in self._settle}.values():
                p.sync_to(p.end_offset)
        updates = []
        for index, _ in self._settle:
            _, _, _, _, state, checks = self.table.get(index)
            updates.append((index, COMMITTED if state == COMMITTING else DISCARDED, checks))
        self._settle = []
        self._update(updates)

    def _update(self, updates) -> None:
        self.redo.append(F_UPDATE, _half.update_frame(updates))
        for index, state, checks in updates:
            self.table.set_state(index, state, checks)
            _half.note(self.intents, self.immunities, index, state)

    # -- check-back ------------------------------------------------------------------

    def due(self, now: float) -> list:
        """Half ids of PREPARED messages old enough to check, oldest first."""
        with self.lock:
            self._check_open()
            self._flush_settle()
            # store_time is whole seconds: stored at most 1 s after it, so
            # never check before the immunity has surely passed.
            idx = self.table.due(math.floor(now - 1 - self.check_immunity)) + self.table.base
            if self.immunities:
                own = np.fromiter(self.immunities, np.int64, len(self.immunities))
                idx = idx[~np.isin(idx, own)]
                extra = [i for i, ms in self.immunities.items()
                         if self.table.base <= i < self.table.end
                         and (r := self.table.get(i))[4] == PREPARED and r[2] <= math.floor(now - 1 - ms / 1000)]
                if extra:
                    idx = np.union1d(idx, np.asarray(extra, np.int64))
            return idx.tolist()

    def check(self, now: float | None = None) -> int:
        """One round of check-back; return how many checks were sent.

        Each due PREPARED message of a group with a live checker is checked
        once (its check count is framed first); one that has had
        ``max_checks`` goes to the check-max topic instead. Groups with no
        live member are skipped and nothing is counted for them."""
        now = self.clock() if now is None else now
        asks = []
        with self.lock:
            self._check_open()
            counts = []
            for index in self.due(now):
                _, _, _, ghash, state, checks = self.table.get(index)
                if not self._checkers.get(ghash):
                    continue
                if checks >= self.max_checks:
                    self._discard(index)
                    continue
                counts.append((index, PREPARED, checks + 1))
                asks.append((index, checks + 1, random.choice(self._checkers[ghash])))
            if counts:
                self._update(counts)
                self.stats_counts["checks"] += len(counts)
                crashpoints.reached("half.check_counted")
        for index, checks, producer in asks:
            found = self._read(index)
            if found is None:
                continue
            try:
                answer = as_local_state(producer.checker(found[0]))
            except Exception:
                log.exception("checker of group %r raised for half message %d: taken as UNKNOWN",
                              producer.group, index)
                answer = LocalTransactionState.UNKNOWN
            if answer is not LocalTransactionState.UNKNOWN:
                try:
                    self.end(index, answer, expect_checks=checks)
                except BrokerClosedError:
                    return len(asks)
                except TxmqError:
                    # (a failed append: the message stays PREPARED and is checked again)
                    log.exception("check-back of half message %d could not end it", index)
        return len(asks)

    def _check_max_topic(self):
        t = self.broker._topics.get(CHECK_MAX_TOPIC)
        if t is None:
            self.broker.create_topic(CHECK_MAX_TOPIC, 1)
            t = self.broker._topics[CHECK_MAX_TOPIC]
        return t

    def _discard(self, index: int) -> None:
        """Move a half message to the check-max topic, once (lock held)."""
        found = self._read(index)
        _, size, store_s, ghash, _, checks = self.table.get(index)
        if found is None:
            self._update([(index, DISCARDED, checks)])
            return
        m, pid = found
        topic, group = self.groups.get(pid, ("?", "?"))
        p = self._check_max_topic().partitions[0]
        self._send_once(index, DISCARDING, p, _dead_letter_spec(m, index, topic, group), pid, size, store_s,
                        ghash, checks)
        self._flush_settle()
        self.stats_counts["discarded"] += 1

    def resume(self, half_ids=None) -> list:
        """Check DISCARDED half messages again from a check count of 0 (all
        of them, or those of ``half_ids``); return the half ids resumed."""
        with self.lock:
            self._check_open()
            recs = self.table.records()
            found = (np.flatnonzero(recs["state"] == DISCARDED) + self.table.base).tolist()
            if half_ids is not None:
                wanted = _half_ids(half_ids)
                bad = [i for i in wanted if not (self.table.base <= i < self.table.end)
                       or self.table.state_of(i) != DISCARDED]
                if bad:
                    i = bad[0]
                    state = STATE_NAMES[self.table.state_of(i)] if self.table.base <= i < self.table.end \
                        else "unknown"
                    raise InvalidHalfStateError(i, state, "resume checks")
                found = sorted(wanted)
            if found:
                self._update([(i, PREPARED, 0) for i in found])
            return found

    # -- compaction ------------------------------------------------------------------

    def maybe_compact(self, now: float | None = None) -> bool:
        """Drop the records (and half-log segments) before the first one
        that is unresolved or younger than the retention, and start the
        redo log again from a snapshot, when the log has grown past the
        records it describes."""
        now = self.clock() if now is None else now
        with self.lock:
            self._check_open()
            self._flush_settle()
            recs = self.table.records()
            done = np.isin(recs["state"], (COMMITTED, ROLLED_BACK, DISCARDED)) & (
                recs["store_time"] <= now - self.retention)
            keep = int(np.argmin(done)) if len(done) and not done.all() else len(done)
            base = self.table.base + keep
            live = self.table.end - base
            if self.redo.frames_since_snapshot < max(COMPACT_MIN_FRAMES, live // 2) and keep < COMPACT_MIN_FRAMES:
                return False
            self._compact(base)
            return True

    def _compact(self, base: int) -> None:
        end = self.table.end
        raw = self.table.raw(base, end)
        self.redo.compact(_half.snapshot(base, end, raw, self.intents, self.immunities, self.groups))
        path = self.table.path
        tmp = path + ".compact"
        fresh = StateTable(tmp, base, end)
        fresh.load(raw)
        if self.fsync != "never":
            fresh.sync()
        fresh.close()
        os.replace(tmp, path)
        if self.fsync != "never":
            sync_dir(self.path)
        self.table.close()
        self.table = StateTable(path, base, end)
        self.intents = {i: v for i, v in self.intents.items() if i >= base}
        self.immunities = {i: v for i, v in self.immunities.items() if i >= base}
        self.log.delete_segments(base, -1, None)

    # -- state -------------------------------------------------------------------------

    def stats(self) -> dict:
        """Half messages by state, the oldest PREPARED one's age (s), checks
        sent, discards, and what opening found."""
        with self.lock:
            self._check_open()
            recs = self.table.records()
            counts = _half.count_states(recs)
            prepared = recs["store_time"][recs["state"] == PREPARED]
            oldest = max(0.0, round(self.clock() - int(prepared.min()), 3)) if len(prepared) else None
            return {
                "by_state": {name: int(counts[i]) for i, name in enumerate(STATE_NAMES) if i != EMPTY},
                "oldest_prepared_age_s": oldest,
                "checks_sent": self.stats_counts["checks"],
                "discarded": self.stats_counts["discarded"],
                "committed": self.stats_counts["committed"],
                "rolled_back": self.stats_counts["rolled_back"],
                "records": self.table.end - self.table.base,
                "first_half_id": self.table.base,
                "live_checker_groups": len(self._checkers),
                "found_on_open": self.stats_counts["found_on_open"],
                "recommitted_on_open": self.stats_counts["recommitted_on_open"],
                "table_records_rebuilt_on_open": self.stats_counts["table_records_rebuilt_on_open"],
                "problems_on_open": list(self.problems),
            }

    def close(self) -> None:
        with self.lock:
            self.closed = True
            if self.table is not None and not self.redo.closed:
                try:
                    self._flush_settle()
                    if self.fsync != "never":
                        self.redo.sync()
                        self.table.sync()
                finally:
                    self.table.close()
            self.redo.close()
            self.log.close()


def _spec_of(m: Message) -> BatchSpec:
    return BatchSpec([m.value], None if m.key is None else [m.key], [m.headers] if m.headers else None,
                     [m.event_time])


def _dead_letter_spec(m: Message, index: int, topic: str, group: str) -> BatchSpec:
    headers = list(m.headers) + [("txmq.half-id", str(index).encode()), ("txmq.real-topic", topic.encode()),
                                 ("txmq.producer-group", group.encode())]
    return BatchSpec([m.value], None if m.key is None else [m.key], [headers], [m.event_time])


def _half_ids(half_ids) -> set:
    """``half_ids`` (an iterable of ints) as a set; anything else is an
    :class:`~txmq.errors.InvalidArgumentError`."""
    if isinstance(half_ids, (str, bytes)):
        raise InvalidArgumentError("half_ids", half_ids, "None or a list of half ids (ints)")
    try:
        wanted = set(half_ids)
    except TypeError:
        raise InvalidArgumentError("half_ids", half_ids, "None or a list of half ids (ints)") from None
    for i in wanted:
        if type(i) is not int and not isinstance(i, np.integer):
            raise InvalidArgumentError("half_ids", half_ids, "None or a list of half ids (ints)")
    return {int(i) for i in wanted}
