"""The exactly-once function runner (txmq.functions): stateless steps,
failures and dead letters, event-time windows against a recomputation,
restart, several instances, metrics. The SIGKILL test is
tests/functions/test_function_crash.py."""

from __future__ import annotations

import collections
import json
import os
import random
import sys
import threading
import time

import pytest

import txmq
from txmq.errors import InvalidArgumentError
from txmq.functions import Function, Record, Sliding, Tumbling
from txmq.functions.windows import WindowState

from killer import drain


@pytest.fixture
def broker(tmp_path):
    b = txmq.Broker(tmp_path / "data", fsync="never")
    yield b
    b.close()


def read_all(b, topic: str) -> list:
    """Every committed message of ``topic``, through a throwaway subscription."""
    c = b.subscribe(topic, "check", initial_position="earliest")
    try:
        return drain(c)
    finally:
        c.unsubscribe()


def totals_of(msgs) -> dict:
    """{(key, start): (end, total, count)} of window results; asserts each
    window came once."""
    out = {}
    for m in msgs:
        r = json.loads(m.value)
        k = (m.key, r["start"])
        assert k not in out, f"window {k} emitted twice: {out[k]} and {r}"
        out[k] = (r["end"], r["total"], r["count"])
    return out


def expected_totals(events, window, inputs, ooo_ms: int, lateness_ms: int) -> dict:
    """Recompute the windows a function has emitted once every event is
    processed, for events that are never late: per lane the final
    watermark, then every window ending (plus lateness) at or before it.
    ``events``: (topic, lane, key, event time, amount)."""
    top = collections.defaultdict(dict)              # lane -> topic -> max event time
    sums = collections.defaultdict(lambda: [0, 0])   # (lane, key, start) -> [total, count]
    for topic, lane, key, t, amount in events:
        top[lane][topic] = max(top[lane].get(topic, t), t)
        for s in window.starts(t):
            agg = sums[(lane, key, s)]
            agg[0] += amount
            agg[1] += 1
    out = {}
    for (lane, key, s), (total, count) in sums.items():
        if len(top[lane]) < len(inputs):
            continue
        wm = min(top[lane].values()) - ooo_ms
        if s + window.size_ms + lateness_ms <= wm:
            assert (key, s) not in out, "keys must be co-partitioned for one total per window"
            out[(key, s)] = (s + window.size_ms, total, count)
    return out


def send_events(b, topic: str, events: list, rng: random.Random) -> list:
    """Send (key, event time, amount) in small batches; return (topic,
    partition, key, time, amount) as stored."""
    p = b.producer(topic)
    out = []
    i = 0
    while i < len(events):
        chunk = events[i:i + rng.randint(1, 7)]
        i += len(chunk)
        for key, t, amount in chunk:
            mid = p.send(str(amount).encode(), key=key, event_time=t)
            out.append((topic, mid.partition, key, t, amount))
    return out


def bounded_disorder(rng, n: int, keys: list, start_ms: int, ooo_ms: int, step_ms: int = 7) -> list:
    """n events whose times go up by ``step_ms`` on average, each a random
    0..ooo_ms ahead of that: disorder within ``ooo_ms``, so none is late."""
    return [(rng.choice(keys), start_ms + i * step_ms + rng.randint(0, ooo_ms), rng.randint(-5, 50))
            for i in range(n)]


def amount(m):
    return int(m.value)


# -- stateless ------------------------------------------------------------------------------

def test_identity_and_map_exactly_once(broker):
    broker.create_topic("in", 3)
    p = broker.producer("in")
    sent = {}
    for i in range(500):
        mid = p.send(b"v%d" % i, key=b"k%d" % (i % 7), event_time=1000 + i)
        sent[b"v%d" % i] = (b"k%d" % (i % 7), 1000 + i, mid)

    def fn(m):
        i = int(m.value[1:])
        if i % 10 == 0:
            return None                                    # filtered out
        if i % 10 == 1:                                    # two outputs, own key and time
            return [Record(m.value + b"-a", key=b"x", event_time=5), Record(m.value + b"-b")]
        return m.value.upper()

    with Function(broker, "map", "in", "out", fn, batch_size=32) as f:
        f.run(idle_timeout=0.2)
        metrics = f.metrics()
    out = read_all(broker, "out")
    by_value = {m.value: m for m in out}
    assert len(by_value) == len(out)
    want = set()
    for v, (key, t, _) in sent.items():
        i = int(v[1:])
        if i % 10 == 1:
            want |= {v + b"-a", v + b"-b"}
            assert (by_value[v + b"-a"].key, by_value[v + b"-a"].event_time) == (b"x", 5)
            assert (by_value[v + b"-b"].key, by_value[v + b"-b"].event_time) == (None, t)
        elif i % 10:
            want.add(v.upper())
            assert (by_value[v.upper()].key, by_value[v.upper()].event_time) == (key, t)
    assert set(by_value) == want
    assert all(m.txn_id is not None for m in out)
    assert metrics["processed"] == 500 and metrics["outputs"] == len(want) and metrics["aborted"] == 0
    assert metrics["lag"] == 0 and broker.consumer_lag("in", "map") == {0: 0, 1: 0, 2: 0}


def test_multiple_inputs(broker):
    for t in ("a", "b", "c"):
        broker.create_topic(t, 2)
        p = broker.producer(t)
        p.send_batch([f"{t}{i}".encode() for i in range(300)])
    with Function(broker, "merge", ["a", "b", "c"], "all", lambda m: m.topic.encode() + b":" + m.value,
                  batch_size=50) as f:
        f.run(idle_timeout=0.2)
        assert f.metrics()["processed"] == 900
        assert f.metrics()["lag_by_input"] == {t: {0: 0, 1: 0} for t in "abc"}
    got = sorted(m.value for m in read_all(broker, "all"))
    assert got == sorted(f"{t}:{t}{i}".encode() for t in "abc" for i in range(300))


def test_exception_aborts_and_the_inputs_come_again(broker):
    broker.create_topic("in", 1)
    broker.producer("in").send_batch([b"%d" % i for i in range(40)])
    calls = collections.defaultdict(list)

    def flaky(m):
        calls[m.value].append(m.redelivery_count)
        if m.value == b"17" and m.redelivery_count == 0:
            raise ValueError("first try fails")
        return m.value

    with Function(broker, "flaky", "in", "out", flaky, batch_size=10, subscription_type="exclusive") as f:
        f.run(idle_timeout=0.2)
        m = f.metrics()
    assert sorted(int(x.value) for x in read_all(broker, "out")) == list(range(40))
    # 17's batch (10..19) ran twice: the abort handed all of it back.
    assert calls[b"17"] == [0, 1]
    assert calls[b"10"] == [0, 1] and calls[b"18"] == [1] and calls[b"20"] == [0]
    assert m["aborted"] == 1 and m["failures"] == 1 and m["committed"] == 4 and m["processed"] == 40
    assert read_all(broker, "flaky-dlq") == []


@pytest.mark.parametrize("windowed", [False, True])
def test_dead_letter_after_max_redeliveries(broker, windowed):
    broker.create_topic("in", 1)
    p = broker.producer("in")
    for i in range(30):
        p.send(b"bad" if i == 12 else b"%d" % i, key=b"k", event_time=i * 10, headers={"h": b"1"})
    tries = []

    def fn(m):
        if m.value == b"bad":
            tries.append(m.redelivery_count)
            raise KeyError("poison")
        return int(m.value) if windowed else m.value

    kw = dict(window=Tumbling(50)) if windowed else {}
    with Function(broker, "f", "in", "out", fn, max_redeliveries=2, batch_size=8, retry_backoff=0, **kw) as f:
        f.run(idle_timeout=0.2)
        m = f.metrics()
    assert tries == [0, 1, 2]              # tried 1 + max_redeliveries times
    dlq = read_all(broker, "f-dlq")
    assert [(d.value, d.key, d.event_time) for d in dlq] == [(b"bad", b"k", 120)]
    h = dict(dlq[0].headers)
    assert h["h"] == b"1" and h["txmq-origin"] == b"in/0@12" and h["txmq-error"] == b"KeyError: 'poison'"
    assert m["dead_lettered"] == 1 and m["aborted"] == 2 and m["failures"] == 3 and m["lag"] == 0
    out = read_all(broker, "out")
    if windowed:
        # The windows count every good message, the poison one nowhere.
        assert totals_of(out) == {(b"k", s): (s + 50, sum(i for i in range(s // 10, s // 10 + 5) if i != 12),
                                                5 - (s == 100)) for s in range(0, 250, 50)}
    else:
        assert sorted(int(x.value) for x in out) == [i for i in range(30) if i != 12]


@pytest.mark.parametrize("windowed", [False, True])
def test_transient_error_on_the_first_call_is_retried_max_redeliveries_times(broker, windowed):
    """A message in the very first batch of a fresh instance (a windowed
    function's lane that never had an owner) is first seen with
    redelivery_count 0, so a transient error gets max_redeliveries retries:
    failing twice with max_redeliveries=2, it is processed on the third
    call and dead-lettered nowhere."""
    broker.create_topic("in", 1)
    p = broker.producer("in")
    for i in range(6):
        p.send(b"%d" % i, key=b"k", event_time=i * 10)
    p.send(b"1", key=b"k", event_time=500)             # closes the window [0, 50)
    calls = collections.Counter()
    seen = []

    def fn(m):
        if m.value == b"2":
            seen.append(m.redelivery_count)
            calls[m.value] += 1
            if calls[m.value] <= 2:
                raise ConnectionError("transient")
        return int(m.value) if windowed else m.value

    kw = dict(window=Tumbling(50)) if windowed else {}
    with Function(broker, "f", "in", "out", fn, max_redeliveries=2, batch_size=8, retry_backoff=0, **kw) as f:
        f.run(idle_timeout=0.2)
        m = f.metrics()
    assert seen == [0, 1, 2]
    assert read_all(broker, "f-dlq") == [] and m["dead_lettered"] == 0 and m["failures"] == 2
    out = read_all(broker, "out")
    if windowed:
        assert totals_of(out)[(b"k", 0)] == (50, sum(range(5)), 5)
    else:
        assert sorted(x.value for x in out) == sorted([b"%d" % i for i in range(6)] + [b"1"])


def test_late_event_sent_to_late_topic_once_across_an_aborted_step(broker):
    """A late event goes to ``late_topic`` in its step's transaction: when
    that step aborts (the function fails on another message of it) and is
    retried, the late event is there exactly once, with its origin."""
    broker.create_topic("in", 1)
    p = broker.producer("in")
    for t in (5, 260):
        p.send(b"1", key=b"k", event_time=t)           # watermark 260: [0, 100) closed with lateness 50
    p.send(b"7", key=b"k", event_time=40)              # late, offset 2
    p.send(b"boom", key=b"k", event_time=270)          # fails the step once
    p.send(b"1", key=b"k", event_time=900)
    failed = []

    def fn(m):
        if m.value == b"boom":
            if not failed:
                failed.append(m.redelivery_count)
                raise ConnectionError("transient")
            return 1
        return int(m.value)

    with Function(broker, "w", "in", "out", fn, window=Tumbling(100), allowed_lateness_ms=50, late_topic="late",
                  batch_size=10, retry_backoff=0) as f:
        f.run(idle_timeout=0.2)
        m = f.metrics()
    late = read_all(broker, "late")
    assert [(x.value, x.event_time, dict(x.headers)["txmq-origin"]) for x in late] == [(b"7", 40, b"in/0@2")]
    assert failed == [0] and m["late"] == 1 and m["aborted"] == 1
    assert totals_of(read_all(broker, "out"))[(b"k", 200)] == (300, 2, 2)


# -- windows -----------------------------------------------------------------------------

def test_window_starts():
    assert list(Tumbling(10).starts(25)) == [20]
    assert list(Tumbling(10).starts(-1)) == [-10]
    assert list(Sliding(10, 5).starts(25)) == [20, 25]
    assert list(Sliding(10, 5).starts(24)) == [15, 20]
    assert list(Sliding(10, 3).starts(10)) == [3, 6, 9]
    for w in (Sliding(10, 3), Sliding(7, 7), Sliding(100, 1)):
        for t in range(-20, 40):
            assert list(w.starts(t)) == [s for s in range(-200, 200) if s % w.slide_ms == 0 and s <= t < s + w.size_ms]
    with pytest.raises(InvalidArgumentError):
        Sliding(10, 20)


@pytest.mark.parametrize("window", [Tumbling(100), Sliding(100, 25), Sliding(90, 40)], ids=repr)
def test_window_totals_match_a_recomputation(broker, window):
    rng = random.Random(7)
    ooo, lateness = 30, 20
    broker.create_topic("a", 2)
    broker.create_topic("b", 2)
    keys = [b"k%d" % i for i in range(6)]
    events = send_events(broker, "a", bounded_disorder(rng, 1500, keys, 0, ooo), rng)
    events += send_events(broker, "b", bounded_disorder(rng, 900, keys, 0, ooo, step_ms=11), rng)
    with Function(broker, "agg", ["a", "b"], "totals", amount, window=window, batch_size=37,
                  max_out_of_orderness_ms=ooo, allowed_lateness_ms=lateness) as f:
        f.run(idle_timeout=0.3)
        m = f.metrics()
    got = totals_of(read_all(broker, "totals"))
    want = expected_totals(events, window, ("a", "b"), ooo, lateness)
    assert len(want) > 100 and got == want
    assert m["late"] == 0 and m["windows_emitted"] == len(want) and m["processed"] == 2400
    assert m["lanes"] == [0, 1] and m["restores"] == 2


def test_late_events_dropped_and_counted_or_sent_to_late_topic(broker):
    broker.create_topic("in", 1)
    p = broker.producer("in")
    for t in (5, 15, 120, 250):
        p.send(b"1", key=b"k", event_time=t)
    # Watermark 250 - 0: windows [0,100) and [100,200) emitted (lateness 50 <= 250-200).
    for t in (60, 199, 230, 201):
        p.send(b"10", key=b"k", event_time=t)   # 60, 199: late; 230, 201: in the open [200,300)
    p.send(b"1", key=b"k", event_time=400)
    for late_topic in (None, "late"):
        with Function(broker, f"w-{late_topic}", "in", f"out-{late_topic}", amount, window=Tumbling(100),
                      allowed_lateness_ms=50, late_topic=late_topic, batch_size=2) as f:
            f.run(idle_timeout=0.2)
            m = f.metrics()
        got = totals_of(read_all(broker, f"out-{late_topic}"))
        assert got == {(b"k", 0): (100, 2, 2), (b"k", 100): (200, 1, 1), (b"k", 200): (300, 21, 3)}
        assert m["late"] == 2
    late = read_all(broker, "late")
    assert [(x.event_time, dict(x.headers)["txmq-origin"]) for x in late] == [(60, b"in/0@4"), (199, b"in/0@5")]


def test_sliding_late_event_counts_in_its_open_windows():
    s2 = WindowState(0, Sliding(100, 50), ["in"], 0, 0)
    s2.add("in", 0, b"k", 1)
    s2.add("in", 160, b"k", 1)                        # watermark 160: [0,100) and [50,150) due
    s2.fire()
    assert s2.add("in", 120, b"k", 7)                 # [50,150) emitted, [100,200) open: counted there
    assert s2.windows[(b"k", 100)] == [8, 2] and (b"k", 50) not in s2.windows
    assert not s2.add("in", 90, b"k", 7)              # [0,100) and [50,150): both emitted


def test_restart_resumes_windows(tmp_path):
    """Close the function and the broker mid-window, reopen, carry on: the
    totals are those of one uninterrupted run."""
    rng = random.Random(3)
    path = tmp_path / "data"
    ooo, window = 20, Sliding(200, 100)
    keys = [b"k%d" % i for i in range(5)]
    evs_a = bounded_disorder(rng, 1200, keys, 0, ooo)
    evs_b = bounded_disorder(rng, 1200, keys, 0, ooo, step_ms=6)
    events = []
    for part in range(3):
        with txmq.Broker(path, fsync="commit") as b:
            if part == 0:
                b.create_topic("a", 2)
                b.create_topic("b", 2)
            events += send_events(b, "a", evs_a[part * 400:(part + 1) * 400], rng)
            events += send_events(b, "b", evs_b[part * 400:(part + 1) * 400], rng)
            f = Function(b, "agg", ["a", "b"], "totals", amount, window=window, max_out_of_orderness_ms=ooo,
                         batch_size=rng.randint(5, 40))
            f.run(idle_timeout=0.2)
            m = f.metrics()
            assert m["restores"] == 2 and m["processed"] == 800
            st = b.stats()["topics"]["agg-state"]["partitions"]
            assert all(p["open_transactions"] == 0 for p in st)
            # Left mid-window: the windows still open live only in the state topic now.
            f.close()
            got = totals_of(read_all(b, "totals"))
            assert got == expected_totals(events, window, ("a", "b"), ooo, 0)
    assert len(got) > 50


def test_step_that_times_out_leaves_no_state(tmp_path):
    """A step whose commit is refused (its transaction timed out while the
    function ran) leaves nothing behind: a restart restores the state of
    the last committed step and counts the redelivered events once."""
    path = tmp_path / "data"
    with txmq.Broker(path, fsync="never") as b:
        b.create_topic("in", 1)
        b.producer("in").send_batch([b"%d" % i for i in range(10)], keys=[b"k"] * 10,
                                    event_times=[i * 10 for i in range(10)])
        slow = []

        def fn(m):
            if m.value == b"7" and not slow:
                slow.append(m.offset)
                time.sleep(0.5)             # past the step's transaction timeout
            return int(m.value)

        with Function(b, "agg", "in", "totals", fn, window=Tumbling(1000), batch_size=5,
                      transaction_timeout=0.3, retry_backoff=0) as f:
            assert f.step(1.0) == 5 and f.metrics()["restores"] == 1   # the lane taken, 0..4 given back
            assert f.step(1.0) == 5 and f.metrics()["committed"] == 1
            assert f.step(1.0) == 5                 # 5..9: the commit is refused, the step aborted
            m = f.metrics()
            assert (m["committed"], m["aborted"], slow) == (1, 1, [7])
    with txmq.Broker(path, fsync="never") as b:
        b.producer("in").send(b"100", key=b"k", event_time=5000)
        with Function(b, "agg", "in", "totals", amount, window=Tumbling(1000)) as f:
            f.run(idle_timeout=0.2)
        assert totals_of(read_all(b, "totals")) == {(b"k", 0): (1000, 45, 10)}


def test_state_snapshot_round_trip_and_wrong_window():
    s = WindowState(3, Tumbling(10), ["a", "b"], 5, 0)
    s.add("a", 11, b"\x00k", 2.5)
    s.add("b", 40, None, 3)
    raw = s.to_bytes()
    t = WindowState(3, Tumbling(10), ["a", "b"], 5, 0)
    t.load(raw, "x")
    assert (t.windows, t.max_event_ms, t.watermark) == (s.windows, s.max_event_ms, s.watermark) == (
        {(b"\x00k", 10): [2.5, 1], (None, 40): [3, 1]}, {"a": 11, "b": 40}, 6)
    with pytest.raises(InvalidArgumentError):
        WindowState(3, Tumbling(20), ["a", "b"], 5, 0).load(raw, "x")
    with pytest.raises(txmq.errors.CorruptLogError):
        WindowState(4, Tumbling(10), ["a", "b"], 5, 0).load(raw, "x")


# -- several instances ----------------------------------------------------------------------

def test_two_stateless_instances_share_the_work(broker):
    broker.create_topic("in", 2)
    broker.producer("in").send_batch([b"%d" % i for i in range(4000)], keys=[b"%d" % (i % 13) for i in range(4000)])
    slow = lambda m: (time.sleep(0.0002), m.value)[1]   # noqa: E731  (both get a share)
    fs = [Function(broker, "share", "in", "out", slow, batch_size=20, instance=f"i{i}") for i in range(2)]
    for f in fs:
        f.start()
    deadline = time.monotonic() + 30
    while sum(broker.consumer_lag("in", "share").values()) and time.monotonic() < deadline:
        time.sleep(0.02)
    for f in fs:
        f.close()
    done = [f.metrics()["processed"] for f in fs]
    assert sum(done) == 4000 and min(done) > 0, done
    assert sorted(int(m.value) for m in read_all(broker, "out")) == list(range(4000))


class Stuck(BaseException):
    """Ends a thread that stands for a killed instance."""


def test_two_windowed_instances_and_one_is_killed(broker):
    """Two instances split the lanes (failover); one then stops dead inside a
    step, its transaction open, and its consumers drop (a killed client):
    the other takes its lanes over, fences it (its transaction is aborted),
    restores the lanes' state, and the totals are exact."""
    rng = random.Random(11)
    ooo, window = 25, Tumbling(150)
    broker.create_topic("a", 2)
    broker.create_topic("b", 2)
    keys = [b"k%d" % i for i in range(8)]
    events = send_events(broker, "a", bounded_disorder(rng, 2000, keys, 0, ooo), rng)
    events += send_events(broker, "b", bounded_disorder(rng, 2000, keys, 0, ooo), rng)
    block = threading.Event()
    hold = threading.Event()
    seen = [0]

    def victim_fn(m):
        seen[0] += 1
        if seen[0] == 150:
            deadline = time.monotonic() + 10
            while not other._lanes and time.monotonic() < deadline:
                time.sleep(0.001)         # until the other instance has lanes of its own
            block.set()
            hold.wait()                   # stops dead, its transaction open
            raise Stuck()
        return int(m.value)

    other = Function(broker, "agg", ["a", "b"], "totals", amount, window=window, batch_size=25,
                     max_out_of_orderness_ms=ooo, instance="i2")
    victim = Function(broker, "agg", ["a", "b"], "totals", victim_fn, window=window, batch_size=25,
                      max_out_of_orderness_ms=ooo, instance="i1")
    errors = []
    t = threading.Thread(target=lambda: _run_catching(victim, errors))
    t.start()
    other.start()
    assert block.wait(30), (seen, errors, victim.metrics(), other.metrics())
    assert broker.transactions(), "the victim's step transaction is open"
    assert victim.metrics()["lanes"] and other.metrics()["lanes"], "the lanes were shared"
    for c in victim._consumers:
        c.close()                         # its connection drops: the lanes go to the other instance
    deadline = time.monotonic() + 30
    while (sum(broker.consumer_lag("a", "agg").values()) + sum(broker.consumer_lag("b", "agg").values())
           and time.monotonic() < deadline):
        time.sleep(0.02)
    other.stop()
    hold.set()
    t.join()
    assert errors and isinstance(errors[0], (Stuck, txmq.errors.BrokerClosedError, txmq.errors.ProducerFencedError))
    m = other.metrics()
    assert m["lanes"] == [0, 1] and m["lag"] == 0 and m["restores"] >= 2
    # The fence hands the victim's uncommitted messages back: they come again
    # before the later ones, so none of them is taken for late.
    assert m["late"] == 0 and victim.metrics()["fenced"] >= 1
    assert not broker.transactions()
    got = totals_of(read_all(broker, "totals"))
    assert got == expected_totals(events, window, ("a", "b"), ooo, 0)
    other.close()
    victim.close()


def _run_catching(f, errors):
    try:
        f.run()
    except BaseException as e:
        errors.append(e)


# -- metrics, arguments -------------------------------------------------------------------------

def test_metrics(broker):
    broker.create_topic("in", 2)
    broker.producer("in").send_batch([b"%d" % i for i in range(50)], keys=[b"%d" % i for i in range(50)])
    now = [1_700_000_000.25]
    f = Function(broker, "m", "in", "out", lambda m: None if m.value == b"3" else m.value, batch_size=10,
                 subscription_type="failover", clock=lambda: now[0])
    m0 = f.metrics()
    assert m0["lag"] == 50 and m0["committed"] == 0 and m0["last_commit_time_ms"] is None
    assert sum(m0["lag_by_input"]["in"].values()) == 50
    assert f.step(1.0) == 10
    m1 = f.metrics()
    assert (m1["received"], m1["processed"], m1["committed"], m1["lag"]) == (10, 10, 1, 40)
    assert m1["last_commit_time_ms"] == 1_700_000_000_250
    now[0] += 2
    f.run(idle_timeout=0.1)
    m2 = f.metrics()
    assert (m2["processed"], m2["outputs"], m2["aborted"], m2["lag"]) == (50, 49, 0, 0)
    assert m2["committed"] >= 5 and m2["last_commit_time_ms"] == 1_700_000_002_250
    assert json.loads(json.dumps(m2))["processed"] == 50
    f.close()


def test_bad_arguments(broker):
    broker.create_topic("a", 2)
    broker.create_topic("b", 3)
    with pytest.raises(InvalidArgumentError):
        Function(broker, "x", ["a", "b"], "o", amount, window=Tumbling(10))   # not co-partitioned
    with pytest.raises(InvalidArgumentError):
        Function(broker, "x", "a", "o", amount, window=Tumbling(10), subscription_type="shared")
    with pytest.raises(InvalidArgumentError):
        Function(broker, "x", "a", "a", amount)
    with pytest.raises(InvalidArgumentError):
        Function(broker, "x", "a", "o", amount, batch_size=0)
    with pytest.raises(InvalidArgumentError):
        Function(broker, "x", "a", "o", amount, late_topic="late")          # lateness needs a window
    with pytest.raises(txmq.errors.InvalidTxnTimeoutError):
        Function(broker, "x", "a", "o", amount, transaction_timeout=10_000)
    assert broker.subscriptions("a") == []                                  # refused before subscribing
    broker.producer("a").send(b"v")
    with Function(broker, "y", "a", "o", lambda m: 42) as f:
        with pytest.raises(InvalidArgumentError):
            f.step(1.0)                    # not bytes: a bad output is raised, the step aborted
        assert f.metrics()["aborted"] == 1 and f.metrics()["committed"] == 0
