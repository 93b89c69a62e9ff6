"""Half messages (RocketMQ-style transactional messages).

1. ``send_in_transaction`` whose local transaction commits at once (one
   half-log append, one RECORD frame, one append to the topic, a share of
   one UPDATE frame per 256 messages) against plain ``send()`` of the same
   100-byte message, same broker, rounds alternating. Goal at fsync
   "never": >= 50% of ``send()``. At "commit" it is reported for
   information: a half message then waits for two fsyncs (the half message
   before its local transaction, the COMMITTING frame before the append)
   and a plain send for none.
2. The check scan (``StateTable.due``: PREPARED and stored before the
   cutoff, one C pass over the mapped records into a numpy array; the
   broker's checker uses it) over 1,000,000 records against a
   Python loop reading the same records with ``struct.unpack_from``.
   Goal: >= 50x.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from txmq import LocalTransactionState
from txmq import _half
from test_bench_producers import alternate, data_dir, looped, open_broker  # noqa: F401

COMMIT = LocalTransactionState.COMMIT
PER_ROUND = 2000


def commit_now(message, arg):
    return COMMIT


@pytest.mark.parametrize("fsync", ["never", "commit"])
def test_send_in_transaction_vs_send(fsync, measure, benchmark, results, data_dir, request):  # noqa: F811
    """2,000 messages of 100 B per round to one partition, alternately by
    ``send()`` and by ``send_in_transaction`` (a local transaction that
    commits). At "commit" rounds are 50 messages (each waits for fsyncs)."""
    broker = open_broker(data_dir, fsync, request, "plain", "half")
    value = b"x" * 100
    n = PER_ROUND if fsync == "never" else 50
    plain = broker.producer("plain")
    hp = broker.half_producer("half", "bench")
    alternate(measure, benchmark, results, f"half_send_{fsync}",
              ("send", looped(n, plain.send, value)),
              ("send_in_transaction", looped(n, hp.send_in_transaction, value, commit_now)),
              ops_per_round=n, unit="msg", rounds=100 if fsync == "never" else 20, warmup=4)
    s = broker.stats()["half"]
    assert s["by_state"]["prepared"] == 0 and s["committed"] == broker.high_watermark("half", 0)


RECORDS = 1_000_000


def python_scan(raw: bytes, n: int, cutoff: int) -> list:
    """The baseline: one record at a time."""
    due = []
    unpack = struct.Struct("<qiiiii").unpack_from
    for i in range(n):
        _, _, store_time, _, state, _ = unpack(raw, i * 28)
        if state == _half.PREPARED and store_time <= cutoff:
            due.append(i)
    return due


def test_check_scan(measure, benchmark, results, tmp_path):
    """1,000,000 records, 10% PREPARED, store times spread over 100 s; the
    cutoff finds about half of the PREPARED ones due."""
    rng = np.random.default_rng(7)
    recs = np.zeros(RECORDS, _half.RECORD_DTYPE)
    recs["offset"] = np.arange(RECORDS)
    recs["size"] = 150
    recs["store_time"] = 1_700_000_000 + rng.integers(0, 100, RECORDS)
    recs["state"] = np.where(rng.random(RECORDS) < 0.1, _half.PREPARED, _half.COMMITTED)
    table = _half.StateTable(str(tmp_path / "statetable"), 0, 0)
    table.load(recs.tobytes())
    cutoff = 1_700_000_050
    raw = table.raw(0, RECORDS)
    expect = python_scan(raw, RECORDS, cutoff)
    assert table.due(cutoff).tolist() == expect and len(expect) > 40_000
    assert _half.due(table.records(), cutoff).tolist() == expect
    alternate(measure, benchmark, results, "half_scan",
              ("python loop", lambda: python_scan(raw, RECORDS, cutoff)),
              ("numpy scan", lambda: table.due(cutoff)),
              ops_per_round=RECORDS, unit="record", rounds=6, warmup=2)
    table.close()
