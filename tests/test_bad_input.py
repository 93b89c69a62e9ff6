"""Bad input to the public calls (DESIGN.md §6: a typed error from
txmq.errors naming the value, never a bare exception, a crash or a
half-written state). The options of Broker() and create_topic() are in
test_options.py."""

from __future__ import annotations

import pyarrow as pa
import pytest

import txmq
from txmq import errors


@pytest.fixture
def broker(tmp_path):
    b = txmq.Broker(tmp_path / "data", fsync="never")
    b.create_topic("t", partitions=2)
    yield b
    b.close()


def log_values(broker, topic="t"):
    out = []
    for part in broker._topic(topic).partitions:
        out += [m[2] for m in part.read(part.start_offset, 10**9)]
    return sorted(out)


# -- send / send_batch ---------------------------------------------------------------


@pytest.mark.parametrize("txn", ["abc", 5, object(), (0, 1)])
def test_txn_must_be_a_transaction(broker, txn):
    p = broker.producer("t")
    with pytest.raises(errors.InvalidArgumentError) as e:
        p.send(b"x", txn=txn)
    assert e.value.name == "txn" and e.value.value is txn
    with pytest.raises(errors.InvalidArgumentError):
        p.send_batch([b"x"], txn=txn)
    m = p.send(b"in")
    c = broker.subscribe("t", "s", initial_position="earliest")
    got = c.receive(1)
    for ack in (c.ack, c.ack_cumulative):
        with pytest.raises(errors.InvalidArgumentError) as e:
            ack(got, txn=txn)
        assert e.value.name == "txn"
    assert log_values(broker) == [b"in"] and m == got.message_id


def test_a_transaction_of_another_broker_is_refused(broker, tmp_path):
    with txmq.Broker(tmp_path / "other", fsync="never") as other:
        txn = other.new_transaction()
        with pytest.raises(errors.InvalidArgumentError) as e:
            broker.producer("t").send(b"x", txn=txn)
        assert e.value.name == "txn"


@pytest.mark.parametrize("headers", [5, 1.5, object(), [("k", b"v"), 7], {"k": 5}, {5: b"v"}, [("k",)]])
def test_bad_headers_are_invalid_messages(broker, headers):
    p = broker.producer("t")
    with pytest.raises(errors.InvalidMessageError):
        p.send(b"x", headers=headers)
    with pytest.raises(errors.InvalidMessageError):
        p.send_batch([b"a"], headers=[headers])
    assert log_values(broker) == []


@pytest.mark.parametrize("headers", [5, "ab", object(), {"k": b"v"}, [None, None]])
def test_send_batch_headers_need_one_entry_per_message(broker, headers):
    with pytest.raises(errors.InvalidMessageError):
        broker.producer("t").send_batch([b"a"], headers=headers)
    assert log_values(broker) == []


@pytest.mark.parametrize("values", [None, 5, b"ab", "ab", bytearray(b"ab"), {b"a": b"b"}, object()])
def test_send_batch_refuses_what_is_not_a_sequence_of_messages(broker, values):
    with pytest.raises(errors.InvalidMessageError) as e:
        broker.producer("t").send_batch(values)
    assert e.value.value is values
    assert log_values(broker) == []


def test_send_batch_takes_any_iterable(broker):
    p = broker.producer("t")
    mids = p.send_batch(iter([b"a", b"b"]), partition=0)
    assert [m.offset for m in mids] == [0, 1]
    p.send_batch((v for v in [b"c", b"d"]), keys=iter([b"k1", b"k2"]), headers=iter([{"h": b"1"}, None]),
                 event_times=iter([1, 2]))
    with pytest.raises(errors.InvalidMessageError):
        p.send_batch(iter([]))
    p.send_batch(pa.chunked_array([[b"e"], [b"f"]]), partition=1)
    assert log_values(broker) == [b"a", b"b", b"c", b"d", b"e", b"f"]


@pytest.mark.parametrize("partition", [True, False, 1.0, "1", -1, 2, 2**70])
def test_partition_must_be_an_int_in_range(broker, partition):
    p = broker.producer("t")
    with pytest.raises(errors.PartitionNotFoundError) as e:
        p.send(b"x", partition=partition)
    assert e.value.partition is partition
    with pytest.raises(errors.PartitionNotFoundError):
        p.send_batch([b"x"], partition=partition)
    assert log_values(broker) == []


def test_a_producer_of_a_deleted_topic_gets_topic_not_found(broker):
    broker.create_topic("gone", partitions=2)
    p = broker.producer("gone")
    txn = broker.new_transaction()
    broker.delete_topic("gone")
    for send in (lambda: p.send(b"x"), lambda: p.send(b"x", partition=1), lambda: p.send_batch([b"x"]),
                 lambda: p.send_batch([b"x", b"y"], keys=[b"a", b"b"]), lambda: p.send(b"x", txn=txn)):
        with pytest.raises(errors.TopicNotFoundError) as e:
            send()
        assert e.value.name == "gone"
    txn.commit()
