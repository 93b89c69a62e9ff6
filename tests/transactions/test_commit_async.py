"""``Transaction.commit_async`` (docs/API.md, "Transaction"): the future
resolves once the decision is synced, the outputs visible and the acks
applied; one thread's pipelined commits go to one coordinator, whose
flusher syncs them together; a failed sync fails every future it covered.
The power-loss promise of a resolved future is in
tests/broker/test_power_loss.py."""

from __future__ import annotations

import threading

import pytest

import txmq


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


def committed(b) -> list:
    rc = b.subscribe("out", "rc", initial_position="earliest")
    return sorted(m.value for m in rc.receive_many(100, 0.2))


def test_the_futures_resolve_with_the_outputs_visible_and_the_acks_applied(broker):
    futures = pipeline(broker, 10)
    assert [f.result(10) for f in futures] == [None] * 10
    assert committed(broker) == sorted(b"M%d" % i for i in range(10))
    assert broker.stats()["topics"]["in"]["subscriptions"]["s"]["backlog"] == 0


def test_a_sync_that_fails_fails_every_future_it_covered(broker, monkeypatch):
    tc = broker._coordinators[0]                  # (the first thread to begin one: coordinator 0)

    def failing(mark):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(tc.log, "sync_to", failing)
    futures = pipeline(broker, 3)

    assert all(isinstance(f.exception(10), OSError) for f in futures)
    with pytest.raises(OSError):
        futures[1].result(10)


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
