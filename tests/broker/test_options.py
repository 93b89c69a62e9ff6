"""The options of Broker() and create_topic() (txmq.options): every value
outside what an option accepts is refused with InvalidArgumentError naming
the option and the value, before anything is opened; the broker's
background work cannot be made to spin."""

import math
import os
import resource
import threading
import time

import numpy as np
import pytest

import txmq
from txmq import errors
from txmq.scheduler import MIN_INTERVAL, Scheduler

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize("option, value", [
    ("retention_check_interval", 0), ("retention_check_interval", -1), ("retention_check_interval", NAN),
    ("retention_check_interval", INF), ("retention_check_interval", MIN_INTERVAL / 2),
    ("retention_check_interval", "60"), ("retention_check_interval", True),
    ("transaction_timeout_max", NAN), ("transaction_timeout_max", INF), ("transaction_timeout_max", 0),
    ("transaction_timeout_max", True), ("transaction_timeout_max", 1e300),
    ("retention_ms", -1), ("retention_ms", "x"), ("retention_ms", 1.5), ("retention_ms", True),
    ("retention_bytes", "x"), ("retention_bytes", -5), ("retention_bytes", False),
    ("index_interval_bytes", -1), ("index_interval_bytes", 0), ("index_interval_bytes", "x"),
    ("index_interval_bytes", 2**31), ("index_interval_bytes", True), ("index_interval_bytes", None),
    ("control_socket", "x"), ("control_socket", 1), ("control_socket", None),
    ("segment_bytes_max", True), ("segment_bytes_max", 65536.0),
    ("max_message_bytes", True), ("max_message_bytes", 0), ("max_message_bytes", 1.0),
    ("num_coordinators", True), ("num_coordinators", 0), ("num_coordinators", 2.0),
    ("producer_id_expiration", NAN), ("producer_id_expiration", INF), ("producer_id_expiration", 0),
    ("half_check_interval", NAN), ("half_check_interval", 0), ("half_check_interval", -1),
    ("half_check_immunity", NAN), ("half_check_immunity", -1), ("half_check_immunity", INF),
    ("half_retention", INF), ("half_retention", "x"),
    ("half_max_checks", True), ("half_max_checks", -1), ("half_max_checks", 1.0),
])
def test_broker_refuses_a_bad_option(tmp_path, option, value):
    with pytest.raises(errors.InvalidArgumentError) as e:
        txmq.Broker(tmp_path / "d", fsync="never", **{option: value})
    assert e.value.name == option and e.value.value is value
    assert option in str(e.value) and repr(value) in str(e.value)
    # Refused before the directory was touched: nothing to undo, no lock held.
    assert not os.path.exists(tmp_path / "d")


@pytest.mark.parametrize("option, value", [
    ("retention_ms", -1), ("retention_ms", "x"), ("retention_ms", True), ("retention_ms", 2.0),
    ("retention_bytes", "x"), ("retention_bytes", -1), ("retention_bytes", True),
    ("partitions", True), ("partitions", 0), ("partitions", 10_001), ("partitions", "2"),
])
def test_create_topic_refuses_the_same_values(tmp_path, option, value):
    with txmq.Broker(tmp_path / "d", fsync="never") as b:
        with pytest.raises(errors.InvalidArgumentError) as e:
            b.create_topic("t", **{option: value})
        assert e.value.name == option and e.value.value is value
        assert b.topics() == []


def test_good_options_are_taken_as_given(tmp_path):
    with txmq.Broker(tmp_path / "d", fsync="never", retention_ms=np.int64(1000), retention_bytes=0,
                     index_interval_bytes=1, transaction_timeout_max=5, control_socket=False,
                     retention_check_interval=MIN_INTERVAL) as b:
        assert (b.retention_ms, b.retention_bytes, b.transaction_timeout_max) == (1000, 0, 5.0)
        assert type(b.retention_ms) is int
        assert not os.path.exists(os.path.join(b.path, "control.sock"))
        b.create_topic("t", 2, retention_ms=np.int32(5), retention_bytes=None)
        assert b.describe_topic("t")["retention_ms"] == 5


def test_option_error_names_the_option_and_the_value(tmp_path):
    with pytest.raises(errors.InvalidArgumentError) as e:
        txmq.Broker(tmp_path / "d", transaction_timeout_max=NAN)
    assert str(e.value) == ("invalid transaction_timeout_max nan: expected finite seconds > 0 "
                            "and <= 1e+09")
    assert isinstance(e.value, ValueError)


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def test_an_idle_broker_does_not_spin(tmp_path):
    """The smallest retention_check_interval allowed leaves an idle broker
    mostly asleep (a 0 interval used to burn a whole core)."""
    with txmq.Broker(tmp_path / "d", fsync="never", retention_check_interval=MIN_INTERVAL,
                     control_socket=False):
        before = _cpu_seconds()
        time.sleep(0.5)
        used = _cpu_seconds() - before
    assert used < 0.3, f"an idle broker used {used:.2f} CPU-s in 0.5 s"


@pytest.mark.parametrize("kind", ["every", "on_demand"])
@pytest.mark.parametrize("interval", [0, -1, NAN, INF, MIN_INTERVAL / 10, None, "1"])
def test_the_scheduler_refuses_an_interval_it_would_spin_on(interval, kind):
    s = Scheduler()
    try:
        with pytest.raises(ValueError):
            getattr(s, kind)(interval, lambda: None)
    finally:
        s.stop()


@pytest.mark.parametrize("option, value", [
    ("ack_timeout", NAN), ("ack_timeout", INF), ("ack_timeout", 0), ("ack_timeout", True),
    ("nack_delay", NAN), ("nack_delay", -1), ("nack_delay", False), ("nack_delay", "1"),
    ("type", 5), ("isolation", None), ("initial_position", b"earliest"),
])
def test_subscribe_refuses_a_bad_option(tmp_path, option, value):
    with txmq.Broker(tmp_path / "d", fsync="never") as b:
        b.create_topic("t")
        with pytest.raises(errors.InvalidArgumentError) as e:
            b.subscribe("t", "s", **{option: value})
        assert e.value.value is value
        assert b.subscriptions("t") == []


def _wait_until(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_an_on_demand_task_sleeps_until_armed_and_while_it_returns_false():
    runs = []
    keep = [True, True, False]
    s = Scheduler()
    try:
        task = s.on_demand(MIN_INTERVAL, lambda: runs.append(time.monotonic()) or keep[len(runs) - 1])
        time.sleep(5 * MIN_INTERVAL)
        assert runs == [], "ran before it was armed"
        armed_at = time.monotonic()
        task.arm()
        task.arm()                                   # (armed already: one schedule)
        _wait_until(lambda: len(runs) == 3)
        assert runs[0] - armed_at >= MIN_INTERVAL * 0.9
        time.sleep(5 * MIN_INTERVAL)
        assert len(runs) == 3, "ran again after returning false"
        assert not task.armed
        keep.append(False)
        task.arm()
        _wait_until(lambda: len(runs) == 4)
        time.sleep(5 * MIN_INTERVAL)
        assert len(runs) == 4
    finally:
        s.stop()


def test_an_arm_while_an_on_demand_task_runs_is_kept():
    started, release, runs = threading.Event(), threading.Event(), []
    s = Scheduler()

    def fn():
        runs.append(1)
        if len(runs) == 1:
            started.set()
            release.wait(5)
        return False                                  # "nothing left", as seen before the arm

    try:
        task = s.on_demand(MIN_INTERVAL, fn)
        task.arm()
        assert started.wait(5)
        task.arm()                                    # work that came while it ran
        release.set()
        _wait_until(lambda: len(runs) == 2)
    finally:
        s.stop()


def test_an_on_demand_task_that_raises_keeps_running_until_it_returns_false():
    runs = []

    def fn():
        runs.append(1)
        if len(runs) < 3:
            raise RuntimeError("boom")
        return False

    s = Scheduler()
    try:
        s.on_demand(MIN_INTERVAL, fn).arm()
        _wait_until(lambda: len(runs) == 3)
        time.sleep(5 * MIN_INTERVAL)
        assert len(runs) == 3
    finally:
        s.stop()


def test_the_linger_timer_sleeps_while_no_batch_is_open(tmp_path, monkeypatch):
    """The timer that appends lingering batches runs only while an
    accumulator is open: a broker whose transactions send nothing one
    message at a time never wakes it."""
    from txmq.client.accumulator import SendBatching
    calls = []
    flush_due = SendBatching.flush_due
    monkeypatch.setattr(SendBatching, "flush_due", lambda self: calls.append(1) or flush_due(self))
    with txmq.Broker(tmp_path / "d", fsync="never", linger_ms=10, control_socket=False) as b:
        b.create_topic("t")
        p = b.producer("t")
        for _ in range(5):
            with b.transaction() as txn:
                p.send_batch([b"x"] * 10, txn=txn)
        time.sleep(0.2)
        assert calls == [], "the linger timer ran with no batch open"
        end = b.high_watermark("t", 0)
        txn = b.new_transaction()
        p.send(b"lingering", txn=txn)               # joins a batch: the timer wakes to append it
        _wait_until(lambda: b.high_watermark("t", 0) == end + 1)
        txn.commit()
        _wait_until(lambda: len(calls) >= 2)      # (one more run finds nothing left and sleeps)
        time.sleep(0.1)
        settled = len(calls)
        time.sleep(0.2)
        assert len(calls) == settled, "the linger timer kept running after the transaction ended"


def test_open_transactions_whose_batches_went_out_cost_the_timer_nothing(tmp_path, monkeypatch):
    """An accumulator is the timer's only while it holds messages: 2,000
    transactions that each sent one message and stay open leave the
    timer asleep once their batches are appended, and a later send into
    one of them wakes it again and is appended within linger_ms."""
    from txmq.client.accumulator import SendBatching
    calls = []
    flush_due = SendBatching.flush_due
    monkeypatch.setattr(SendBatching, "flush_due", lambda self: calls.append(len(self.live)) or flush_due(self))
    with txmq.Broker(tmp_path / "d", fsync="never", linger_ms=5, control_socket=False) as b:
        b.create_topic("t")
        p = b.producer("t")
        held = []
        for i in range(2000):
            txn = b.new_transaction()
            p.send(b"%d" % i, partition=0, txn=txn)
            held.append(txn)
        _wait_until(lambda: b.high_watermark("t", 0) == 2000)       # every batch appended by the timer
        _wait_until(lambda: not b._batching.live)
        time.sleep(0.1)
        settled = len(calls)
        time.sleep(0.2)
        assert len(calls) == settled, "the timer kept looking at empty accumulators"
        p.send(b"again", partition=0, txn=held[7])                  # joins a new batch: the timer wakes
        _wait_until(lambda: b.high_watermark("t", 0) == 2001)
        assert len(b._batching.live) <= 1 and all(t.state == "OPEN" for t in held)
        for txn in held:
            txn.commit()
        c = b.subscribe("t", "s", initial_position="earliest")
        got = [m.value for m in c.receive_many(3000, 1.0)]
        assert len(got) == 2001 and got[7] == b"7" and b"again" in got


def test_a_periodic_task_keeps_running_whatever_it_returns_or_raises():
    runs = []

    def fn():
        runs.append(1)
        if len(runs) == 2:
            raise RuntimeError("boom")
        return False                                  # (an on_demand task would sleep here)

    s = Scheduler()
    try:
        s.every(MIN_INTERVAL, fn)
        _wait_until(lambda: len(runs) >= 5)
    finally:
        s.stop()
