"""The options of Broker() and create_topic() (txmq.options): every value
outside what an option accepts is refused with InvalidArgumentError naming
the option and the value, before anything is opened; the broker's
background work cannot be made to spin."""

import math
import os
import resource
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


@pytest.mark.parametrize("interval", [0, -1, NAN, INF, MIN_INTERVAL / 10, None, "1"])
def test_the_scheduler_refuses_an_interval_it_would_spin_on(interval):
    s = Scheduler()
    try:
        with pytest.raises(ValueError):
            s.every(interval, lambda: None)
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
