"""The exactly-once function runner against the loop it automates.

An identity function (``lambda m: m.value``) run by ``txmq.functions.Function``
over a topic of 100 B messages, 100 messages per transaction, fsync
"never", against the raw consume-transform-produce loop of
``test_bench_txn.py::test_consume_transform_produce`` (``receive_many(100)``,
``new_transaction``, ``send_batch(txn=)``, ``ack(txn=)``, ``commit``) with
the same identity transform. Both sides run in one broker, each on its own
input and output topic, and take turns round by round
(``test_bench_producers.alternate``). A round is 10 transactions.

Goal (reported, not asserted): the runner keeps >= 80 % of the raw loop's
throughput.
"""

from __future__ import annotations

import os

import pyarrow as pa

import conftest
import txmq
from test_bench_producers import alternate
from test_bench_send import payloads
from txmq.functions import Function

TXN_MESSAGES = 100           # messages per transaction
TXNS_PER_ROUND = 10
ROUNDS, WARMUP = 200, 10
FILL = (ROUNDS + WARMUP + 4) * TXNS_PER_ROUND * TXN_MESSAGES   # per side, with room to spare
TXN_TIMEOUT = 900.0

GROUP = "functions_identity_never"
COMPARISON = conftest.Comparison(
    "identity function 100/txn vs raw consume-transform-produce loop, never", "function", "raw loop",
    0.8, ">=", note="goal >= 80% of the hand-written loop's throughput")
conftest.add_comparison(GROUP, COMPARISON)


def identity(m):
    return m.value


def test_identity_function_vs_raw_loop(measure, benchmark, results, tmp_path, request):
    """Per transaction on both sides: 100 messages received under
    read_committed, their values sent to the output in one batch in the
    transaction, the inputs acknowledged in it, commit."""
    os.sync()                        # no writeback left over from an earlier test
    broker = txmq.Broker(tmp_path / "data", fsync="never")
    request.addfinalizer(broker.close)
    arr = pa.array(payloads(1000, 100), pa.binary())
    for side in ("raw", "fn"):
        broker.create_topic(f"in-{side}", 1)
        broker.create_topic(f"out-{side}", 1)
        feed = broker.producer(f"in-{side}")
        for _ in range(FILL // len(arr)):
            feed.send_batch(arr)

    consumer = broker.subscribe("in-raw", "s", isolation="read_committed", initial_position="earliest")
    producer = broker.producer("out-raw")
    new_txn = broker.new_transaction
    raw_counts = []

    def raw_round():
        for _ in range(TXNS_PER_ROUND):
            msgs = consumer.receive_many(TXN_MESSAGES, 1.0)
            txn = new_txn(TXN_TIMEOUT)
            producer.send_batch([identity(m) for m in msgs], partition=0, txn=txn)
            consumer.ack(msgs, txn=txn)
            txn.commit()
            raw_counts.append(len(msgs))

    fn = Function(broker, "identity", ["in-fn"], "out-fn", identity, batch_size=TXN_MESSAGES,
                  subscription_type="exclusive", transaction_timeout=TXN_TIMEOUT)
    request.addfinalizer(fn.close)
    fn_counts = []

    def fn_round():
        for _ in range(TXNS_PER_ROUND):
            fn_counts.append(fn.step(1.0))

    runs_raw, runs_fn = alternate(measure, benchmark, results, GROUP, ("raw loop", raw_round),
                                  ("function", fn_round), ops_per_round=TXNS_PER_ROUND * TXN_MESSAGES,
                                  unit="msg", rounds=ROUNDS, warmup=WARMUP)
    # Both sides moved full transactions, one per step, and committed each.
    assert raw_counts and set(raw_counts) == {TXN_MESSAGES}, sorted(set(raw_counts))
    assert fn_counts and set(fn_counts) == {TXN_MESSAGES}, sorted(set(fn_counts))
    m = fn.metrics()
    assert m["committed"] == len(fn_counts) and m["aborted"] == 0 and m["processed"] == sum(fn_counts)
    for side, counts in (("raw", raw_counts), ("fn", fn_counts)):
        out = broker.stats()["topics"][f"out-{side}"]["partitions"][0]
        assert out["end_offset"] == len(counts) * (TXN_MESSAGES + 1) and out["open_transactions"] == 0
