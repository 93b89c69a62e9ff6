"""Subprocess side of tests/transactions/test_txn_crash.py: transactions until SIGKILLed.

    python txn_crash_worker.py cpp <data> <fsync> <run> <seed> <stage> <nth>
    python txn_crash_worker.py cppo <data> <fsync> <run> <seed>
    python txn_crash_worker.py matrix <data> <fsync> <cycle> <seed> <threads> small|default

Both modes print ``READY`` once the broker is open, then one line per
event (one ``write`` each). A line that reports a call is written only
*after* the call returned, so what the worker printed is what the broker
acknowledged; "about to" lines (``C``, ``AB``, ``W``) come before the call.

``cpp`` (consume-process-produce): one loop takes what the
``agg`` subscriptions of A1 and A2 deliver, sends one aggregate per input
topic to B (A1's to B/0, A2's to B/1), acknowledges the inputs and commits,
all in one transaction. Each aggregate names the inputs it covers (see
:func:`make_output`). Two receives in five take the Arrow path
(``receive_batch``, then ``ack(batch, txn=)`` of that batch), in ``cppo``
too. Lines:

    T <step> <txn>        a transaction began for this step
    S <step>              its aggregates were sent
    A <step>              its inputs were acknowledged in it
    C <step> <txn>        about to commit
    K <step> <txn>        commit() returned
    DONE                  nothing left to consume (the worker exits 0)

``stage`` makes the worker SIGKILL itself at its ``nth`` transaction:
``before_send`` (after begin), ``send_ack`` (after the sends),
``ack_commit`` (after the acks); ``none`` leaves it to the broker's crash
points (``TXMQ_CRASH_AT``, set by the parent) or runs to the end.

``cppo`` (consume-process-produce out of order): the same loop over the
``aggo`` subscriptions of A1 and A2 (shared, read_committed,
``allow_out_of_order_delivery``: no cumulative acks), while two feeder
threads write the inputs in transactions held open a while (plain inputs
pass them), then committed or aborted. Every input names its feeder
transaction (``key``, None for a plain one). Lines, besides the ``cpp``
ones (T, S, A, C, K, DONE; there is no ``stage``: the parent SIGKILLs the
worker at a random moment):

    IS <key> <txn> <topic>:<p>:<off> ..  a feeder transaction's sends returned (flushed: in the log)
    IN <topic>:<p>:<off>                 a plain input send returned
    IC <key>                             about to commit it
    IK <key>                             its commit returned
    IA <key>                             its abort returned
    R <topic> <p>:<off> ..               receive_many returned these inputs
    G2 <topic> <p>:<off> <key>           an input of a transaction of this run was delivered before
                                         its commit began
    P <topic> <p>:<off>                  ...and this one was past maxReadPosition when it came (an open
                                         transaction before it did not hold it back)
    DONE                                 the feeders finished and nothing is left to consume

``matrix``: ``threads`` threads run transactions that send to several
partitions of T1 and T2 and acknowledge what the subscriptions s1 (T1,
shared), s2 (T2, exclusive, cumulative acks too) and ru (T1,
read_uncommitted) deliver, then commit, abort, get force-aborted or let
their short timeout expire; a reaper thread force-aborts random live
transactions meanwhile, as an operator would. Each transaction has a key ``<cycle>.<thread>.<n>``
and every value names its key (see :func:`txn_value`). ``small`` compacts
the logs and snapshots the transaction buffers every few frames
(:func:`shrink_thresholds`). ``so`` (T1) is shared and out of order
(``allow_out_of_order_delivery``), one consumer per thread as ``s1``. Lines:

    B <key> <txn> <kind>                 began; kind commit | abort | timeout | forced
    S <key> <topic> <p>:<off>=<value> .. sends in it returned
    N <topic> <p>:<off>=<value>          a plain (non-transactional) send returned
    R <sub> <p>:<off>=<value> ..         receive_many returned these
    A <key> <sub> <p>:<off> ..           individual acks in it returned
    AC <key> <sub> <p>:<off>             cumulative ack in it returned
    X <key> <sub> <reason>               an ack was refused (TransactionConflictError)
    C <key>                              about to commit
    K <key>                              commit() returned
    F <key> <error>                      commit() raised
    AB <key>                             about to abort (or force-abort)
    D <key>                              the abort returned
    W <key>                              waiting for the timeout to abort it
    E <key> <error>                      a send or ack in it raised: it was aborted meanwhile
    TO <key> <error>                     the broker aborted it (timeout, or the reaper first) and
                                         a later send and commit in it raised <error>
    FA? <txn>                            the reaper is about to force-abort <txn>
    FA <txn>                             ...and abort_transaction returned
    FAX <txn> <error>                    ...or raised: <txn> had ended
    G2 <sub> <p>:<off>=<value>           READ_COMMITTED delivered data of a transaction of this
                                         process whose commit had not begun
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
import traceback
from typing import NamedTuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers"))
from worker_io import Out  # noqa: E402

# -- consume-process-produce ---------------------------------------------------

IN_TOPICS = ("A1", "A2")
IN_PARTITIONS = 2
OUT_TOPIC = "B"
OUT_PARTITIONS = 2
CPP_SUB = "agg"
APP_STAGES = ("before_send", "send_ack", "ack_commit")
CRASH_POINTS = ("txn.prepared", "txn.recorded", "txn.decided", "txn.markers_half", "txn.applied")

# -- random matrix ---------------------------------------------------------------

M_TOPICS = {"T1": 4, "T2": 3}
M_SUBS = {   # name -> (topic, type, isolation)
    "s1": ("T1", "shared", "read_committed"),
    "s2": ("T2", "exclusive", "read_committed"),
    "ru": ("T1", "exclusive", "read_uncommitted"),
    "so": ("T1", "shared", "read_committed"),
}
M_OUT_OF_ORDER = {"so"}          # subscribed with allow_out_of_order_delivery=True

# -- consume-process-produce out of order ------------------------------------------

OOO_SUB = "aggo"
FEEDERS = 2
FEEDER_TXNS = 8                  # per feeder and run
SHORT_TIMEOUT = 0.2
M_SEGMENT_BYTES = 32 * 1024      # segments roll every few dozen transactions
KINDS = (("commit", 0.55), ("abort", 0.2), ("timeout", 0.15), ("forced", 0.1))


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def input_value(topic: str, n: int, v: int) -> bytes:
    return json.dumps({"in": topic, "n": n, "v": v}).encode()


def make_output(run: int, step: int, txn: str, part: int, nparts: int, src: str, msgs) -> bytes:
    """One aggregate: which run, step and transaction made it, which part
    of how many, and the inputs ``[[partition, offset], ...]`` of ``src``
    it covers with the sum of their values."""
    return json.dumps({
        "run": run, "step": step, "txn": txn, "part": part, "nparts": nparts, "src": src,
        "inputs": [[m.partition, m.offset] for m in msgs],
        "sum": sum(json.loads(m.value)["v"] for m in msgs),
    }, separators=(",", ":")).encode()


class Row(NamedTuple):
    """A message of a received RecordBatch, as the aggregates and the lines use it."""
    partition: int
    offset: int
    value: bytes


class BatchReceived(list):
    """The rows of one ``receive_batch`` (a run of one partition), with the
    batch itself: the worker acknowledges it whole, ``ack(batch, txn=)``."""

    def __init__(self, batch):
        partition = int(batch.schema.metadata[b"partition"])
        super().__init__(Row(partition, o, v) for o, v in zip(batch.column("offset").to_pylist(),
                                                              batch.column("value").to_pylist()))
        self.batch = batch


def receive(consumer, rng: random.Random) -> list:
    """A few inputs: ``receive_many``, or (two times in five) the Arrow path,
    ``receive_batch``."""
    if rng.random() < 0.4:
        batch = consumer.receive_batch(rng.randint(1, 6), timeout=0.02)
        return [] if batch is None else BatchReceived(batch)
    return consumer.receive_many(rng.randint(1, 6), timeout=0.02)


def ack_inputs(consumer, ms: list, txn, rng: random.Random) -> None:
    """Acknowledge what one receive gave, in ``txn``: a received batch
    whole, messages as a list or (one) alone."""
    if isinstance(ms, BatchReceived):
        consumer.ack(ms.batch, txn=txn)
    else:
        consumer.ack(ms if len(ms) > 1 or rng.random() < 0.5 else ms[0], txn=txn)


def input_steps(cons: dict, rng: random.Random, out: Out, finished=lambda: True, received=None):
    """The consume side of consume-process-produce: receive from every
    input subscription (``received(got)`` is told each time) and yield
    ``(step, {topic: messages})`` for each receive that got any, until
    nothing came five times in a row and ``finished()``: then print DONE.
    (``finished()`` is asked before the receives: a feeder's last commit,
    returned by then, is visible to them.)"""
    step = idle = 0
    while True:
        done = finished()
        got = {t: receive(cons[t], rng) for t in IN_TOPICS}
        if received is not None:
            received(got)
        if not any(got.values()):
            idle += 1
            if idle >= 5 and done:
                out.line("DONE")
                return
            continue
        idle = 0
        step += 1
        yield step, got


def send_aggregates(prod, run: int, step: int, txn, got: dict) -> None:
    """One aggregate per input topic that gave messages, to B (A1's to B/0,
    A2's to B/1), in ``txn``."""
    parts = [(i, t, ms) for i, (t, ms) in enumerate(got.items()) if ms]
    for k, (bp, t, ms) in enumerate(parts):
        prod.send(make_output(run, step, str(txn.id), k, len(parts), t, ms), key=f"{run}.{step}".encode(),
                  partition=bp, txn=txn)


def commit_step(out: Out, step: int, txn) -> None:
    """Commit a step's transaction between its C and K lines, every other
    one through commit_async (the flusher thread's path: sync, fan-out,
    resolve)."""
    out.line(f"C {step} {txn.id}")
    if step % 2:
        txn.commit_async().result()
    else:
        txn.commit()
    out.line(f"K {step} {txn.id}")


def cpp(broker, out: Out, run: int, rng: random.Random, stage: str, nth: int) -> None:
    cons = {t: broker.subscribe(t, CPP_SUB, "exclusive", isolation="read_committed",
                                initial_position="earliest") for t in IN_TOPICS}
    prod = broker.producer(OUT_TOPIC)
    out.line("READY")
    for step, got in input_steps(cons, rng, out):
        txn = broker.new_transaction(timeout=60)
        out.line(f"T {step} {txn.id}")
        if stage == "before_send" and step == nth:
            die()
        send_aggregates(prod, run, step, txn, got)
        if step == nth and stage in ("send_ack", "ack_commit"):
            # The sends are batched until the commit: the step killed before
            # it puts them in the log first, so that recovery has data of an
            # open transaction to abort (the check reads them uncommitted).
            prod.flush()
        out.line(f"S {step}")
        if stage == "send_ack" and step == nth:
            die()
        for t, ms in got.items():
            if isinstance(ms, BatchReceived):
                ack_inputs(cons[t], ms, txn, rng)
                continue
            by_partition = {}
            for m in ms:
                by_partition.setdefault(m.partition, []).append(m)
            for p, pms in by_partition.items():
                # One consumer, one transaction at a time, every earlier one
                # committed: the cursor is exactly below what this run was
                # handed, so a cumulative ack covers just these messages.
                if rng.random() < 0.3:
                    cons[t].ack_cumulative(pms[-1], txn=txn)
                else:
                    ack_inputs(cons[t], pms, txn, rng)
        out.line(f"A {step}")
        if stage == "ack_commit" and step == nth:
            die()
        commit_step(out, step, txn)


def feed(broker, out: Out, run: int, index: int, rng: random.Random, committing: set) -> None:
    """One feeder: FEEDER_TXNS input transactions, each held open a while
    (plain inputs are sent meanwhile), then committed or aborted."""
    prods = {t: broker.producer(t) for t in IN_TOPICS}
    for i in range(FEEDER_TXNS):
        key = f"r{run}.{index}.{i}"
        txn = broker.new_transaction(timeout=60)
        sent = []
        for _ in range(rng.randint(1, 4)):
            t = rng.choice(IN_TOPICS)
            value = json.dumps({"in": t, "key": key, "v": rng.randint(0, 1000)}).encode()
            mid = prods[t].send(value, partition=rng.randrange(IN_PARTITIONS), txn=txn)
            sent.append(f"{t}:{mid.partition}:{mid.offset}")
        txn.flush()                    # in the log while it is open
        out.line(f"IS {key} {txn.id} " + " ".join(sent))
        for _ in range(rng.randint(0, 3)):
            t = rng.choice(IN_TOPICS)
            mid = prods[t].send(json.dumps({"in": t, "key": None, "v": rng.randint(0, 1000)}).encode(),
                                partition=rng.randrange(IN_PARTITIONS))
            out.line(f"IN {t}:{mid.partition}:{mid.offset}")
            time.sleep(rng.uniform(0, 0.02))
        time.sleep(rng.uniform(0.02, 0.25))
        if rng.random() < 0.7:
            committing.add(key)
            out.line(f"IC {key}")
            txn.commit()
            out.line(f"IK {key}")
        else:
            txn.abort()
            out.line(f"IA {key}")


def cppo(broker, out: Out, run: int, rng: random.Random) -> None:
    cons = {t: broker.subscribe(t, OOO_SUB, "shared", initial_position="earliest",
                                allow_out_of_order_delivery=True) for t in IN_TOPICS}
    prod = broker.producer(OUT_TOPIC)
    committing: set = set()
    feeders = []
    for i in range(FEEDERS):
        seed = rng.randrange(1 << 30)

        def target(i=i, seed=seed):
            try:
                feed(broker, out, run, i, random.Random(seed), committing)
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
                os._exit(3)
        feeders.append(threading.Thread(target=target, daemon=True))
    out.line("READY")
    for f in feeders:
        f.start()
    mine = f"r{run}."

    def received(got):
        for t, ms in got.items():
            if ms:
                out.line(f"R {t} " + " ".join(f"{m.partition}:{m.offset}" for m in ms))
            for m in ms:
                key = json.loads(m.value)["key"]
                if key is not None and key.startswith(mine) and key not in committing:
                    out.line(f"G2 {t} {m.partition}:{m.offset} {key}")
                if m.offset >= broker.last_stable_offset(t, m.partition):
                    out.line(f"P {t} {m.partition}:{m.offset}")

    for step, got in input_steps(cons, rng, out, lambda: not any(f.is_alive() for f in feeders), received):
        txn = broker.new_transaction(timeout=60)
        out.line(f"T {step} {txn.id}")
        send_aggregates(prod, run, step, txn, got)
        out.line(f"S {step}")
        for t, ms in got.items():
            if ms:
                ack_inputs(cons[t], ms, txn, rng)
        out.line(f"A {step}")
        commit_step(out, step, txn)


# -- matrix -----------------------------------------------------------------------

def txn_value(key: str, i: int, txn: str) -> bytes:
    return f"X|{key}|{i}|{txn}".encode()


def plain_value(cycle: int, thread: int, n: int) -> bytes:
    return f"N|{cycle}.{thread}.{n}".encode()


def parse_value(value: bytes) -> dict:
    """``X|<key>|<i>|<txn>`` (transactional) or ``N|<id>`` (plain)."""
    parts = value.decode().split("|")
    if parts[0] == "X" and len(parts) == 4:
        return {"kind": "X", "key": parts[1], "i": int(parts[2]), "txn": parts[3]}
    if parts[0] == "N" and len(parts) == 2:
        return {"kind": "N", "id": parts[1]}
    raise ValueError(f"malformed value {value!r}")


def _items(msgs) -> str:
    return " ".join(f"{m.partition}:{m.offset}={m.value.decode()}" for m in msgs)


class MatrixThread:
    def __init__(self, broker, out: Out, cycle: int, index: int, seed: int, shared: dict):
        import txmq.errors as E
        self.E = E
        self.broker = broker
        self.out = out
        self.cycle = cycle
        self.index = index
        self.rng = random.Random(seed)
        self.prods = {t: broker.producer(t) for t in M_TOPICS}
        # s1 is shared: a consumer per thread; s2 and ru are exclusive: one
        # consumer shared by every thread (consumers are thread-safe).
        self.cons = {"s1": broker.subscribe("T1", "s1", "shared", initial_position="earliest"),
                     "so": broker.subscribe("T1", "so", "shared", initial_position="earliest",
                                            allow_out_of_order_delivery=True),
                     "s2": shared["s2"], "ru": shared["ru"]}
        self.shared = shared
        self.held = {s: [] for s in M_SUBS}       # received, not yet acknowledged
        self.n = 0
        self.plain = 0

    def pick_kind(self) -> str:
        r = self.rng.random()
        for kind, w in KINDS:
            if r < w:
                return kind
            r -= w
        return KINDS[0][0]

    def send(self, key: str, txn, state: dict) -> None:
        rng = self.rng
        topic = rng.choice(sorted(M_TOPICS))
        k = rng.randint(1, 4)
        vals = []
        for _ in range(k):
            vals.append(txn_value(key, state["i"], str(txn.id)))
            state["i"] += 1
        if k == 1 and rng.random() < 0.5:
            mids = [self.prods[topic].send(vals[0], key=f"{key}.{state['i']}".encode(), txn=txn)]
        else:
            part = rng.randrange(M_TOPICS[topic]) if rng.random() < 0.7 else None
            mids = list(self.prods[topic].send_batch(vals, txn=txn, partition=part))
        self.out.line(f"S {key} {topic} " + " ".join(
            f"{m.partition}:{m.offset}={v.decode()}" for m, v in zip(mids, vals)))

    def send_plain(self) -> None:
        topic = self.rng.choice(sorted(M_TOPICS))
        self.plain += 1
        v = plain_value(self.cycle, self.index, self.plain)
        m = self.prods[topic].send(v)
        self.out.line(f"N {topic} {m.partition}:{m.offset}={v.decode()}")

    def ack(self, key: str, txn) -> None:
        rng = self.rng
        sub = rng.choice(sorted(M_SUBS))
        c = self.cons[sub]
        got = c.receive_many(rng.randint(1, 8), timeout=0.005)
        if got:
            self.out.line(f"R {sub} {_items(got)}")
            if M_SUBS[sub][2] == "read_committed":
                self.check_committing(sub, got)
            self.held[sub].extend(got)
        held = self.held[sub]
        if not held:
            return
        if sub == "s2" and rng.random() < 0.35:
            m = rng.choice(held)
            try:
                c.ack_cumulative(m, txn=txn)
            except self.E.TransactionConflictError as e:
                self.out.line(f"X {key} {sub} {type(e).__name__}")
            else:
                self.out.line(f"AC {key} {sub} {m.partition}:{m.offset}")
            # Acknowledged, pending, or held by another transaction's ack: let go.
            self.held[sub] = [x for x in held if not (x.partition == m.partition and x.offset <= m.offset)]
            return
        rng.shuffle(held)
        k = rng.randint(1, len(held))
        batch, self.held[sub] = held[:k], held[k:]
        try:
            c.ack(batch, txn=txn)
        except self.E.TransactionConflictError as e:
            # Another transaction's cumulative ack holds one of them: nothing changed.
            self.out.line(f"X {key} {sub} {type(e).__name__}")
            return
        self.out.line(f"A {key} {sub} " + " ".join(f"{m.partition}:{m.offset}" for m in batch))

    def check_committing(self, sub: str, msgs) -> None:
        """READ_COMMITTED hands out data of this process's transactions only
        once their commit has begun (earlier processes' are settled: the
        parent checks those)."""
        mine = f"{self.cycle}."
        for m in msgs:
            f = parse_value(m.value)
            if f["kind"] == "X" and f["key"].startswith(mine) and f["key"] not in self.shared["committing"]:
                self.out.line(f"G2 {sub} {m.partition}:{m.offset}={m.value.decode()}")

    def work(self, key: str, txn, kind: str) -> None:
        E = self.E
        state = {"i": 0}
        try:
            for _ in range(self.rng.randint(1, 6)):
                r = self.rng.random()
                if r < 0.45:
                    self.send(key, txn, state)
                elif r < 0.9:
                    self.ack(key, txn)
                else:
                    self.send_plain()
        except (E.TransactionTimeoutError, E.InvalidTxnStateError) as e:
            # The reaper force-aborted it, or (kind timeout) it expired while
            # still working: either way it is over.
            if isinstance(e, E.TransactionTimeoutError) and kind != "timeout":
                raise
            self.out.line(f"E {key} {type(e).__name__}")

    def one_transaction(self) -> None:
        E = self.E
        self.n += 1
        key = f"{self.cycle}.{self.index}.{self.n}"
        kind = self.pick_kind()
        if kind == "commit" and self.rng.random() < 0.3:
            try:
                with self.broker.transaction(timeout=30.0) as txn:     # commits on exit
                    self.out.line(f"B {key} {txn.id} {kind}")
                    self.work(key, txn, kind)
                    self.shared["committing"].add(key)
                    self.out.line(f"C {key}")
            except E.InvalidTxnStateError as e:      # reaped
                self.out.line(f"F {key} {type(e).__name__}")
            else:
                self.out.line(f"K {key}")
            return
        txn = self.broker.new_transaction(timeout=SHORT_TIMEOUT if kind == "timeout" else 30.0)
        self.out.line(f"B {key} {txn.id} {kind}")
        self.work(key, txn, kind)
        if kind == "commit":
            self.shared["committing"].add(key)
            self.out.line(f"C {key}")
            try:
                txn.commit()
            except E.InvalidTxnStateError as e:      # reaped
                self.out.line(f"F {key} {type(e).__name__}")
            else:
                self.out.line(f"K {key}")
        elif kind in ("abort", "forced"):
            self.out.line(f"AB {key}")
            if kind == "forced":
                try:
                    self.broker.abort_transaction(txn.id)
                except (E.InvalidTxnStateError, E.TransactionNotFoundError):
                    pass           # the reaper was first
            txn.abort()    # after a force-abort: does nothing
            self.out.line(f"D {key}")
        else:
            self.out.line(f"W {key}")
            deadline = time.monotonic() + 10
            while txn.state.value != "ABORTED":
                if time.monotonic() > deadline:
                    raise AssertionError(f"{txn.id} outlived its timeout by 10 s: {txn.state}")
                time.sleep(0.01)
            errors = []
            for call in (lambda: self.prods["T1"].send(b"late", txn=txn), txn.commit):
                try:
                    call()
                except (E.TransactionTimeoutError, E.InvalidTxnStateError) as e:
                    errors.append(type(e).__name__)
                else:
                    raise AssertionError(f"{txn.id} was aborted, yet a send or commit in it succeeded")
            # TransactionTimeoutError unless the reaper aborted it first.
            self.out.line(f"TO {key} {errors[0]}")

    def run(self) -> None:
        try:
            while True:
                self.one_transaction()
                if self.rng.random() < 0.3:
                    time.sleep(0.002)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(3)


def reaper(broker, out: Out, seed: int) -> None:
    """An operator now and then force-aborts a live transaction, racing its
    owner's sends, acks and commit."""
    import txmq.errors as E
    rng = random.Random(seed)
    try:
        while True:
            time.sleep(rng.uniform(0.01, 0.05))
            live = [t["id"] for t in broker.transactions() if t["state"] == "OPEN"]
            if not live or rng.random() < 0.6:
                continue
            tid = rng.choice(live)
            out.line(f"FA? {tid}")
            try:
                broker.abort_transaction(tid)
            except (E.TransactionNotFoundError, E.InvalidTxnStateError, E.TransactionTimeoutError) as e:
                out.line(f"FAX {tid} {type(e).__name__}")     # it ended first
            else:
                out.line(f"FA {tid}")
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(3)


def matrix(broker, out: Out, cycle: int, rng: random.Random, nthreads: int) -> None:
    shared = {"committing": set(),
              "s2": broker.subscribe("T2", "s2", "exclusive", initial_position="earliest"),
              "ru": broker.subscribe("T1", "ru", "exclusive", isolation="read_uncommitted",
                                     initial_position="earliest")}
    workers = [MatrixThread(broker, out, cycle, i, rng.randrange(1 << 30), shared)
               for i in range(nthreads)]
    out.line("READY")
    threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
    threads.append(threading.Thread(target=reaper, args=(broker, out, rng.randrange(1 << 30)), daemon=True))
    for t in threads:
        t.start()
    while True:
        time.sleep(1)


def shrink_thresholds() -> None:
    """Compact every log, snapshot every transaction buffer and write
    recovery points (each with its buffer snapshot) after a few frames or
    KiB instead of thousands, so kills land in those paths too."""
    import txmq.broker.broker
    import txmq.transactions.coordinator
    import txmq.storage.cursor
    import txmq.storage.log
    import txmq.storage.txnbuffer
    import txmq.dispatch.subscription
    txmq.storage.txnbuffer.SNAPSHOT_EVERY_TXNS = 3
    txmq.transactions.coordinator.COMPACT_FRAMES = 40
    txmq.transactions.coordinator.LIVE_FRAMES = 1
    txmq.storage.log.CHECKPOINT_BYTES = 8 * 1024
    txmq.storage.cursor.COMPACT_FRAMES = 6
    txmq.dispatch.pending_acks.COMPACT_FRAMES = 6
    txmq.broker.broker.SNAPSHOT_INTERVAL = 0.03


def main(argv) -> None:
    mode, data, fsync, run, seed = argv[1], argv[2], argv[3], int(argv[4]), int(argv[5])
    import txmq

    rng = random.Random(seed)
    out = Out()
    if mode == "cpp":
        broker = txmq.Broker(data, fsync=fsync)
        cpp(broker, out, run, rng, argv[6], int(argv[7]))
        broker.close()
    elif mode == "cppo":
        broker = txmq.Broker(data, fsync=fsync)
        cppo(broker, out, run, rng)
        broker.close()
    elif mode == "matrix":
        if argv[7] == "small":
            shrink_thresholds()
        # small: every transaction on one coordinator, whose log then
        # compacts while the other threads commit through it.
        broker = txmq.Broker(data, fsync=fsync, segment_bytes_max=M_SEGMENT_BYTES,
                             num_coordinators=1 if argv[7] == "small" else 4)
        matrix(broker, out, run, rng, int(argv[6]))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(sys.argv)
