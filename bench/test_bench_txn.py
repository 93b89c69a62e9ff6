"""Transactions: what they cost next to the same work done without them, or
done by SQLite in one SQLite transaction.

1. ``send_batch`` of 100 x 1 KiB at full speed with a commit every 100 ms,
   against the same producer loop without a transaction (fsync "never" and
   "commit").
2. Exactly-once consume-transform-produce, 100 messages per transaction
   (``receive_many`` under read_committed, ``send_batch(txn=)``,
   ``ack(txn=)``, ``commit``), against SQLite doing the same in one
   transaction (``SqliteQueue.transform_batch``): fsync "never" vs
   ``synchronous=OFF``, fsync "commit" vs ``synchronous=FULL``.
3. begin + send + commit on a partition where 100,000 transactions are
   open, against the same with 10 open.
4. Draining a topic whose transactions are 10% aborted: a read_committed
   subscription against a read_uncommitted one on the same data, with
   ``receive_many`` + ``ack`` and with ``receive_batch`` + ``ack``.
5. ``receive()`` + ``ack(m, txn=)`` in a transaction that already holds
   50,000 pending acks, against the same in one that holds none.
6. ``Broker(path)`` after SIGKILL with 1,000,000 transactions in the logs,
   against 10,000; and with 1,025,684, another phase of the compaction and
   snapshot cycles (marker ``reopen``: it runs last).

Each test is one side of a comparison (conftest.COMPARISONS). Goals are
reported, never asserted.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pyarrow.compute as pc
import pytest

import conftest
import txmq
from dirsnap import DirSnapshot
from sqlite_baseline import SqliteQueue
from test_bench_producers import alternate
from test_bench_send import payloads

MiB = 1024 * 1024
TXN_TIMEOUT = 900.0          # the broker's default transaction_timeout_max


def transform(value: bytes) -> bytes:
    """The 'transform' of consume-transform-produce, the same on both sides."""
    return value[::-1]


# -- 1. a commit every 100 ms at full speed ------------------------------------------

COMMIT_EVERY = 0.1           # seconds of wall time
BATCH_100 = 100              # messages per send_batch
FULL_SPEED_BATCHES = 5000    # per round: 500 MiB, ~0.3 s (never) / ~0.6-0.75 s (commit)


@pytest.mark.parametrize("fsync,side", [(f, s) for f in ("never", "commit") for s in ("plain", "txn 100ms")])
def test_commit_every_100ms(fsync, side, measure, results, tmp_path, request):
    """The same loop on both sides: send_batch(100 x 1 KiB) and a look at
    the clock after each batch. The transactional side begins a transaction
    at the start of the round, sends with ``txn=``, commits and begins the
    next one once 100 ms have passed, and commits at the end of the round
    (one commit more than 100 ms alone would give: a conservative count).

    The segments a round filled are deleted before the next round
    (``enforce_retention`` with ``retention_bytes=0``, untimed), so neither
    side pays for the other's writeback or runs the disk full."""
    if shutil.disk_usage(tmp_path).free < 4 * 1024 * MiB:
        pytest.skip("needs >= 4 GiB free")
    request.addfinalizer(lambda: shutil.rmtree(tmp_path, ignore_errors=True))
    os.sync()
    broker = txmq.Broker(tmp_path / "data", fsync=fsync, retention_bytes=0,
                         retention_check_interval=3600.0)
    request.addfinalizer(broker.close)
    broker.create_topic("t", 1)
    producer = broker.producer("t")
    values = payloads(BATCH_100, 1024)
    send_batch, clock = producer.send_batch, time.perf_counter
    transactional = side != "plain"
    commits = []

    def run():
        txn = broker.new_transaction(TXN_TIMEOUT) if transactional else None
        n = 0
        due = clock() + COMMIT_EVERY
        for _ in range(FULL_SPEED_BATCHES):
            send_batch(values, partition=0, txn=txn)
            if clock() >= due:
                if transactional:
                    txn.commit()
                    txn = broker.new_transaction(TXN_TIMEOUT)
                    n += 1
                due = clock() + COMMIT_EVERY
        if transactional:
            txn.commit()
            n += 1
        commits.append(n)

    def drop_last_round():
        broker.enforce_retention()     # returns a count: pedantic must get None from setup

    measure(f"txn_100ms_{fsync}", side, run, ops_per_round=FULL_SPEED_BATCHES * BATCH_100,
            unit="msg", rounds=15, warmup=2, setup=drop_last_round)
    end = broker.stats()["topics"]["t"]["partitions"][0]
    assert end["end_offset"] >= 17 * FULL_SPEED_BATCHES * BATCH_100 and end["open_transactions"] == 0
    rec = results.sides.get(f"txn_100ms_{fsync}", {}).get(side)
    if rec is not None:
        rec["commits_per_round_median"] = sorted(commits)[len(commits) // 2]


# -- 2. exactly-once consume-transform-produce ---------------------------------------

CTP_TXN = 100                # messages per transaction
CTP_TXNS_PER_ROUND = 10
CTP_ROUNDS, CTP_WARMUP = 40, 5
CTP_FILL = (CTP_ROUNDS + CTP_WARMUP + 2) * CTP_TXNS_PER_ROUND * CTP_TXN
SQLITE_SYNC = {"never": "OFF", "commit": "FULL"}


@pytest.mark.parametrize("fsync,side", [("never", "txmq"), ("never", "txmq per-message"), ("never", "txmq arrow"),
                                        ("never", "sqlite"), ("commit", "txmq"), ("commit", "sqlite"),
                                        ("commit", "txmq pipelined"), ("commit", "txmq 4 threads")])
def test_consume_transform_produce(fsync, side, measure, tmp_path, request):
    """Per transaction: 100 messages of 100 B in, ``transform`` of each out,
    the inputs acknowledged, all or nothing. ``txmq`` is the per-message
    API with one ``send_batch`` and one ``ack(list)`` per transaction;
    ``txmq per-message`` the README's loop, ``send(txn=)`` and ``ack(m,
    txn=)`` for each message; ``txmq arrow`` (information only) is receive_batch, a pyarrow
    compute transform, send_batch of the array and ack of the RecordBatch,
    all in the transaction. SQLite is WAL with synchronous OFF / FULL.
    ``txmq pipelined`` is the batch loop with ``commit_async``, the round's
    futures awaited at its end; ``txmq 4 threads`` runs the batch loop in
    four threads on one shared subscription (each thread's commits in the
    round: the same number of transactions per round)."""
    values = payloads(1000, 100)
    threads = 4 if side == "txmq 4 threads" else 1
    if side.startswith("txmq"):
        broker = txmq.Broker(tmp_path / "data", fsync=fsync)
        request.addfinalizer(broker.close)
        broker.create_topic("in", 1)
        broker.create_topic("out", 1)
        feed = broker.producer("in")
        arr = pa.array(values, pa.binary())
        for _ in range(CTP_FILL // len(values)):
            feed.send_batch(arr)
        consumers = [broker.subscribe("in", "s", type="shared" if threads > 1 else "exclusive",
                                      isolation="read_committed", initial_position="earliest")
                     for _ in range(threads)]
        consumer = consumers[0]
        producer = broker.producer("out")
        new_txn = broker.new_transaction
        futures = []
        if side in ("txmq pipelined", "txmq 4 threads"):
            def loop(consumer, n):
                for _ in range(n):
                    msgs = consumer.receive_many(CTP_TXN, 1.0)
                    txn = new_txn(TXN_TIMEOUT)
                    producer.send_batch([transform(m.value) for m in msgs], partition=0, txn=txn)
                    consumer.ack(msgs, txn=txn)
                    if threads == 1:
                        futures.append(txn.commit_async())
                    else:
                        txn.commit()
                    got.append(len(msgs))
        if side == "txmq":
            def one():
                msgs = consumer.receive_many(CTP_TXN, 1.0)
                txn = new_txn(TXN_TIMEOUT)
                producer.send_batch([transform(m.value) for m in msgs], partition=0, txn=txn)
                consumer.ack(msgs, txn=txn)
                txn.commit()
                return len(msgs)
        elif side == "txmq per-message":
            send, ack = producer.send, consumer.ack

            def one():
                msgs = consumer.receive_many(CTP_TXN, 1.0)
                txn = new_txn(TXN_TIMEOUT)
                for m in msgs:
                    send(transform(m.value), partition=0, txn=txn)
                    ack(m, txn=txn)
                txn.commit()
                return len(msgs)
        else:
            def one():
                batch = consumer.receive_batch(CTP_TXN, 1.0)
                txn = new_txn(TXN_TIMEOUT)
                producer.send_batch(pc.binary_reverse(batch.column("value")), partition=0, txn=txn)
                consumer.ack(batch, txn=txn)
                txn.commit()
                return batch.num_rows
    else:
        q = SqliteQueue(str(tmp_path / "q.db"), synchronous=SQLITE_SYNC[fsync], topic="in")
        request.addfinalizer(q.close)
        for _ in range(CTP_FILL // len(values)):
            q.insert_batch(values)

        def one():
            return q.transform_batch(CTP_TXN, transform, "out")

    got = []

    def run():
        if side == "txmq pipelined":
            loop(consumer, CTP_TXNS_PER_ROUND)
            for f in futures:
                f.result()
            futures.clear()
        elif side == "txmq 4 threads":
            workers = [threading.Thread(target=loop, args=(c, CTP_TXNS_PER_ROUND // threads
                                                            + (i < CTP_TXNS_PER_ROUND % threads)))
                       for i, c in enumerate(consumers)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        else:
            for _ in range(CTP_TXNS_PER_ROUND):
                got.append(one())

    measure(f"ctp_{fsync}", side, run, ops_per_round=CTP_TXNS_PER_ROUND * CTP_TXN, unit="msg",
            rounds=CTP_ROUNDS, warmup=CTP_WARMUP)
    # The rate assumes full transactions: every one moved 100 messages.
    assert got and all(n == CTP_TXN for n in got), sorted(set(got))
    if side.startswith("txmq") and side != "txmq arrow":
        out = broker.stats()["topics"]["out"]["partitions"][0]
        # every transaction wrote its 100 messages and one COMMIT marker
        assert out["end_offset"] == len(got) * (CTP_TXN + 1) and out["open_transactions"] == 0


# -- 3. commit throughput with many transactions open ----------------------------------

OPEN_TXNS = {"10 open": 10, "100k open": 100_000}
# A round is 20,000 transactions. A coordinator compacts its log after
# 16,384 frames plus 16 per live transaction (or 16 MiB plus 1 KiB per live
# transaction), so with 100,000 open ones a compaction (about 5 us per live
# transaction) comes once per ~400,000 transactions of that coordinator,
# outside most rounds: the median leaves it out, its amortised cost is
# about 1.3 us per transaction.
FRESH_PER_ROUND = 20_000


@pytest.mark.parametrize("side", list(OPEN_TXNS))
def test_commit_with_open_transactions(side, measure, tmp_path, request):
    """N transactions each send one 100 B message to partition 0 and stay
    open; then each round runs begin + send + commit of fresh transactions
    on that partition (fsync="never")."""
    broker = txmq.Broker(tmp_path / "data", fsync="never")
    request.addfinalizer(broker.close)
    broker.create_topic("t", 1)
    producer = broker.producer("t")
    value = payloads(1, 100)[0]
    t0 = time.perf_counter()
    held = []
    for _ in range(OPEN_TXNS[side]):
        txn = broker.new_transaction(TXN_TIMEOUT)
        producer.send(value, partition=0, txn=txn)
        held.append(txn)
    open_s = time.perf_counter() - t0
    assert broker.stats()["transactions"]["open"] == OPEN_TXNS[side]
    new_txn, send = broker.new_transaction, producer.send

    def run():
        for _ in range(FRESH_PER_ROUND):
            txn = new_txn(TXN_TIMEOUT)
            send(value, partition=0, txn=txn)
            txn.commit()

    measure("txn_open", side, run, ops_per_round=FRESH_PER_ROUND, unit="txn", rounds=10, warmup=1,
            extra={"open_transactions": OPEN_TXNS[side], "opening_s": open_s})
    st = broker.stats()
    # Nothing timed out or ended on its own: the open ones were open throughout.
    assert st["transactions"]["open"] == OPEN_TXNS[side] and st["transactions"]["timed_out"] == 0
    assert st["topics"]["t"]["partitions"][0]["open_transactions"] == OPEN_TXNS[side]


# -- 4. read_committed over aborted transactions vs read_uncommitted -----------------

RC_TXN = 100                 # messages per transaction (one batch)
RC_CALLS = 100               # receive + ack calls per round
RC_ROUNDS, RC_WARMUP = 40, 5
RC_TXNS = (RC_ROUNDS + RC_WARMUP + 5) * RC_CALLS * 10 // 9 + 100   # every 10th one aborted


@pytest.fixture(scope="module")
def aborted_topic(tmp_path_factory):
    """A topic of RC_TXNS transactions of 100 x 100 B, every 10th aborted;
    every side subscribes to this same data under its own name."""
    broker = txmq.Broker(tmp_path_factory.mktemp("rc") / "data", fsync="never")
    broker.create_topic("t", 1)
    producer = broker.producer("t")
    values = payloads(RC_TXN, 100)
    for i in range(RC_TXNS):
        txn = broker.new_transaction(TXN_TIMEOUT)
        producer.send_batch(values, partition=0, txn=txn)
        if i % 10 == 9:
            txn.abort()
        else:
            txn.commit()
    part = broker.stats()["topics"]["t"]["partitions"][0]
    assert part["aborted_transactions"] == RC_TXNS // 10 and part["open_transactions"] == 0
    # The batches went in with pwritev, so reading through the mapping
    # first-touch faults every page. Both sides share that mapping and
    # read_committed runs ahead (it passes over the aborted tenth), so it
    # would take every fault: one untimed reader touches the whole log first.
    warm = broker.subscribe("t", "warm-up", isolation="read_uncommitted", initial_position="earliest")
    while msgs := warm.receive_many(10_000, 0.01):
        warm.ack(msgs)
    warm.close()
    yield broker
    broker.close()


@pytest.mark.parametrize("api,side", [(a, s) for a in ("receive_many", "receive_batch")
                                      for s in ("read_committed", "read_uncommitted")])
def test_read_committed_with_aborts(api, side, measure, aborted_topic):
    """Drain the topic: receive_many(100) + ack(list), or receive_batch
    + ack(batch), 100 calls per round; messages/s delivered. Each call
    returns one transaction's 100 messages; read_committed passes over the
    aborted batches (and both pass over the markers) inside the call."""
    consumer = aborted_topic.subscribe("t", f"{side}-{api}", isolation=side,
                                       initial_position="earliest")
    if api == "receive_many":
        def one():
            msgs = consumer.receive_many(RC_TXN, 1.0)
            consumer.ack(msgs)
            return len(msgs)
    else:
        def one():
            batch = consumer.receive_batch(1000, 1.0)
            consumer.ack(batch)
            return batch.num_rows
    got = []

    def run():
        for _ in range(RC_CALLS):
            got.append(one())

    try:
        measure(f"rc_aborted_{api}", side, run, ops_per_round=RC_CALLS * RC_TXN, unit="msg",
                rounds=RC_ROUNDS, warmup=RC_WARMUP)
    finally:
        consumer.close()
    assert got and all(n == RC_TXN for n in got), sorted(set(got))


# -- 5. receive + ack inside a transaction that holds many pending acks -----------------

HELD = 50_000                # pending acks the transaction of the "50k held" side holds first
HELD_PER_ROUND = 1_000       # receive() + ack(m, txn=) pairs per round
HELD_ROUNDS, HELD_WARMUP = 40, 4
HELD_GROUP = "txn_held_acks"
conftest.add_comparison(HELD_GROUP, conftest.Comparison(
    "receive+ack(txn=) per message, 50k held / none held by the txn", "50k held", "none held", 0.9, ">=",
    note="goal >= 90%: an ack costs the same however many acks its transaction holds"))


def test_ack_in_a_transaction_holding_many(measure, benchmark, results, tmp_path, request):
    """Each round receives 1,000 messages one at a time (exclusive,
    read_committed) and acks each inside a transaction. On the "50k held"
    side one transaction, never ended while measured, first took 50,000
    messages as pending acks (untimed) and keeps the acks of every round
    (50,000 to 94,000 held); on the "none held" side each round starts a
    fresh transaction (the previous one committed, untimed). Every receive
    asks the lane's pending-ack table whether what it hands out is held,
    so a cost per call that grew with the acks a transaction holds (a walk
    of them) shows as a ratio far below 1. The sides alternate round by
    round (``alternate``)."""
    broker = txmq.Broker(tmp_path / "data", fsync="never")
    request.addfinalizer(broker.close)
    values = payloads(1000, 100)
    per_side = (HELD_ROUNDS + HELD_WARMUP) * HELD_PER_ROUND
    consumers = {}
    for topic, n in (("held", HELD + per_side), ("none", per_side)):
        broker.create_topic(topic, 1)
        for _ in range(n // 1000):
            broker.producer(topic).send_batch(values, partition=0)
        consumers[topic] = broker.subscribe(topic, "s", isolation="read_committed", initial_position="earliest")
    held_txn = broker.new_transaction(TXN_TIMEOUT)
    held = consumers["held"]
    left = HELD
    while left:
        msgs = held.receive_many(min(left, 1000), 1.0)
        held.ack(msgs, txn=held_txn)
        left -= len(msgs)
    fresh = [broker.new_transaction(TXN_TIMEOUT)]

    def renew():
        fresh[0].commit()
        fresh[0] = broker.new_transaction(TXN_TIMEOUT)

    def run(consumer, txn):
        receive, ack = consumer.receive, consumer.ack
        for _ in range(HELD_PER_ROUND):
            ack(receive(1.0), txn=txn)

    alternate(measure, benchmark, results, HELD_GROUP,
              ("none held", lambda: run(consumers["none"], fresh[0])),
              ("50k held", lambda: run(held, held_txn)),
              ops_per_round=HELD_PER_ROUND, unit="msg", rounds=HELD_ROUNDS, warmup=HELD_WARMUP,
              before_first=renew)
    held_txn.abort()


# -- 6. reopen after SIGKILL with many transactions in the logs ---------------------------

# What opening replays is bounded by cycles, not by the count: a
# coordinator log is compacted once it holds 16,384 frames (plus 16 per
# live transaction), i.e. every ~4,000 transactions of 4 frames (one
# thread's transactions all go to one coordinator), and each compaction
# also writes a recovery point in the partitions it touched; the
# transaction buffer is snapshotted every 1,000 ended transactions. Where
# in those cycles the kill lands decides what is replayed (10,000 and
# 1,025,684 transactions end at different phases of them).
REOPEN_TXNS = {"10k txns": 10_000, "1M txns": 1_000_000, "1.02M txns": 1_025_684}

CHILD = r"""
import os, signal, sys, time
import txmq
path, n = sys.argv[1], int(sys.argv[2])
b = txmq.Broker(path, fsync="never")
b.create_topic("t", 1)
p = b.producer("t")
value = b"v" * 100
t0 = time.perf_counter()
for _ in range(n):
    txn = b.new_transaction(60)
    p.send(value, partition=0, txn=txn)
    txn.commit()
print("done", n, time.perf_counter() - t0, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def build_killed_txns(path: str, n: int) -> float:
    """Run ``n`` begin + send + commit in a child that then SIGKILLs itself
    with the broker open; return the seconds the child spent in the loop."""
    env = dict(os.environ)
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(txmq.__file__)))
    env["PYTHONPATH"] = pkg_root + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("TXMQ_DEBUG", None)
    child = subprocess.run([sys.executable, "-c", CHILD, path, str(n)], stdout=subprocess.PIPE,
                           env=env, text=True, timeout=1800)
    line = child.stdout.strip().splitlines()[-1] if child.stdout.strip() else ""
    if child.returncode != -signal.SIGKILL or not line.startswith("done"):
        raise RuntimeError(f"child exit {child.returncode}: {child.stdout[-500:]!r}")
    return float(line.split()[2])


@pytest.fixture(scope="session")
def killed_txn_dirs(tmp_path_factory):
    """Data directories built once per session: name -> (path, build seconds)."""
    root = tmp_path_factory.mktemp("txn-reopen")
    if shutil.disk_usage(root).free < 4 * 1024 * MiB:
        pytest.skip("needs >= 4 GiB free")
    built = {}

    def get(name):
        if name not in built:
            path = str(root / name.replace(" ", "-"))
            built[name] = (path, build_killed_txns(path, REOPEN_TXNS[name]))
        return built[name]

    yield get
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.reopen
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("size", list(REOPEN_TXNS))
def test_reopen_after_sigkill_txns(size, measure, results, killed_txn_dirs):
    """Time ``txmq.Broker(path)`` (open only) on the just-killed directory;
    the close of the previous round and the restore run untimed before each
    round."""
    path, build_s = killed_txn_dirs(size)
    n = REOPEN_TXNS[size]
    snap = DirSnapshot(path)
    opened, seen = [], []

    def close_previous():
        while opened:
            b = opened.pop()
            st = b.stats()
            seen.append((st["topics"]["t"]["partitions"][0], st["transactions"]))
            b.close()

    def setup():
        close_previous()
        snap.restore()

    try:
        measure("txn_reopen", size, lambda: opened.append(txmq.Broker(path)), ops_per_round=1,
                unit="s", rounds=15, warmup=1, setup=setup,
                extra={"transactions": n, "build_s": build_s})
    finally:
        close_previous()
    # Every open recovered the whole log (n messages + n COMMIT markers), cut nothing.
    for part, txns in seen:
        assert part["end_offset"] == 2 * n and not part["truncated_on_open"], part
        assert part["open_transactions"] == 0 and not txns["coordinator_problems_on_open"], txns
    rec = results.sides.get("txn_reopen", {}).get(size)
    if rec is not None:
        rec["log_bytes"] = seen[-1][0]["bytes"]
        rec["recovered"] = seen[-1][1]["recovered"]
    print(f"\n{size}: built in {build_s:.1f}s (child's loop), "
          f"log {seen[-1][0]['bytes'] / MiB:.0f} MiB")
