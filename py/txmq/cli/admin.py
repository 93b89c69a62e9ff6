"""Inspection and administration commands: ``topics``, ``subscriptions``,
``transactions`` and ``stats``. Each prints a table, or JSON with ``--json``."""

from __future__ import annotations

from txmq.cli import exits, opening
from txmq.cli.output import emit_json, size, table
from txmq.errors import InvalidArgumentError, TransactionNotFoundError
from txmq.txn import TxnID

POSITIONS = ("earliest", "latest")


# -- lookups with errors that say what exists ------------------------------------------

def require_topic(broker, name: str) -> None:
    topics = broker.topics()
    if name in topics:
        return
    if topics:
        raise exits.CliError(f"topic {name!r} does not exist; existing topics: {', '.join(topics)}")
    raise exits.CliError(f"topic {name!r} does not exist: the data directory has no topics "
                         f"(create one with `txmq topics create DIR {name}`)")


def require_subscription(broker, topic: str, name: str) -> dict:
    """The stats of subscription ``name`` of ``topic`` (its type, isolation, cursors)."""
    require_topic(broker, topic)
    subs = broker.stats()["topics"][topic]["subscriptions"]
    if name in subs:
        return subs[name]
    existing = ", ".join(sorted(subs)) or "none"
    raise exits.CliError(f"topic {topic!r} has no subscription {name!r}; its subscriptions: {existing}")


def parse_txn_id(text: str) -> TxnID:
    try:
        return TxnID.parse(text)
    except InvalidArgumentError:
        raise exits.CliError(f"bad transaction id {text!r}: write it as (tc,seq) or tc,seq, e.g. (0,17), "
                             f"as `txmq transactions list` shows it") from None


def parse_position(text: str):
    """``earliest``, ``latest`` or an offset (int >= 0)."""
    if text in POSITIONS:
        return text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise exits.CliError(f"bad offset {text!r}: expected earliest, latest or an offset (an integer >= 0)")
    return value


def check_offset(what: str, offset: int, topic: str, partition: int, start: int, end: int) -> None:
    if not start <= offset <= end:
        raise exits.CliError(f"bad offset: {what} {offset} is outside {topic}/{partition}, which holds "
                             f"offsets {start} to {end - 1} (log end {end}); use earliest, latest or "
                             f"an offset from {start} to {end}")


def partitions_of(broker, topic: str, partition) -> list:
    n = broker.describe_topic(topic)["partitions"]
    if partition is None:
        return list(range(n))
    if not 0 <= partition < n:
        raise exits.CliError(f"topic {topic!r} has no partition {partition}: its partitions are 0 to {n - 1}")
    return [partition]


# -- topics ----------------------------------------------------------------------------

def topics_list(args) -> int:
    with opening.open_for_reading(args.dir, args.progress) as broker:
        topics = [broker.describe_topic(name) for name in broker.topics()]
    if args.json:
        emit_json(topics)
        return exits.OK
    if not topics:
        print(f"no topics in {args.dir} (create one with `txmq topics create {args.dir} NAME`)")
        return exits.OK
    table([{"topic": t["name"], "partitions": t["partitions"],
            "offsets": sum(e - s for s, e in zip(t["start_offsets"], t["end_offsets"])),
            "subscriptions": len(t["subscriptions"]),
            "retention": _retention(t)} for t in topics],
          [("topic", "topic"), ("partitions", "partitions"), ("offsets", "offsets"),
           ("subscriptions", "subscriptions"), ("retention", "retention")])
    return exits.OK


def _retention(t: dict) -> str:
    parts = []
    if t.get("retention_ms") is not None:
        parts.append(f"{t['retention_ms']:,} ms")
    if t.get("retention_bytes") is not None:
        parts.append(size(t["retention_bytes"]))
    return " / ".join(parts) or "broker default"


def topics_describe(args) -> int:
    with opening.open_for_reading(args.dir, args.progress) as broker:
        require_topic(broker, args.topic)
        info = broker.describe_topic(args.topic)
        stats = broker.stats()["topics"][args.topic]
    info["partition_stats"] = stats["partitions"]
    info["subscription_stats"] = stats["subscriptions"]
    if args.json:
        emit_json(info)
        return exits.OK
    print(f"topic {info['name']}: {info['partitions']} partition(s), retention {_retention(info)}")
    print()
    _partition_table(stats["partitions"])
    print()
    _subscription_table([dict(s, topic=args.topic, subscription=name)
                         for name, s in sorted(stats["subscriptions"].items())], with_topic=False)
    return exits.OK


def _partition_table(parts: list) -> None:
    table([{"partition": i, "start": p["start_offset"], "end": p["end_offset"],
            "lso": p["max_read_position"], "bytes": p["bytes"], "segments": p["segments"],
            "open_txns": p["open_transactions"], "blocked_by": p["blocked_by"]}
           for i, p in enumerate(parts)],
          [("partition", "partition"), ("start", "start"), ("end", "end"), ("lso", "last stable"),
           ("bytes", "bytes"), ("segments", "segments"), ("open_txns", "open txns"),
           ("blocked_by", "blocked by")])


def _subscription_table(rows: list, with_topic: bool = True) -> None:
    if not rows:
        print("no subscriptions")
        return
    cols = [("topic", "topic")] if with_topic else []
    cols += [("subscription", "subscription"), ("type", "type"), ("isolation", "isolation"),
             ("backlog", "backlog"), ("unacked", "unacked"), ("consumers", "consumers")]
    table([dict(r, consumers=len(r["consumers"])) for r in rows], cols)


def topics_create(args) -> int:
    with opening.open_for_writing(args.dir, args.progress, create=True) as broker:
        broker.create_topic(args.topic, args.partitions, retention_ms=args.retention_ms,
                            retention_bytes=args.retention_bytes)
    if args.json:
        emit_json({"created": args.topic, "partitions": args.partitions})
    else:
        print(f"created topic {args.topic!r} with {args.partitions} partition(s) in {args.dir}")
    return exits.OK


def topics_delete(args) -> int:
    with opening.open_for_writing(args.dir, args.progress) as broker:
        require_topic(broker, args.topic)
        broker.delete_topic(args.topic, force=True)
    if args.json:
        emit_json({"deleted": args.topic})
    else:
        print(f"deleted topic {args.topic!r}, its data and its subscriptions")
    return exits.OK


# -- subscriptions -----------------------------------------------------------------------

def subscriptions_list(args) -> int:
    with opening.open_for_reading(args.dir, args.progress) as broker:
        if args.topic is not None:
            require_topic(broker, args.topic)
        stats = broker.stats()["topics"]
    rows = [dict(s, topic=t, subscription=name)
            for t, ts in sorted(stats.items()) if args.topic in (None, t)
            for name, s in sorted(ts["subscriptions"].items())]
    if args.json:
        emit_json([{k: v for k, v in r.items() if k != "partitions"} for r in rows])
        return exits.OK
    _subscription_table(rows)
    return exits.OK


def subscriptions_describe(args) -> int:
    with opening.open_for_reading(args.dir, args.progress) as broker:
        sub = require_subscription(broker, args.topic, args.subscription)
        parts = broker.stats()["topics"][args.topic]["partitions"]
    sub = dict(sub, topic=args.topic, subscription=args.subscription)
    if args.json:
        emit_json(sub)
        return exits.OK
    _print_subscription(sub, parts)
    return exits.OK


def _print_subscription(sub: dict, parts: list) -> None:
    print(f"subscription {sub['subscription']} on {sub['topic']}: {sub['type']}, {sub['isolation']}, "
          f"backlog {sub['backlog']:,}, consumers {len(sub['consumers'])}")
    print()
    table([dict(p, end=parts[p["partition"]]["end_offset"], lso=parts[p["partition"]]["max_read_position"])
           for p in sub["partitions"]],
          [("partition", "partition"), ("mark_delete", "mark-delete"),
           ("individually_acked", "acked above"), ("backlog", "backlog"), ("end", "end"),
           ("lso", "last stable")])
    for p in sub["partitions"]:
        for problem in p.get("cursor_problems_on_open") or ():
            print(f"partition {p['partition']}: {problem}")


def subscriptions_reset(args) -> int:
    target = parse_position(args.to)
    with opening.open_for_writing(args.dir, args.progress) as broker:
        sub = require_subscription(broker, args.topic, args.subscription)
        partitions = partitions_of(broker, args.topic, args.partition)
        if isinstance(target, int):
            if args.partition is None and len(partitions) > 1:
                raise exits.CliError(f"an offset is a position in one partition: add --partition P "
                                     f"(topic {args.topic!r} has {len(partitions)} partitions)")
            p = partitions[0]
            info = broker.describe_topic(args.topic)
            check_offset("--to", target, args.topic, p, info["start_offsets"][p], info["end_offsets"][p])
        # No broker call resets a subscription by name: attach a consumer
        # of the same type and isolation (so neither changes), seek, detach.
        consumer = broker.subscribe(args.topic, args.subscription, sub["type"], isolation=sub["isolation"])
        try:
            consumer.seek(target, partition=args.partition)
        finally:
            consumer.close()
        after = broker.stats()["topics"][args.topic]
    sub = dict(after["subscriptions"][args.subscription], topic=args.topic, subscription=args.subscription)
    if args.json:
        emit_json(sub)
        return exits.OK
    where = "every partition" if args.partition is None else f"partition {args.partition}"
    print(f"reset {args.topic}/{args.subscription} to {args.to} on {where}")
    print()
    _print_subscription(sub, after["partitions"])
    return exits.OK


# -- transactions ------------------------------------------------------------------------

_TXN_COLUMNS = [("id", "id"), ("state", "state"), ("age_s", "age s"), ("timeout_s", "timeout s"),
                ("partitions", "partitions"), ("subscriptions", "subscriptions")]


def transactions_list(args) -> int:
    with opening.open_for_reading(args.dir, args.progress) as broker:
        txns = broker.transactions()
    if args.json:
        emit_json(txns)
        return exits.OK
    if not txns:
        print("no live transactions")
        return exits.OK
    table(txns, _TXN_COLUMNS)
    return exits.OK


def transactions_describe(args) -> int:
    txn_id = parse_txn_id(args.txn)
    with opening.open_for_reading(args.dir, args.progress) as broker:
        info = _txn_info(broker, txn_id)
        info["blocking"] = [f"{t}/{i}" for t, ts in sorted(broker.stats()["topics"].items())
                            for i, p in enumerate(ts["partitions"]) if p["blocked_by"] == info["id"]]
    if args.json:
        emit_json(info)
        return exits.OK
    for key, title in _TXN_COLUMNS + [("started_ms", "started ms"), ("blocking", "holds back")]:
        value = info[key]
        print(f"{title + ':':<15} {', '.join(value) if isinstance(value, list) else value}"
              + (" (none)" if isinstance(value, list) and not value else ""))
    return exits.OK


def transactions_abort(args) -> int:
    txn_id = parse_txn_id(args.txn)
    with opening.open_for_writing(args.dir, args.progress) as broker:
        _txn_info(broker, txn_id)
        broker.abort_transaction(txn_id)
    if args.json:
        emit_json({"aborted": str(txn_id)})
    else:
        print(f"aborted transaction {txn_id}: its messages are dropped and its acks undone")
    return exits.OK


def _txn_info(broker, txn_id: TxnID) -> dict:
    try:
        return broker.transaction_info(txn_id)
    except TransactionNotFoundError:
        live = ", ".join(t["id"] for t in broker.transactions()) or "none"
        raise exits.CliError(f"transaction {txn_id} is not live (live transactions: {live}); ended "
                             f"transactions are forgotten, and opening a directory ends every "
                             f"transaction its previous owner left open") from None


# -- stats -------------------------------------------------------------------------------

def stats(args) -> int:
    with opening.open_for_reading(args.dir, args.progress) as broker:
        st = broker.stats()
    if args.json:
        emit_json(st)
        return exits.OK
    print(f"data directory {st['path']}")
    for name, t in sorted(st["topics"].items()):
        print()
        print(f"topic {name}")
        _partition_table(t["partitions"])
        _subscription_table([dict(s, topic=name, subscription=sname)
                             for sname, s in sorted(t["subscriptions"].items())], with_topic=False)
    tx = st["transactions"]
    print()
    print(f"transactions: {tx['open']} open, {tx['begun']} begun, {tx['committed']} committed, "
          f"{tx['aborted']} aborted, {tx['timed_out']} timed out since open; recovered on open: "
          f"{tx['recovered']['committed']} committed, {tx['recovered']['aborted']} aborted")
    problems = [f"{name}/{i}: {d}" for name, t in sorted(st["topics"].items())
                for i, p in enumerate(t["partitions"]) for d in p["truncated_on_open"]]
    problems += [f"{name}/{sname}: {c}" for name, t in sorted(st["topics"].items())
                 for sname, s in sorted(t["subscriptions"].items())
                 for p in s["partitions"] for c in p.get("cursor_problems_on_open") or ()]
    problems += list(tx.get("coordinator_problems_on_open") or ())
    problems += list(st.get("producers", {}).get("registry_problems_on_open") or ())
    if problems:
        print()
        print("repaired on open:")
        for p in problems:
            print(f"  {p}")
    return exits.OK
