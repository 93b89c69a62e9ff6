"""Half messages (docs/FORMAT.md, "Half messages"; docs/GUARANTEES.md G10): commit, rollback, check-back,
discards, the state table and its redo log."""

from __future__ import annotations

import os
import random
import struct
import threading
import time

import numpy as np
import pytest

import txmq
from txmq import LocalTransactionState as S
from txmq import _half
from txmq.errors import CorruptLogError, InvalidArgumentError, InvalidHalfStateError

from killer import drain

CHECK_MAX = txmq.storage.half_messages.CHECK_MAX_TOPIC


def open_broker(path, **kw):
    opts = dict(fsync="never", half_check_interval=3600.0, half_check_immunity=0.0, half_max_checks=3)
    opts.update(kw)
    return txmq.Broker(path, **opts)


def visible(broker, topic="orders"):
    c = broker.subscribe(topic, f"look-{time.monotonic_ns()}", isolation="read_uncommitted",
                         initial_position="earliest")
    try:
        return sorted(m.value for m in drain(c))
    finally:
        c.unsubscribe()


def resolve(broker, rounds=10):
    """Run check rounds until nothing is PREPARED (store times are whole
    seconds: a check waits until the immunity has surely passed)."""
    deadline = time.monotonic() + 10
    for _ in range(rounds):
        while not broker._half.due(time.time()):
            if broker.stats()["half"]["by_state"]["prepared"] == 0 or time.monotonic() > deadline:
                return
            time.sleep(0.05)
        broker.check_half_messages()


@pytest.fixture
def broker(tmp_path):
    with open_broker(tmp_path / "d") as b:
        b.create_topic("orders", 3)
        yield b


def test_commit_rollback_unknown(broker):
    hp = broker.half_producer("orders", "svc")
    seen = []
    r1 = hp.send_in_transaction(b"a", lambda m, arg: (seen.append((m.value, arg, m.txn_id)), S.COMMIT)[1], arg=7)
    r2 = hp.send_in_transaction(b"b", lambda m, arg: S.ROLLBACK, key=b"k")
    r3 = hp.send_in_transaction(b"c", lambda m, arg: S.UNKNOWN)
    assert seen == [(b"a", 7, r1.half_id)]
    assert r1.state is S.COMMIT and r1.message_id.topic == "orders"
    assert (r2.state, r2.message_id, r3.state, r3.message_id) == (S.ROLLBACK, None, S.UNKNOWN, None)
    assert [r1.half_id, r2.half_id, r3.half_id] == [0, 1, 2]
    assert visible(broker) == [b"a"]
    by = broker.stats()["half"]["by_state"]
    assert (by["prepared"], by["rolled_back"], by["committed"] + by["committing"]) == (1, 1, 1)
    assert hp.end_transaction(r3.half_id, S.COMMIT).topic == "orders"
    assert visible(broker) == [b"a", b"c"]


def test_committed_message_keeps_key_headers_event_time_and_partition(broker):
    hp = broker.half_producer("orders", "svc")
    r = hp.send_in_transaction(b"v", lambda m, a: S.COMMIT, key=b"customer-9", headers={"h": b"1"})
    plain = broker.producer("orders").send(b"w", key=b"customer-9")
    assert r.message_id.partition == plain.partition
    c = broker.subscribe("orders", "s", initial_position="earliest")
    m = c.receive(timeout=1)
    assert (m.value, m.key, m.headers, m.message_id) == (b"v", b"customer-9", [("h", b"1")], r.message_id)


def test_half_message_is_invisible_until_committed(broker):
    hp = broker.half_producer("orders", "svc")
    c = broker.subscribe("orders", "ru", isolation="read_uncommitted", initial_position="earliest")
    gate = threading.Event()
    inside = threading.Event()

    def local(m, a):
        inside.set()
        gate.wait(5)
        return S.COMMIT

    t = threading.Thread(target=hp.send_in_transaction, args=(b"x", local))
    t.start()
    inside.wait(5)
    assert c.receive(timeout=0.2) is None          # stored, not visible, not even uncommitted
    assert broker.high_watermark("orders", 0) + broker.high_watermark("orders", 1) \
        + broker.high_watermark("orders", 2) == 0
    gate.set()
    t.join()
    assert c.receive(timeout=1).value == b"x"


def test_local_transaction_exception_is_unknown_then_checked(broker):
    answers = {}
    hp = broker.half_producer("orders", "svc", checker=lambda m: answers[m.value])
    r = hp.send_in_transaction(b"boom", lambda m, a: 1 / 0)
    assert r.state is S.UNKNOWN
    answers[b"boom"] = S.COMMIT
    resolve(broker)
    assert visible(broker) == [b"boom"]
    assert broker.stats()["half"]["checks_sent"] == 1


@pytest.mark.parametrize("answer, expect", [(S.COMMIT, [b"q"]), (S.ROLLBACK, [])])
def test_check_back_commits_or_rolls_back(broker, answer, expect):
    asked = []
    hp = broker.half_producer("orders", "svc", checker=lambda m: (asked.append(m.txn_id), answer)[1])
    r = hp.send_in_transaction(b"q", lambda m, a: S.UNKNOWN)
    resolve(broker)
    assert asked == [r.half_id]
    assert visible(broker) == expect
    by = broker.stats()["half"]["by_state"]
    assert by["prepared"] == 0 and (by["committed"] if answer is S.COMMIT else by["rolled_back"]) == 1
    broker.check_half_messages()
    assert asked == [r.half_id]                    # resolved: never asked again


def test_discard_after_max_checks_then_resume(broker):
    asked = []
    hp = broker.half_producer("orders", "svc", checker=lambda m: (asked.append(1), S.UNKNOWN)[1])
    r = hp.send_in_transaction(b"stuck", lambda m, a: S.UNKNOWN, key=b"k", headers=[("h", b"1")])
    resolve(broker)
    assert len(asked) == 3                          # half_max_checks
    assert visible(broker) == []
    dead = broker.subscribe(CHECK_MAX, "ops", initial_position="earliest")
    (m,) = drain(dead)
    assert (m.value, m.key) == (b"stuck", b"k")
    assert dict(m.headers) == {"h": b"1", "txmq.half-id": str(r.half_id).encode(), "txmq.real-topic": b"orders",
                               "txmq.producer-group": b"svc"}
    s = broker.stats()["half"]
    assert s["by_state"]["discarded"] == 1 and s["discarded"] == 1 and s["checks_sent"] == 3
    with pytest.raises(InvalidHalfStateError):
        hp.end_transaction(r.half_id, S.ROLLBACK)
    # an operator resumes it; its checker now commits it
    assert broker.resume_half_checks() == [r.half_id]
    hp.checker = lambda m: S.COMMIT
    resolve(broker)
    assert visible(broker) == [b"stuck"]
    assert drain(dead) == []                        # discarded once
    with pytest.raises(InvalidHalfStateError):
        broker.resume_half_checks([r.half_id])     # not discarded any more


def test_group_without_live_member_is_not_checked_or_counted(broker):
    hp = broker.half_producer("orders", "lonely")  # no checker
    hp.send_in_transaction(b"x", lambda m, a: S.UNKNOWN)
    other = broker.half_producer("orders", "other", checker=lambda m: S.COMMIT)
    for _ in range(6):
        time.sleep(0.4)
        broker.check_half_messages()
    s = broker.stats()["half"]
    assert s["checks_sent"] == 0 and s["discarded"] == 0 and s["by_state"]["prepared"] == 1
    assert broker._half.table.get(0)[5] == 0
    # a member of the group arrives: now it is checked
    broker.half_producer("orders", "lonely", checker=lambda m: S.COMMIT)
    resolve(broker)
    assert visible(broker) == [b"x"]
    other.close()


def test_raising_checker_counts_as_unknown(broker):
    hp = broker.half_producer("orders", "svc", checker=lambda m: 1 / 0)
    hp.send_in_transaction(b"x", lambda m, a: S.UNKNOWN)
    resolve(broker)
    s = broker.stats()["half"]
    assert s["checks_sent"] == 3 and s["by_state"]["discarded"] == 1
    assert visible(broker) == []


def test_check_picks_a_live_producer_of_the_group_at_random(broker):
    asked = {"a": 0, "b": 0}

    def checker(name):
        def check(m):
            asked[name] += 1
            return S.UNKNOWN
        return check

    a = broker.half_producer("orders", "svc", checker=checker("a"))
    b = broker.half_producer("orders", "svc", checker=checker("b"))
    broker._half.max_checks = 1000
    for i in range(40):
        a.send_in_transaction(b"%d" % i, lambda m, x: S.UNKNOWN)
    time.sleep(1.1)
    for _ in range(3):
        broker.check_half_messages()
    assert asked["a"] + asked["b"] == 120 and asked["a"] > 20 and asked["b"] > 20
    b.close()
    broker.check_half_messages()
    assert asked["b"] + asked["a"] == 160 and asked["b"] < 120


def test_check_immunity_per_message(broker):
    hp = broker.half_producer("orders", "svc", checker=lambda m: S.COMMIT)
    broker._half.check_immunity = 3600.0
    hp.send_in_transaction(b"default", lambda m, a: S.UNKNOWN)
    hp.send_in_transaction(b"quick", lambda m, a: S.UNKNOWN, check_immunity=0.0)
    hp.send_in_transaction(b"slow", lambda m, a: S.UNKNOWN, check_immunity=7200.0)
    time.sleep(1.1)
    broker.check_half_messages()
    assert visible(broker) == [b"quick"]
    broker._half.check_immunity = 0.0              # the default no longer holds "default" back
    broker.check_half_messages()
    assert visible(broker) == [b"default", b"quick"]
    with pytest.raises(InvalidArgumentError):
        hp.send_in_transaction(b"x", lambda m, a: S.COMMIT, check_immunity=-1)


def test_end_twice_appends_once_and_contradictions_fail(broker):
    hp = broker.half_producer("orders", "svc")
    r = hp.send_in_transaction(b"x", lambda m, a: S.UNKNOWN)
    assert hp.end_transaction(r.half_id, S.COMMIT) is not None
    assert hp.end_transaction(r.half_id, S.COMMIT) is None
    assert hp.end_transaction(r.half_id, S.UNKNOWN) is None
    with pytest.raises(InvalidHalfStateError):
        hp.end_transaction(r.half_id, S.ROLLBACK)
    r2 = hp.send_in_transaction(b"y", lambda m, a: S.ROLLBACK)
    hp.end_transaction(r2.half_id, S.ROLLBACK)
    with pytest.raises(InvalidHalfStateError):
        hp.end_transaction(r2.half_id, S.COMMIT)
    with pytest.raises(InvalidHalfStateError):
        hp.end_transaction(999, S.COMMIT)
    with pytest.raises(InvalidArgumentError):
        hp.end_transaction(r.half_id, "commit")
    assert visible(broker) == [b"x"]


def test_bad_arguments(broker, tmp_path):
    with pytest.raises(txmq.errors.TopicNotFoundError):
        broker.half_producer("nope", "g")
    with pytest.raises(InvalidArgumentError):
        broker.half_producer("orders", "")
    with pytest.raises(InvalidArgumentError):
        broker.half_producer("orders", "g", checker=5)
    with pytest.raises(InvalidArgumentError):
        broker.producer("orders", name="__txmq.half/orders/g")
    for kw in ({"half_check_interval": 0}, {"half_check_immunity": -1}, {"half_max_checks": -1},
               {"half_retention": "x"}):
        with pytest.raises(InvalidArgumentError):
            txmq.Broker(tmp_path / "other", **kw)
    hp = broker.half_producer("orders", "g")
    hp.close()
    with pytest.raises(txmq.errors.BrokerClosedError):
        hp.send_in_transaction(b"x", lambda m, a: S.COMMIT)


def test_prepared_survives_restart_and_is_checked_after(tmp_path):
    with open_broker(tmp_path / "d") as b:
        b.create_topic("orders", 2)
        hp = b.half_producer("orders", "svc")
        ids = [hp.send_in_transaction(b"%d" % i, lambda m, a: S.UNKNOWN).half_id for i in range(5)]
        hp.end_transaction(ids[0], S.ROLLBACK)
    with open_broker(tmp_path / "d") as b:
        assert b.stats()["half"]["by_state"]["prepared"] == 4
        b.half_producer("orders", "svc", checker=lambda m: S.COMMIT if int(m.value) % 2 else S.ROLLBACK)
        resolve(b)
        assert visible(b) == [b"1", b"3"]
        s = b.stats()["half"]
        assert s["table_records_rebuilt_on_open"] == 0 and s["problems_on_open"] == []


def _table_bytes(path):
    with open(os.path.join(path, "half", "statetable"), "rb") as f:
        return f.read()


def test_corrupt_state_table_is_rebuilt_from_the_redo_log(tmp_path):
    d = tmp_path / "d"
    with open_broker(d) as b:
        b.create_topic("orders", 1)
        hp = b.half_producer("orders", "svc")
        for i in range(300):
            hp.send_in_transaction(b"%d" % i, lambda m, a, i=i: (S.COMMIT, S.ROLLBACK, S.UNKNOWN)[i % 3])
    good = _table_bytes(d)[:_half.HEADER_SIZE + 300 * 28]
    table = os.path.join(d, "half", "statetable")
    rng = random.Random(3)
    with open(table, "r+b") as f:               # scribble over states and offsets
        for _ in range(40):
            f.seek(_half.HEADER_SIZE + rng.randrange(300) * 28 + rng.choice((0, 20, 24)))
            f.write(struct.pack("<i", rng.randrange(1, 7)))
    with open_broker(d) as b:
        s = b.stats()["half"]
        assert s["table_records_rebuilt_on_open"] > 0
        assert _table_bytes(d)[:len(good)] == good
        assert s["by_state"]["prepared"] == 100 and s["by_state"]["rolled_back"] == 100
    with open(table, "r+b") as f:               # a table whose header is gone
        f.write(b"\0" * 16)
    with open_broker(d) as b:
        assert any("header" in p for p in b.stats()["half"]["problems_on_open"])
        assert _table_bytes(d)[:len(good)] == good
    os.unlink(table)                            # no table at all
    with open_broker(d) as b:
        assert b.stats()["half"]["by_state"]["prepared"] == 100
        assert _table_bytes(d)[:len(good)] == good


def test_corrupt_redo_log_is_a_clear_error(tmp_path):
    d = tmp_path / "d"
    with open_broker(d) as b:
        b.create_topic("orders", 1)
        b.half_producer("orders", "svc").send_in_transaction(b"x", lambda m, a: S.UNKNOWN)
    redo = os.path.join(d, "half", "redo.log")
    with open(redo, "r+b") as f:
        f.write(b"JUNK")
    with pytest.raises(CorruptLogError) as e:
        open_broker(d)
    assert e.value.path == redo and e.value.position == 0


def test_torn_redo_tail_is_cut_and_reported(tmp_path):
    d = tmp_path / "d"
    with open_broker(d) as b:
        b.create_topic("orders", 1)
        hp = b.half_producer("orders", "svc")
        for i in range(3):
            hp.send_in_transaction(b"%d" % i, lambda m, a: S.UNKNOWN)
    redo = os.path.join(d, "half", "redo.log")
    size = os.path.getsize(redo)
    with open(redo, "r+b") as f:
        f.truncate(size - 5)                    # the last RECORD frame is torn
    with open_broker(d) as b:
        s = b.stats()["half"]
        assert any("redo.log" in p for p in s["problems_on_open"])
        # its half message is in the half log: found on open, PREPARED again
        assert s["found_on_open"] == 1 and s["by_state"]["prepared"] == 3


def test_compaction_drops_resolved_records_and_half_segments(tmp_path):
    d = tmp_path / "d"
    with open_broker(d, segment_bytes_max=16 * 1024, half_retention=0.0) as b:
        b.create_topic("orders", 2)
        hp = b.half_producer("orders", "svc", checker=lambda m: S.COMMIT)
        first = hp.send_in_transaction(b"early-unknown", lambda m, a: S.UNKNOWN, check_immunity=3600)
        hp.end_transaction(first.half_id, S.COMMIT)
        keep = []
        for i in range(30_000):
            r = hp.send_in_transaction(b"%06d" % i, lambda m, a, i=i: S.COMMIT if i % 2 else S.ROLLBACK)
            if i in (25_000, 29_999):
                keep.append(hp.send_in_transaction(b"late-%d" % i, lambda m, a: S.UNKNOWN,
                                                   check_immunity=3600).half_id)
        segments_before = len(b._half.log.segments)
        assert b._half.maybe_compact(time.time() + 5)
        s = b.stats()["half"]
        assert s["first_half_id"] == keep[0] and s["by_state"]["prepared"] == 2
        assert len(b._half.log.segments) < segments_before / 2
        assert b._half.redo.frames_since_snapshot == 1
        count = len(visible(b))
    with open_broker(d, segment_bytes_max=16 * 1024) as b:
        s = b.stats()["half"]
        assert s["first_half_id"] == keep[0] and s["by_state"]["prepared"] == 2 and s["problems_on_open"] == []
        hp = b.half_producer("orders", "svc")
        for half_id in keep:
            hp.end_transaction(half_id, S.COMMIT)
        got = visible(b)
        assert len(got) == count + 2 and b"late-25000" in got and b"late-29999" in got
        assert len(set(got)) == len(got)


def test_scan_is_vectorised_and_matches_a_python_loop(tmp_path):
    """The due scan over a table of many records equals a record-by-record
    reading of the same bytes."""
    t = _half.StateTable(str(tmp_path / "t"), 1000, 1000)
    rng = np.random.default_rng(5)
    n = 50_000
    states = rng.integers(0, 7, n)
    times = rng.integers(0, 100, n)
    checks = rng.integers(0, 5, n)
    for i in range(n):
        t.put(1000 + i, 1000 + i, 10, int(times[i]), 3, int(states[i]), int(checks[i]))
    raw = t.raw(1000, 1000 + n)
    expect = []
    for i in range(n):
        off, size, st, g, state, cc = struct.unpack_from("<qiiiii", raw, i * 28)
        if state == _half.PREPARED and st <= 50 and cc < 3:
            expect.append(i)
    assert _half.due(t.records(), 50, 3).tolist() == expect
    assert t.due(50, 3).tolist() == expect
    assert _half.count_states(t.records()).tolist() == np.bincount(states, minlength=7).tolist()
    t.close()


def test_state_record_layout():
    assert _half.RECORD_SIZE == 28 and _half.RECORD_DTYPE.itemsize == 28
    frame = _half.record_frame(5, 5, 100, 1_700_000_000, -7, _half.PREPARED, 2)
    assert struct.unpack_from("<qqiiiii", frame) == (5, 5, 100, 1_700_000_000, -7, _half.PREPARED, 2)
    with pytest.raises(ValueError):
        _half.replay([(_half.F_UPDATE, b"\0" * 15)])
    with pytest.raises(ValueError):
        _half.replay([(_half.F_UPDATE, struct.pack("<qii", 3, 1, 0))])   # no such record
    with pytest.raises(ValueError):
        _half.replay([(99, b"")])
