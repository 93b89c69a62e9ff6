"""Acks held by open transactions (dispatch/pending_acks.py) as dispatch
sees them: what a receive and an ack inside a transaction cost does not
grow with the acks that transaction already holds. Counted in Python calls
(txmq.testing.counters), so the test cannot flake; the time per call is
gated in bench/ (test_bench_txn.py, "acks in a transaction that holds
many")."""

import txmq
from txmq.testing.counters import count_calls

PAIRS = 200                  # receive() + ack(m, txn=) pairs counted


def calls_with_held(tmp_path, held: int) -> int:
    """Python calls of PAIRS receive + ack(txn=) pairs in a transaction
    that first took ``held`` messages as pending acks."""
    with txmq.Broker(tmp_path / f"held-{held}", fsync="never") as broker:
        broker.create_topic("t", 1)
        for _ in range((held + PAIRS) // 1000 + 1):
            broker.producer("t").send_batch([b"v" * 100] * 1000, partition=0)
        consumer = broker.subscribe("t", "s", initial_position="earliest")
        txn = broker.new_transaction(900)
        left = held
        while left:
            msgs = consumer.receive_many(min(left, 1000), 1.0)
            consumer.ack(msgs, txn=txn)
            left -= len(msgs)

        def pairs():
            for _ in range(PAIRS):
                consumer.ack(consumer.receive(1.0), txn=txn)

        calls = count_calls(pairs)
        assert broker.stats()["topics"]["t"]["subscriptions"]["s"]["unacked"] == 0
        txn.abort()
        return calls


def test_receive_and_ack_in_a_transaction_cost_the_same_however_many_it_holds(tmp_path):
    few, many = calls_with_held(tmp_path, 1_000), calls_with_held(tmp_path, 50_000)
    assert few == many, f"{few} calls with 1,000 held, {many} with 50,000"
