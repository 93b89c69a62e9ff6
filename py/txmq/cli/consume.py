"""``txmq consume``: messages of a topic to stdout.

With ``--subscription NAME`` it reads as that durable subscription (created
if missing) and acknowledges every message once it is written to stdout.

Without, the read is non-durable: it must leave the subscriptions as they
were. The broker has no call that reads a partition without a cursor, so
the read uses a temporary subscription, ``txmq-cli-read-<pid>-<ns>``, which
is deleted when the read ends (also on Ctrl-C or an error). A kill -9 could
leave one behind: since only the process holding the directory lock can
have created one, any such subscription found by a later non-durable read
of the topic is a leftover and is deleted first. (With ``txmq.readonly``
this becomes a plain read of the mapped segments, through
:func:`txmq.cli.opening.open_for_reading`, which it already uses.)

A read ends at ``--until`` (exclusive; default ``latest``: the end when the
read began, the last stable offset for read_committed, else the log end),
after ``--max-messages``, or when no message came for ``--timeout``
seconds.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import time

from txmq.cli import admin, exits, opening

TEMP_PREFIX = "txmq-cli-read-"
RECEIVE_MAX = 1000


def consume(args) -> int:
    start = admin.parse_position(args.from_) if args.from_ is not None else None
    until = admin.parse_position(args.until)
    fmt = "json" if args.json else args.format
    durable = args.subscription is not None
    opener = opening.open_for_writing if durable else opening.open_for_reading
    with opener(args.dir, args.progress) as broker:
        admin.require_topic(broker, args.topic)
        selected = admin.partitions_of(broker, args.topic, args.partition)
        info = broker.describe_topic(args.topic)
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
        if durable:
            consumer, isolation = _durable(broker, args, start)
        else:
            consumer, isolation = _temporary(broker, args, start or "earliest", selected)
        try:
            n = _read(broker, consumer, args, selected, until, isolation, fmt, durable)
        finally:
            if durable:
                consumer.close()
            else:
                consumer.unsubscribe()
    how = f"subscription {args.subscription!r}" if durable else "a non-durable read"
    print(f"consumed {n:,} message(s) from {args.topic!r} ({how}, {isolation})", file=sys.stderr)
    return exits.OK


def _durable(broker, args, start):
    subs = broker.stats()["topics"][args.topic]["subscriptions"]
    existing = subs.get(args.subscription)
    if existing is None:
        isolation = args.isolation or "read_committed"
        initial = start if start in admin.POSITIONS else "earliest"
        consumer = broker.subscribe(args.topic, args.subscription, args.type, isolation=isolation,
                                    initial_position=initial)
    else:
        # Keep the subscription's type; its isolation is fixed (a different
        # --isolation is refused by the broker, with the level it has).
        isolation = args.isolation or existing["isolation"]
        consumer = broker.subscribe(args.topic, args.subscription, existing["type"], isolation=isolation)
    if start is not None:
        try:
            consumer.seek(start, partition=args.partition)
        except BaseException:
            consumer.close()
            raise
    return consumer, isolation


def _temporary(broker, args, start, selected):
    isolation = args.isolation or "read_committed"
    stats = broker.stats()["topics"][args.topic]["subscriptions"]
    for name, s in stats.items():
        if name.startswith(TEMP_PREFIX):        # left by a non-durable read that was killed
            broker.subscribe(args.topic, name, s["type"], isolation=s["isolation"]).unsubscribe()
    name = f"{TEMP_PREFIX}{os.getpid()}-{time.time_ns()}"
    consumer = broker.subscribe(args.topic, name, "exclusive", isolation=isolation,
                                initial_position="earliest")
    try:
        n = broker.describe_topic(args.topic)["partitions"]
        for p in range(n):
            consumer.seek(start if p in selected else "latest", partition=p)
    except BaseException:
        consumer.unsubscribe()
        raise
    return consumer, isolation


def _read(broker, consumer, args, selected, until, isolation, fmt, durable) -> int:
    topic = args.topic
    end_of = broker.last_stable_offset if isolation == "read_committed" else broker.high_watermark
    limit = {p: until if isinstance(until, int) else end_of(topic, p) for p in selected}
    if until == "earliest":
        limit = {p: broker.describe_topic(topic)["start_offsets"][p] for p in selected}
    sub = consumer.subscription
    marks = {p["partition"]: p["mark_delete"]
             for p in broker.stats()["topics"][topic]["subscriptions"][sub]["partitions"]}
    lag = broker.consumer_lag(topic, sub)
    pending = {p for p in selected if marks[p] < limit[p] and lag.get(p, 0) > 0}
    out = sys.stdout
    out.flush()
    write = out.buffer.write if fmt == "raw" else None
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
            if mid.partition in limit and mid.offset >= limit[mid.partition] - 1:
                pending.discard(mid.partition)
        if fmt == "raw":
            for m in keep:
                write(m.value)
                write(b"\n")
        else:
            for m in keep:
                out.write(json.dumps(message_json(m)) + "\n")
        out.flush()
        # Acknowledged only once written: a failed write leaves them unacknowledged.
        consumer.ack(keep if durable else ms)
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

