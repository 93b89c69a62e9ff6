"""Writing a Spark DataFrame into txmq, exactly once (docs/SPARK.md).

``df.write.format("txmq").option("path", data_dir).option("topic", "out")
.mode("append").save()``: the columns are those of Spark's Kafka sink —
``value`` (binary or string, required), ``key``, ``headers``
(array<struct<key string, value binary>>) and ``partition`` (int), all
optional. Without ``partition`` a row goes where its key hashes (as a
txmq or Kafka producer sends it), else round-robin.

Each task attempt stages its Arrow batches in the on-disk batch layout
(:class:`txmq.ingest.StagedWriter`) under the job's staging directory and
returns its attempt id. With ``option("flight", "grpc://host:port")``
(:mod:`pyspark_txmq.remote`) the task sends its batches to the owner's
Flight service, which stages them there (``DoPut``), and the commit and
abort are Flight actions: the same staging, the same one transaction.
Given ``path``, a task whose executor cannot open the directory stages
through the owner's Flight service the driver found in
``<data>/flight.json`` (:class:`pyspark_txmq.remote.Fallback`); the
commit stays the driver's. The job's commit ingests exactly the attempts
Spark reports as successful **as one transaction**, through the process
that owns the data directory (its control socket) or, when none does,
by opening the directory itself; every other attempt of the job is
deleted. ``abort`` deletes the job's staging, so a failed job leaves
nothing visible. All of this runs in processes other than the driver's
Python one: the writer carries only picklable fields (path, topic, job
id), and the Spark worker opens files inside ``write``.

``writeStream.format("txmq")``: each micro-batch commits the same way,
keyed by (sink key, batchId), and the batch id is recorded in the same
transaction as the data (``txmq.sinks``), so a micro-batch that Spark
replays after a driver crash commits once. The sink key is the query's
persistent id — the one Spark keeps in the checkpoint's ``metadata`` file
and hands every task as the local property ``sql.streaming.queryId`` —
prefixed with the ``sinkId`` option when given (:func:`sink_key`). A query
restarted from its checkpoint keeps its id and so its committed batch ids;
a query on a fresh (or deleted) checkpoint is a new query whose batches
0, 1, ... are all written; two queries given one ``sinkId`` are kept apart.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass

from pyspark.sql.datasource import DataSourceArrowWriter, DataSourceStreamArrowWriter, WriterCommitMessage

from pyspark_txmq.remote import FLIGHT_OPTIONS, Fallback, fallback, flight_target, task_target
from txmq import ingest
from txmq.errors import InvalidArgumentError, StagingError
from txmq.flight.client import connect

JOB_SINK = "txmq.job/"            # sink keys of batch writes: one commit per job id
QUERY_SINK = "txmq.query"         # the prefix of sink keys of streaming queries without a sinkId
QUERY_ID_PROPERTY = "sql.streaming.queryId"     # set by Spark on every task of a streaming query

__all__ = ["StagedAttempt", "TxmqArrowWriter", "TxmqStreamArrowWriter", "batch_writer", "stream_writer",
           "sink_key"]


@dataclass
class StagedAttempt(WriterCommitMessage):
    """What a task attempt tells the commit: the attempt it staged, and
    (streaming) the persistent id of the query it ran for."""
    attempt: str
    messages: int
    query: str | None = None


def sink_key(sink_id: str | None, query_id: str) -> str:
    """The key under which a streaming query's last committed batch id is
    recorded in ``txmq.sinks`` (:meth:`txmq.Broker.sink_batch_id`):
    ``<sinkId>/<query id>``, or ``txmq.query/<query id>`` without a
    ``sinkId``."""
    return f"{sink_id or QUERY_SINK}/{query_id}"


def _stream_job(key: str) -> str:
    # The staging job of a query's micro-batches: a file name, whatever the key holds.
    return "stream-" + hashlib.sha256(key.encode()).hexdigest()[:24]


def _options(options) -> tuple:
    """``(destination, topic, fallback)``: the destination is the data
    directory's path (a str), or the :class:`txmq.flight.client.FlightTarget`
    of the ``flight`` option; ``fallback`` (with a path) is where a task
    whose executor cannot open the directory stages instead
    (:class:`pyspark_txmq.remote.Fallback`)."""
    target = flight_target(options)
    path = options.get("path")
    topic = options.get("topic")
    if target is None and not path:
        raise InvalidArgumentError("path", path, "the data directory (.option('path', ...)), "
                                   "or .option('flight', 'grpc://host:port')")
    if not topic:
        raise InvalidArgumentError("topic", topic, "the topic to write (.option('topic', ...))")
    if target is not None:
        _flight(target).topic_partitions(topic)     # TopicNotFoundError now, not in every task
        return target, topic, None
    ingest.topic_partitions(path, topic)            # TopicNotFoundError now, not in every task
    return path, topic, fallback(options, path)


def _flight(target):
    return connect(target)


def _commit(dest, job: str, attempts: list, sink) -> None:
    if isinstance(dest, str):
        ingest.commit(dest, job, attempts, sink=sink)
    else:
        _flight(dest).commit(job, attempts, sink)


def _abort(dest, job: str, tombstone: bool = True) -> None:
    if isinstance(dest, str):
        ingest.abort(dest, job, tombstone=tombstone)
    else:
        _flight(dest).abort(job, tombstone)


def _stage(dest, job: str, topic: str, iterator, query: str | None = None,
           fb: Fallback | None = None) -> StagedAttempt:
    """One task attempt: stage every batch, mark the attempt complete. A
    ``topic`` column is not read: the ``topic`` option overrides it, as in
    Spark's Kafka sink. ``dest``: a data directory path, or a Flight
    target (the owner stages what the task sends); a path this executor
    cannot open goes to ``fb``'s target instead (the same staging
    directory, so the driver's commit is the same)."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    attempt = (f"p{ctx.partitionId()}-a{ctx.attemptNumber()}-" if ctx is not None else "") + uuid.uuid4().hex[:12]
    if isinstance(dest, str):
        dest = task_target(dest, fb) or dest
    if not isinstance(dest, str):
        return StagedAttempt(**_flight(dest).stage(job, attempt, topic, iterator), query=query)
    writer = ingest.StagedWriter(dest, job, attempt, topic)
    try:
        for batch in iterator:
            writer.write_arrow(batch)
        return StagedAttempt(**writer.close(), query=query)
    except BaseException:
        writer.abort()
        raise


def _query_id() -> str:
    """The persistent id of the streaming query this task runs for."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    query = ctx.getLocalProperty(QUERY_ID_PROPERTY) if ctx is not None else None
    if not query:
        raise StagingError(f"a streaming write task without the {QUERY_ID_PROPERTY} local property: "
                           "writeStream runs inside a Spark streaming query")
    return query


def _attempts(messages) -> list:
    # A task that failed reports None; a task that wrote nothing still staged an attempt.
    return [m.attempt for m in messages if isinstance(m, StagedAttempt)]


class TxmqArrowWriter(DataSourceArrowWriter):
    """A batch write: one job id, staged per task attempt, one commit.
    ``path``: the data directory, or a Flight target."""

    def __init__(self, path, topic: str, fallback: Fallback | None = None):
        self.path = path
        self.topic = topic
        self.fallback = fallback
        self.job = f"spark-{uuid.uuid4().hex}"

    def write(self, iterator) -> StagedAttempt:
        return _stage(self.path, self.job, self.topic, iterator, fb=self.fallback)

    def commit(self, messages) -> None:
        # Keyed by the job (a fresh id per write): if the owner dies during
        # the commit, asking again commits it once.
        _commit(self.path, self.job, _attempts(messages), (f"{JOB_SINK}{self.job}", 0))

    def abort(self, messages) -> None:
        _abort(self.path, self.job)


class TxmqStreamArrowWriter(DataSourceStreamArrowWriter):
    """A streaming write: each micro-batch is one commit keyed by
    (:func:`sink_key`, batchId). The query's id reaches the writer through
    its tasks (Spark gives it to them, not to the process that commits),
    in their commit messages. Micro-batches of one query run one at a
    time, so they share one staging job, emptied by each commit."""

    def __init__(self, path, topic: str, sink_id: str | None = None, fallback: Fallback | None = None):
        self.path = path
        self.topic = topic
        self.sink_id = sink_id
        self.fallback = fallback

    def write(self, iterator) -> StagedAttempt:
        query = _query_id()
        return _stage(self.path, _stream_job(sink_key(self.sink_id, query)), self.topic, iterator, query,
                      self.fallback)

    def _key(self, messages) -> str | None:
        queries = {m.query for m in messages if isinstance(m, StagedAttempt)}
        if len(queries) > 1 or None in queries:
            raise StagingError(f"one micro-batch's tasks ran for different queries: {sorted(map(str, queries))}")
        return sink_key(self.sink_id, queries.pop()) if queries else None

    def commit(self, messages, batchId: int) -> None:
        key = self._key(messages)
        if key is None:
            return                    # no task ran: nothing was staged, nothing to record
        _commit(self.path, _stream_job(key), _attempts(messages), (key, batchId))

    def abort(self, messages, batchId: int) -> None:
        # A failed task sends no message; what it staged goes with the next commit
        # of the query (it empties the job), or with clean_staging.
        key = self._key(messages)
        if key is not None:
            _abort(self.path, _stream_job(key), tombstone=False)


def batch_writer(options, schema, overwrite: bool) -> TxmqArrowWriter:
    """The writer of ``df.write.format("txmq")``; ``overwrite`` is refused
    (a topic is append-only)."""
    if overwrite:
        raise InvalidArgumentError("mode", "overwrite", "'append' (a txmq topic is append-only)")
    _check_options(options, BATCH_OPTIONS)
    _check_columns(schema)
    return TxmqArrowWriter(*_options(options))


def stream_writer(options, schema, overwrite: bool) -> TxmqStreamArrowWriter:
    """The writer of ``df.writeStream.format("txmq")``: any checkpoint
    (per query or ``spark.sql.streaming.checkpointLocation``) serves,
    since commits are keyed by the query's persistent id; ``sinkId``, when
    given, prefixes that key."""
    if overwrite:
        raise InvalidArgumentError("outputMode", "complete", "'append' (a txmq topic is append-only)")
    _check_options(options, STREAM_OPTIONS)
    _check_columns(schema)
    path, topic, fb = _options(options)
    sink_id = options.get("sinkId")
    if sink_id is not None and not str(sink_id).strip():
        raise InvalidArgumentError("sinkId", sink_id, "a non-empty name, or no sinkId")
    return TxmqStreamArrowWriter(path, topic, sink_id, fb)


# Options each writer knows (lower case: Spark's option map is case-insensitive).
# checkpointLocation and queryName are Spark's own, passed through to a streaming sink.
BATCH_OPTIONS = ("path", "topic") + FLIGHT_OPTIONS
STREAM_OPTIONS = BATCH_OPTIONS + ("sinkId", "checkpointLocation", "queryName")


def _check_options(options, known: tuple) -> None:
    """Refuse an option the sink does not know (a typo, or a Kafka option
    txmq has no use for), naming it."""
    allowed = {k.lower() for k in known}
    for name in options:
        if name.lower() not in allowed:
            raise InvalidArgumentError("option", name, "one of " + ", ".join(known)
                                       + " (see docs/SPARK.md for Spark's Kafka sink options)")


def _check_columns(schema) -> None:
    """The columns of Spark's Kafka sink, checked when the writer is made
    (before any task runs): ``value`` binary or string (required),
    ``key`` binary or string, ``headers`` array<struct<key string, value
    binary>>, ``partition`` int, ``topic`` string. Other columns are
    ignored, as there, so the columns of a txmq or Kafka read pass."""
    from pyspark.sql.types import ArrayType, BinaryType, IntegerType, StringType, StructField, StructType

    names = [f.name for f in schema.fields]
    if "value" not in names:
        raise InvalidArgumentError("columns", names, "a 'value' column (binary or string), as Spark's Kafka sink")
    header = StructType([StructField("key", StringType()), StructField("value", BinaryType())])
    for f in schema.fields:
        t = f.dataType
        if f.name in ("key", "value"):
            ok, expected = isinstance(t, (BinaryType, StringType)), "binary or string"
        elif f.name == "headers":
            ok = (isinstance(t, ArrayType) and isinstance(t.elementType, StructType)
                  and t.elementType.simpleString() == header.simpleString())
            expected = "array<struct<key:string,value:binary>>"
        elif f.name == "partition":
            ok, expected = isinstance(t, IntegerType), "int"
        elif f.name == "topic":
            ok, expected = isinstance(t, StringType), "string (the topic option overrides it)"
        else:
            continue
        if not ok:
            raise InvalidArgumentError(f"{f.name} column", t.simpleString(), expected)
