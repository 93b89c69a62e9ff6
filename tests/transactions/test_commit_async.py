"""``Transaction.commit_async`` (docs/API.md, "Transaction"): the future
resolves once the decision is synced, the outputs visible and the acks
applied; one thread's pipelined commits go to one coordinator and share its
sync; a thread that waits on a queued commit's future finishes the queue
itself (sync, fan-out, every queued future resolved) rather than wait for
the flusher thread. The power-loss promise of a resolved future is in
tests/broker/test_power_loss.py."""

from __future__ import annotations

import threading

import pytest

import txmq
from txmq.testing.counters import FlushCounter


@pytest.fixture
def broker(tmp_path):
    b = txmq.Broker(tmp_path / "data", fsync="commit")
    b.create_topic("in")
    b.create_topic("out")
    b.producer("in").send_batch([b"m%d" % i for i in range(10)])
    yield b
    b.close()


def pipeline(b, n: int) -> list:
    """``n`` transactions, each moving one message of ``in`` to ``out``
    upper-cased and acking it, committed with commit_async; the futures."""
    c = b.subscribe("in", "s", initial_position="earliest")
    out = b.producer("out")
    futures = []
    for m in c.receive_many(n, 1.0):
        txn = b.new_transaction()
        out.send(m.value.upper(), txn=txn)
        c.ack(m, txn=txn)
        futures.append(txn.commit_async())
    assert len(futures) == n
    return futures


def without_flusher(b) -> None:
    """Every coordinator's flusher thread exits at once: only a thread
    waiting on a future finishes queued commits."""
    for tc in b._coordinators:
        tc._flush_loop = lambda: None


def committed(b) -> list:
    rc = b.subscribe("out", "rc", initial_position="earliest")
    return sorted(m.value for m in rc.receive_many(100, 0.2))


def test_the_futures_resolve_with_the_outputs_visible_and_the_acks_applied(broker):
    futures = pipeline(broker, 10)
    assert [f.result(10) for f in futures] == [None] * 10
    assert committed(broker) == sorted(b"M%d" % i for i in range(10))
    assert broker.stats()["topics"]["in"]["subscriptions"]["s"]["backlog"] == 0


def test_a_thread_waiting_on_a_queued_future_finishes_every_queued_commit(broker):
    without_flusher(broker)
    futures = pipeline(broker, 6)
    assert not any(f.done() for f in futures)       # (nothing finishes them but a waiter)
    ran_in = []
    for f in futures:
        f.add_done_callback(lambda f: ran_in.append(threading.get_ident()))
    with FlushCounter() as flushes:
        assert futures[2].result(10) is None
    assert all(f.done() for f in futures) and ran_in == [threading.get_ident()] * 6
    assert flushes.by_kind["fdatasync"] == 1           # one sync for the six, in this thread
    assert committed(broker) == sorted(b"M%d" % i for i in range(6))


def test_exception_waits_the_same_way(broker):
    without_flusher(broker)
    futures = pipeline(broker, 3)
    assert futures[0].exception(10) is None
    assert all(f.done() and f.result() is None for f in futures)


def test_a_sync_that_fails_fails_every_future_it_covered(broker, monkeypatch):
    without_flusher(broker)
    futures = pipeline(broker, 3)
    tcs = {id(tc): tc for tc in broker._coordinators if tc._queued}
    assert len(tcs) == 1                                 # one thread: one coordinator
    [tc] = tcs.values()

    def failing(mark):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(tc.log, "sync_to", failing)
    with pytest.raises(OSError):
        futures[1].result(10)
    assert all(isinstance(f.exception(0), OSError) for f in futures)


def test_each_thread_pipelines_on_its_own_coordinator(broker):
    seen = {}

    def run(name):
        txns = [broker.new_transaction() for _ in range(3)]
        seen[name] = {t.id.coordinator for t in txns}
        for t in txns:
            t.commit_async().result(10)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(len(s) for s in seen.values()) == [1, 1, 1, 1]
    assert set().union(*seen.values()) == {0, 1, 2, 3}
