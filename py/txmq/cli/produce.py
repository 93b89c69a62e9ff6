"""``txmq produce``: messages from stdin or a file, one per line.

Raw lines are values (bytes as they are, without the newline). With
``--json`` each line is an object: ``value`` (a string, stored as UTF-8;
any other JSON value is stored as its compact JSON text), and optionally
``key`` (string or null), ``headers`` (an object or a list of [name,
value] pairs), ``partition`` (int), ``event_time`` (int ms);
``value_base64`` / ``key_base64`` carry binary bytes. ``txmq consume
--format json`` writes exactly this shape, so its output can be produced
again.

Lines are sent in batches (``--batch-size``, default 1,000) with one
``send_batch`` each; consecutive lines bound for the same partition share a
batch. With ``--transactional`` every batch is sent in one transaction that
commits at the end: all of the input is produced, or none.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import sys
import time

import numpy as np

from txmq.cli import admin, exits, opening
from txmq.cli.output import Progress, emit_json, wants_progress
from txmq.errors import TxmqError

# Progress is worth drawing for files above this size.
PROGRESS_MIN_BYTES = 4 * 1024 * 1024


def produce(args) -> int:
    key = None if args.key is None else args.key.encode()
    source, total = _open_input(args.file)
    t0 = time.perf_counter()
    sent = 0
    line_no = 0
    partitions: dict = {}
    txn = None
    with source, opening.open_for_writing(args.dir, args.progress) as broker:
        admin.require_topic(broker, args.topic)
        if args.partition is not None:
            admin.partitions_of(broker, args.topic, args.partition)
        producer = broker.producer(args.topic)
        if args.transactional:
            txn = broker.new_transaction(timeout=args.txn_timeout)
        show = wants_progress(args.progress) and (total is None or total >= PROGRESS_MIN_BYTES
                                                  or args.progress)
        progress = Progress(f"produce {args.topic}", total, "B", show)
        batch = _Batch()
        try:
            for raw in source:
                line_no += 1
                progress.update(len(raw), f"{sent:,} messages")
                msg = _parse(raw, line_no, args.json, key, args.partition)
                if batch.messages and (batch.full(args.batch_size) or not batch.fits(msg)):
                    sent += batch.send(producer, txn, partitions)
                batch.add(msg)
            if batch.messages:
                sent += batch.send(producer, txn, partitions)
            if txn is not None:
                txn.commit()
        except (exits.CliError, TxmqError, KeyboardInterrupt) as e:
            if txn is not None:
                _abort_quietly(txn)
                note = "nothing was produced: the transaction was aborted"
            else:
                note = (f"{sent:,} message(s) before line {line_no} were produced; "
                        f"use --transactional for all or nothing")
            if isinstance(e, KeyboardInterrupt):
                raise exits.CliError(f"interrupted ({note})", exits.INTERRUPTED) from None
            err = e if isinstance(e, exits.CliError) else exits.from_broker_error(e)
            raise exits.CliError(f"{err} ({note})", err.code) from None
        except BaseException:
            if txn is not None:
                _abort_quietly(txn)
            raise
        finally:
            progress.close()
    seconds = time.perf_counter() - t0
    summary = {"topic": args.topic, "messages": sent, "seconds": round(seconds, 3),
               "partitions": {str(p): {"first": a, "last": b, "messages": n}
                              for p, (a, b, n) in sorted(partitions.items())},
               "transaction": None if txn is None else str(txn.id)}
    if args.json_summary:
        emit_json(summary)
    else:
        rate = f", {sent / seconds:,.0f} msg/s" if seconds > 0 and sent else ""
        in_txn = f" in transaction {txn.id}" if txn is not None else ""
        print(f"produced {sent:,} message(s) to {args.topic!r}{in_txn} in {seconds:.2f} s{rate}",
              file=sys.stderr)
    return exits.OK


def _abort_quietly(txn) -> None:
    try:
        txn.abort()
    except TxmqError:
        pass


def _open_input(path):
    """(binary line iterator usable as a context manager, size in bytes or None)."""
    if path in (None, "-"):
        return _NoClose(sys.stdin.buffer), None
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise exits.CliError(f"input file {path} does not exist") from None
    except OSError as e:
        raise exits.CliError(f"cannot read input file {path}: {e.strerror}") from None
    try:
        total = os.fstat(f.fileno()).st_size or None
    except OSError:
        total = None
    return f, total


class _NoClose:
    def __init__(self, f):
        self.f = f

    def __iter__(self):
        return iter(self.f)

    def __enter__(self):
        return self.f

    def __exit__(self, *exc):
        pass


class _Message:
    __slots__ = ("value", "key", "headers", "partition", "event_time")

    def __init__(self, value, key, headers, partition, event_time):
        self.value = value
        self.key = key
        self.headers = headers
        self.partition = partition
        self.event_time = event_time


def _parse(raw: bytes, line_no: int, as_json: bool, key, partition) -> _Message:
    if raw.endswith(b"\n"):
        raw = raw[:-1]
        if raw.endswith(b"\r"):
            raw = raw[:-1]
    if not as_json:
        return _Message(raw, key, None, partition, None)
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise exits.CliError(f"line {line_no}: not a JSON object ({e}); with --json every line is "
                             f'an object such as {{"value": "..."}}') from None
    if not isinstance(obj, dict):
        raise exits.CliError(f"line {line_no}: expected a JSON object, got {type(obj).__name__}")
    value = _bytes_field(obj, "value", line_no)
    if value is None:
        raise exits.CliError(f"line {line_no}: no \"value\" (or \"value_base64\") field")
    k = _bytes_field(obj, "key", line_no) if ("key" in obj or "key_base64" in obj) else key
    headers = obj.get("headers")
    if headers is not None:
        headers = _headers(headers, line_no)
    p = obj.get("partition", partition)
    if p is not None and (type(p) is not int or p < 0):
        raise exits.CliError(f"line {line_no}: \"partition\" must be an integer >= 0, not {p!r}")
    et = obj.get("event_time")
    if et is not None and type(et) is not int:
        raise exits.CliError(f"line {line_no}: \"event_time\" must be integer milliseconds, not {et!r}")
    return _Message(value, k, headers, p, et)


def _bytes_field(obj: dict, name: str, line_no: int):
    if name + "_base64" in obj:
        try:
            return base64.b64decode(obj[name + "_base64"], validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise exits.CliError(f"line {line_no}: \"{name}_base64\" is not base64") from None
    v = obj.get(name)
    if v is None:
        return None
    if isinstance(v, str):
        return v.encode()
    return json.dumps(v, separators=(",", ":")).encode()


def _headers(h, line_no: int) -> list:
    items = h.items() if isinstance(h, dict) else h
    out = []
    try:
        for name, value in items:
            if not isinstance(name, str) or not (value is None or isinstance(value, str)):
                raise ValueError
            # surrogateescape: consume --format json writes non-UTF-8 bytes so
            out.append((name, None if value is None else value.encode("utf-8", "surrogateescape")))
    except (TypeError, ValueError):
        raise exits.CliError(f"line {line_no}: \"headers\" must be an object of strings or a list of "
                             f"[name, value] pairs") from None
    return out


class _Batch:
    """Consecutive messages for the same partition (or for the
    partitioner), all with or all without event times: one send_batch."""

    def __init__(self):
        self.messages: list = []

    def full(self, batch_size: int) -> bool:
        return len(self.messages) >= batch_size

    def fits(self, m: _Message) -> bool:
        first = self.messages[0]
        return m.partition == first.partition and (m.event_time is None) == (first.event_time is None)

    def add(self, m: _Message) -> None:
        self.messages.append(m)

    def send(self, producer, txn, partitions: dict) -> int:
        ms, self.messages = self.messages, []
        keys = [m.key for m in ms]
        headers = [m.headers for m in ms]
        ids = producer.send_batch(
            [m.value for m in ms],
            keys=None if all(k is None for k in keys) else keys,
            headers=headers if any(headers) else None,
            event_times=None if ms[0].event_time is None else [m.event_time for m in ms],
            partition=ms[0].partition, txn=txn)
        for p in np.unique(ids.partitions).tolist():
            offs = ids.offsets[ids.partitions == p]
            lo, hi = int(offs.min()), int(offs.max())
            a, b, n = partitions.get(p, (lo, hi, 0))
            partitions[p] = (min(a, lo), max(b, hi), n + len(offs))
        return len(ms)
