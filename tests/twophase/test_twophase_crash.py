"""Crash tests of txmq.twophase.PostgresTwoPhase against a real PostgreSQL
server: an application process (tests/workers/twophase_crash_worker.py)
commits pairs — rows in PostgreSQL, messages in txmq, the inputs' acks in
the txmq transaction — and is SIGKILLed at every step of the protocol
(``twophase.before_prepare``, ``twophase.between_prepares``,
``twophase.prepared``, ``twophase.decided``, ``twophase.between_commits``),
inside txmq's own prepare and commit, and at random moments. After every
kill this process opens the directory, runs ``recover()``, and checks:

- every committed row has exactly one committed message, and every
  committed message a row (the same input and global id): the pairs are
  atomic;
- nothing of a pair the application aborted is visible on either side,
  and every pair it saw commit is there on both;
- nothing is left prepared on either side;
- each input is in at most one committed pair, and the inputs in none are
  exactly those still to deliver (consume-process-produce, G6).

The application then runs again (its own recover() first) until every
input is in exactly one committed pair.
"""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys

import psycopg
import pytest

import txmq
from txmq.twophase import PostgresTwoPhase

import twophase_crash_worker as W
from killer import drain, read_lines, start_and_kill, worker, worker_env
from postgres_server import postgres  # noqa: F401  (a pytest fixture)

WORKER = worker("twophase_crash_worker.py")
POINTS = ("twophase.before_prepare", "twophase.between_prepares", "twophase.prepared", "twophase.decided",
          "twophase.between_commits", "txn.prepare_recorded", "txn.decided")
INPUTS = {"in-%03d" % i for i in range(W.INPUTS)}
_tests = itertools.count()



class App:
    """One application's data: its directory, table and name."""

    def __init__(self, tmp_path, conninfo):
        n = next(_tests)
        self.path = tmp_path / "d"
        self.conninfo = conninfo
        self.name = f"crash{n}"
        self.table = f"crash_rows_{n}"
        self.committed = set()        # gids the application saw commit
        self.aborted = set()          # ... abort on purpose
        self.done = False
        with psycopg.connect(conninfo, autocommit=True) as c:
            c.execute(f"CREATE TABLE {self.table} (input text NOT NULL, gid text NOT NULL)")
        W.setup(str(self.path))

    def argv(self, seed: int) -> list:
        return [sys.executable, WORKER, str(self.path), self.conninfo, self.name, self.table, str(seed)]

    def read(self, out) -> None:
        for ln in read_lines(out):
            kind, _, gid = ln.partition(" ")
            if kind == "C":
                self.committed.add(gid)
            elif kind == "A":
                self.aborted.add(gid)
            elif kind == "DONE":
                self.done = True

    def check(self) -> set:
        """recover(), then the checks of the module docstring; returns the
        inputs in committed pairs."""
        with txmq.Broker(self.path, **W.OPTIONS) as b:
            with PostgresTwoPhase(b, self.conninfo, name=self.name) as tp:
                tp.recover()
            with psycopg.connect(self.conninfo) as c:
                rows = [tuple(r) for r in c.execute(f"SELECT input, gid FROM {self.table}")]
                pg_prepared = [r[0] for r in c.execute("SELECT gid FROM pg_prepared_xacts WHERE gid LIKE %s",
                                                       (self.name + ":%",))]
            assert pg_prepared == [], f"left prepared in PostgreSQL: {pg_prepared}"
            assert b.prepared_transactions() == []
            reader = b.subscribe("out", "audit", initial_position="earliest")
            messages = [tuple(m.value.decode().split("|")) for m in drain(reader)]
            reader.unsubscribe()
            assert len(messages) == len(set(messages)), "a message committed twice"
            assert len(rows) == len(set(rows)), "a row committed twice"
            assert set(rows) == set(messages), \
                f"pairs not atomic: rows only {sorted(set(rows) - set(messages))[:5]}, " \
                f"messages only {sorted(set(messages) - set(rows))[:5]}"
            gids = {g for _, g in rows}
            assert not gids & self.aborted, f"aborted pairs visible: {sorted(gids & self.aborted)}"
            assert self.committed <= gids, f"committed pairs lost: {sorted(self.committed - gids)}"
            covered = [i for i, _ in rows]
            assert len(covered) == len(set(covered)), "an input in two committed pairs"
            c = b.subscribe("in", "s", type="shared")
            left = {m.value.decode() for m in drain(c)}
            c.close()
            assert set(covered) | left == INPUTS and not set(covered) & left, \
                "an input neither in a committed pair nor deliverable"
        return set(covered)

    def run_to_the_end(self, tmp_path) -> None:
        for i in range(4):
            out = tmp_path / f"final{i}.out"
            proc = subprocess.run(self.argv(1000 + i), stdout=open(out, "wb"), stderr=subprocess.PIPE,
                                  env=worker_env(), timeout=300)
            assert proc.returncode == 0, proc.stderr.decode()[-3000:]
            self.read(out)
            if self.done and self.check() == INPUTS:
                return
        raise AssertionError("inputs left after 4 runs")


@pytest.mark.parametrize("point", POINTS)
def test_kill_at_every_step_of_the_protocol(tmp_path, postgres, point):  # noqa: F811
    app = App(tmp_path, postgres.conninfo)
    for visit in (1, 3, 6):
        out = tmp_path / f"run{visit}.out"
        proc = subprocess.run(app.argv(visit), stdout=open(out, "wb"), stderr=subprocess.PIPE,
                              env=worker_env(f"{point}@{visit}"), timeout=300)
        assert proc.returncode == -9, f"{point}@{visit} never reached: {proc.stderr.decode()[-3000:]}"
        app.read(out)
        app.check()
    app.run_to_the_end(tmp_path)


def test_kill_at_random_moments(tmp_path, postgres):  # noqa: F811
    seed = int(os.environ.get("TXMQ_CRASH_SEED", "0")) or random.randrange(1 << 30)
    rng = random.Random(seed)
    app = App(tmp_path, postgres.conninfo)
    for run in range(8):
        out = tmp_path / f"run{run}.out"
        code, err, _ = start_and_kill(app.argv(rng.randrange(1 << 30)), worker_env(), out, rng,
                                      p_after_ready=0.8, after_ready=(0.0, 0.5))
        assert code in (0, -9), f"seed {seed}: {err[-3000:]}"
        app.read(out)
        app.check()
    app.run_to_the_end(tmp_path)
