"""Out-of-order delivery (``allow_out_of_order_delivery``): a read_committed
subscription that open transactions do not hold back, against a
read_uncommitted one on the same traffic (the ceiling: it is never held
back by anything).

1. Delay. A producer thread commits transactions of 10 x 100 B
   (``send_batch``, appended at once) at 400 transactions a second on one
   partition for ``LIVE_S`` seconds; one transaction in ten is left open
   for 1 s before it commits. One consumer drains the partition as the
   traffic comes (``receive_many`` + ``ack``), noting for every message of
   a transaction committed at once the time from just before its
   ``send_batch`` to its delivery (``time.time_ns``, the producer's clock
   written into the value). Figure per round: the p99 of those delays.
   The transactions held open are left out of it: they are delivered when
   they commit, by design. Goal: p99(out of order) <= 2 x p99(read
   uncommitted). A classic read_committed subscription on the same traffic
   waits up to the 1 s behind each open transaction (printed, not a side
   of the comparison).
2. Throughput. A partition holds ``DRAIN_TXNS`` transactions of 100 x
   100 B, one in ten still open while the consumer drains it with
   ``receive_many(1000)`` + ``ack``: the out-of-order subscription parks the
   open ones and delivers the rest, then (the open ones committed, untimed)
   delivers the released ones; the read_uncommitted one delivers
   everything in one pass. Figure: messages per second of the drains.
   Goal: out of order >= 0.9 x read_uncommitted.

The sides of each comparison alternate round by round in one broker (the
machine has 2 cores and is shared): see ``test_bench_producers.alternate``
for why. Goals are reported, never asserted.
"""

from __future__ import annotations

import statistics
import threading
import time

import pytest

import conftest
import txmq
from test_bench_producers import data_dir  # noqa: F401  (fixture)
from test_bench_send import payloads

OUT_OF_ORDER, UNCOMMITTED, CLASSIC = "out of order", "read_uncommitted", "read_committed"
HELD_EVERY = 10              # one transaction in ten ...
HELD_S = 1.0                 # ... is left open this long

# -- 1. delay ------------------------------------------------------------------------------

LIVE_S = 2.5                 # seconds of traffic per round
LIVE_TXNS_PER_S = 400
LIVE_TXN = 10                # messages per transaction
DELAY_ROUNDS, DELAY_WARMUP = 8, 1
DELAY_GROUP = "ooo_delay"

# -- 2. throughput -------------------------------------------------------------------------

DRAIN_TXNS = 500             # transactions of 100 messages per round
DRAIN_TXN = 100
DRAIN_ROUNDS, DRAIN_WARMUP = 20, 2
DRAIN_GROUP = "ooo_drain"

conftest.add_comparison(DELAY_GROUP, conftest.Comparison(
    "p99 delivery delay, 10% txns open 1 s: out of order / read_uncommitted", OUT_OF_ORDER, UNCOMMITTED,
    2, "<=", kind="time", note="goal <= 2x: committed messages' p99 delay, open transactions don't hold them back"))
conftest.add_comparison(DRAIN_GROUP, conftest.Comparison(
    "receive_many(1000)+ack, 10% txns open: out of order / read_uncommitted", OUT_OF_ORDER, UNCOMMITTED,
    0.9, ">=", note="goal >= 0.9x the read_uncommitted drain"))


def run_rounds(benchmark, group: str, one_round, rounds: int, warmup: int) -> None:
    """pytest-benchmark runs ``one_round`` (a round of every side, which
    notes its own figures) ``warmup`` + ``rounds`` times; its own timing
    of the whole call is not a figure of the comparison."""
    benchmark.group = group
    benchmark.extra_info.update({"side": "a round of every side"})
    benchmark.pedantic(one_round, rounds=rounds, warmup_rounds=warmup, iterations=1)


def record(benchmark, results, group: str, series: dict, warmup: int, ops_per_round: int, unit: str,
           extra: dict | None = None) -> bool:
    """Give ``results`` each side's median of its ``series`` (seconds per
    round, the warm-up rounds dropped); False under --benchmark-disable."""
    if benchmark.stats is None:
        return False
    for side, xs in series.items():
        timed = xs[warmup:]
        results.add(group, side, statistics.median(timed), ops_per_round, unit, len(timed),
                    {"mean_s_per_round": statistics.fmean(timed), **(extra or {})}, timed)
    return True


def subscribe(broker, side: str, name: str):
    if side == OUT_OF_ORDER:
        return broker.subscribe("t", name, "shared", initial_position="latest", allow_out_of_order_delivery=True)
    return broker.subscribe("t", name, "shared", initial_position="latest",
                            isolation="read_committed" if side == CLASSIC else "read_uncommitted")


def live_round(broker, consumers: dict) -> dict:
    """LIVE_S seconds of traffic read by every consumer at once; returns
    {side: (p99 s of the messages of transactions committed at once,
    how many)}."""
    producer = broker.producer("t")
    body = payloads(LIVE_TXN, 100 - 20)
    stop = threading.Event()
    delays = {side: [] for side in consumers}

    def produce():
        held = []                                  # (commit at, txn)
        t0 = time.monotonic()
        i = 0
        while True:
            now = time.monotonic()
            while held and held[0][0] <= now:
                held.pop(0)[1].commit()
            if now - t0 >= LIVE_S:
                if not held:
                    return
                time.sleep(max(0.0, held[0][0] - now))
                continue
            wait = t0 + i / LIVE_TXNS_PER_S - now
            if wait > 0:
                time.sleep(wait)
            kind = b"H" if i % HELD_EVERY == HELD_EVERY - 1 else b"C"
            stamp = b"%s%019d" % (kind, time.time_ns())
            txn = broker.new_transaction(30)
            producer.send_batch([stamp + v for v in body], partition=0, txn=txn)
            if kind == b"H":
                held.append((time.monotonic() + HELD_S, txn))
            else:
                txn.commit()
            i += 1

    def consume(side):
        c, out = consumers[side], delays[side]
        while True:
            msgs = c.receive_many(1000, 0.01)
            if not msgs:
                if stop.is_set():
                    return
                continue
            now = time.time_ns()
            for m in msgs:
                v = m.value
                if v[:1] == b"C":
                    out.append(now - int(v[1:20]))
            c.ack(msgs)

    readers = [threading.Thread(target=consume, args=(side,)) for side in consumers]
    for t in readers:
        t.start()
    produce()
    time.sleep(0.2)
    stop.set()
    for t in readers:
        t.join()
    out = {}
    for side, ds in delays.items():
        ds.sort()
        out[side] = (ds[min(len(ds) - 1, len(ds) * 99 // 100)] / 1e9, len(ds))
    return out


def test_delivery_delay_past_open_transactions(benchmark, results, data_dir):  # noqa: F811
    """Side by side on the same traffic: p99 delay of the committed
    messages, out of order against read_uncommitted (and classic
    read_committed, for information)."""
    broker = txmq.Broker(data_dir, fsync="never", control_socket=False)
    try:
        broker.create_topic("t", 1)
        consumers = {side: subscribe(broker, side, side.replace(" ", "-"))
                     for side in (OUT_OF_ORDER, UNCOMMITTED, CLASSIC)}
        p99 = {side: [] for side in consumers}
        counts = []

        def one_round():
            got = live_round(broker, consumers)
            for side, (d, n) in got.items():
                p99[side].append(d)
            counts.append(got[UNCOMMITTED][1])
            assert got[OUT_OF_ORDER][1] == got[UNCOMMITTED][1] == got[CLASSIC][1]

        run_rounds(benchmark, DELAY_GROUP, one_round, DELAY_ROUNDS, DELAY_WARMUP)
    finally:
        broker.close()
    if record(benchmark, results, DELAY_GROUP, p99, DELAY_WARMUP, 1, "s",
              {"messages_per_round": counts[DELAY_WARMUP:]}):
        print({side: f"p99 median {statistics.median(xs[DELAY_WARMUP:]) * 1000:.1f} ms "
                     f"(rounds {min(xs[DELAY_WARMUP:]) * 1000:.1f}-{max(xs[DELAY_WARMUP:]) * 1000:.1f})"
               for side, xs in p99.items()})


def fill(broker, producer, topic: str, values) -> list:
    """DRAIN_TXNS transactions of ``values`` on ``topic``, one in
    HELD_EVERY left open: returns the open ones."""
    held = []
    for i in range(DRAIN_TXNS):
        txn = broker.new_transaction(30)
        producer.send_batch(values, partition=0, txn=txn)
        if i % HELD_EVERY == HELD_EVERY - 1:
            held.append(txn)
        else:
            txn.commit()
    return held


def drain(consumer) -> int:
    n = 0
    while msgs := consumer.receive_many(1000, 0):
        consumer.ack(msgs)
        n += len(msgs)
    return n


def test_drain_past_open_transactions(benchmark, results, data_dir):  # noqa: F811
    """Out of order against read_uncommitted, each on its own topic, their
    rounds alternating (A B B A A B ...). A round appends DRAIN_TXNS
    transactions (untimed), one in ten left open, and times the side's
    drain of them; the open ones then commit (untimed) and the side drains
    again (timed: out of order, the released messages; read_uncommitted,
    only the markers are left)."""
    broker = txmq.Broker(data_dir, fsync="never", control_socket=False)
    try:
        values = payloads(DRAIN_TXN, 100)
        topics = {OUT_OF_ORDER: "ooo", UNCOMMITTED: "ru"}
        consumers, producers = {}, {}
        for side, topic in topics.items():
            broker.create_topic(topic, 1)
            producers[side] = broker.producer(topic)
            consumers[side] = broker.subscribe(topic, "s", "shared", initial_position="latest",
                                               isolation="read_uncommitted" if side == UNCOMMITTED else
                                               "read_committed",
                                               allow_out_of_order_delivery=side == OUT_OF_ORDER)
        total = DRAIN_TXNS * DRAIN_TXN
        clock = time.perf_counter
        times = {side: [] for side in topics}
        pairs = [0]

        def pair():
            order = list(topics) if pairs[0] % 2 else list(topics)[::-1]
            pairs[0] += 1
            for side in order:
                held = fill(broker, producers[side], topics[side], values)
                c = consumers[side]
                t0 = clock()
                n = drain(c)
                t = clock() - t0
                for txn in held:
                    txn.commit()
                t0 = clock()
                n += drain(c)
                times[side].append(t + clock() - t0)
                assert n == total, (side, n)

        run_rounds(benchmark, DRAIN_GROUP, pair, DRAIN_ROUNDS, DRAIN_WARMUP)
    finally:
        broker.close()
    record(benchmark, results, DRAIN_GROUP, times, DRAIN_WARMUP, total, "msg")
