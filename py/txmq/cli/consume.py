"""``txmq consume``: messages of a topic to stdout.

With ``--subscription NAME`` it reads as that durable subscription (created
if missing) through a broker, so it needs the directory free, and
acknowledges every message once it is written to stdout. It ends at
``--until``, after ``--max-messages``, or when no message came for
``--timeout`` seconds.

Without, the read is non-durable: a plain read of the mapped segments
through :func:`txmq.cli.opening.open_for_reading` (``txmq.readonly``). It
takes no lock and writes nothing, so it leaves every subscription as it
was and works beside the directory's owner. Each partition is read from
one view taken when the read begins, from ``--from`` up to ``--until``
(exclusive; default ``latest``: the last stable offset of that view for
read_committed, else its log end), partition after partition, and ends
there or after ``--max-messages``; it never waits.
"""

from __future__ import annotations

import base64
import itertools
import json
import sys

from txmq.cli import admin, exits, opening

RECEIVE_MAX = 1000


def consume(args) -> int:
    start = admin.parse_position(args.from_) if args.from_ is not None else None
    until = admin.parse_position(args.until)
    fmt = "json" if args.json else args.format
    if args.skip_data_loss and args.subscription is None:
        raise exits.CliError("--skip-data-loss moves a subscription's cursor: it needs --subscription NAME")
    if args.subscription is None:
        isolation = args.isolation or "read_committed"
        with opening.open_for_reading(args.dir, args.progress) as view:
            selected = _partitions(view, args, start, until)
            n = _read_view(view, args, selected, start, until, isolation, fmt)
        how = "a non-durable read"
    else:
        with opening.open_for_writing(args.dir, args.progress) as broker:
            selected = _partitions(broker, args, start, until)
            created = args.subscription not in broker.stats()["topics"][args.topic]["subscriptions"]
            consumer, isolation = _durable(broker, args, start)
            try:
                if args.skip_data_loss:
                    skipped = consumer.skip_data_loss(args.partition)
                    print(f"acknowledged {skipped:,} offset(s) lost to damaged bytes", file=sys.stderr)
                n = _read_subscription(broker, consumer, args, selected, until, isolation, fmt)
            except BaseException:
                if created:         # a command that fails creates nothing
                    consumer.unsubscribe()
                raise
            finally:
                consumer.close()
        how = f"subscription {args.subscription!r}"
    print(f"consumed {n:,} message(s) from {args.topic!r} ({how}, {isolation})", file=sys.stderr)
    return exits.OK


def _partitions(source, args, start, until) -> list:
    """The partitions to read, once --from and --until are checked
    against them (``source``: a view or a broker)."""
    admin.require_topic(source, args.topic)
    selected = admin.partitions_of(source, args.topic, args.partition)
    info = source.describe_topic(args.topic)
    for what, pos in (("--from", start), ("--until", until)):
        if isinstance(pos, int):
            if args.partition is None and info["partitions"] > 1:
                raise exits.CliError(f"an offset is a position in one partition: {what} {pos} needs "
                                     f"--partition P (topic {args.topic!r} has {info['partitions']} "
                                     f"partitions)")
            p = selected[0]
            admin.check_offset(what, pos, args.topic, p, info["start_offsets"][p], info["end_offsets"][p])
    if isinstance(start, int) and isinstance(until, int) and until < start:
        raise exits.CliError(f"bad offset: --until {until} is before --from {start}")
    return selected


def _read_view(view, args, selected, start, until, isolation, fmt) -> int:
    printed = 0
    for p in selected:
        part = view.partition(args.topic, p)
        messages = part.read(_offset(start, part, isolation), _offset(until, part, isolation), isolation,
                             args.fail_on_data_loss)
        if args.max_messages is not None:
            messages = itertools.islice(messages, args.max_messages - printed)
        while chunk := list(itertools.islice(messages, RECEIVE_MAX)):
            _write(chunk, fmt)
            printed += len(chunk)
    return printed


def _offset(pos, part, isolation: str) -> int:
    """--from / --until in one partition's view (None: --from's default)."""
    if pos in (None, "earliest"):
        return part.log_start
    if pos == "latest":
        return part.limit(isolation, None)
    return pos


def _write(messages: list, fmt: str) -> None:
    out = sys.stdout
    if fmt == "raw":
        out.flush()
        for m in messages:
            out.buffer.write(m.value)
            out.buffer.write(b"\n")
        out.buffer.flush()
    else:
        out.write("".join(json.dumps(message_json(m)) + "\n" for m in messages))
        out.flush()


def _durable(broker, args, start):
    subs = broker.stats()["topics"][args.topic]["subscriptions"]
    existing = subs.get(args.subscription)
    if existing is None:
        isolation = args.isolation or "read_committed"
        initial = start if start in admin.POSITIONS else "earliest"
        consumer = broker.subscribe(args.topic, args.subscription, args.type, isolation=isolation,
                                    initial_position=initial, fail_on_data_loss=args.fail_on_data_loss)
    else:
        # Keep the subscription's type and order; its isolation is fixed (a
        # different --isolation is refused by the broker, with the level it has).
        isolation = args.isolation or existing["isolation"]
        consumer = broker.subscribe(args.topic, args.subscription, existing["type"], isolation=isolation,
                                    fail_on_data_loss=args.fail_on_data_loss,
                                    allow_out_of_order_delivery=existing["allow_out_of_order_delivery"])
    if start is not None:
        try:
            consumer.seek(start, partition=args.partition)
        except BaseException:
            if existing is None:        # a command that fails creates nothing
                consumer.unsubscribe()
            consumer.close()
            raise
    return consumer, isolation


def _read_subscription(broker, consumer, args, selected, until, isolation, fmt) -> int:
    topic = args.topic
    sub = consumer.subscription
    stats = broker.stats()["topics"][topic]["subscriptions"][sub]
    # Out of order, a subscription reads past open transactions to the log
    # end, and the last offset below the limit may come before the others.
    out_of_order = stats["allow_out_of_order_delivery"]
    end_of = broker.last_stable_offset if isolation == "read_committed" and not out_of_order else broker.high_watermark
    limit = {p: until if isinstance(until, int) else end_of(topic, p) for p in selected}
    if until == "earliest":
        limit = {p: broker.describe_topic(topic)["start_offsets"][p] for p in selected}
    marks = {p["partition"]: p["mark_delete"] for p in stats["partitions"]}
    lag = broker.consumer_lag(topic, sub)
    pending = {p for p in selected if marks[p] < limit[p] and lag.get(p, 0) > 0}
    printed = 0
    while pending and (args.max_messages is None or printed < args.max_messages):
        want = RECEIVE_MAX if args.max_messages is None else min(RECEIVE_MAX, args.max_messages - printed)
        ms = consumer.receive_many(want, timeout=args.timeout)
        if not ms:
            break                           # nothing came for --timeout seconds
        keep = []
        for m in ms:
            mid = m.message_id
            if mid.partition in pending and mid.offset < limit[mid.partition]:
                keep.append(m)
            if not out_of_order and mid.partition in limit and mid.offset >= limit[mid.partition] - 1:
                pending.discard(mid.partition)
        _write(keep, fmt)
        # Acknowledged only once written: a failed write leaves them unacknowledged.
        consumer.ack(keep)
        printed += len(keep)
        if len(ms) < want:
            # Drained what is deliverable now: a partition with nothing left
            # (only markers or aborted data before its limit) is done.
            lag = broker.consumer_lag(topic, sub)
            pending = {p for p in pending if lag.get(p, 0) > 0}
    return printed


def message_json(m) -> dict:
    """A message as ``txmq produce --json`` reads it back (plus where it was)."""
    mid = m.message_id
    d = {"topic": mid.topic, "partition": mid.partition, "offset": mid.offset}
    d.update(_text_or_base64("key", m.key))
    d.update(_text_or_base64("value", m.value))
    if m.headers:
        # Header values are text to JSON: bytes that are not UTF-8 travel
        # as lone surrogates (surrogateescape), which produce turns back.
        d["headers"] = [[k, None if v is None else bytes(v).decode("utf-8", "surrogateescape")]
                        for k, v in m.headers]
    d["event_time"] = m.event_time
    d["publish_time"] = m.publish_time
    d["txn_id"] = None if m.txn_id is None else str(m.txn_id)
    d["redelivery_count"] = m.redelivery_count
    return d


def _text_or_base64(name: str, value) -> dict:
    if value is None:
        return {name: None}
    value = bytes(value)
    try:
        return {name: value.decode("utf-8")}
    except UnicodeDecodeError:
        return {name + "_base64": base64.b64encode(value).decode("ascii")}

