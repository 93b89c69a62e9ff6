"""Reading txmq topics into Spark: the batch and streaming readers of the
``txmq`` data source (docs/SPARK.md).

Planning and reading run in different processes. ``partitions()`` runs in
Spark's planner process; it opens the data directory read-only
(:mod:`txmq.readonly`), takes one view per topic partition and fixes every
range's end there: the last stable offset (maxReadPosition) under
``read_committed``, the log end under ``read_uncommitted``, or a smaller
``endingOffsets``. ``read()`` runs in an executor's Python worker, opens the
directory again and reads exactly that range. Below a view's
maxReadPosition every transaction has ended, and maxReadPosition never moves
back, so a task reading later, while a writer keeps appending, sees the same
committed rows the planner counted: one consistent committed prefix per
partition. Nothing the reader or its partitions hold is a file or a mapping,
so both pickle.

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

import json
import math
import re
from dataclasses import dataclass

from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (ReadAllAvailable, ReadMaxRows, SupportsTriggerAvailableNow)

import txmq.readonly
from txmq.errors import DataLossError, InvalidArgumentError
from txmq.storage.delivery import ISOLATIONS

__all__ = ["ReadOptions", "parse_read_options", "TxmqReader", "TxmqStreamReader", "OffsetRange",
           "DataLossError"]

EARLIEST = -2                  # Kafka's sentinels in offset JSON
LATEST = -1
SPLIT_OFFSETS_DEFAULT = 1_000_000       # ~ Spark's 128 MiB file split at 100-byte messages
MAX_ROWS_PER_BATCH = 65536              # rows per RecordBatch handed to Spark


# -- options -----------------------------------------------------------------------

@dataclass(frozen=True)
class ReadOptions:
    """The reading options of the ``txmq`` source, checked (picklable)."""

    path: str
    subscribe: tuple = ()          # topic names
    pattern: str | None = None     # subscribePattern
    assign: tuple = ()             # ((topic, partition), ...)
    starting: object = "earliest"  # "earliest" | "latest" | {(topic, partition): offset or sentinel} | ByTime
    ending: object = "latest"
    by_time_strategy: str = "error"     # startingOffsetsByTimestampStrategy
    isolation: str = "read_committed"
    include_headers: bool = False
    max_offsets_per_trigger: int | None = None
    split_offsets: int = SPLIT_OFFSETS_DEFAULT
    min_partitions: int | None = None
    fail_on_data_loss: bool = True


@dataclass(frozen=True)
class ByTime:
    """A start or end given by time (ms since the epoch): ``at`` for every
    partition (``startingTimestamp``), else ``per`` partition
    (``startingOffsetsByTimestamp``), which must name every one read.
    ``option`` is the option it came from, for errors."""

    option: str
    at: int | None = None
    per: tuple = ()                # ((topic, partition, timestamp), ...)

    def timestamp(self, key: tuple) -> int:
        if self.at is not None:
            return self.at
        for topic, p, ts in self.per:
            if (topic, p) == key:
                return ts
        raise InvalidArgumentError(self.option, {f"{t}/{p}": ts for t, p, ts in self.per},
                                   f"a timestamp for every partition read (none for {key[0]}/{key[1]}), "
                                   "as Spark's Kafka source")


BY_TIME_STRATEGIES = ("error", "latest")

# Every option the source knows (Spark's option map is case-insensitive).
# Spark's Kafka options txmq has no use for (kafka.bootstrap.servers,
# groupIdPrefix, ...) are refused like typos: docs/SPARK.md lists them.
COMMON_OPTIONS = ("path", "subscribe", "subscribePattern", "assign", "startingOffsets", "startingTimestamp",
                  "startingOffsetsByTimestamp", "startingOffsetsByTimestampStrategy", "isolation",
                  "kafka.isolation.level", "includeHeaders", "maxOffsetsPerPartition", "minPartitions",
                  "failOnDataLoss")
BATCH_OPTIONS = COMMON_OPTIONS + ("endingOffsets", "endingTimestamp", "endingOffsetsByTimestamp")
STREAM_OPTIONS = COMMON_OPTIONS + ("maxOffsetsPerTrigger",)
STREAM_ONLY = ("maxOffsetsPerTrigger",)
BATCH_ONLY = ("endingOffsets", "endingTimestamp", "endingOffsetsByTimestamp")


def _check_names(options, streaming: bool) -> None:
    """Refuse every option the source does not know, naming it (a typo
    must not pass silently)."""
    known = STREAM_OPTIONS if streaming else BATCH_OPTIONS
    allowed = {k.lower() for k in known}
    elsewhere = {k.lower(): k for k in (BATCH_ONLY if streaming else STREAM_ONLY)}
    for name in options:
        if name.lower() in allowed:
            continue
        if name.lower() in elsewhere:
            raise InvalidArgumentError(elsewhere[name.lower()], _get(options, name),
                                       "nothing: a streaming read has no end (use a batch read)" if streaming
                                       else "nothing in a batch read (a streaming option)")
        raise InvalidArgumentError("option", name, "one of " + ", ".join(known)
                                   + " (docs/SPARK.md lists Spark's Kafka source options beside them)")


def _timestamp(name: str, value, text: str) -> int:
    if type(value) is not int or value < 0:
        raise InvalidArgumentError(name, text, "a time in milliseconds since the epoch (an integer >= 0)")
    return value


def _by_time(options, single: str, per: str):
    """``single`` (one timestamp for all partitions) or ``per`` (Kafka's
    JSON ``{"topic": {"partition": timestamp}}``) as a :class:`ByTime`;
    ``single`` takes precedence, as in Spark's Kafka source. None: neither."""
    text = _get(options, single)
    if text is not None:
        try:
            value = int(text.strip())
        except ValueError:
            value = None
        return ByTime(single, at=_timestamp(single, value, text))
    text = _get(options, per)
    if text is None:
        return None
    expected = 'JSON {"topic": {"partition": timestamp in ms}}'
    try:
        spec = json.loads(text)
    except ValueError:
        raise InvalidArgumentError(per, text, expected) from None
    if not isinstance(spec, dict) or not spec or not all(isinstance(v, dict) and v for v in spec.values()):
        raise InvalidArgumentError(per, text, expected)
    out = []
    for topic, parts in spec.items():
        for p, ts in parts.items():
            if not (isinstance(p, str) and p.isdigit()):
                raise InvalidArgumentError(per, text, expected)
            out.append((topic, int(p), _timestamp(per, ts, text)))
    return ByTime(per, per=tuple(out))


def _get(options, name):
    value = options.get(name)
    return None if value is None else str(value)


def option_bool(options, name, default: bool) -> bool:
    value = _get(options, name)
    if value is None:
        return default
    if value.strip().lower() not in ("true", "false"):
        raise InvalidArgumentError(name, value, "true | false")
    return value.strip().lower() == "true"


def _positive_int(options, name) -> int | None:
    value = _get(options, name)
    if value is None:
        return None
    try:
        n = int(value.strip())
    except ValueError:
        n = 0
    if n < 1:
        raise InvalidArgumentError(name, value, "an integer >= 1")
    return n


def _offsets(options, name: str, allowed: tuple, sentinels: tuple):
    """``earliest`` / ``latest`` (those in ``allowed``) or Kafka's JSON
    ``{"topic": {"partition": offset}}`` with the ``sentinels`` it may use
    (-2 earliest, -1 latest); JSON becomes ``{(topic, partition): offset}``."""
    value = _get(options, name)
    if value is None:
        return None
    text = value.strip()
    if text.lower() in ("earliest", "latest"):
        if text.lower() not in allowed:
            raise InvalidArgumentError(name, value, " | ".join(allowed + ("JSON",)) + " here")
        return text.lower()
    expected = ('JSON {"topic": {"partition": offset}} with offsets >= 0'
                + "".join(f" or {s} ({'earliest' if s == EARLIEST else 'latest'})" for s in sentinels))
    try:
        spec = json.loads(text)
    except ValueError:
        raise InvalidArgumentError(name, value, " | ".join(allowed) + " | " + expected) from None
    if not isinstance(spec, dict):
        raise InvalidArgumentError(name, value, expected)
    out = {}
    for topic, parts in spec.items():
        if not isinstance(parts, dict):
            raise InvalidArgumentError(name, value, expected)
        for p, off in parts.items():
            if not (isinstance(p, str) and p.isdigit()) or type(off) is not int or (off < 0 and off not in sentinels):
                raise InvalidArgumentError(name, value, expected)
            out[(topic, int(p))] = off
    return out


def parse_read_options(options, streaming: bool) -> ReadOptions:
    """Check the options of a read (names as Spark's Kafka source has them;
    Spark's option map is case-insensitive). Raises
    :class:`~txmq.errors.InvalidArgumentError` (a ValueError) naming the
    option and its value."""
    _check_names(options, streaming)
    path = _get(options, "path")
    if not path:
        raise InvalidArgumentError("path", path, "the data directory: .option('path', dir) or .load(dir)")
    subscribe = _get(options, "subscribe")
    pattern = _get(options, "subscribePattern")
    assign = _get(options, "assign")
    given = [n for n, v in (("subscribe", subscribe), ("subscribePattern", pattern), ("assign", assign))
             if v is not None]
    if len(given) != 1:
        raise InvalidArgumentError("subscribe", given or None,
                                   "exactly one of subscribe, subscribePattern, assign")
    topics = ()
    if subscribe is not None:
        topics = tuple(t.strip() for t in subscribe.split(","))
        if not subscribe.strip() or not all(topics):
            raise InvalidArgumentError("subscribe", subscribe, "comma-separated topic names")
    if pattern is not None:
        try:
            re.compile(pattern)
        except re.error as e:
            raise InvalidArgumentError("subscribePattern", pattern, f"a regular expression ({e})") from None
    assigned = ()
    if assign is not None:
        bad = 'JSON {"topic": [partition, ...]}'
        try:
            spec = json.loads(assign)
        except ValueError:
            raise InvalidArgumentError("assign", assign, bad) from None
        if not isinstance(spec, dict) or not spec or not all(
                isinstance(ps, list) and all(type(p) is int and p >= 0 for p in ps) for ps in spec.values()):
            raise InvalidArgumentError("assign", assign, bad)
        assigned = tuple((t, p) for t, ps in spec.items() for p in ps)

    isolation = _get(options, "isolation")
    kafka_level = _get(options, "kafka.isolation.level")
    if isolation is not None and kafka_level is not None and isolation != kafka_level:
        raise InvalidArgumentError("isolation", isolation, f"the same as kafka.isolation.level ({kafka_level})")
    isolation = isolation or kafka_level or "read_committed"
    if isolation not in ISOLATIONS:
        raise InvalidArgumentError("isolation", isolation, " | ".join(ISOLATIONS))

    if streaming:
        # Spark's Kafka source: a stream starts at latest by default and has no end.
        starting = _offsets(options, "startingOffsets", ("earliest", "latest"), (EARLIEST, LATEST)) or "latest"
        ending = "latest"
    else:
        # A batch read cannot start at latest or end at earliest (as in Spark's Kafka source).
        starting = _offsets(options, "startingOffsets", ("earliest",), (EARLIEST,)) or "earliest"
        ending = _offsets(options, "endingOffsets", ("latest",), (LATEST,)) or "latest"
        # By time takes precedence over offsets, as in Spark's Kafka source.
        ending = _by_time(options, "endingTimestamp", "endingOffsetsByTimestamp") or ending
    starting = _by_time(options, "startingTimestamp", "startingOffsetsByTimestamp") or starting
    strategy = (_get(options, "startingOffsetsByTimestampStrategy") or "error").strip().lower()
    if strategy not in BY_TIME_STRATEGIES:
        raise InvalidArgumentError("startingOffsetsByTimestampStrategy",
                                   _get(options, "startingOffsetsByTimestampStrategy"), " | ".join(BY_TIME_STRATEGIES))
    for spec in (starting, ending):
        if isinstance(spec, ByTime):
            for topic, p, _ in spec.per:
                if (topics and topic not in topics) or (assigned and (topic, p) not in assigned):
                    raise InvalidArgumentError(spec.option, _get(options, spec.option),
                                               f"only subscribed partitions (not {topic}/{p})")
    for name, spec in (("startingOffsets", starting), ("endingOffsets", ending)):
        if isinstance(spec, dict):
            for topic, p in spec:
                if (topics and topic not in topics) or (assigned and (topic, p) not in assigned):
                    raise InvalidArgumentError(name, _get(options, name),
                                               f"only subscribed partitions (not {topic}/{p})")
    if isinstance(starting, dict) and isinstance(ending, dict):
        for key, end in ending.items():
            start = starting.get(key, EARLIEST)
            if end >= 0 and start >= 0 and end < start:
                raise InvalidArgumentError("endingOffsets", _get(options, "endingOffsets"),
                                           f"offsets >= startingOffsets ({key[0]}/{key[1]} starts at {start})")

    return ReadOptions(
        path=path, subscribe=topics, pattern=pattern, assign=assigned, starting=starting, ending=ending,
        by_time_strategy=strategy, isolation=isolation, include_headers=option_bool(options, "includeHeaders", False),
        max_offsets_per_trigger=_positive_int(options, "maxOffsetsPerTrigger"),
        split_offsets=_positive_int(options, "maxOffsetsPerPartition") or SPLIT_OFFSETS_DEFAULT,
        min_partitions=_positive_int(options, "minPartitions"),
        fail_on_data_loss=option_bool(options, "failOnDataLoss", True))


# -- planning --------------------------------------------------------------------------

@dataclass(frozen=True)
class OffsetRange(InputPartition):
    """One Spark partition: offsets [start, end) of one topic partition.
    ``strict``: a start below the log start at read time is data loss
    (False for a range that begins at "earliest")."""

    topic: str
    partition: int
    start: int
    end: int
    strict: bool = True


def _open(opts: ReadOptions):
    return txmq.readonly.open(opts.path)


def _assigned(opts: ReadOptions, directory) -> list:
    """The (topic, partition) pairs a read covers, in order."""
    if opts.assign:
        for topic, p in opts.assign:
            directory.view(topic, p)            # raises TopicNotFoundError / PartitionNotFoundError
        return sorted(set(opts.assign))
    if opts.pattern is not None:
        topics = [t for t in directory.topics() if re.fullmatch(opts.pattern, t)]
    else:
        topics = list(dict.fromkeys(opts.subscribe))
    return [(t, p) for t in topics for p in directory.partitions(t)]


def _resolve(spec, key, view, isolation: str, default: str, strategy: str | None = None) -> tuple:
    """(offset, strict) of ``spec`` for one partition, given its view. A
    time resolves through the partition's time index to the first offset
    published at or after it; past the last message, a start (``strategy``
    given: Kafka's startingOffsetsByTimestampStrategy) fails with
    ``error`` or starts at the end with ``latest``, and an end (no
    ``strategy``) is the latest."""
    if isinstance(spec, ByTime):
        ts = spec.timestamp(key)
        off = view.offset_for_time(ts)
        if off is not None:
            return off, True
        if strategy == "error":
            raise InvalidArgumentError(spec.option, ts, f"a time no later than the last message of {key[0]}/{key[1]} "
                                       "(or startingOffsetsByTimestampStrategy=latest)")
        return view.limit(isolation, None), True
    if isinstance(spec, dict):
        off = spec.get(key, EARLIEST if default == "earliest" else LATEST)
    else:
        off = EARLIEST if spec == "earliest" else LATEST
    if off == EARLIEST:
        return view.log_start, False
    if off == LATEST:
        return view.limit(isolation, None), True
    return off, True


def check_start(opts: ReadOptions, topic: str, p: int, start: int, view) -> int:
    """A planned start checked against the partition as it is: below its
    log start (retention deleted it) or past its log end (no such offset)
    fails the read with ``failOnDataLoss`` (as Spark's Kafka source does),
    else the start moves to what is there."""
    if start < view.log_start:
        if opts.fail_on_data_loss:
            raise DataLossError(topic, p, start, view.log_start, "startingOffsets below the log start")
        return view.log_start
    if start > view.log_end:
        if opts.fail_on_data_loss:
            raise DataLossError(topic, p, start, view.log_end, "startingOffsets past the log end")
        return view.log_end
    return start


def split(ranges: list, size: int, min_partitions: int | None) -> list:
    """Cut ranges longer than ``size`` offsets into pieces of at most that
    many (smaller when ``min_partitions`` asks for more pieces in all)."""
    total = sum(r.end - r.start for r in ranges)
    if min_partitions and total:
        size = min(size, max(1, math.ceil(total / min_partitions)))
    out = []
    for r in ranges:
        n = max(1, math.ceil((r.end - r.start) / size))
        step = math.ceil((r.end - r.start) / n)
        for i in range(n):
            lo = r.start + i * step
            hi = min(r.end, lo + step)
            out.append(OffsetRange(r.topic, r.partition, lo, hi, r.strict if i == 0 else True))
    return out


def read_range(opts: ReadOptions, rng: OffsetRange):
    """The record batches of one planned range, read through a fresh
    read-only view (a task runs in another process than the planner)."""
    directory = _open(opts)
    view = directory.view(rng.topic, rng.partition)
    start = rng.start
    if view.log_start > start and rng.strict and opts.fail_on_data_loss:
        raise DataLossError(rng.topic, rng.partition, start, view.log_start, "retention deleted offsets")
    top = view.limit(opts.isolation, None)
    if top < rng.end and opts.fail_on_data_loss:
        # maxReadPosition and the log end never move back while the files
        # last; a shorter log means the directory was replaced or lost data.
        raise DataLossError(rng.topic, rng.partition, rng.end, top, "the log ends before the planned end")
    yield from view.read_arrow(start, rng.end, opts.isolation, MAX_ROWS_PER_BATCH, opts.include_headers, "us",
                               fail_on_data_loss=opts.fail_on_data_loss)


class TxmqReader(DataSourceReader):
    """Batch read: one Spark partition per topic partition, ranges above
    ``maxOffsetsPerPartition`` offsets split (module docstring)."""

    def __init__(self, opts: ReadOptions):
        self.opts = opts

    def partitions(self):
        opts = self.opts
        ranges = []
        with _open(opts) as directory:
            for topic, p in _assigned(opts, directory):
                view = directory.view(topic, p)
                key = (topic, p)
                top = view.limit(opts.isolation, None)
                start, strict = _resolve(opts.starting, key, view, opts.isolation, "earliest", opts.by_time_strategy)
                end, _ = _resolve(opts.ending, key, view, opts.isolation, "latest")
                start = check_start(opts, topic, p, start, view)
                end = min(end, top)               # what is there now: fixed for every task
                if end > start:
                    ranges.append(OffsetRange(topic, p, start, end, strict))
        return split(ranges, opts.split_offsets, opts.min_partitions)

    def read(self, partition):
        if not isinstance(partition, OffsetRange):      # Spark's placeholder when nothing was planned
            return iter(())
        return read_range(self.opts, partition)


# -- streaming ---------------------------------------------------------------------------

def offset_key(topic: str, partition: int) -> str:
    return f"{topic}/{partition}"


def parse_offset_key(key: str) -> tuple:
    topic, _, p = key.rpartition("/")
    return topic, int(p)


def admit(start: dict, latest: dict, max_rows: int) -> dict:
    """End offsets that take at most ``max_rows`` offsets past ``start``,
    shared among partitions in proportion to what each has available
    (Spark's Kafka source's ``maxOffsetsPerTrigger``). Offsets count
    markers and aborted messages too, so rows <= offsets <= ``max_rows``."""
    avail = {k: latest[k] - start.get(k, latest[k]) for k in latest}
    avail = {k: v for k, v in avail.items() if v > 0}
    total = sum(avail.values())
    if total <= max_rows:
        return dict(latest)
    share = {k: max_rows * v // total for k, v in avail.items()}
    left = max_rows - sum(share.values())
    # The rest goes one by one to the largest fractional parts (ties by key).
    for k in sorted(avail, key=lambda k: (-(max_rows * avail[k] % total), k))[:left]:
        share[k] += 1
    end = dict(latest)
    for k, v in avail.items():
        end[k] = start[k] + share[k]
    return end


class TxmqStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batch read. Lives in one long-running planner process for the
    query (initialOffset, latestOffset, partitions, commit); ``read`` runs
    in executors from a pickled copy, which holds only the options."""

    def __init__(self, opts: ReadOptions):
        self.opts = opts
        self._target = None        # Trigger.AvailableNow: the end fixed when the query starts

    def _views(self) -> dict:
        with _open(self.opts) as directory:
            return {offset_key(t, p): directory.view(t, p) for t, p in _assigned(self.opts, directory)}

    def _latest(self) -> dict:
        return {k: v.limit(self.opts.isolation, None) for k, v in self._views().items()}

    def initialOffset(self) -> dict:
        out = {}
        for k, view in self._views().items():
            key = parse_offset_key(k)
            off, _ = _resolve(self.opts.starting, key, view, self.opts.isolation, "latest", self.opts.by_time_strategy)
            out[k] = check_start(self.opts, *key, off, view)
        return out

    def getDefaultReadLimit(self):
        n = self.opts.max_offsets_per_trigger
        return ReadMaxRows(n) if n else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._latest()

    def reportLatestOffset(self) -> dict:
        return self._latest()

    def latestOffset(self, start: dict, limit) -> dict:
        views = self._views()
        latest = {k: v.limit(self.opts.isolation, None) for k, v in views.items()}
        if self._target is not None:
            latest = {k: min(v, self._target.get(k, v)) for k, v in latest.items()}
        begin = dict(start)
        for k, view in views.items():
            begin.setdefault(k, view.log_start)        # a partition the topic gained: from its start
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
        return split(ranges, self.opts.split_offsets, self.opts.min_partitions)

    def read(self, partition):
        return read_range(self.opts, partition)

    def commit(self, end: dict) -> None:
        """Nothing to release: a read holds no state in the data directory."""
