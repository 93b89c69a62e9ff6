"""Acks held by open transactions (dispatch/pending_acks.py) as dispatch
sees them: what a receive and an ack inside a transaction cost does not
grow with the acks that transaction already holds. Counted in Python calls
(txmq.testing.counters), so the test cannot flake; the time per call is
gated in bench/ (test_bench_txn.py, "acks in a transaction that holds
many")."""

import pytest

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


def test_the_compiled_ack_records_only_the_common_case(tmp_path):
    """``ack_in`` (the compiled ``ack(m, txn=)``) records an ack only when
    the pending-ack table's ``ack_one`` need not register, raise or
    refuse; in every other case it changes nothing and says False, and
    ``ack_one`` takes over."""
    from txmq import errors
    from txmq._txn import ack_in
    from txmq.message import Message, MessageId
    from txmq.transactions.records import TxnState
    with txmq.Broker(tmp_path / "d", fsync="never") as broker:
        broker.create_topic("t", 2)
        broker.create_topic("u")
        broker.producer("t").send_batch([b"v"] * 10, partition=1)
        broker.producer("u").send_batch([b"v"] * 10)
        consumer = broker.subscribe("t", "s", initial_position="earliest")
        other = broker.subscribe("u", "s", initial_position="earliest").receive_many(10, 1.0)
        msgs = consumer.receive_many(10, 1.0)
        pending = consumer._sub.pending_acks

        def recorded(t, m):
            return ack_in(pending, t._meta, m.topic, m.partition, m.offset, TxnState.OPEN)
        lane = consumer._sub.lanes[1]
        txn, rival = broker.new_transaction(60), broker.new_transaction(60)
        assert not recorded(txn, msgs[0])    # not registered yet
        assert len(lane.pending) == 0
        consumer.ack(msgs[0], txn=txn)                                            # registers
        assert recorded(txn, msgs[1])
        assert recorded(txn, msgs[1])        # held already: no change
        assert not recorded(txn, other[0])   # another topic
        for partition in (2, -1, 2**64, -2**64):                                   # no such partition
            made = Message(b"v", None, None, MessageId("t", partition, 0), 0, 0)
            assert not recorded(txn, made)
            with pytest.raises(errors.NotAcknowledgeableError):
                consumer.ack(made, txn=txn)
        consumer.ack(msgs[5], txn=rival)
        held = len(lane.pending)
        assert not recorded(txn, msgs[5])    # the rival holds it
        assert not recorded(rival, msgs[1])  # txn holds it
        assert len(lane.pending) == held == 3
        txn.commit()
        assert not recorded(txn, msgs[2])    # no longer open
        assert lane.cursor.is_acked(msgs[1].offset) and not lane.cursor.is_acked(msgs[2].offset)
        rival.abort()
        assert not lane.cursor.is_acked(msgs[5].offset)
