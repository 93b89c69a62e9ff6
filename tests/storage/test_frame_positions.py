"""Where a damaged byte is, every reader of a data directory says so: the
broker refuses to open it with CorruptLogError(path, position), the
read-only view raises the same error, and ``txmq check`` prints that
position, found by the decoder itself (no search over frames). The
position is the damaged byte's, inside its frame or entry, not 0."""

from __future__ import annotations

import os
import struct

import pytest

import txmq
import txmq.readonly as readonly
from txmq import LocalTransactionState as S
from txmq import _half
from txmq import _txnlog as L
from txmq._redolog import FRAME_HEADER_BYTES, frame
from txmq.cli import exits, main
from txmq.storage.cursor import ACK
from txmq.errors import CorruptLogError

OPTS = dict(fsync="never", half_check_interval=3600.0, half_check_immunity=0.0)
I64 = struct.Struct("<q").pack
TXN = struct.pack("<QQ", 0, 12345)          # a transaction no frame began


@pytest.fixture
def data(tmp_path):
    """Topic t with a committed transaction, a named producer, a half
    message and subscription s that acknowledged in a transaction."""
    path = str(tmp_path / "data")
    with txmq.Broker(path, **OPTS) as b:
        b.create_topic("t")
        p = b.producer("t", name="svc")
        p.send(b"plain")
        with b.transaction() as txn:
            p.send(b"in a transaction", txn=txn)
        b.half_producer("t", "g").send_in_transaction(b"half", lambda m, a: S.COMMIT)
        c = b.subscribe("t", "s", initial_position="earliest")
        with b.transaction() as txn:
            c.ack(c.receive(timeout=1.0), txn=txn)
        c.close()
    return path


# (file, the damaged frame, the damaged field's byte in its payload, what the error says)
CASES = {
    "coordinator": ("coordinator/tc-0.log", (L.TC_COMMITTING, TXN), 0,
                    "coordinator frame of type 5: frame for transaction"),
    "producer registry": ("producers.log", (L.PR_NAME, L.encode_text("svc-b") + b"\1\2\3"), 7,
                          "producer registry frame of type 3: ends at byte"),
    "half-message redo": ("half/redo.log", (_half.F_GROUP, I64(9) + L.encode_text("t") + b"\x07\x00gr"), 11,
                          "half-message redo frame of type 4: text of 7 bytes runs past"),
    "pending acks": ("subscriptions/t/s/pending-0.log", (L.PA_ACK, TXN + struct.pack("<I", 3) + I64(1)), 20,
                     "pending-ack frame of type 2: 3 items of 8 bytes do not fit"),
    "cursor": ("subscriptions/t/s/cursor-0.log", (ACK, struct.pack("<I", 1) + I64(1) + b"\0\0"), 12,
               "cursor frame of type 2: 2 stray bytes"),
}


READ_ONLY = {
    "coordinator": lambda ro: ro.transactions(),
    "pending acks": lambda ro: ro.subscription("t", "s"),
    "cursor": lambda ro: ro.subscription("t", "s"),
}


def _damage(data: str, case: str):
    rel, (kind, payload), field, reason = CASES[case]
    path = os.path.join(data, rel)
    at = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(frame(kind, payload))      # a right CRC over wrong content
    return path, at + FRAME_HEADER_BYTES + field, reason


@pytest.mark.parametrize("case", sorted(CASES))
def test_open_check_and_read_only_report_the_damaged_byte(case, data, capsys):
    path, position, reason = _damage(data, case)
    assert position > FRAME_HEADER_BYTES
    code = main(["check", data])
    out = capsys.readouterr().out
    assert code == exits.PROBLEMS
    assert f"{path} at byte {position}: {reason}" in out, out
    with pytest.raises(CorruptLogError) as e:
        txmq.Broker(data, **OPTS)
    assert (e.value.path, e.value.position) == (path, position)
    assert e.value.reason.startswith(reason)
    read = READ_ONLY.get(case)
    if read is not None:                    # a file the read-only view reads
        with readonly.open(data) as ro:
            with pytest.raises(CorruptLogError) as e:
                read(ro)
        assert (e.value.path, e.value.position) == (path, position)


def test_a_damaged_txnindex_entry_is_reported_at_that_entry(tmp_path, capsys):
    """A byte of the second .txnindex entry fails its CRC: check and the
    writer's recovery both name the second entry's first byte."""
    path = str(tmp_path / "d")
    with txmq.Broker(path, fsync="never", linger_ms=0) as b:     # (aborted sends leave data)
        b.create_topic("t")
        p = b.producer("t")
        for _ in range(2):
            txn = b.new_transaction()
            p.send(b"gone", txn=txn)
            txn.abort()
    txnindex = os.path.join(path, "topics", "t", "0", f"{0:020d}.txnindex")
    assert os.path.getsize(txnindex) == 96
    with open(txnindex, "r+b") as f:
        f.seek(48 + 30)
        byte = f.read(1)
        f.seek(48 + 30)
        f.write(bytes([byte[0] ^ 0x5A]))
    assert main(["check", path]) == exits.PROBLEMS
    assert f"{txnindex} at byte 48: entry fails its CRC" in capsys.readouterr().out
    with txmq.Broker(path, fsync="never") as b:
        b.high_watermark("t", 0)          # partitions open (and recover) on first use
        dropped = b.stats()["topics"]["t"]["partitions"][0]["truncated_on_open"]
    assert any(d.startswith(f"{txnindex} at byte 48: ") for d in dropped), dropped


def test_a_snapshot_whose_tables_do_not_parse_is_reported_at_the_bad_byte(tmp_path):
    """A snapshot with a good CRC whose table stops short (a count that
    promises more entries than follow): the error names the byte inside
    the tables where the table's reader ran out, not the tables' start."""
    from txmq.storage.layout import (TXNBUF_FILE, TXNBUF_HEAD, TXNBUF_MAGIC, TXNBUF_VERSION, parse_snapshot,
                                     parse_txn_tables, sealed)
    from txmq._txn import AbortSet, OngoingQueue
    ongoing = OngoingQueue()
    for i in range(3):
        ongoing.add(0, i + 1, 10 * i, 5)
    tables = ongoing.to_bytes() + AbortSet().to_bytes()
    short = tables[:len(ongoing.to_bytes()) - 8]          # the last entry cut: the AbortSet is gone too
    path = str(tmp_path / TXNBUF_FILE)
    raw = sealed(TXNBUF_HEAD.pack(TXNBUF_MAGIC, TXNBUF_VERSION, 0, 0) + short)
    with pytest.raises(CorruptLogError) as e:
        parse_snapshot(path, raw, TXNBUF_MAGIC, TXNBUF_VERSION, TXNBUF_HEAD, parse_txn_tables)
    assert e.value.path == path
    assert TXNBUF_HEAD.size < e.value.position <= TXNBUF_HEAD.size + len(short)
