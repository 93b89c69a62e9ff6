"""Subprocess side of tests/transactions/test_prepared_crash.py: prepared
consume-process-produce transactions until SIGKILLed.

    python prepared_crash_worker.py <data> <seed>

Opens the broker (``fsync="commit"``), prints ``READY``, then takes what
the shared subscription ``s`` of ``in`` delivers, a few messages at a time,
and for each group: begins a transaction, sends ``out-<value>`` to ``out``
and acknowledges the inputs in it, prepares it, and ends it by the rule of
:func:`intended` — through its handle or through
``Broker.commit_prepared`` / ``abort_prepared``. One transaction in ten is
left prepared, for a later process to end. Lines (each written whole, and
only after the call it reports returned; ``B`` before ``prepare``):

    B <txn> <value> ...     began, sent and acked; about to prepare
    P <txn>                 prepare() returned
    E <txn>                 the commit or abort returned
    L <txn>                 left prepared
    DONE                    nothing left to consume (the worker exits 0)

The parent may arm crash points (``TXMQ_CRASH_AT``) in the prepare and in
the commit of a prepared transaction.
"""

from __future__ import annotations

import os
import random
import sys

import txmq
from txmq import TxnID

INPUTS = 120
PER_TXN = 4
OPTIONS = dict(fsync="commit", num_coordinators=2, control_socket=False)


def intended(txn_id) -> bool:
    """Whether the worker commits (True) or aborts a prepared transaction."""
    return TxnID.parse(txn_id).sequence % 4 != 3


def setup(path: str) -> None:
    with txmq.Broker(path, **OPTIONS) as b:
        b.create_topic("in", 2)
        b.create_topic("out", 2)
        b.subscribe("in", "s", type="shared", initial_position="earliest").close()
        b.producer("in").send_batch([b"in-%04d" % i for i in range(INPUTS)])


def line(text: str) -> None:
    os.write(1, (text + "\n").encode())


def main(path: str, seed: int) -> None:
    rng = random.Random(seed)
    b = txmq.Broker(path, **OPTIONS)
    c = b.subscribe("in", "s", type="shared")
    out = b.producer("out")
    line("READY")
    while True:
        msgs = c.receive_many(PER_TXN, timeout=0.3)
        if not msgs:
            break
        txn = b.new_transaction()
        for m in msgs:
            out.send(b"out-" + m.value, partition=m.partition, txn=txn)
        c.ack(msgs, txn=txn)
        line(f"B {txn.id} " + " ".join(m.value.decode() for m in msgs))
        txn.prepare(xid=f"w{txn.id}")
        line(f"P {txn.id}")
        if rng.random() < 0.1:
            line(f"L {txn.id}")
            continue
        commit = intended(txn.id)
        if rng.random() < 0.5:
            txn.commit() if commit else txn.abort()
        else:
            (b.commit_prepared if commit else b.abort_prepared)(txn.id)
        line(f"E {txn.id}")
    line("DONE")
    b.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
