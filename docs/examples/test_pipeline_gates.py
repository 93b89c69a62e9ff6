"""Gating a pipeline that embeds txmq: an example (docs/GATES.md).

The pipeline reads ``orders``, enriches each value and writes ``enriched``,
exactly once (read, write and acknowledgement in one transaction per 100
messages). Three gates from ``perf_gates.toml`` beside this file:

- a ratio: the pipeline's rate ÷ the rate of the same ``enrich`` over a
  Python list, both measured in the same run (``txmq_gate.ratio``);
- two counts, which do not depend on the machine: flushes per committed
  batch at fsync="commit" and Python calls per step of 100 messages.

Run it as a benchmark (``pytest --benchmark-only docs/examples``) to gate
the ratio; under ``--benchmark-disable`` (txmq's own test suite runs it
that way) the ratio's sides run once and only the counts are held.
"""

from __future__ import annotations

import os

import pytest

from txmq.testing import gates
from txmq.testing.counters import FlushCounter, count_calls

GATES = gates.by_name(gates.load(os.path.join(os.path.dirname(__file__), "perf_gates.toml")))
BATCH = 100


def enrich(value: bytes) -> bytes:
    return value.upper() + b"|seen"


def fill(broker, n: int):
    broker.create_topic("orders", 1)
    broker.create_topic("enriched", 1)
    broker.producer("orders").send_batch([b"order-%06d" % i for i in range(n)], partition=0)
    return (broker.subscribe("orders", "enricher", isolation="read_committed", initial_position="earliest"),
            broker.producer("enriched"))


def step(broker, consumer, producer) -> int:
    """One exactly-once batch: receive, enrich, send and ack in a transaction."""
    msgs = consumer.receive_many(BATCH, 1.0)
    txn = broker.new_transaction(60)
    producer.send_batch([enrich(m.value) for m in msgs], partition=0, txn=txn)
    consumer.ack(msgs, txn=txn)
    txn.commit()
    return len(msgs)


def test_pipeline_vs_list(txmq_broker, txmq_gate):
    rounds, warmup, per_round = 20, 2, 1000
    consumer, producer = fill(txmq_broker, (rounds + warmup + 2) * 2 * per_round)
    values = [b"order-%06d" % i for i in range(per_round)]

    def pipeline():
        for _ in range(per_round // BATCH):
            assert step(txmq_broker, consumer, producer) == BATCH

    def plain():
        [enrich(v) for v in values]

    txmq_gate.ratio(GATES["enrich 1000 messages: txmq pipeline vs the same enrich over a list"],
                    pipeline, plain, ops_per_round=per_round, rounds=rounds, warmup=warmup)


@pytest.mark.txmq(fsync="commit")
def test_flushes_per_commit(txmq_broker, txmq_gate):
    consumer, producer = fill(txmq_broker, 20 * BATCH)
    step(txmq_broker, consumer, producer)          # the first batch opens the files
    with FlushCounter() as flushes:
        for _ in range(10):
            step(txmq_broker, consumer, producer)
    txmq_gate.count(GATES["flushes per committed batch, fsync=commit"], flushes.total / 10)


def test_calls_per_message(txmq_broker, txmq_gate):
    consumer, producer = fill(txmq_broker, 20 * BATCH)
    step(txmq_broker, consumer, producer)
    calls = count_calls(step, txmq_broker, consumer, producer)
    txmq_gate.count(GATES["python calls per pipeline step of 100 messages"], calls)
