"""Subprocess side of tests/twophase/test_twophase_crash.py: an application
that commits txmq and PostgreSQL together until SIGKILLed.

    python twophase_crash_worker.py <data> <conninfo> <name> <table> <seed>

Opens the broker, runs ``PostgresTwoPhase.recover()``, prints ``READY``,
then takes what the shared subscription ``s`` of ``in`` delivers, a few
messages at a time, and for each group runs one pair: a row per input in
``<table>`` (input, gid), a message ``<input>|<gid>`` per input to ``out``,
the inputs acknowledged in the txmq transaction; then commits the pair, or,
for one pair in five, raises inside it so both sides abort. Lines (each
written whole, after the call it reports returned):

    C <gid>      the pair committed
    A <gid>      the pair aborted (on purpose)
    DONE         nothing left to consume (the worker exits 0)

The parent arms the recipe's crash points (``TXMQ_CRASH_AT``) or kills it
at a random moment.
"""

from __future__ import annotations

import os
import random
import sys

import txmq
from txmq.twophase import PostgresTwoPhase

INPUTS = 60
PER_PAIR = 3
OPTIONS = dict(fsync="commit", num_coordinators=2, control_socket=False)


class Abort(Exception):
    """Raised inside a pair to abort it."""


def setup(path: str) -> None:
    with txmq.Broker(path, **OPTIONS) as b:
        b.create_topic("in", 2)
        b.create_topic("out", 2)
        b.subscribe("in", "s", type="shared", initial_position="earliest").close()
        b.producer("in").send_batch([b"in-%03d" % i for i in range(INPUTS)])


def line(text: str) -> None:
    os.write(1, (text + "\n").encode())


def main(path: str, conninfo: str, name: str, table: str, seed: int) -> None:
    rng = random.Random(seed)
    b = txmq.Broker(path, **OPTIONS)
    two_phase = PostgresTwoPhase(b, conninfo, name=name)
    two_phase.recover()
    c = b.subscribe("in", "s", type="shared")
    out = b.producer("out")
    line("READY")
    while msgs := c.receive_many(PER_PAIR, timeout=0.3):
        abort = rng.random() < 0.2
        try:
            with two_phase.transaction() as pair:
                with pair.conn.cursor() as cur:
                    cur.executemany(f"INSERT INTO {table} (input, gid) VALUES (%s, %s)",
                                    [(m.value.decode(), pair.gid) for m in msgs])
                for m in msgs:
                    out.send(m.value + b"|" + pair.gid.encode(), partition=m.partition, txn=pair.txn)
                c.ack(msgs, txn=pair.txn)
                if abort:
                    raise Abort()
        except Abort:
            line(f"A {pair.gid}")
            continue
        line(f"C {pair.gid}")
    line("DONE")
    two_phase.close()
    b.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
