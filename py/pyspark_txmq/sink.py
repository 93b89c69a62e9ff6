"""Writing a Spark DataFrame into txmq, exactly once (DESIGN.md §9).

``df.write.format("txmq").option("path", data_dir).option("topic", "out")
.mode("append").save()``: the columns are those of Spark's Kafka sink —
``value`` (binary or string, required), ``key``, ``headers``
(array<struct<key string, value binary>>) and ``partition`` (int), all
optional. Without ``partition`` a row goes where its key hashes (as a
txmq or Kafka producer sends it), else round-robin.

Each task attempt stages its Arrow batches in the on-disk batch layout
(:class:`txmq.ingest.StagedWriter`) under the job's staging directory and
returns its attempt id. The job's commit ingests exactly the attempts
Spark reports as successful **as one transaction**, through the process
that owns the data directory (its control socket) or, when none does,
by opening the directory itself; every other attempt of the job is
deleted. ``abort`` deletes the job's staging, so a failed job leaves
nothing visible. All of this runs in processes other than the driver's
Python one: the writer carries only picklable fields (path, topic, job
id), and the Spark worker opens files inside ``write``.

``writeStream.format("txmq")``: each micro-batch commits the same way,
keyed by (sink id, batchId) — the sink id is the ``sinkId`` option, else
the query's ``checkpointLocation`` — and the batch id is recorded in the
same transaction as the data (``txmq.sinks``), so a micro-batch that
Spark replays after a driver crash commits once.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass

from pyspark.sql.datasource import DataSourceArrowWriter, DataSourceStreamArrowWriter, WriterCommitMessage

from txmq import ingest
from txmq.errors import InvalidArgumentError

JOB_SINK = "txmq.job/"            # sink keys of batch writes: one commit per job id

__all__ = ["StagedAttempt", "TxmqArrowWriter", "TxmqStreamArrowWriter", "batch_writer", "stream_writer"]


@dataclass
class StagedAttempt(WriterCommitMessage):
    """What a task attempt tells the commit: the attempt it staged."""
    attempt: str
    messages: int


def _options(options) -> tuple:
    path = options.get("path")
    topic = options.get("topic")
    if not path:
        raise InvalidArgumentError("path", path, "the data directory (.option('path', ...))")
    if not topic:
        raise InvalidArgumentError("topic", topic, "the topic to write (.option('topic', ...))")
    ingest.topic_partitions(path, topic)            # TopicNotFoundError now, not in every task
    return path, topic


def _stage(path: str, job: str, topic: str, iterator) -> StagedAttempt:
    """One task attempt: stage every batch, mark the attempt complete."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    attempt = (f"p{ctx.partitionId()}-a{ctx.attemptNumber()}-" if ctx is not None else "") + uuid.uuid4().hex[:12]
    writer = ingest.StagedWriter(path, job, attempt, topic)
    try:
        for batch in iterator:
            if "topic" in batch.schema.names:
                _same_topic(batch.column("topic"), topic)
            writer.write_arrow(batch)
        return StagedAttempt(**writer.close())
    except BaseException:
        writer.abort()
        raise


def _same_topic(column, topic: str) -> None:
    import pyarrow.compute as pc

    other = pc.filter(column, pc.not_equal(column, topic))
    if len(other) or column.null_count:
        raise InvalidArgumentError("topic column", other[0].as_py() if len(other) else None,
                                   f"{topic!r}, the topic option, in every row (one topic per write)")


def _attempts(messages) -> list:
    # A task that failed reports None; a task that wrote nothing still staged an attempt.
    return [m.attempt for m in messages if isinstance(m, StagedAttempt)]


class TxmqArrowWriter(DataSourceArrowWriter):
    """A batch write: one job id, staged per task attempt, one commit."""

    def __init__(self, path: str, topic: str):
        self.path = path
        self.topic = topic
        self.job = f"spark-{uuid.uuid4().hex}"

    def write(self, iterator) -> StagedAttempt:
        return _stage(self.path, self.job, self.topic, iterator)

    def commit(self, messages) -> None:
        # Keyed by the job (a fresh id per write): if the owner dies during
        # the commit, asking again commits it once.
        ingest.commit(self.path, self.job, _attempts(messages), sink=(f"{JOB_SINK}{self.job}", 0))

    def abort(self, messages) -> None:
        ingest.abort(self.path, self.job)


class TxmqStreamArrowWriter(DataSourceStreamArrowWriter):
    """A streaming write: each micro-batch is one commit keyed by (sink id,
    batchId). Micro-batches of one query run one at a time, so they share
    one staging job, emptied by each commit."""

    def __init__(self, path: str, topic: str, sink: str):
        self.path = path
        self.topic = topic
        self.sink = sink
        self.job = "stream-" + hashlib.sha256(sink.encode()).hexdigest()[:24]

    def write(self, iterator) -> StagedAttempt:
        return _stage(self.path, self.job, self.topic, iterator)

    def commit(self, messages, batchId: int) -> None:
        ingest.commit(self.path, self.job, _attempts(messages), sink=(self.sink, batchId))

    def abort(self, messages, batchId: int) -> None:
        ingest.abort(self.path, self.job, tombstone=False)


def batch_writer(options, schema, overwrite: bool) -> TxmqArrowWriter:
    """The writer of ``df.write.format("txmq")``; ``overwrite`` is refused
    (a topic is append-only)."""
    if overwrite:
        raise InvalidArgumentError("mode", "overwrite", "'append' (a txmq topic is append-only)")
    _check_columns(schema)
    return TxmqArrowWriter(*_options(options))


def stream_writer(options, schema, overwrite: bool) -> TxmqStreamArrowWriter:
    """The writer of ``df.writeStream.format("txmq")``."""
    if overwrite:
        raise InvalidArgumentError("outputMode", "complete", "'append' (a txmq topic is append-only)")
    _check_columns(schema)
    path, topic = _options(options)
    sink = options.get("sinkId") or options.get("checkpointLocation")
    if not sink:
        raise InvalidArgumentError("sinkId", None, "a stable id of this sink (.option('sinkId', ...)), or a "
                                                   "checkpointLocation option: it keys exactly-once commits")
    return TxmqStreamArrowWriter(path, topic, sink)


def _check_columns(schema) -> None:
    """``value`` is required; other columns than Spark's Kafka sink's are
    ignored, as there (so the columns of a txmq or Kafka read pass)."""
    names = [f.name for f in schema.fields]
    if "value" not in names:
        raise InvalidArgumentError("columns", names, "a 'value' column (binary or string), as Spark's Kafka sink")
