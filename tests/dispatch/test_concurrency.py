"""Threads (docs/ARCHITECTURE.md): producers and consumers at once, blocked
receivers, and the dispatch rules of exclusive, failover and shared
subscriptions, including redelivery after close, ack timeout and nack."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

import txmq
from txmq.errors import BrokerClosedError, SubscriptionBusyError


@pytest.fixture
def broker(tmp_path):
    b = txmq.Broker(tmp_path / "data", fsync="never", segment_bytes_max=256 * 1024)
    yield b
    b.close()


def drain(consumer, timeout=0.0):
    out = []
    while ms := consumer.receive_many(1000, timeout=timeout):
        out.extend(ms)
    return out


def test_four_producers_four_shared_consumers_exactly_once(broker):
    broker.create_topic("t", 4)
    subs = [broker.subscribe("t", "s", "shared", initial_position="earliest") for _ in range(4)]
    per_producer = 1500
    sent = {}                 # value -> MessageId returned by send
    sent_lock = threading.Lock()
    deliveries = []           # (consumer index, value, message_id, redelivery_count)
    deliveries_lock = threading.Lock()
    acked = Counter()
    producers_done = threading.Event()
    stop = threading.Event()
    errors = []

    def produce(t):
        try:
            prod = broker.producer("t")
            i = 0
            while i < per_producer:
                if i % 3 == 0:
                    n = min(7, per_producer - i)
                    values = [f"{t}:{i + j}".encode() for j in range(n)]
                    keys = [f"k{i + j}".encode() for j in range(n)] if i % 2 else None
                    ids = prod.send_batch(values, keys=keys)
                    mine = dict(zip(values, ids))
                    i += n
                else:
                    v = f"{t}:{i}".encode()
                    mine = {v: prod.send(v, key=None if i % 2 else b"key%d" % i)}
                    i += 1
                with sent_lock:
                    sent.update(mine)
        except BaseException as e:   # pragma: no cover - reported below
            errors.append(e)

    def consume(ci, c):
        try:
            k = 0
            while not stop.is_set():
                ms = c.receive_many(1 + k % 40, timeout=0.05)
                k += 1
                if not ms:
                    continue
                with deliveries_lock:
                    deliveries.extend((ci, m.value, m.message_id, m.redelivery_count) for m in ms)
                if k % 2:
                    c.ack(ms)
                else:
                    for m in ms:
                        c.ack(m)
                with deliveries_lock:
                    acked.update(m.message_id for m in ms)
        except BaseException as e:   # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(4)]
    threads += [threading.Thread(target=consume, args=(i, c)) for i, c in enumerate(subs)]
    for th in threads:
        th.start()
    for th in threads[:4]:
        th.join(60)
    producers_done.set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with deliveries_lock:
            if len(acked) >= 4 * per_producer:
                break
        time.sleep(0.02)
    time.sleep(0.2)       # anything delivered twice would show up now
    stop.set()
    for th in threads[4:]:
        th.join(10)
    assert not errors, errors
    assert not any(th.is_alive() for th in threads)

    assert len(sent) == 4 * per_producer
    assert len(set(sent.values())) == len(sent), "two sends got the same MessageId"
    by_id = Counter(mid for _, _, mid, _ in deliveries)
    dups = [mid for mid, n in by_id.items() if n > 1]
    assert not dups, f"delivered twice without any redelivery cause: {dups[:5]}"
    assert all(rc == 0 for *_, rc in deliveries)
    delivered = {v: mid for _, v, mid, _ in deliveries}
    assert delivered == sent, "every message delivered once, under the id its send returned"
    assert set(acked) == set(sent.values()) and all(n == 1 for n in acked.values())
    assert len({ci for ci, *_ in deliveries}) > 1, "the shared subscription used one consumer only"
    st = broker.stats()["topics"]["t"]["subscriptions"]["s"]
    assert st["backlog"] == 0 and st["unacked"] == 0
    for part in st["partitions"]:
        end = broker.stats()["topics"]["t"]["partitions"][part["partition"]]["end_offset"]
        assert part["mark_delete"] == end and part["individually_acked"] == 0


@pytest.mark.parametrize("type_", ["exclusive", "shared", "failover"])
def test_blocked_receive_wakes_on_send(broker, type_):
    broker.create_topic("t", 3)
    c = broker.subscribe("t", "s", type_, initial_position="earliest")
    result = {}

    def wait():
        t0 = time.monotonic()
        result["msg"] = c.receive(timeout=5)
        result["at"] = time.monotonic()
        result["waited"] = result["at"] - t0

    th = threading.Thread(target=wait)
    th.start()
    time.sleep(0.3)
    assert th.is_alive(), "receive returned before anything was sent"
    sent_at = time.monotonic()
    mid = broker.producer("t").send(b"wake", partition=2)
    th.join(5)
    assert not th.is_alive()
    assert result["msg"] is not None and result["msg"].value == b"wake"
    assert result["msg"].message_id == mid
    assert result["at"] - sent_at < 1.0, "the receiver slept through the send"
    assert result["waited"] >= 0.25


def test_one_send_wakes_exactly_one_of_two_shared_receivers(broker):
    broker.create_topic("t", 1)
    cs = [broker.subscribe("t", "s", "shared", initial_position="earliest") for _ in range(2)]
    got = [None, None]

    def wait(i):
        got[i] = cs[i].receive(timeout=1.5)

    ths = [threading.Thread(target=wait, args=(i,)) for i in range(2)]
    for th in ths:
        th.start()
    time.sleep(0.2)
    broker.producer("t").send(b"one")
    for th in ths:
        th.join(5)
    assert sorted((g.value if g else None) for g in got if g) == [b"one"]
    assert sum(g is not None for g in got) == 1


@pytest.mark.parametrize("closing", ["consumer", "broker"])
def test_blocked_receive_fails_when_closed(tmp_path, closing):
    b = txmq.Broker(tmp_path / "d", fsync="never")
    b.create_topic("t", 2)
    c = b.subscribe("t", "s", "exclusive")
    result = {}

    def wait():
        try:
            result["msg"] = c.receive(timeout=None)
        except BrokerClosedError as e:
            result["err"] = e

    th = threading.Thread(target=wait)
    th.start()
    time.sleep(0.2)
    (c if closing == "consumer" else b).close()
    th.join(3)
    b.close()
    assert not th.is_alive(), f"receive(timeout=None) hangs after closing the {closing}"
    assert isinstance(result.get("err"), BrokerClosedError)


def test_exclusive_refuses_a_second_consumer(broker):
    broker.create_topic("t", 2)
    c1 = broker.subscribe("t", "s", "exclusive", initial_position="earliest")
    with pytest.raises(SubscriptionBusyError) as ei:
        broker.subscribe("t", "s", "exclusive")
    assert ei.value.subscription == "s" and ei.value.topic == "t"
    prod = broker.producer("t")
    ids = [prod.send(b"m%d" % i, partition=i % 2) for i in range(10)]
    got = drain(c1)
    assert sorted(m.message_id for m in got) == sorted(ids)
    c1.ack(got[:4])
    # Still refused while c1 is attached, then accepted once it closed; the
    # new consumer gets exactly what c1 had not acknowledged, marked redelivered.
    with pytest.raises(SubscriptionBusyError):
        broker.subscribe("t", "s", "exclusive")
    c1.close()
    c2 = broker.subscribe("t", "s", "exclusive")
    again = drain(c2)
    assert sorted(m.message_id for m in again) == sorted(m.message_id for m in got[4:])
    assert all(m.redelivery_count == 1 for m in again)
    for p in range(2):
        offs = [m.offset for m in again if m.partition == p]
        assert offs == sorted(offs)


def test_failover_one_active_consumer_per_partition_and_takeover(broker):
    broker.create_topic("t", 4)
    a = broker.subscribe("t", "s", "failover", initial_position="earliest", consumer_name="a")
    b = broker.subscribe("t", "s", "failover", initial_position="earliest", consumer_name="b")
    prod = broker.producer("t")
    ids = [prod.send(b"v%d" % i, partition=i % 4) for i in range(40)]
    got_a, got_b = drain(a), drain(b)
    parts_a = {m.partition for m in got_a}
    parts_b = {m.partition for m in got_b}
    assert parts_a and parts_b and not parts_a & parts_b, (parts_a, parts_b)
    assert parts_a | parts_b == {0, 1, 2, 3}
    assert sorted(m.message_id for m in got_a + got_b) == sorted(ids)
    for ms in (got_a, got_b):
        for p in range(4):
            offs = [m.offset for m in ms if m.partition == p]
            assert offs == sorted(offs), "failover delivers each partition in order"
    # More data keeps going to the same active consumer.
    more = [prod.send(b"w%d" % i, partition=i % 4) for i in range(8)]
    assert {m.partition for m in drain(b)} <= parts_b
    assert {m.partition for m in drain(a)} <= parts_a
    # a acks part of its messages and goes away: b takes over a's partitions
    # and gets a's unacknowledged messages (redelivered) and nothing acked.
    a_all = [m for m in got_a]
    a.ack(a_all[: len(a_all) // 2])
    unacked_a = {m.message_id for m in a_all[len(a_all) // 2:]}
    unacked_a |= {mid for mid in more if mid.partition in parts_a}
    a.close()
    taken = drain(b)
    assert {m.message_id for m in taken} == unacked_a
    assert all(m.redelivery_count == 1 for m in taken)
    # and new data on any partition now goes to b
    prod.send(b"late", partition=min(parts_a))
    assert [m.value for m in drain(b)] == [b"late"]


def test_shared_closed_consumers_unacked_go_to_the_others(broker):
    broker.create_topic("t", 2)
    c1 = broker.subscribe("t", "s", "shared", initial_position="earliest")
    c2 = broker.subscribe("t", "s", "shared", initial_position="earliest")
    prod = broker.producer("t")
    ids = [prod.send(b"m%d" % i, partition=i % 2) for i in range(12)]
    mine = c1.receive_many(12, timeout=1)
    assert sorted(m.message_id for m in mine) == sorted(ids), "c1 asked for all of them first"
    assert c2.receive(timeout=0.1) is None, "a delivered message went to a second consumer"
    c1.ack(mine[:5])
    c1.nack(mine[5])                       # nacked and then closed: delivered once more, not twice
    c1.close()
    got = drain(c2, timeout=0.05)
    got += drain(c2, timeout=1.2)          # the nack delay (1 s default) may hold one back
    assert sorted(m.message_id for m in got) == sorted(m.message_id for m in mine[5:])
    assert all(m.redelivery_count == 1 for m in got), [(m.message_id, m.redelivery_count) for m in got]
    c2.ack(got)
    st = broker.stats()["topics"]["t"]["subscriptions"]["s"]
    assert st["backlog"] == 0 and st["unacked"] == 0


def test_ack_timeout_redelivers_to_someone_else(broker):
    broker.create_topic("t", 1)
    c1 = broker.subscribe("t", "s", "shared", initial_position="earliest", ack_timeout=0.4)
    c2 = broker.subscribe("t", "s", "shared", initial_position="earliest", ack_timeout=0.4)
    mid = broker.producer("t").send(b"slow")
    first = c1.receive(timeout=1)
    assert first.message_id == mid and first.redelivery_count == 0
    t0 = time.monotonic()
    assert c2.receive(timeout=0.2) is None, "redelivered before the ack timeout"
    again = c2.receive(timeout=2)
    waited = time.monotonic() - t0
    assert again is not None, "never redelivered after the ack timeout"
    assert again.message_id == mid and again.redelivery_count == 1
    assert 0.3 <= waited < 1.5
    c2.ack(again)
    assert c1.receive(timeout=0.6) is None and c2.receive(timeout=0.1) is None, "acked, yet redelivered"
    st = broker.stats()["topics"]["t"]["subscriptions"]["s"]
    assert st["backlog"] == 0 and st["unacked"] == 0


def test_ack_timeout_leaves_acked_messages_alone(broker):
    broker.create_topic("t", 1)
    c = broker.subscribe("t", "s", "exclusive", initial_position="earliest", ack_timeout=0.2)
    prod = broker.producer("t")
    ids = [prod.send(b"x%d" % i) for i in range(6)]
    ms = c.receive_many(6, timeout=1)
    c.ack([m for m in ms if m.offset % 2 == 0])
    time.sleep(0.35)
    back = c.receive_many(10, timeout=0.3)   # all three expired together
    assert sorted(m.offset for m in back) == [1, 3, 5]
    assert all(m.redelivery_count == 1 for m in back)
    c.ack(back)
    assert drain(c, timeout=0.4) == []
    assert {m.message_id for m in ms} == set(ids)


def test_nack_redelivers_after_the_delay(broker):
    broker.create_topic("t", 1)
    c = broker.subscribe("t", "s", "shared", initial_position="earliest", nack_delay=0.3)
    broker.producer("t").send(b"again")
    m = c.receive(timeout=1)
    t0 = time.monotonic()
    c.nack(m)
    assert c.receive(timeout=0.15) is None, "nacked message came back before nack_delay"
    m2 = c.receive(timeout=2)
    assert m2 is not None and time.monotonic() - t0 >= 0.25
    assert m2.message_id == m.message_id and m2.redelivery_count == 1
    c.nack(m2)
    m3 = c.receive(timeout=2)
    assert m3.message_id == m.message_id and m3.redelivery_count == 2
    c.ack(m3)
    assert c.receive(timeout=0.5) is None


def test_concurrent_acks_and_receives_keep_stats_consistent(broker):
    """Consumers racing on one shared subscription while a producer appends:
    at every moment stats() counts backlog = outstanding + not yet delivered."""
    broker.create_topic("t", 2)
    cs = [broker.subscribe("t", "s", "shared", initial_position="earliest") for _ in range(3)]
    prod = broker.producer("t")
    total = 3000
    stop = threading.Event()
    seen = Counter()
    lock = threading.Lock()

    def run(c):
        while not stop.is_set():
            ms = c.receive_many(25, timeout=0.05)
            if ms:
                c.ack(ms)
                with lock:
                    seen.update(m.message_id for m in ms)

    ths = [threading.Thread(target=run, args=(c,)) for c in cs]
    for th in ths:
        th.start()
    ids = []
    for i in range(0, total, 10):
        ids.extend(prod.send_batch([b"%d" % (i + j) for j in range(10)]))
        st = broker.stats()["topics"]["t"]["subscriptions"]["s"]
        assert 0 <= st["unacked"] <= st["backlog"] <= len(ids)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with lock:
            if len(seen) == total:
                break
        time.sleep(0.02)
    stop.set()
    for th in ths:
        th.join(5)
    assert set(seen) == set(ids) and all(n == 1 for n in seen.values())
    st = broker.stats()["topics"]["t"]["subscriptions"]["s"]
    assert st["backlog"] == 0 and st["unacked"] == 0


def test_sends_racing_close_fail_cleanly(tmp_path):
    """Producers still sending while the broker closes get BrokerClosedError,
    never an internal error, and everything acknowledged is there after."""
    b = txmq.Broker(tmp_path / "d", fsync="always")
    b.create_topic("t", 2)
    acked, errors_seen = [], []

    def produce(k):
        p = b.producer("t")
        try:
            for i in range(100_000):
                acked.append(p.send(b"%d-%d" % (k, i)))
        except BrokerClosedError:
            pass
        except Exception as e:  # pragma: no cover - the failure this test looks for
            errors_seen.append(e)

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(3)]
    for th in threads:
        th.start()
    time.sleep(0.3)
    b.close()
    for th in threads:
        th.join(10)
    assert not errors_seen, errors_seen
    assert acked
    with txmq.Broker(tmp_path / "d", fsync="never") as b2:
        ends = b2.describe_topic("t")["end_offsets"]
        for mid in acked:
            assert mid.offset < ends[mid.partition]
