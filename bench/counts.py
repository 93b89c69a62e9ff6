"""The counts txmq's performance gates hold exactly: flushes per durable
commit, Python-level calls per operation, memory blocks per received
message. Each workload runs on a fresh broker in a directory it is given
and returns ``{count name: value}``; the names are those of
``bench/gates.toml``'s ``[[count]]`` gates.

These do not depend on the machine, so they run in the test suite too
(``tests/testing/test_perf_gates.py``) and gate exactly: a ceiling equal to
today's count. A change that lowers one lowers its ceiling in the same
commit (bench/README.md, "Raising a gate").
"""

from __future__ import annotations

import os

import txmq
from txmq.testing.counters import FlushCounter, count_blocks, count_calls, net_blocks

TXN_TIMEOUT = 900.0
TXN_MESSAGES = 100           # the consume-transform-produce loop of test_bench_txn.py
VALUE = b"v" * 100


def _fed_broker(path, fsync: str, messages: int):
    """A broker with topics ``in`` (``messages`` of 100 B) and ``out``, and a
    read_committed subscription on ``in``."""
    broker = txmq.Broker(path, fsync=fsync)
    broker.create_topic("in", 1)
    broker.create_topic("out", 1)
    feed = broker.producer("in")
    for _ in range(messages // 1000):
        feed.send_batch([VALUE] * 1000, partition=0)
    consumer = broker.subscribe("in", "s", isolation="read_committed", initial_position="earliest")
    broker.high_watermark("out", 0)      # partitions open on first use: not inside a count
    return broker, consumer, broker.producer("out")


def flushes(path) -> dict:
    """Flush syscalls per durable commit (fsync="commit"): the consume-
    transform-produce transaction (``send_batch(txn=)`` + ``ack(list,
    txn=)``), a transaction that only sends, and a half message whose local
    transaction commits."""
    commits = 20
    broker, consumer, producer = _fed_broker(os.path.join(path, "flush"), "commit", 4000)
    try:
        def ctp():
            msgs = consumer.receive_many(TXN_MESSAGES, 1.0)
            txn = broker.new_transaction(TXN_TIMEOUT)
            producer.send_batch([m.value for m in msgs], partition=0, txn=txn)
            consumer.ack(msgs, txn=txn)
            txn.commit()

        def send_only():
            txn = broker.new_transaction(TXN_TIMEOUT)
            producer.send_batch([VALUE] * TXN_MESSAGES, partition=0, txn=txn)
            txn.commit()

        half = broker.half_producer("out", "gate")
        commit_now = lambda message, arg: txmq.LocalTransactionState.COMMIT  # noqa: E731
        out = {}
        for name, one in (("flushes per commit: consume-transform-produce, fsync=commit", ctp),
                          ("flushes per commit: send-only transaction, fsync=commit", send_only),
                          ("flushes per half message, local transaction commits, fsync=commit",
                           lambda: half.send_in_transaction(VALUE, commit_now))):
            one()                                 # first use opens files: not the steady state
            with FlushCounter() as f:
                for _ in range(commits):
                    one()
            out[name] = f.total / commits
        return out
    finally:
        broker.close()


def calls(path) -> dict:
    """Python-level calls per operation, fsync="never": the README's
    consume-transform-produce loop message by message (``send(txn=)``,
    ``ack(m, txn=)``), its begin + commit, and ``send()`` and
    ``send_in_transaction`` outside a transaction."""
    n = TXN_MESSAGES
    broker, consumer, producer = _fed_broker(os.path.join(path, "calls"), "never", 2000)
    try:
        out = {}
        msgs = consumer.receive_many(n, 1.0)
        txn = broker.new_transaction(TXN_TIMEOUT)
        send, ack = producer.send, consumer.ack
        out["python calls per send(txn=)"] = count_calls(
            lambda: [send(m.value, partition=0, txn=txn) for m in msgs]) / n
        out["python calls per ack(message, txn=)"] = count_calls(
            lambda: [ack(m, txn=txn) for m in msgs]) / n
        txn.commit()
        msgs = consumer.receive_many(n, 1.0)
        out["python calls per ack(list, txn=) of 100"] = count_calls(_ack_list_in_txn, broker, consumer, msgs)
        out["python calls per begin + commit (100 sends, 100 acks)"] = count_calls(
            _begin_commit, broker, producer, consumer, n)
        out["python calls per send()"] = count_calls(lambda: [send(VALUE, partition=0) for _ in range(n)]) / n
        half = broker.half_producer("out", "gate")
        commit_now = lambda message, arg: txmq.LocalTransactionState.COMMIT  # noqa: E731
        half.send_in_transaction(VALUE, commit_now)
        out["python calls per send_in_transaction (local transaction commits)"] = count_calls(
            lambda: [half.send_in_transaction(VALUE, commit_now) for _ in range(n)]) / n
        return out
    finally:
        broker.close()


def _ack_list_in_txn(broker, consumer, msgs):
    txn = broker.new_transaction(TXN_TIMEOUT)
    consumer.ack(msgs, txn=txn)
    txn.abort()


def _begin_commit(broker, producer, consumer, n):
    """Everything of one README-loop transaction but its sends and acks is
    counted here: the sends and acks run uncounted in between."""
    import sys
    saved = sys.getprofile()
    txn = broker.new_transaction(TXN_TIMEOUT)
    sys.setprofile(None)
    msgs = consumer.receive_many(n, 1.0)
    for m in msgs:
        producer.send(m.value, partition=0, txn=txn)
        consumer.ack(m, txn=txn)
    sys.setprofile(saved)
    txn.commit()


def blocks(path) -> dict:
    """Memory blocks per received message (fsync="never"): those a
    ``receive_many(1000)`` allocates and keeps alive while the caller holds
    the messages (the Message, its value, its offset in the dispatch
    table...), and those a receive + ack + drop leaves behind in the steady
    state (a leak; 0 today)."""
    n, rounds = 1000, 10
    broker, consumer, _ = _fed_broker(os.path.join(path, "blocks"), "never", (rounds + 4) * n)
    try:
        def round_trip():
            consumer.ack(consumer.receive_many(n, 1.0))

        round_trip()                   # the first calls size the dispatch tables
        msgs, held = count_blocks(consumer.receive_many, n, 1.0)
        assert len(msgs) == n
        consumer.ack(msgs)
        del msgs
        left = net_blocks(round_trip, rounds)
        return {"memory blocks held per received message (receive_many(1000))": held.count / n,
                "memory blocks left per message after receive_many(1000) + ack(list)": left / n}
    finally:
        broker.close()


WORKLOADS = {"flushes": flushes, "calls": calls, "blocks": blocks}


def measure_all(path) -> dict:
    """Every count, ``{name: value}``."""
    out = {}
    for fn in WORKLOADS.values():
        out.update(fn(path))
    return out
