"""Reading txmq topics into Spark: the batch and streaming readers of the
``txmq`` data source (docs/SPARK.md).

Planning and reading run in different processes. ``partitions()`` runs in
Spark's planner process; it opens the data directory read-only
(:mod:`txmq.readonly`), or asks the owner's Flight service to
(``option("flight", ...)``, :mod:`pyspark_txmq.remote`), takes one view
per topic partition and fixes every range's end there: the last stable
offset (maxReadPosition) under ``read_committed``, the log end under
``read_uncommitted`` or ``allowOutOfOrderDelivery`` (past open
transactions, whose batches every task skips alike:
:mod:`txmq.requester.read_plan`), or a smaller ``endingOffsets``. ``read()`` runs in
an executor's Python worker, opens the directory again (or streams the
range from the Flight service) and reads exactly that range. Both paths
run :mod:`txmq.requester.read_plan`, so they plan and read alike. Given
``path``, a task whose executor cannot open the directory reads its range
through the owner's Flight service instead, which the planner found in
``<data>/flight.json`` and put in every range
(:class:`pyspark_txmq.remote.Fallback`, docs/SPARK_CLUSTER.md). Below a view's
maxReadPosition every transaction has ended, and maxReadPosition never
moves back, so a task reading later, while a writer keeps appending, sees
the same committed rows the planner counted: one consistent committed
prefix per partition. Nothing the reader or its partitions hold is a file,
a mapping or a connection, so both pickle.

Rows come as ``pyarrow.RecordBatch``es from
:meth:`txmq.readonly.PartitionView.read_arrow`: the key and value columns of
an on-disk batch of ``txmq.readonly.GATHER_BELOW`` rows or more are views
of the mapped segment (no copy of message bytes); runs of smaller batches
(a topic fed by single sends) are copied together, since Spark pays a fixed
cost per record batch (an Arrow IPC message to the JVM and a columnar batch
there). Timestamps are in microseconds, the only unit Spark's Arrow reader
takes.

Streaming offsets are ``{"topic/partition": offset}``: the next offset to
read in each partition. A partition missing from a start offset (the topic
grew) is read from its log start.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (ReadAllAvailable, ReadMaxRows, SupportsTriggerAvailableNow)

import txmq.readonly
from pyspark_txmq.remote import FALLBACK, FLIGHT_OPTIONS, fallback, flight_target, task_target, \
    without_flight_options
from txmq.errors import DataLossError
from txmq.flight.client import connect
from txmq.flight.wire import Ticket
from txmq.requester import read_plan
from txmq.requester.read_plan import (EARLIEST, LATEST, MAX_ROWS_PER_BATCH, SPLIT_OFFSETS_DEFAULT,  # noqa: F401
                                      ByTime, ReadOptions, Split, admit, option_bool, offset_key,
                                      parse_offset_key)

__all__ = ["ReadOptions", "parse_read_options", "TxmqReader", "TxmqStreamReader", "OffsetRange",
           "DataLossError", "read_options"]


def parse_read_options(options, streaming: bool) -> ReadOptions:
    """:func:`txmq.requester.read_plan.parse_read_options` of a local read (the
    ``path`` option required)."""
    return read_plan.parse_read_options(options, streaming)


@dataclass(frozen=True)
class OffsetRange(InputPartition):
    """One Spark partition: offsets [start, end) of one topic partition
    (a :class:`txmq.requester.read_plan.Split` Spark can hand to a task)."""

    topic: str
    partition: int
    start: int
    end: int
    strict: bool = True
    fallback: object = field(default=None, compare=False)     # a remote.Fallback, for a read given path
    as_of: tuple | None = None     # allowOutOfOrderDelivery: (maxReadPosition, log end) at planning


def split(ranges: list, size: int, min_partitions: int | None) -> list:
    """:func:`txmq.requester.read_plan.split`."""
    return read_plan.split(ranges, size, min_partitions)


def _range(s, fb=None) -> OffsetRange:
    return OffsetRange(s.topic, s.partition, s.start, s.end, s.strict, fb, s.as_of)


@dataclass(frozen=True)
class _Local:
    """Plans (in the driver) by opening the data directory read-only, and
    reads the same way in the task, or, when the task's executor cannot
    open the directory, through the owner's Flight service the planner
    found (:class:`pyspark_txmq.remote.Fallback`, carried by each range;
    ``fallback`` False: ``flight.fallback=false``)."""

    fallback: bool = True

    def resolve(self, opts):
        """The :class:`pyspark_txmq.remote.Fallback` the ranges planned now carry."""
        return fallback({FALLBACK: str(self.fallback)}, opts.path)

    def _open(self, opts):
        return txmq.readonly.open(opts.path)

    def plan(self, opts) -> list:
        with self._open(opts) as directory:
            return read_plan.plan(opts, directory)

    def initial(self, opts) -> dict:
        with self._open(opts) as directory:
            return read_plan.initial_offsets(opts, directory)

    def current(self, opts) -> dict:
        with self._open(opts) as directory:
            return read_plan.current_offsets(opts, directory)

    def read(self, opts, rng):
        target = task_target(opts.path, rng.fallback)
        if target is not None:
            return connect(target).read(Ticket.of(rng, opts))
        return read_plan.read_split(opts, rng)


@dataclass(frozen=True)
class _Flight:
    """Plans and reads through the owner's Flight service: ``target``
    (where, and the token) and the read's options as Spark gave them."""

    target: object
    options: dict

    def _conn(self):
        return connect(self.target)

    def resolve(self, opts):
        return None                 # every task goes through the service already

    def plan(self, opts) -> list:
        return self._conn().plan(self.options)

    def initial(self, opts) -> dict:
        return self._conn().offsets(self.options, "initial")

    def current(self, opts) -> dict:
        return self._conn().offsets(self.options, "current")

    def read(self, opts, rng):
        return self._conn().read(Ticket.of(rng, opts))


def read_options(options, streaming: bool) -> tuple:
    """``(ReadOptions, backend)`` of a read: the options checked here
    (errors name the option, before any task runs) and the way the read is
    planned and done — the data directory, or the Flight service of
    ``option("flight", ...)``."""
    target = flight_target(options)
    if target is None:
        opts = read_plan.parse_read_options(options, streaming, extra=(FALLBACK,))
        return opts, _Local(option_bool(options, FALLBACK, True))
    opts = read_plan.parse_read_options(options, streaming, path="", extra=FLIGHT_OPTIONS)
    return opts, _Flight(target, without_flight_options(options))


class TxmqReader(DataSourceReader):
    """Batch read: one Spark partition per topic partition, ranges above
    ``maxOffsetsPerPartition`` offsets split (module docstring)."""

    def __init__(self, opts: ReadOptions, backend=None):
        self.opts = opts
        self.backend = backend or _Local()

    def partitions(self):
        splits = self.backend.plan(self.opts)
        fb = self.backend.resolve(self.opts) if splits else None
        return [_range(s, fb) for s in splits]

    def read(self, partition):
        if not isinstance(partition, OffsetRange):      # Spark's placeholder when nothing was planned
            return iter(())
        return self.backend.read(self.opts, partition)


# -- streaming ---------------------------------------------------------------------------

class TxmqStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batch read. Lives in one long-running planner process for the
    query (initialOffset, latestOffset, partitions, commit); ``read`` runs
    in executors from a pickled copy, which holds only the options."""

    def __init__(self, opts: ReadOptions, backend=None):
        self.opts = opts
        self.backend = backend or _Local()
        self._target = None        # Trigger.AvailableNow: the end fixed when the query starts

    def _latest(self) -> dict:
        return {k: latest for k, (_, latest) in self.backend.current(self.opts).items()}

    def initialOffset(self) -> dict:
        return self.backend.initial(self.opts)

    def getDefaultReadLimit(self):
        n = self.opts.max_offsets_per_trigger
        return ReadMaxRows(n) if n else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._latest()

    def reportLatestOffset(self) -> dict:
        return self._latest()

    def latestOffset(self, start: dict, limit) -> dict:
        current = self.backend.current(self.opts)
        latest = {k: v for k, (_, v) in current.items()}
        if self._target is not None:
            latest = {k: min(v, self._target.get(k, v)) for k, v in latest.items()}
        begin = dict(start)
        for k, (log_start, _) in current.items():
            begin.setdefault(k, log_start)             # a partition the topic gained: from its start
        latest = {k: max(v, begin[k]) for k, v in latest.items()}
        end = admit(begin, latest, limit.max_rows) if isinstance(limit, ReadMaxRows) else latest
        for k, off in start.items():
            end.setdefault(k, off)                     # partitions no longer listed keep their offset
        return end

    def partitions(self, start: dict, end: dict):
        ranges = []
        for k in sorted(end, key=parse_offset_key):
            topic, p = parse_offset_key(k)
            lo = start.get(k)
            strict = lo is not None
            lo = 0 if lo is None else lo
            if end[k] > lo:
                ranges.append(OffsetRange(topic, p, lo, end[k], strict))
        ranges = split(ranges, self.opts.split_offsets, self.opts.min_partitions)
        if not ranges:
            return ranges
        fb = self.backend.resolve(self.opts)          # found again at each micro-batch: an owner may restart
        return [replace(r, fallback=fb) for r in ranges]

    def read(self, partition):
        return self.backend.read(self.opts, partition)

    def commit(self, end: dict) -> None:
        """Nothing to release: a read holds no state in the data directory."""
