"""Consuming: receive 1,000 messages of 100 B and acknowledge them, against
the SQLite queue reading 1,000 rows and moving its cursor in one transaction.

Two txmq paths: the per-message API (receive_many + ack of the list) and
the Arrow fast path (receive_batch + ack of the RecordBatch, whose value
column is a view of the log: nothing is copied or materialised per
message, while SQLite returns Python bytes per row).
"""

from __future__ import annotations

import pyarrow as pa
import pytest

import txmq
from sqlite_baseline import SqliteQueue
from test_bench_send import payloads

BATCH = 1000
ROUNDS = 80
WARMUP = 5
# Every round consumes one fresh batch: fill enough for all of them.
FILL_BATCHES = ROUNDS + WARMUP + 5


@pytest.mark.parametrize("side", ["txmq receive_many", "txmq receive_batch", "sqlite"])
def test_receive_ack_100B(side, measure, tmp_path, request):
    values = payloads(BATCH, 100)
    if side.startswith("txmq"):
        broker = txmq.Broker(tmp_path / "data", fsync="never")
        request.addfinalizer(broker.close)
        broker.create_topic("t", 1)
        producer = broker.producer("t")
        arr = pa.array(values, pa.binary())
        for _ in range(FILL_BATCHES):
            producer.send_batch(arr)
        consumer = broker.subscribe("t", "s", "exclusive", initial_position="earliest")
        if side == "txmq receive_many":
            def run():
                msgs = consumer.receive_many(BATCH, 1.0)
                consumer.ack(msgs)
                return len(msgs)
        else:
            def run():
                batch = consumer.receive_batch(BATCH, 1.0)
                consumer.ack(batch)
                return batch.num_rows
    else:
        q = SqliteQueue(str(tmp_path / "q.db"), synchronous="OFF")
        request.addfinalizer(q.close)
        for _ in range(FILL_BATCHES):
            q.insert_batch(values)

        def run():
            return len(q.read_batch(BATCH))

    got = []
    measure("receive_ack", side, lambda: got.append(run()), ops_per_round=BATCH, unit="msg",
            rounds=ROUNDS, warmup=WARMUP)
    # The rate assumes full rounds: check every round got a whole batch.
    assert got and all(n == BATCH for n in got), sorted(set(got))
