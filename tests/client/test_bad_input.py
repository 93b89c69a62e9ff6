"""Bad input to the public calls: a typed error from txmq.errors naming
the value, never a bare exception, a crash or a half-written state. The options of Broker() and create_topic() are in
tests/broker/test_options.py."""

from __future__ import annotations

import math
import shutil
import tempfile

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

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


@pytest.mark.parametrize("keys", [(0, 0), [b"k", 1.5]])
def test_send_batch_keys_that_are_not_bytes_are_invalid_messages_on_any_topic(broker, keys):
    """Keys routing a batch over several partitions are checked as a
    one-partition topic's are: an InvalidMessageError, not a TypeError."""
    broker.create_topic("multi", 3)
    with pytest.raises(errors.InvalidMessageError, match="key at index"):
        broker.producer("multi").send_batch([b"a", b"b"], keys=keys)
    assert broker.high_watermark("multi", 0) == 0


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


@pytest.mark.parametrize("how", ["receive", "receive_many", "receive_batch"])
@pytest.mark.parametrize("timeout", [math.nan, -1, -0.5, math.inf, True, "1", b"1", object()])
def test_receive_timeout_must_be_none_or_finite_seconds(broker, how, timeout):
    """A nan timeout used to spin forever (it neither expires nor waits)."""
    c = broker.subscribe("t", "s")
    call = getattr(c, how)
    args = (timeout,) if how == "receive" else (5, timeout)
    with pytest.raises(errors.InvalidArgumentError) as e:
        call(*args)
    assert e.value.name == "timeout"
    assert call(*((0,) if how == "receive" else (5, 0))) in (None, [])


@pytest.mark.parametrize("messages", [None, "id", b"id", 5, {"a": 1}, [None], [5]])
def test_ack_of_junk_is_refused(broker, messages):
    c = broker.subscribe("t", "s", initial_position="earliest")
    for how in ("ack", "ack_cumulative", "nack"):
        with pytest.raises(errors.InvalidArgumentError):
            getattr(c, how)(messages)


@pytest.mark.parametrize("partition", ["", "0", 2, -1, True, 1.0])
@pytest.mark.parametrize("target", [0, "earliest", "latest"])
def test_seek_partition_must_be_a_partition(broker, target, partition):
    c = broker.subscribe("t", "s")
    with pytest.raises(errors.InvalidArgumentError) as e:
        c.seek(target, partition=partition)
    assert e.value.name == "partition"


def test_seek_timestamp_must_be_int_milliseconds(broker):
    c = broker.subscribe("t", "s")
    for ts in (True, 1.5, "0"):
        with pytest.raises(errors.InvalidArgumentError):
            c.seek(timestamp=ts)


@pytest.mark.parametrize("half_ids", ["t", b"1", False, 5, [None], ["1"]])
def test_resume_half_checks_takes_half_ids(broker, half_ids):
    with pytest.raises(errors.InvalidArgumentError):
        broker.resume_half_checks(half_ids)


def test_staged_ingest_and_sink_arguments(broker):
    for sink in (False, "k", ("k",), ("k", "1"), ("", 0), ("k", -1), ("k", True)):
        with pytest.raises(errors.InvalidArgumentError):
            broker.ingest_staged("job", [], sink=sink)
    for attempts in (None, 5, "a", [None]):
        with pytest.raises(errors.InvalidArgumentError):
            broker.ingest_staged("job", attempts)
    for sink in ([], None, 5, ""):
        with pytest.raises(errors.InvalidArgumentError):
            broker.sink_batch_id(sink)
    assert broker.sink_batch_id("k") == -1


def test_transactional_producer_topic_must_be_a_topic_name(broker):
    tp = broker.transactional_producer("tp")
    for topic in ([], None, 5):
        with pytest.raises(errors.InvalidTopicNameError):
            tp.producer(topic)
    assert tp.producer("t") is tp.producer("t")


def test_acks_with_non_int_offsets_are_refused(broker):
    broker.producer("t").send_batch([b"a", b"b", b"c"], partition=0)
    c = broker.subscribe("t", "s", initial_position="earliest")
    with pytest.raises(errors.NotAcknowledgeableError):
        c.ack([txmq.MessageId("t", 0, 0), txmq.MessageId("t", 0, 1.5), txmq.MessageId("t", 0, 2)])
    assert len(c.receive_many(10, timeout=1)) == 3


def test_size_limit_counts_the_key(tmp_path):
    with txmq.Broker(tmp_path / "d", fsync="never", max_message_bytes=1000) as b:
        b.create_topic("t")
        p = b.producer("t")
        p.send(b"v" * 900, key=b"k" * 100)
        with pytest.raises(errors.MessageTooLargeError):
            p.send(b"v" * 900, key=b"k" * 101)
        with pytest.raises(errors.MessageTooLargeError):
            p.send_batch(pa.array([b"v" * 900]), keys=pa.array([b"k" * 200]))
    with pytest.raises(errors.InvalidArgumentError):
        txmq.Broker(tmp_path / "e", segment_bytes_max=2**31)


# -- every public call, driven with junk --------------------------------------------------

# Values of the wrong type or out of range for any parameter: the property
# below passes them everywhere and accepts only txmq.errors out.
JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.sampled_from([-1, 0, 1, 2**31, 2**63, -2**63 - 1]),
    st.floats(), st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e-300, 1e300]),
    st.text(max_size=6), st.binary(max_size=6),
    st.lists(st.one_of(st.none(), st.integers(-5, 5), st.binary(max_size=3), st.text(max_size=2)), max_size=3),
    st.dictionaries(st.text(max_size=3), st.one_of(st.integers(), st.binary(max_size=2), st.none()), max_size=2),
    st.tuples(st.integers(-3, 3), st.integers(-3, 3)), st.tuples(st.text(max_size=2), st.integers(-1, 3)),
    st.builds(object),
    st.sampled_from([int, float, str, bytes, bytearray, complex, tuple, frozenset, list, dict]).flatmap(
        lambda t: st.from_type(t).filter(lambda v: len(repr(v)) < 200)),
)
# A timeout that would not make a test wait long: junk, minus the real numbers
# above 0.05 s (valid, and a receive would wait that long).
SHORT_TIMEOUT = st.one_of(st.sampled_from([0, 0.01]),
                          JUNK.filter(lambda v: not (isinstance(v, (int, float)) and not isinstance(v, bool)
                                                     and v > 0.05) and v is not None))
TXN = object()          # drawn: the machine's open transaction
MSG = object()          # drawn: a message the consumer received


def arg(*valid):
    """A parameter's value: one of ``valid`` or junk."""
    return st.one_of(st.sampled_from(valid), JUNK)


class JunkEverywhere(RuleBasedStateMachine):
    """Drives the public calls of Broker, Producer, TransactionalProducer,
    HalfProducer, Consumer and Transaction with junk. Every call either
    works or raises a txmq.errors error; at the end the directory opens
    again and holds every message whose send returned."""

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="txmq-junk-")
        self.broker = txmq.Broker(self.dir, fsync="never", control_socket=False, retention_check_interval=3600,
                                  half_check_interval=3600)
        self.broker.create_topic("t", partitions=2)
        self.producer = self.broker.producer("t")
        self.consumer = self.broker.subscribe("t", "s", initial_position="earliest")
        self.tp = self.broker.transactional_producer("tp")
        self.hp = self.broker.half_producer("t", "g")
        self.txn = self.broker.new_transaction()
        self.sent = {}               # (partition, offset) -> value of every send that returned
        self.received = []

    def call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except txmq.errors.TxmqError:
            return None

    def resolve(self, data, value):
        """TXN and MSG stand for the machine's transaction and messages."""
        if value is TXN:
            if self.txn.state is not txmq.TxnState.OPEN:
                self.txn = self.broker.new_transaction()
            return self.txn
        if value is MSG:
            if not self.received:
                return None
            return data.draw(st.sampled_from(self.received), label="message")
        return value

    def record(self, mids, values):
        if mids is not None:
            for mid, v in zip([mids] if isinstance(mids, txmq.MessageId) else list(mids), values):
                self.sent[(mid.partition, mid.offset)] = bytes(v)

    @rule(data=st.data(), value=arg(b"v"), key=arg(None, b"k", "k"), headers=arg(None, {"h": b"1"}, [("h", None)]),
          event_time=arg(None, 1000), partition=arg(None, 0, 1), txn=arg(None, TXN), sequence=arg(None))
    def send(self, data, value, key, headers, event_time, partition, txn, sequence):
        txn = self.resolve(data, txn)
        mid = self.call(self.producer.send, value, key=key, headers=headers, event_time=event_time,
                        partition=partition, txn=txn, sequence=sequence)
        if txn is None:
            self.record(mid, [value])

    @rule(data=st.data(), values=arg([b"a", b"b"], (b"c",)), keys=arg(None, [b"k", None]),
          headers=arg(None, [{"h": b"1"}, None]), event_times=arg(None, [1, 2]), partition=arg(None, 0, 1),
          txn=arg(None, TXN), sequence=arg(None))
    def send_batch(self, data, values, keys, headers, event_times, partition, txn, sequence):
        txn = self.resolve(data, txn)
        mids = self.call(self.producer.send_batch, values, keys=keys, headers=headers, event_times=event_times,
                         partition=partition, txn=txn, sequence=sequence)
        if txn is None and mids is not None:
            self.record(mids, list(values))

    @rule(how=st.sampled_from(["receive", "receive_many", "receive_batch"]), n=arg(1, 5), timeout=SHORT_TIMEOUT)
    def receive(self, how, n, timeout):
        c = self.consumer
        if how == "receive":
            m = self.call(c.receive, timeout)
            got = [] if m is None else [m]
        elif how == "receive_many":
            got = self.call(c.receive_many, n, timeout) or []
        else:
            rb = self.call(c.receive_batch, n, timeout)
            got = [] if rb is None else [rb]
        self.received = (self.received + got)[-20:]

    @rule(data=st.data(), how=st.sampled_from(["ack", "ack_cumulative", "nack"]),
          messages=st.one_of(arg(MSG), st.lists(arg(MSG), max_size=3)), txn=arg(None, TXN))
    def acknowledge(self, data, how, messages, txn):
        messages = ([self.resolve(data, m) for m in messages] if isinstance(messages, list)
                    else self.resolve(data, messages))
        txn = self.resolve(data, txn)
        if how == "nack":
            self.call(self.consumer.nack, messages)
        else:
            self.call(getattr(self.consumer, how), messages, txn=txn)

    @rule(where=arg("earliest", "latest", 0, 3), timestamp=arg(None), partition=arg(None, 0, 1))
    def seek(self, where, timestamp, partition):
        self.call(self.consumer.seek, where, timestamp=timestamp, partition=partition)

    @rule(data=st.data(), how=st.sampled_from(["commit", "abort", "new", "info", "force"]),
          value=arg(60, 0.5), txn=arg(TXN))
    def transaction(self, data, how, value, txn):
        txn = self.resolve(data, txn)
        if how == "new":
            self.txn = self.call(self.broker.new_transaction, value) or self.txn
        elif how in ("info", "force"):
            fn = self.broker.transaction_info if how == "info" else self.broker.abort_transaction
            self.call(fn, txn.id if isinstance(txn, txmq.Transaction) else txn)
        elif isinstance(txn, txmq.Transaction):
            self.call(getattr(txn, how))

    @rule(data=st.data(), how=st.sampled_from(["begin", "producer", "offsets", "open"]),
          a=arg(5, "t"), b=arg("s", ("t", "s")), offsets=arg({0: 1}, {1: 0}), txn=arg(TXN))
    def transactional(self, data, how, a, b, offsets, txn):
        tp = self.tp
        if how == "begin":
            self.call(tp.begin, a if a != "t" else None)
        elif how == "producer":
            p = self.call(tp.producer, a)
            if p is not None:
                self.call(p.send, b"in-txn", txn=self.resolve(data, txn))
        elif how == "offsets":
            sub = self.consumer if b == "s" else b
            self.call(tp.send_offsets_to_transaction, self.resolve(data, txn), sub, offsets)
        else:
            self.tp = self.call(self.broker.transactional_producer, "tp" if a == 5 else a, b if b != "s" else 60) \
                or self.tp

    @rule(value=arg(b"h"), local=st.sampled_from(["commit", "junk", "raise", "none"]) | JUNK, state=JUNK,
          key=arg(None, b"k"), headers=arg(None, {"h": b"1"}), event_time=arg(None, 5), immunity=arg(None, 0))
    def half(self, value, local, state, key, headers, event_time, immunity):
        def local_txn(message, a):
            if local == "raise":
                raise RuntimeError("the local transaction failed")
            return (txmq.LocalTransactionState.COMMIT if local == "commit"
                    else None if local == "none" else state)
        fn = local_txn if isinstance(local, str) and local in ("commit", "junk", "raise", "none") else local
        r = self.call(self.hp.send_in_transaction, value, fn, None, key=key, headers=headers,
                      event_time=event_time, check_immunity=immunity)
        if r is not None and r.message_id is not None:
            self.record(r.message_id, [value])
        self.call(self.hp.end_transaction, state, txmq.LocalTransactionState.ROLLBACK)
        if r is not None:
            self.call(self.hp.end_transaction, r.half_id, state)

    @rule(how=st.sampled_from(["create_topic", "describe_topic", "delete_topic", "producer", "subscribe",
                               "subscriptions", "high_watermark", "last_stable_offset", "aborted_transactions",
                               "consumer_lag", "half_producer", "resume_half_checks", "ingest_staged",
                               "sink_batch_id", "unsubscribe"]),
          a=arg("t", "u"), b=arg(None, 0, "x"), c=JUNK, d=JUNK)
    def broker_call(self, how, a, b, c, d):
        br = self.broker
        if how == "create_topic":
            self.call(br.create_topic, a, b, retention_ms=c, retention_bytes=d)
        elif how == "delete_topic":
            if a != "t":                  # the topic whose data the end checks
                self.call(br.delete_topic, a, force=b)
        elif how == "producer":
            self.call(br.producer, a, b)
        elif how == "subscribe":
            consumer = self.call(br.subscribe, a, b, c, isolation=d, initial_position="earliest",
                                 ack_timeout=c, nack_delay=d, consumer_name=c)
            if consumer is not None:
                consumer.close()
        elif how == "unsubscribe":
            if b != "s":
                consumer = self.call(br.subscribe, a, b)
                if consumer is not None:
                    self.call(consumer.unsubscribe)
        elif how in ("high_watermark", "last_stable_offset"):
            self.call(getattr(br, how), a, b)
        elif how == "aborted_transactions":
            self.call(br.aborted_transactions, a, b, c, d)
        elif how == "half_producer":
            hp = self.call(br.half_producer, a, b, checker=c)
            if hp is not None:
                hp.close()
        elif how == "ingest_staged":
            self.call(br.ingest_staged, b, c, sink=d)
        elif how in ("describe_topic", "subscriptions", "resume_half_checks", "sink_batch_id"):
            self.call(getattr(br, how), a)
        else:
            self.call(getattr(br, how), a, b)

    @rule()
    def housekeeping(self):
        br = self.broker
        br.stats()
        br.flush()
        br.enforce_retention()
        br.check_half_messages()
        br.transactions()

    def teardown(self):
        self.broker.close()
        try:
            with txmq.Broker(self.dir, fsync="never", control_socket=False) as b:
                parts = b._topic("t").partitions
                for (p, offset), value in self.sent.items():
                    got = parts[p].read(offset, 1)
                    assert got and got[0][0] == offset and got[0][2] == value, (p, offset, value, got)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


TestJunkEverywhere = JunkEverywhere.TestCase
TestJunkEverywhere.settings = settings(max_examples=50, stateful_step_count=40, deadline=None,
                                       suppress_health_check=list(HealthCheck))


@pytest.mark.slow
def test_junk_everywhere_long():
    run_state_machine_as_test(JunkEverywhere, settings=settings(
        max_examples=400, stateful_step_count=60, deadline=None, suppress_health_check=list(HealthCheck)))


@pytest.mark.parametrize("name", [[], None, 5, ""])
def test_a_subscription_name_that_is_not_one_is_refused_by_every_lookup(broker, name):
    with pytest.raises(errors.InvalidSubscriptionNameError):
        broker.consumer_lag("t", name)
