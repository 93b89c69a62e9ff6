"""Planning and reading a range read of a data directory: what the Spark
source does with it, shared by every place a read is planned or served
(docs/SPARK.md).

The ``txmq`` Spark source plans in one process and reads in others. With
a local data directory both sides open it read-only (:mod:`txmq.readonly`);
through Arrow Flight the owner's Flight service (:mod:`txmq.flight`) does
both on the client's behalf. Either way the same functions below run:

- :func:`parse_read_options` checks the options of a read (the names and
  meanings of Spark's Kafka source) into a picklable :class:`ReadOptions`;
- :func:`plan` fixes a batch read's ranges: for every partition read,
  offsets [start, end) where the end is the last stable offset
  (maxReadPosition) under ``read_committed``, the log end under
  ``read_uncommitted`` or ``allowOutOfOrderDelivery``, or a smaller
  ``endingOffsets``, cut into :class:`Split` pieces of at most
  ``maxOffsetsPerPartition`` offsets;
- :func:`initial_offsets` and :func:`current_offsets` answer a streaming
  read's planner; :func:`admit` shares ``maxOffsetsPerTrigger``;
- :func:`read_split` checks a planned range against the partition as it is
  now (retention, a shorter log) and returns its ``pyarrow.RecordBatch`` objects
  with Spark's Kafka columns, timestamps in microseconds
  (:meth:`txmq.readonly.PartitionView.read_arrow`: key and value columns
  over the mapped segments, no copy).

Below a view's maxReadPosition every transaction has ended, and
maxReadPosition never moves back, so a range read later, while a writer
keeps appending, holds the same committed rows the planner counted: one
consistent committed prefix per partition.

``allowOutOfOrderDelivery=true`` (batch reads under ``read_committed``)
reads to the log end, past open transactions: every committed batch there,
none of a transaction open or aborted when the read was planned. Each
split carries ``as_of``, its partition's ``(maxReadPosition, log end)`` at
planning: a transaction with data at or past that maxReadPosition and no
marker below that log end was open then, and its batches are skipped
whatever it has become by the time the task reads
(:meth:`txmq.readonly.PartitionView.open_transactions`), so every task
(and every retry of one) reads the same rows. A streaming read refuses
the option: its offsets are one number per partition, so a micro-batch
that skipped an open transaction could never deliver its batches once it
commits, nor replay the same rows after a restart, without offsets that
also record which transactions were open.

Nothing here imports Spark: the Flight service runs in the owner, which
need not have pyspark installed.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace

from txmq.errors import DataLossError, InvalidArgumentError
from txmq.requester import read_only_directory
from txmq.storage.delivery import ISOLATIONS

__all__ = ["ReadOptions", "ByTime", "Split", "parse_read_options", "plan", "assigned", "split", "check_start",
           "read_split", "initial_offsets", "current_offsets", "admit", "offset_key", "parse_offset_key",
           "option_bool", "EARLIEST", "LATEST"]

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
    out_of_order: bool = False     # allowOutOfOrderDelivery: past open transactions, to the log end


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
                  "failOnDataLoss", "allowOutOfOrderDelivery")
BATCH_OPTIONS = COMMON_OPTIONS + ("endingOffsets", "endingTimestamp", "endingOffsetsByTimestamp")
STREAM_OPTIONS = COMMON_OPTIONS + ("maxOffsetsPerTrigger",)
STREAM_ONLY = ("maxOffsetsPerTrigger",)
BATCH_ONLY = ("endingOffsets", "endingTimestamp", "endingOffsetsByTimestamp")


def _check_names(options, streaming: bool, extra: tuple = ()) -> None:
    """Refuse every option the source does not know, naming it (a typo
    must not pass silently). ``extra``: names a caller handles itself."""
    known = (STREAM_OPTIONS if streaming else BATCH_OPTIONS) + tuple(extra)
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


def parse_read_options(options, streaming: bool, *, path: str | None = None, extra: tuple = ()) -> ReadOptions:
    """Check the options of a read (names as Spark's Kafka source has them,
    case-insensitive as Spark's option map is). Raises
    :class:`~txmq.errors.InvalidArgumentError` (a ValueError) naming the
    option and its value.

    ``path`` None: the data directory is the ``path`` option (required).
    Given (the Flight server's own directory, or "" for a Spark read
    through Flight): a ``path`` option is refused. ``extra``: option names
    the caller handles itself (the Spark source's ``flight`` options)."""
    options = _Options(options)
    _check_names(options, streaming, extra)
    if path is None:
        path = _get(options, "path")
        if not path:
            raise InvalidArgumentError("path", path, "the data directory: .option('path', dir) or .load(dir)")
    elif _get(options, "path") is not None:
        raise InvalidArgumentError("path", _get(options, "path"),
                                   "no path with Flight: the Flight server reads its own data directory")
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
    out_of_order = option_bool(options, "allowOutOfOrderDelivery", False)
    if out_of_order and streaming:
        raise InvalidArgumentError("allowOutOfOrderDelivery", _get(options, "allowOutOfOrderDelivery"),
                                   "false in a streaming read: its offsets (one per partition) cannot record the "
                                   "open transactions a micro-batch read past, so their batches could never be "
                                   "delivered when they commit nor replayed alike (use a batch read)")
    if out_of_order and isolation != "read_committed":
        raise InvalidArgumentError("allowOutOfOrderDelivery", _get(options, "allowOutOfOrderDelivery"),
                                   "false with isolation read_uncommitted (which reads open transactions anyway)")

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
        fail_on_data_loss=option_bool(options, "failOnDataLoss", True), out_of_order=out_of_order)


class _Options(dict):
    """An option map looked up case-insensitively, as Spark's is (a JSON
    object from a Flight client is a plain dict)."""

    def __init__(self, options):
        super().__init__(options.items() if hasattr(options, "items") else options)
        self._lower = {str(k).lower(): k for k in self}

    def get(self, name, default=None):
        key = self._lower.get(str(name).lower())
        return default if key is None else dict.get(self, key, default)


# -- planning --------------------------------------------------------------------------

@dataclass(frozen=True)
class Split:
    """Offsets [start, end) of one topic partition: one Spark partition,
    one Flight endpoint. ``strict``: a start below the log start at read
    time is data loss (False for a range that begins at "earliest")."""

    topic: str
    partition: int
    start: int
    end: int
    strict: bool = True
    as_of: tuple | None = None     # out of order: (maxReadPosition, log end) at planning (module docstring)


def _open(opts: ReadOptions):
    return read_only_directory.open(opts.path)


def assigned(opts: ReadOptions, directory) -> list:
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


def _top(opts: ReadOptions, view) -> int:
    """Where ``latest`` is in ``view`` for a read with ``opts``."""
    return view.limit(opts.isolation, None, opts.out_of_order)


def _resolve(spec, key, view, top: int, default: str, strategy: str | None = None) -> tuple:
    """(offset, strict) of ``spec`` for one partition, given its view and
    where ``latest`` is there (``top``). A
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
        return top, True
    if isinstance(spec, dict):
        off = spec.get(key, EARLIEST if default == "earliest" else LATEST)
    else:
        off = EARLIEST if spec == "earliest" else LATEST
    if off == EARLIEST:
        return view.log_start, False
    if off == LATEST:
        return top, True
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
    many (smaller when ``min_partitions`` asks for more pieces in all),
    each of the type of the range it comes from."""
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
            out.append(replace(r, start=lo, end=hi, strict=r.strict if i == 0 else True))
    return out


def plan(opts: ReadOptions, directory) -> list:
    """The :class:`Split` pieces of a batch read of ``directory`` (a
    :class:`txmq.readonly.ReadOnlyDirectory`), every end fixed now (module
    docstring). Raises ``TopicNotFoundError`` / ``PartitionNotFoundError``
    for what ``assign`` names and is not there, ``DataLossError`` for a
    start outside the log (``failOnDataLoss``)."""
    ranges = []
    for topic, p in assigned(opts, directory):
        view = directory.view(topic, p)
        key = (topic, p)
        top = _top(opts, view)
        start, strict = _resolve(opts.starting, key, view, top, "earliest", opts.by_time_strategy)
        end, _ = _resolve(opts.ending, key, view, top, "latest")
        start = check_start(opts, topic, p, start, view)
        end = min(end, top)               # what is there now: fixed for every task
        if end > start:
            as_of = (view.max_read_position, view.log_end) if opts.out_of_order else None
            ranges.append(Split(topic, p, start, end, strict, as_of))
    return split(ranges, opts.split_offsets, opts.min_partitions)


def read_split(opts: ReadOptions, rng, directory=None):
    """The record batches of one planned range (a :class:`Split` or any
    object with its fields), read through a fresh view of ``directory``
    (default: ``opts.path`` opened read-only here: a task runs in another
    process than the planner). The range is checked first, so a range
    retention deleted or a log shorter than planned raises
    ``DataLossError`` (with ``failOnDataLoss``) before any batch; the
    batches come lazily."""
    if directory is None:
        directory = _open(opts)
    view = directory.view(rng.topic, rng.partition)
    start = rng.start
    if view.log_start > start and rng.strict and opts.fail_on_data_loss:
        raise DataLossError(rng.topic, rng.partition, start, view.log_start, "retention deleted offsets")
    top = _top(opts, view)
    if top < rng.end and opts.fail_on_data_loss:
        # maxReadPosition and the log end never move back while the files
        # last; a shorter log means the directory was replaced or lost data.
        raise DataLossError(rng.topic, rng.partition, rng.end, top, "the log ends before the planned end")
    as_of = getattr(rng, "as_of", None)
    if opts.out_of_order and as_of is None:
        raise InvalidArgumentError("as_of", None, "the (maxReadPosition, log end) an out-of-order range was "
                                                  "planned at")
    return view.read_arrow(start, rng.end, opts.isolation, MAX_ROWS_PER_BATCH, opts.include_headers, "us",
                           fail_on_data_loss=opts.fail_on_data_loss,
                           allow_out_of_order_delivery=opts.out_of_order, as_of=as_of)


# -- streaming ---------------------------------------------------------------------------

def offset_key(topic: str, partition: int) -> str:
    """A streaming offset's key: ``topic/partition``."""
    return f"{topic}/{partition}"


def parse_offset_key(key: str) -> tuple:
    topic, _, p = key.rpartition("/")
    return topic, int(p)


def initial_offsets(opts: ReadOptions, directory) -> dict:
    """A stream's first offsets, ``{"topic/partition": offset}``, from
    ``startingOffsets`` (or by time), checked against each log."""
    out = {}
    for topic, p in assigned(opts, directory):
        view = directory.view(topic, p)
        off, _ = _resolve(opts.starting, (topic, p), view, _top(opts, view), "latest", opts.by_time_strategy)
        out[offset_key(topic, p)] = check_start(opts, topic, p, off, view)
    return out


def current_offsets(opts: ReadOptions, directory) -> dict:
    """``{"topic/partition": (log start, latest)}`` of every partition the
    read covers now: latest is maxReadPosition under ``read_committed``,
    the log end otherwise."""
    out = {}
    for topic, p in assigned(opts, directory):
        view = directory.view(topic, p)
        out[offset_key(topic, p)] = (view.log_start, view.limit(opts.isolation, None))
    return out


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
