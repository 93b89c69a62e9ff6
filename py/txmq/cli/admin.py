"""Inspection and administration commands: ``topics``, ``subscriptions``,
``transactions`` and ``stats``. Each prints a table, or JSON with ``--json``.

The inspecting ones read a :class:`~txmq.cli.view.DirectoryView` (no lock,
no writes: they work beside the directory's owner); the ones that change
something open a broker. The lookups below serve both: they call only
``topics()`` and ``describe_topic()``, which the two have alike."""

from __future__ import annotations

from txmq.cli import exits, opening
from txmq.cli.output import emit_json, size, table
from txmq.errors import InvalidArgumentError
from txmq.transactions.records import TxnID

POSITIONS = ("earliest", "latest")


# -- lookups with errors that say what exists ------------------------------------------

def require_topic(source, name: str) -> None:
    topics = source.topics()
    if name in topics:
        return
    if topics:
        raise exits.CliError(f"topic {name!r} does not exist; existing topics: {', '.join(topics)}")
    raise exits.CliError(f"topic {name!r} does not exist: the data directory has no topics "
                         f"(create one with `txmq topics create DIR {name}`)")


def require_subscription(source, topic: str, name: str) -> None:
    require_topic(source, topic)
    subs = source.describe_topic(topic)["subscriptions"]
    if name not in subs:
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


def partitions_of(source, topic: str, partition) -> list:
    n = source.describe_topic(topic)["partitions"]
    if partition is None:
        return list(range(n))
    if not 0 <= partition < n:
        raise exits.CliError(f"topic {topic!r} has no partition {partition}: its partitions are 0 to {n - 1}")
    return [partition]


# -- topics ----------------------------------------------------------------------------

def topics_list(args) -> int:
    with opening.open_for_reading(args.dir, args.progress) as view:
        topics = [view.describe_topic(name) for name in view.topics()]
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
    with opening.open_for_reading(args.dir, args.progress) as view:
        require_topic(view, args.topic)
        info = view.describe_topic(args.topic)
        info["partition_stats"] = view.partition_stats(args.topic)
        info["subscription_stats"] = view.subscription_stats(args.topic)
    if args.json:
        emit_json(info)
        return exits.OK
    print(f"topic {info['name']}: {info['partitions']} partition(s), retention {_retention(info)}")
    print()
    _partition_table(info["partition_stats"])
    print()
    _subscription_table([dict(s, topic=args.topic, subscription=name)
                         for name, s in sorted(info["subscription_stats"].items())], with_topic=False)
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
             ("backlog", "backlog")]
    table(rows, cols)


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
    with opening.open_for_reading(args.dir, args.progress) as view:
        if args.topic is not None:
            require_topic(view, args.topic)
        rows = [dict(s, topic=t, subscription=name)
                for t in view.topics() if args.topic in (None, t)
                for name, s in sorted(view.subscription_stats(t).items())]
    if args.json:
        emit_json([{k: v for k, v in r.items() if k != "partitions"} for r in rows])
        return exits.OK
    _subscription_table(rows)
    return exits.OK


def subscriptions_describe(args) -> int:
    return _describe_subscription(args, None)


def _describe_subscription(args, headline: str | None) -> int:
    """``subscriptions describe``, also what ``reset`` prints after it."""
    with opening.open_for_reading(args.dir, args.progress) as view:
        require_subscription(view, args.topic, args.subscription)
        sub = view.subscription_stats(args.topic)[args.subscription]
        parts = view.partition_stats(args.topic)
    sub = dict(sub, topic=args.topic, subscription=args.subscription)
    if args.json:
        emit_json(sub)
        return exits.OK
    if headline:
        print(headline)
        print()
    order = ", out of order (allow_out_of_order_delivery)" if sub["allow_out_of_order_delivery"] else ""
    print(f"subscription {sub['subscription']} on {sub['topic']}: {sub['type']}, {sub['isolation']}{order}, "
          f"backlog {'-' if sub['backlog'] is None else format(sub['backlog'], ',')}")
    print()
    table([dict(p, end=parts[p["partition"]]["end_offset"], lso=parts[p["partition"]]["max_read_position"])
           for p in sub["partitions"]],
          [("partition", "partition"), ("mark_delete", "mark-delete"),
           ("individually_acked", "acked above"), ("pending_transactions", "pending txns"),
           ("backlog", "backlog"), ("end", "end"), ("lso", "last stable")])
    return exits.OK


def subscriptions_reset(args) -> int:
    target = parse_position(args.to)
    with opening.open_for_writing(args.dir, args.progress) as broker:
        require_subscription(broker, args.topic, args.subscription)
        sub = broker.stats()["topics"][args.topic]["subscriptions"][args.subscription]
        partitions = partitions_of(broker, args.topic, args.partition)
        if isinstance(target, int):
            if args.partition is None and len(partitions) > 1:
                raise exits.CliError(f"an offset is a position in one partition: add --partition P "
                                     f"(topic {args.topic!r} has {len(partitions)} partitions)")
            p = partitions[0]
            info = broker.describe_topic(args.topic)
            check_offset("--to", target, args.topic, p, info["start_offsets"][p], info["end_offsets"][p])
        # No broker call resets a subscription by name: attach a consumer
        # of the same type, isolation and order (so none changes), seek, detach.
        consumer = broker.subscribe(args.topic, args.subscription, sub["type"], isolation=sub["isolation"],
                                    allow_out_of_order_delivery=sub["allow_out_of_order_delivery"])
        try:
            consumer.seek(target, partition=args.partition)
        finally:
            consumer.close()
    where = "every partition" if args.partition is None else f"partition {args.partition}"
    return _describe_subscription(args, f"reset {args.topic}/{args.subscription} to {args.to} on {where}")


# -- transactions ------------------------------------------------------------------------

_TXN_COLUMNS = [("id", "id"), ("state", "state"), ("age_s", "age s"), ("timeout_s", "timeout s"),
                ("partitions", "partitions"), ("subscriptions", "subscriptions"), ("xid", "xid"),
                ("holds_back", "holds back")]


def transactions_list(args) -> int:
    with opening.open_for_reading(args.dir, args.progress) as view:
        txns = view.transactions()
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
    with opening.open_for_reading(args.dir, args.progress) as view:
        info = _live(view.transactions(), txn_id, "")
    info["blocking"] = info["holds_back"]      # (its name in this command's JSON before lists had it)
    if args.json:
        emit_json(info)
        return exits.OK
    for key, title in _TXN_COLUMNS + [("started_ms", "started ms")]:
        value = info[key]
        print(f"{title + ':':<15} {', '.join(value) if isinstance(value, list) else value}"
              + (" (none)" if isinstance(value, list) and not value else ""))
    return exits.OK


def transactions_abort(args) -> int:
    txn_id = parse_txn_id(args.txn)
    # Opening as owner ends every transaction the previous owner left
    # unfinished: one left OPEN (or ABORTING) is aborted by that, which is
    # what was asked; one COMMITTING is committed, which is not.
    with opening.open_for_reading(args.dir, args.progress) as view:
        left = {t["id"]: t["state"] for t in view.transactions()}
    with opening.open_for_writing(args.dir, args.progress) as broker:
        if any(t["id"] == str(txn_id) for t in broker.transactions()):
            broker.abort_transaction(txn_id)
            how = "aborted"
        elif left.get(str(txn_id)) in ("OPEN", "ABORTING"):
            how = "aborted on open (its owner had stopped)"
        else:
            _live(broker.transactions(), txn_id, "" if str(txn_id) not in left else
                  f"; it was {left[str(txn_id)]} when its owner stopped, so opening the directory completed it")
    if args.json:
        emit_json({"aborted": str(txn_id), "how": how})
    else:
        print(f"{how} transaction {txn_id}: its messages are dropped and its acks undone")
    return exits.OK


def transactions_end_prepared(args) -> int:
    """``commit-prepared`` / ``abort-prepared``: end a PREPARED transaction
    as the directory's owner (opening it keeps prepared transactions)."""
    txn_id = parse_txn_id(args.txn)
    commit = args.action == "commit-prepared"
    with opening.open_for_writing(args.dir, args.progress) as broker:
        (broker.commit_prepared if commit else broker.abort_prepared)(txn_id)
    how = "committed" if commit else "aborted"
    if args.json:
        emit_json({how: str(txn_id)})
    else:
        print(f"{how} prepared transaction {txn_id}: its messages are "
              + ("visible and its acks applied" if commit else "dropped and its acks undone"))
    return exits.OK


def _live(txns: list, txn_id: TxnID, why: str) -> dict:
    """The entry of ``txn_id`` in ``txns`` (``transactions()`` of a view
    or a broker), else an error that lists the live ones."""
    for t in txns:
        if t["id"] == str(txn_id):
            return t
    live = ", ".join(t["id"] for t in txns) or "none"
    raise exits.CliError(f"transaction {txn_id} is not live (live transactions: {live}); ended "
                         f"transactions are forgotten{why}")


# -- stats -------------------------------------------------------------------------------

def stats(args) -> int:
    with opening.open_for_reading(args.dir, args.progress) as view:
        st = {"path": view.path, "writer_pid": view.writer_pid,
              "topics": {name: {"partitions": view.partition_stats(name),
                                "subscriptions": view.subscription_stats(name)} for name in view.topics()},
              "transactions": view.transactions()}
        held_by = view.held_by()
    if args.json:
        emit_json(st)
        return exits.OK
    print(f"data directory {st['path']} (a read-only view; {held_by})")
    for name, t in sorted(st["topics"].items()):
        print()
        print(f"topic {name}")
        _partition_table(t["partitions"])
        _subscription_table([dict(s, topic=name, subscription=sname)
                             for sname, s in sorted(t["subscriptions"].items())], with_topic=False)
    states = [t["state"] for t in st["transactions"]]
    print()
    print(f"transactions: {states.count('OPEN')} open, {states.count('COMMITTING')} committing, "
          f"{states.count('ABORTING')} aborting, {states.count('PREPARED')} prepared "
          f"(`txmq transactions list` lists them)")
    scanned = [f"{name}/{i}" for name, t in sorted(st["topics"].items())
               for i, p in enumerate(t["partitions"]) if p["source"] != "readview"]
    if scanned:
        print()
        print(f"not closed cleanly by its last owner: {', '.join(scanned)} (read past the last published "
              f"view; the next owner recovers them and ends their open transactions; `txmq check` "
              f"reports torn tails)")
    return exits.OK
