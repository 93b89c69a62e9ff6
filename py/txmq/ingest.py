"""Staged ingest: writers in other processes append to a data directory
as one atomic step (DESIGN.md §8).

A writer that cannot hold the data directory (a Spark task, say) stages
its batches, in the on-disk batch layout, under
``<data>/staging/<job>/<attempt>/<topic>/<partition>-<n>.seg`` with
:class:`StagedWriter`, and marks the attempt complete. Then one call,
:func:`commit`, asks the process that owns the directory (through its
control socket, :mod:`txmq.control`) — or, when none does, opens it
itself — to append exactly the listed attempts to their partitions **as one
transaction** and to delete the job's staging directory, every other
attempt with it. Staged files never become visible any other way.

A commit may carry a ``sink`` key and a batch id (a streaming query's
persistent id and micro-batch): the last committed batch id of each sink is
recorded in the topic ``txmq.sinks`` in the same transaction, and a batch
id at or below it is not appended again, so a micro-batch replayed after a
crash commits once.

Staged files are segments (docs/FORMAT.md) whose offsets start at 0; the
owner validates every batch (CRC included) before appending any.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading

import numpy as np
import pyarrow as pa

from txmq import crashpoints
from txmq._log import FLAG, BatchSpec, Segment
from txmq._partitioner import partitions_for_arrow
from txmq.batcharrow import batch_arrays
from txmq.errors import CorruptLogError, InvalidArgumentError, StagingError, TopicNotFoundError, TxmqError
from txmq.files import sync_dir
from txmq.topic import Topic

STAGING = "staging"
COMPLETE = "COMPLETE"             # written last: the attempt's files are whole
SINKS_TOPIC = "txmq.sinks"
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


def _check_name(what: str, value) -> str:
    if not isinstance(value, str) or not _NAME.match(value) or value in (".", ".."):
        raise InvalidArgumentError(what, value, "1-200 of ASCII letters, digits, '.', '_', '-'")
    return value


def staging_dir(data_dir, job: str, attempt: str | None = None) -> str:
    """Where ``job`` (or one attempt of it) stages its files."""
    parts = [os.fspath(data_dir), STAGING, _check_name("job", job)]
    if attempt is not None:
        parts.append(_check_name("attempt", attempt))
    return os.path.join(*parts)


def topic_partitions(data_dir, topic: str) -> int:
    """The partition count of ``topic``, read from its ``topic.json``
    without opening the directory."""
    try:
        return int(Topic.load_config(os.path.join(os.fspath(data_dir), "topics", topic))["partitions"])
    except FileNotFoundError:
        raise TopicNotFoundError(topic) from None


class StagedWriter:
    """Stages one attempt's messages for ``topic`` (in another process than
    the directory's owner). Messages go to the partition given, else to the
    one their key hashes to (as a producer sends them), else each call's
    messages to the next partition in turn. :meth:`close` makes the
    attempt complete; until then nothing of it can be ingested."""

    def __init__(self, data_dir, job: str, attempt: str, topic: str):
        self.data_dir = os.fspath(data_dir)
        self.topic = topic
        self.partitions = topic_partitions(self.data_dir, topic)
        self.path = staging_dir(self.data_dir, job, attempt)
        self.attempt = attempt
        self.messages = 0
        self._dir = os.path.join(self.path, topic)
        if os.path.exists(os.path.join(self.path, COMPLETE)):
            raise InvalidArgumentError("attempt", attempt, "an attempt not staged before")
        self._tombstone = staging_dir(self.data_dir, job) + ABORTED
        if os.path.exists(self._tombstone):
            raise StagingError(f"job {job!r} was aborted: nothing more is staged for it")
        shutil.rmtree(self.path, ignore_errors=True)     # a retried attempt id starts again
        os.makedirs(self._dir)
        self._segments: dict[int, Segment] = {}
        self._files: dict[int, int] = {}
        self._rr = 0
        self.closed = False

    def _segment(self, partition: int, need: int) -> Segment:
        seg = self._segments.get(partition)
        if seg is not None and seg.room() >= need:
            return seg
        if seg is not None:
            seg.close()
        n = self._files.get(partition, -1) + 1
        self._files[partition] = n
        seg = Segment(os.path.join(self._dir, f"{partition}-{n}.seg"), 0, max(STAGED_SEGMENT_BYTES, need), True)
        self._segments[partition] = seg
        return seg

    def write(self, values, keys=None, headers=None, event_times=None, partitions=None) -> int:
        """Stage messages: ``values`` a list of bytes or a pyarrow binary
        array; ``keys``, ``headers`` (one dict / pair list / None per
        message), ``event_times`` (int ms) and ``partitions`` (int per
        message, or one int) optional. Returns how many were staged."""
        if self.closed:
            raise InvalidArgumentError("writer", self, "an open StagedWriter")
        n = len(values)
        if n == 0:
            return 0
        if isinstance(partitions, int):
            targets = np.full(n, partitions, np.int64)
        elif partitions is not None:
            targets = np.asarray(partitions.to_numpy(zero_copy_only=False) if isinstance(partitions, pa.Array)
                                 else partitions, dtype=np.int64)
        elif keys is not None and self.partitions > 1:
            karr = keys if isinstance(keys, pa.Array) else pa.array(keys, pa.binary())
            targets = partitions_for_arrow(karr, self.partitions).astype(np.int64)
            nulls = targets < 0
            if nulls.any():
                self._rr += 1
                targets[nulls] = self._rr % self.partitions
        else:
            self._rr += 1
            targets = np.full(n, self._rr % self.partitions, np.int64)
        if len(targets) != n:
            raise InvalidArgumentError("partitions", len(targets), f"{n} entries")
        bad = (targets < 0) | (targets >= self.partitions)
        if bad.any():
            raise InvalidArgumentError("partition", int(targets[np.flatnonzero(bad)[0]]),
                                       f"a partition of {self.topic!r} (0..{self.partitions - 1})")
        # one stable sort groups the rows by partition, in their order
        order = np.argsort(targets, kind="stable")
        for idx in np.split(order, np.flatnonzero(np.diff(targets[order])) + 1):
            p = targets[idx[0]]
            whole = len(idx) == n
            spec = BatchSpec(values if whole else _take(values, idx),
                             None if keys is None else keys if whole else _take(keys, idx),
                             None if headers is None else [headers[i] for i in idx],
                             None if event_times is None else np.asarray(event_times)[idx])
            seg = self._segment(int(p), spec.encoded_size())
            if seg.append(spec) < 0:
                raise AssertionError("a staged segment sized for the batch took it")
        self.messages += n
        return n

    def write_arrow(self, batch: pa.RecordBatch) -> int:
        """Stage an Arrow batch with Spark's Kafka sink columns: ``value``
        (required), ``key``, ``headers`` (list of struct<key string, value
        binary>), ``partition`` (int)."""
        names = batch.schema.names
        if "value" not in names:
            raise InvalidArgumentError("columns", names, "a 'value' column (binary or string)")
        values = _binary(batch.column("value"), "value")
        keys = _binary(batch.column("key"), "key") if "key" in names else None
        headers = None
        if "headers" in names:
            headers = [None if h is None else [(d["key"], d["value"]) for d in h]
                       for h in batch.column("headers").to_pylist()]
        parts = batch.column("partition") if "partition" in names else None
        if parts is not None and parts.null_count:
            raise InvalidArgumentError("partition", None, "no null partitions (leave the column out instead)")
        return self.write(values, keys, headers, None, parts)

    def close(self) -> dict:
        """Seal the attempt: files synced, then the COMPLETE mark. Returns
        ``{"attempt", "messages"}``, what a commit lists."""
        if not self.closed:
            try:
                for seg in self._segments.values():
                    seg.sync()
                    seg.close()
                sync_dir(self._dir)
                with open(os.path.join(self.path, COMPLETE), "w") as f:
                    f.write(json.dumps({"topic": self.topic, "messages": self.messages}))
                    f.flush()
                    os.fsync(f.fileno())
                sync_dir(self.path)
            except FileNotFoundError:
                if not os.path.exists(self._tombstone):
                    raise
            self.closed = True
            if os.path.exists(self._tombstone):      # the job was aborted while this attempt ran
                self.abort()
                raise StagingError(f"job of {self.path} was aborted while it was staged")
        return {"attempt": self.attempt, "messages": self.messages}

    def abort(self) -> None:
        """Drop this attempt's files."""
        for seg in self._segments.values():
            seg.close()
        self.closed = True
        shutil.rmtree(self.path, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(self.path))      # the job's directory, if nothing else is in it
        except OSError:
            pass


def check_sink_schema(schema: pa.Schema) -> None:
    """Refuse an Arrow schema that is not the sink's before anything is
    staged: ``value`` binary or string (required), ``key`` binary or
    string, ``headers`` list<struct<key string, value binary>>,
    ``partition`` int32, ``topic`` string; other columns are ignored, as
    Spark's Kafka sink ignores them. Raises :class:`InvalidArgumentError`
    naming the column and its type."""
    names = schema.names
    if "value" not in names:
        raise InvalidArgumentError("columns", names, "a 'value' column (binary or string), as Spark's Kafka sink")
    if len(set(names)) != len(names):
        raise InvalidArgumentError("columns", names, "each column name once")
    for f in schema:
        t = f.type
        if f.name in ("key", "value"):
            ok, expected = _is_binary_like(t), "binary or string"
        elif f.name == "headers":
            item = t.value_type if pa.types.is_list(t) or pa.types.is_large_list(t) else None
            ok = (item is not None and pa.types.is_struct(item) and item.num_fields == 2
                  and item[0].name == "key" and _is_string(item[0].type) and item[1].name == "value"
                  and (pa.types.is_binary(item[1].type) or pa.types.is_large_binary(item[1].type)))
            expected = "list<struct<key string, value binary>>"
        elif f.name == "partition":
            ok, expected = pa.types.is_int32(t), "int32 (Spark's int)"
        elif f.name == "topic":
            ok, expected = _is_string(t), "string"
        else:
            continue
        if not ok:
            raise InvalidArgumentError(f"{f.name} column", str(t), expected)


def _is_string(t) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_binary_like(t) -> bool:
    return _is_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t)


def _binary(col, name: str):
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        col = col.cast(pa.large_binary() if pa.types.is_large_string(col.type) else pa.binary())
    if not (pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type)):
        raise InvalidArgumentError(f"{name} column", str(col.type), "binary or string")
    if name == "value" and col.null_count:
        raise InvalidArgumentError("value", None, "no null values")
    return col


def _take(seq, idx):
    if isinstance(seq, pa.Array):
        return seq.take(pa.array(idx))
    return [seq[i] for i in idx]


# -- the owner's side -----------------------------------------------------------------

def _open_staged(path: str) -> Segment:
    """One staged segment file, every batch checked (CRC included)."""
    seg = Segment(path, 0, 0, False)
    bad = seg.recover(0, 0) if seg.capacity else None
    if bad is not None or seg.size != seg.capacity:
        seg.close(False)
        if bad is not None:
            raise CorruptLogError(path, bad[0], f"staged batch: {bad[1]}")
        raise CorruptLogError(path, seg.size, "bytes after the last staged batch")
    return seg


def _staged_batches(seg: Segment):
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


def _attempt_files(path: str):
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


class Ingester:
    """The owner's side of staged ingest (one per broker; requests run one
    at a time, so a sink's batch id is checked and recorded atomically)."""

    def __init__(self, broker):
        self.broker = broker
        self.lock = threading.Lock()
        self._sinks: dict | None = None      # sink key -> last committed batch id

    def _sink_progress(self) -> dict:
        """The last committed batch id of every sink, from ``txmq.sinks``."""
        if self._sinks is None:
            sinks = {}
            if SINKS_TOPIC in self.broker.topics():
                p = self.broker._topics[SINKS_TOPIC].partitions[0]
                offset, end = p.start_offset, p.max_read_position
                while offset < end:
                    got = p.read(offset, 10_000, end)
                    if not got:
                        break
                    for off, key, value, _, _, _, info in got:
                        if not p.never_delivered(info, True):
                            sinks[key.decode()] = max(sinks.get(key.decode(), -1), int(value))
                        offset = off + 1
            self._sinks = sinks
        return self._sinks

    def last_batch(self, sink: str) -> int:
        """The last batch id committed for ``sink`` (-1: none)."""
        with self.lock:
            return self._sink_progress().get(sink, -1)

    def ingest(self, job: str, attempts, sink=None) -> dict:
        """Append the listed attempts of ``job`` as one transaction, then
        delete the job's staging directory. ``sink`` = (key, batch id):
        skipped (and the staging deleted) when that batch id was committed
        already; recorded in ``txmq.sinks`` in the same transaction
        otherwise. Returns ``{"messages", "skipped"}``."""
        broker = self.broker
        jdir = staging_dir(broker.path, job)
        attempts = [_check_name("attempt", a) for a in attempts]
        with self.lock:
            if sink is not None:
                key, batch_id = sink
                if not isinstance(key, str) or not key or type(batch_id) is not int or batch_id < 0:
                    raise InvalidArgumentError("sink", sink, "(non-empty str key, int batch id >= 0)")
                if batch_id <= self._sink_progress().get(key, -1):
                    shutil.rmtree(jdir, ignore_errors=True)
                    return {"messages": 0, "skipped": True}
            files = [f for a in attempts for f in _attempt_files(os.path.join(jdir, a))]
            for topic, part, path in files:
                if topic not in broker.topics():
                    raise TopicNotFoundError(topic)
                if part >= len(broker._topics[topic].partitions):
                    raise StagingError(f"{path}: partition {part} of {topic!r} does not exist")
            producers = {}
            messages = 0
            segments = []
            txn = None
            committed = False
            try:
                for topic, part, path in files:       # all checked before anything is appended
                    segments.append(_open_staged(path))
                txn = broker.new_transaction(timeout=broker.transaction_timeout_max)
                for (topic, part, path), seg in zip(files, segments):
                    p = producers.get(topic) or producers.setdefault(topic, broker.producer(topic))
                    for values, keys, headers, event_times in _staged_batches(seg):
                        p.send_batch(values, keys=keys, headers=headers, event_times=event_times,
                                     partition=part, txn=txn)
                        messages += len(values)
                if sink is not None:
                    if SINKS_TOPIC not in broker.topics():
                        broker.create_topic(SINKS_TOPIC, 1)
                    broker.producer(SINKS_TOPIC).send(str(batch_id).encode(), key=key.encode(), txn=txn)
                if crashpoints.ARMED:
                    crashpoints.reached("ingest.appended")
                txn.commit()
                committed = True
                if crashpoints.ARMED:
                    crashpoints.reached("ingest.committed")
            finally:
                if not committed and txn is not None:
                    try:
                        txn.abort()
                    except TxmqError:
                        pass           # decided already (a commit failing half way ends by retry)
                for seg in segments:
                    seg.close(False)
            if sink is not None:
                self._sinks[key] = batch_id
        shutil.rmtree(jdir, ignore_errors=True)
        return {"messages": messages, "skipped": False}

    def discard(self, job: str) -> None:
        """Delete every staged attempt of ``job``."""
        shutil.rmtree(staging_dir(self.broker.path, job), ignore_errors=True)


# -- the requester's side -------------------------------------------------------------

def commit(data_dir, job: str, attempts, sink=None, *, timeout: float = 120.0) -> dict:
    """Ingest the listed attempts of ``job`` as one transaction, through the
    directory's owner (its control socket) or, when no process owns it,
    by opening it here. See :meth:`Ingester.ingest`."""
    from txmq import control
    return control.request(data_dir, {"op": "ingest", "job": job, "attempts": list(attempts),
                                      "sink": None if sink is None else list(sink)}, timeout=timeout)


def last_batch(data_dir, sink: str, *, timeout: float = 120.0) -> int:
    """The last batch id committed for ``sink`` in ``data_dir`` (-1: none)."""
    from txmq import control
    return control.request(data_dir, {"op": "last_batch", "sink": sink}, timeout=timeout)["batch_id"]


def abort(data_dir, job: str, *, tombstone: bool = True) -> None:
    """Delete every staged attempt of ``job`` (nothing of it was visible).
    With ``tombstone`` leave one, so that attempts still running (a failed
    job's other tasks) stage nothing more: they refuse to start, or remove
    themselves when they close. (A streaming sink, whose micro-batches
    share one job, passes False: its next commit deletes what late tasks
    staged.)"""
    jdir = staging_dir(data_dir, job)
    if tombstone:
        os.makedirs(os.path.dirname(jdir), exist_ok=True)
        with open(jdir + ABORTED, "w"):
            pass
    shutil.rmtree(jdir, ignore_errors=True)


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
