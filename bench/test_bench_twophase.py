"""An event published with a database write, atomically: txmq.twophase
against the outbox pattern, on the same PostgreSQL server (started here,
``fsync=on``: both sides durable) in the same run.

- ``two-phase``: per order, one pair of :class:`txmq.twophase.PostgresTwoPhase`
  (``fsync="commit"``): the row inserted in PostgreSQL and the event sent
  to txmq, both prepared, the decision committed in txmq, then ``COMMIT
  PREPARED``. Each commit returns with both sides durable and visible.
- ``outbox``: per order, one PostgreSQL transaction inserts the row and an
  outbox row; a relay thread polls the outbox (``FOR UPDATE SKIP LOCKED``,
  up to 100 rows), publishes what it found to txmq as one batch and deletes
  it in the same PostgreSQL transaction (at-least-once: a crash between the
  publish and the delete publishes again). A round ends when the relay
  has published all of its events.

Rounds of 50 orders alternate between the sides; orders per second is
reported, with no goal: the ratio says what the atomicity without a relay
costs (two flushes on each side per commit, against one and the relay's
share).
"""

from __future__ import annotations

import itertools
import os
import sys
import threading

import pytest

import conftest
import txmq
from test_bench_producers import alternate

psycopg = pytest.importorskip("psycopg")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "helpers"))
from postgres_server import PostgresServer  # noqa: E402

from txmq.twophase import PostgresTwoPhase  # noqa: E402

GROUP = "twophase"
ORDERS = 50
conftest.add_comparison(GROUP, conftest.Comparison(
    "an order row + its event, atomically: txmq two-phase vs PostgreSQL outbox + relay", "two-phase",
    "outbox", None, ">=", note="no goal: both durable; two-phase commits with no relay"))


@pytest.fixture(scope="module")
def pg():
    server = PostgresServer(fsync=True)
    yield server
    server.stop()


class Relay:
    """The outbox pattern's relay: polls, publishes, deletes."""

    def __init__(self, conninfo, producer):
        self.conn = psycopg.connect(conninfo)
        self.producer = producer
        self.published = 0
        self.cond = threading.Condition()
        self.stop = False
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop:
            with self.conn.transaction():
                rows = self.conn.execute("SELECT id, payload FROM outbox ORDER BY id LIMIT 100 "
                                         "FOR UPDATE SKIP LOCKED").fetchall()
                if rows:
                    self.producer.send_batch([bytes(p) for _, p in rows])
                    self.conn.execute("DELETE FROM outbox WHERE id = ANY(%s)", ([i for i, _ in rows],))
            if rows:
                with self.cond:
                    self.published += len(rows)
                    self.cond.notify_all()
            else:
                with self.cond:
                    self.cond.wait(0.001)

    def wait_for(self, n):
        with self.cond:
            while self.published < n:
                self.cond.wait(1.0)

    def close(self):
        self.stop = True
        self.thread.join()
        self.conn.close()


def test_two_phase_vs_outbox(measure, benchmark, results, tmp_path, pg, request):
    with psycopg.connect(pg.conninfo, autocommit=True) as c:
        c.execute("CREATE TABLE orders (id bigint PRIMARY KEY, item text NOT NULL)")
        c.execute("CREATE TABLE outbox (id bigserial PRIMARY KEY, payload bytea NOT NULL)")
    broker = txmq.Broker(tmp_path / "d", fsync="commit")
    request.addfinalizer(broker.close)
    broker.create_topic("orders-2pc")
    broker.create_topic("orders-outbox")
    events = broker.producer("orders-2pc")
    two_phase = PostgresTwoPhase(broker, pg.conninfo, name="bench")
    request.addfinalizer(two_phase.close)
    app = psycopg.connect(pg.conninfo)
    request.addfinalizer(app.close)
    relay = Relay(pg.conninfo, broker.producer("orders-outbox"))
    request.addfinalizer(relay.close)
    ids = itertools.count()
    queued = [0]

    def two_phase_round():
        for _ in range(ORDERS):
            i = next(ids)
            with two_phase.transaction() as pair:
                pair.conn.execute("INSERT INTO orders VALUES (%s, 'widget')", (i,))
                events.send(b"order %d" % i, txn=pair.txn)

    def outbox_round():
        for _ in range(ORDERS):
            i = next(ids)
            with app.transaction():
                app.execute("INSERT INTO orders VALUES (%s, 'widget')", (i,))
                app.execute("INSERT INTO outbox (payload) VALUES (%s)", (b"order %d" % i,))
        queued[0] += ORDERS
        relay.wait_for(queued[0])

    alternate(measure, benchmark, results, GROUP, ("outbox", outbox_round), ("two-phase", two_phase_round),
              ops_per_round=ORDERS, unit="order", rounds=20, warmup=2)
    assert broker.prepared_transactions() == []
    with psycopg.connect(pg.conninfo) as c:
        assert c.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone()[0] == 0
        assert c.execute("SELECT count(*) FROM outbox").fetchone()[0] == 0
