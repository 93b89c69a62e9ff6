"""Staged ingest, the requester's side: writers in other processes append to
a data directory as one atomic step (docs/ARCHITECTURE.md).

A writer that cannot hold the data directory (a Spark task, say) stages
its batches, in the on-disk batch layout, under
``<data>/staging/<job>/<attempt>/<topic>/<partition>-<n>.seg`` with
:class:`StagedWriter`, and marks the attempt complete. Then one call,
:func:`commit`, asks the process that owns the directory (through its
control socket, :mod:`txmq.requester.control_client`) — or, when none does, opens it
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
import shutil

import numpy as np
import pyarrow as pa

from txmq._batch import BatchSpec
from txmq._partitioner import partitions_for_arrow
from txmq._segment import Segment
from txmq.errors import InvalidArgumentError, StagingError
from txmq.files import sync_dir
from txmq.requester.control_client import request
from txmq.storage.staging import ABORTED, COMPLETE, STAGED_SEGMENT_BYTES, staging_dir, topic_partitions


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


def commit(data_dir, job: str, attempts, sink=None, *, timeout: float = 120.0) -> dict:
    """Ingest the listed attempts of ``job`` as one transaction, through the
    directory's owner (its control socket) or, when no process owns it,
    by opening it here. See :meth:`txmq.broker.ingester.Ingester.ingest`."""
    return request(data_dir, {"op": "ingest", "job": job, "attempts": list(attempts),
                                      "sink": None if sink is None else list(sink)}, timeout=timeout)


def last_batch(data_dir, sink: str, *, timeout: float = 120.0) -> int:
    """The last batch id committed for ``sink`` in ``data_dir`` (-1: none)."""
    return request(data_dir, {"op": "last_batch", "sink": sink}, timeout=timeout)["batch_id"]


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
