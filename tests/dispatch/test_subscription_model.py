"""Hypothesis stateful test: random send / receive / ack / ack_cumulative /
nack / seek / restart against a small pure-Python model of a subscription.

The model knows, per partition, the log, the acknowledged offsets, the
cursor's start (moved by seek) and what is outstanding at the consumer.
Every delivery must be of an available message with the right bytes and
redelivery count; after every step the broker's backlog must match; a
restart must resume exactly at the unacknowledged messages.
"""

import shutil
import tempfile

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import txmq

PARTITIONS = 2


class SubscriptionModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="txmq-model-")
        self.broker = txmq.Broker(self.dir, fsync="never", segment_bytes_max=16384,
                                  index_interval_bytes=256)
        self.broker.create_topic("t", partitions=PARTITIONS)
        self.producer = self.broker.producer("t")
        self.consumer = self._subscribe()
        self.log = [[] for _ in range(PARTITIONS)]
        self.acked = [set() for _ in range(PARTITIONS)]
        self.start = [0] * PARTITIONS
        self.outstanding = {}          # (partition, offset) -> Message
        self.redeliveries = {}         # (partition, offset) -> expected redelivery_count
        self.serial = 0

    def _subscribe(self):
        return self.broker.subscribe("t", "s", "exclusive", initial_position="earliest",
                                     nack_delay=0)

    def available(self, p):
        return [o for o in range(self.start[p], len(self.log[p]))
                if o not in self.acked[p] and (p, o) not in self.outstanding]

    @rule(p=st.integers(0, PARTITIONS - 1), n=st.integers(1, 40), size=st.integers(0, 300))
    def send(self, p, n, size):
        values = []
        for _ in range(n):
            self.serial += 1
            values.append(b"%08d|" % self.serial + b"x" * size)
        if n == 1:
            mid = self.producer.send(values[0], partition=p)
            assert mid.offset == len(self.log[p])
        else:
            ids = self.producer.send_batch(values, partition=p)
            assert [i.offset for i in ids] == list(range(len(self.log[p]), len(self.log[p]) + n))
        self.log[p].extend(values)

    @rule(k=st.integers(1, 50))
    def receive(self, k):
        want = sum(len(self.available(p)) for p in range(PARTITIONS))
        got = self.consumer.receive_many(k, timeout=0)
        if want:
            assert got, "messages were available but none was delivered"
        assert len(got) <= min(k, want)
        for m in got:
            p, o = m.message_id.partition, m.message_id.offset
            assert o in self.available(p), f"delivered {m.message_id} which is not available"
            assert m.value == self.log[p][o]
            assert m.redelivery_count == self.redeliveries.get((p, o), 0)
            self.outstanding[(p, o)] = m

    def _pick(self, data):
        key = data.draw(st.sampled_from(sorted(self.outstanding)))
        return key, self.outstanding[key]

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data())
    def ack(self, data):
        (p, o), m = self._pick(data)
        self.consumer.ack(m)
        self.acked[p].add(o)
        del self.outstanding[(p, o)]
        self.redeliveries.pop((p, o), None)

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data())
    def ack_cumulative(self, data):
        (p, o), m = self._pick(data)
        self.consumer.ack_cumulative(m)
        for x in range(self.start[p], o + 1):
            self.acked[p].add(x)
            self.outstanding.pop((p, x), None)
            self.redeliveries.pop((p, x), None)

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data())
    def nack(self, data):
        (p, o), m = self._pick(data)
        self.consumer.nack(m)
        del self.outstanding[(p, o)]
        self.redeliveries[(p, o)] = self.redeliveries.get((p, o), 0) + 1

    @rule(p=st.integers(0, PARTITIONS - 1), where=st.one_of(
        st.sampled_from(["earliest", "latest"]), st.integers(0, 200)))
    def seek(self, p, where):
        self.consumer.seek(where, partition=p)
        end = len(self.log[p])
        target = 0 if where == "earliest" else end if where == "latest" else min(where, end)
        self.start[p] = target
        self.acked[p] = set()
        for key in [k for k in self.outstanding if k[0] == p]:
            del self.outstanding[key]
        for key in [k for k in self.redeliveries if k[0] == p]:
            del self.redeliveries[key]

    @rule()
    def restart(self):
        self.broker.close()
        self.broker = txmq.Broker(self.dir, fsync="never", segment_bytes_max=16384,
                                  index_interval_bytes=256)
        self.producer = self.broker.producer("t")
        self.consumer = self._subscribe()
        # What was outstanding comes back; redelivery counts live in memory.
        self.outstanding.clear()
        self.redeliveries.clear()
        for p in range(PARTITIONS):
            # Acks below a cursor's first unacknowledged offset are folded
            # into mark-delete; the model keeps them as acked either way.
            assert self.broker.stats()["topics"]["t"]["partitions"][p]["end_offset"] == len(self.log[p])

    @invariant()
    def backlog_matches(self):
        stats = self.broker.stats()["topics"]["t"]["subscriptions"]["s"]
        for p in range(PARTITIONS):
            unacked = [o for o in range(self.start[p], len(self.log[p])) if o not in self.acked[p]]
            part = stats["partitions"][p]
            assert part["backlog"] == len(unacked), (p, part, len(unacked))
            first = unacked[0] if unacked else len(self.log[p])
            assert part["mark_delete"] == first

    def teardown(self):
        self.broker.close()
        shutil.rmtree(self.dir, ignore_errors=True)


SubscriptionModel.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                               deadline=None)
TestSubscriptionModel = SubscriptionModel.TestCase
