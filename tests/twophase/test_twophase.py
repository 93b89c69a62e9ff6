"""txmq.twophase.PostgresTwoPhase against a real PostgreSQL server
(tests/helpers/postgres_server.py): a commit of both sides or of neither,
the failures before the decision, and recover() on every in-doubt state of
its table (docs/TWOPHASE.md), PostgreSQL unreachable included. The crash
tests are in test_twophase_crash.py."""

from __future__ import annotations

import itertools
import logging

import psycopg
import pytest

import txmq
from txmq import TxnState
from txmq.errors import InvalidArgumentError, TransactionTimeoutError
from txmq.twophase import PostgresTwoPhase

from postgres_server import postgres  # noqa: F401  (a pytest fixture)

_names = itertools.count()


@pytest.fixture
def setup(tmp_path, postgres):  # noqa: F811
    """A broker with topics in/out, a table of its own, a PostgresTwoPhase
    with a name of its own."""
    n = next(_names)
    table = f"orders_{n}"
    with psycopg.connect(postgres.conninfo, autocommit=True) as c:
        c.execute(f"CREATE TABLE {table} (id text PRIMARY KEY, note text)")
        c.execute(f"ALTER TABLE {table} ADD CONSTRAINT {table}_note UNIQUE (note) DEFERRABLE INITIALLY DEFERRED")
    b = txmq.Broker(tmp_path / "d")
    b.create_topic("in")
    b.create_topic("out")
    tp = PostgresTwoPhase(b, postgres.conninfo, name=f"t{n}")
    yield b, tp, table, postgres
    tp.close()
    b.close()


def rows(conninfo, table) -> list:
    with psycopg.connect(conninfo) as c:
        return sorted(r[0] for r in c.execute(f"SELECT id FROM {table}"))


def prepared_in_pg(conninfo) -> list:
    with psycopg.connect(conninfo) as c:
        return sorted(r[0] for r in c.execute("SELECT gid FROM pg_prepared_xacts"))


def out_values(b, name="check"):
    c = b.subscribe("out", name, initial_position="earliest")
    got = []
    while ms := c.receive_many(1000, timeout=0.2):
        got += ms
    c.close()
    return sorted(m.value for m in got)


def test_a_pair_commits_both_sides(setup):
    b, tp, table, pg = setup
    b.producer("in").send(b"order-1")
    c = b.subscribe("in", "s", initial_position="earliest")
    m = c.receive(1.0)
    with tp.transaction() as pair:
        pair.conn.execute(f"INSERT INTO {table} VALUES (%s, 'a')", (m.value.decode(),))
        b.producer("out").send(b"shipped " + m.value, txn=pair.txn)
        c.ack(m, txn=pair.txn)
    assert rows(pg.conninfo, table) == ["order-1"]
    assert out_values(b) == [b"shipped order-1"]
    assert c.receive_many(10, timeout=0.2) == []                 # the input's ack committed with them
    assert prepared_in_pg(pg.conninfo) == [] and b.prepared_transactions() == []
    assert b.prepared_outcome(pair.txn.id) is None               # forgotten once both sides committed
    assert pair.gid == tp.gid_of(pair.txn.id) == f"{tp.name}:{pair.txn.id.coordinator}:{pair.txn.id.sequence}"
    with pytest.raises(InvalidArgumentError):
        pair.commit()                                            # a pair is used once


def test_an_exception_aborts_both_sides(setup):
    b, tp, table, pg = setup
    with pytest.raises(RuntimeError):
        with tp.transaction() as pair:
            pair.conn.execute(f"INSERT INTO {table} VALUES ('x', 'a')")
            b.producer("out").send(b"x", txn=pair.txn)
            raise RuntimeError("the application failed")
    assert pair.txn.state is TxnState.ABORTED
    assert rows(pg.conninfo, table) == [] and out_values(b) == []
    assert prepared_in_pg(pg.conninfo) == []


def test_a_failed_postgresql_prepare_aborts_the_txmq_side(setup):
    """A deferred constraint fails at PREPARE TRANSACTION: no decision was
    made, so txmq's prepared side is aborted and the input comes again."""
    b, tp, table, pg = setup
    with psycopg.connect(pg.conninfo, autocommit=True) as c:
        c.execute(f"INSERT INTO {table} VALUES ('first', 'taken')")
    b.producer("in").send(b"in")
    c = b.subscribe("in", "s", initial_position="earliest")
    m = c.receive(1.0)
    pair = tp.begin()
    pair.conn.execute(f"INSERT INTO {table} VALUES ('second', 'taken')")   # violates UNIQUE (note) at commit
    b.producer("out").send(b"lost", txn=pair.txn)
    c.ack(m, txn=pair.txn)
    with pytest.raises(psycopg.errors.UniqueViolation):
        pair.commit()
    assert pair.txn.state is TxnState.ABORTED
    assert rows(pg.conninfo, table) == ["first"] and out_values(b) == []
    assert [x.value for x in c.receive_many(10, timeout=0.5)] == [b"in"]
    assert prepared_in_pg(pg.conninfo) == [] and b.prepared_transactions() == []
    assert b.prepared_outcome(pair.txn.id) is None


def test_a_failed_txmq_prepare_rolls_back_postgresql(setup):
    import time
    b, tp, table, pg = setup
    pair = tp.begin(timeout=0.1)
    pair.conn.execute(f"INSERT INTO {table} VALUES ('late', 'a')")
    time.sleep(0.3)
    with pytest.raises(TransactionTimeoutError):
        pair.commit()
    assert rows(pg.conninfo, table) == [] and prepared_in_pg(pg.conninfo) == []


def _in_doubt(b, tp, table, value: str, *, txmq_prepared=True, pg_prepared=True):
    """A pair left as a crash would leave it: both sides prepared or only
    one, the connection gone. Returns the pair."""
    pair = tp.begin()
    pair.conn.execute(f"INSERT INTO {table} VALUES (%s, %s)", (value, value))
    b.producer("out").send(value.encode(), txn=pair.txn)
    if txmq_prepared:
        pair.txn.prepare(xid=pair.gid)
    if pg_prepared:
        pair.conn.tpc_prepare()
    pair.conn.close()                  # (an unprepared PostgreSQL side rolls back)
    tp._ended(pair.gid)                # no longer in flight: as after a crash
    return pair


def test_recover_resolves_every_state_of_its_table(setup):
    b, tp, table, pg = setup
    undecided = _in_doubt(b, tp, table, "undecided")                        # both prepared, no decision
    decided = _in_doubt(b, tp, table, "decided")
    b.commit_prepared(decided.txn.id)                                       # the decision, then a crash
    only_txmq = _in_doubt(b, tp, table, "only-txmq", pg_prepared=False)
    aborted = _in_doubt(b, tp, table, "aborted")
    b.abort_prepared(aborted.txn.id)                                        # decided abort, then a crash
    forgotten = _in_doubt(b, tp, table, "forgotten")
    b.abort_prepared(forgotten.txn.id)
    b.forget_prepared(forgotten.txn.id)                                     # txmq knows nothing of it
    in_flight = tp.begin()                                  # a pair of this process between its prepares
    in_flight.conn.execute(f"INSERT INTO {table} VALUES ('in-flight', 'in-flight')")
    in_flight.txn.prepare(xid=in_flight.gid)
    other = PostgresTwoPhase(b, pg.conninfo, name=tp.name + "x")            # another name's pair: not ours
    theirs = _in_doubt(b, other, table, "theirs")

    assert tp.recover() == {"committed": 1, "aborted": 4}
    assert rows(pg.conninfo, table) == ["decided"]
    assert out_values(b) == [b"decided"]
    assert prepared_in_pg(pg.conninfo) == [theirs.gid]
    assert [t["xid"] for t in b.prepared_transactions()] == [in_flight.gid, theirs.gid]
    for pair, outcome in ((undecided, None), (decided, None), (only_txmq, None), (aborted, None)):
        assert b.prepared_outcome(pair.txn.id) is outcome           # every resolved one forgotten
    assert tp.recover() == {"committed": 0, "aborted": 0}           # idempotent
    in_flight.conn.tpc_prepare()                            # (the rest of its commit)
    b.commit_prepared(in_flight.txn.id)
    in_flight.conn.tpc_commit()
    assert rows(pg.conninfo, table) == ["decided", "in-flight"]
    assert other.recover() == {"committed": 0, "aborted": 1}
    other.close()
    assert prepared_in_pg(pg.conninfo) == [] and b.prepared_transactions() == []


def test_recover_with_postgresql_unreachable_changes_nothing(setup, caplog):
    b, tp, table, pg = setup
    pair = _in_doubt(b, tp, table, "waits", pg_prepared=False)
    down = PostgresTwoPhase(b, "host=127.0.0.1 port=1 user=txmq dbname=txmq connect_timeout=2", name=tp.name)
    with pytest.raises(psycopg.OperationalError):
        down.recover()
    assert b.prepared_outcome(pair.txn.id) is TxnState.PREPARED      # still holding its readers back
    assert [t["xid"] for t in b.prepared_transactions()] == [pair.gid]
    assert tp.recover() == {"committed": 0, "aborted": 1}
    assert b.prepared_transactions() == [] and rows(pg.conninfo, table) == []


def test_a_commit_whose_postgresql_commit_fails_is_completed_by_recover(setup, caplog, monkeypatch):
    """PostgreSQL goes away after the decision: commit() returns (the pair
    committed), txmq's side is visible, and recover() commits PostgreSQL's."""
    b, tp, table, pg = setup
    pair = tp.begin()
    pair.conn.execute(f"INSERT INTO {table} VALUES ('after', 'a')")
    b.producer("out").send(b"after", txn=pair.txn)

    def gone(*a):
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(pair.conn, "tpc_commit", gone)
    with caplog.at_level(logging.WARNING, logger="txmq.twophase"):
        pair.commit()
    assert "recover() completes it" in caplog.text
    assert out_values(b) == [b"after"] and rows(pg.conninfo, table) == []
    assert b.prepared_outcome(pair.txn.id) is TxnState.COMMITTED
    assert tp.recover() == {"committed": 1, "aborted": 0}
    assert rows(pg.conninfo, table) == ["after"] and prepared_in_pg(pg.conninfo) == []
    assert b.prepared_outcome(pair.txn.id) is None


def test_bad_arguments(setup):
    b, tp, table, pg = setup
    for name in ("", "a b", "x" * 101, None):
        with pytest.raises(InvalidArgumentError):
            PostgresTwoPhase(b, pg.conninfo, name=name)
    with pytest.raises(InvalidArgumentError):
        PostgresTwoPhase(b, None, name="ok")
    assert tp.txn_id_of("not-ours:0:1") is None and tp.txn_id_of(f"{tp.name}:2:7") == (2, 7)
