"""Idempotent producers: what the producer id, epoch and sequence of every
batch (and the partition's producer table that checks them) cost.

1. ``send_batch`` from a named producer (``broker.producer(t, name=...)``)
   against an anonymous one (``broker.producer(t)``): 100 x 100 B and
   1,000 x 100 B lists at fsync "never", 100 x 100 B at fsync "commit".
   Goal: named >= 95% of anonymous.
2. ``send_batch`` of 100 x 100 B to one partition whose producer table
   holds 10,000 live producer ids, the batches coming from those 10,000
   producers in a shuffled rotation, against the same loop with 1 live id
   (one producer sends every batch). With the partition's own next sequence
   and with an explicit ``sequence=`` (the retry path: the dedup cache is
   consulted). Goal: 10,000 >= 95% of 1.

Both sides of a comparison live in one broker (a topic each, one
partition), and their rounds alternate, A A B B A A B B ...:
``alternate`` times the second side with ``measure`` and runs the first
side's rounds, timed with the same clock, in its untimed ``setup``. The
machine has 2 cores and is shared; running the 300 rounds of one side and
then those of the other would let drift between the two halves decide the
ratio.

Each test starts after an ``os.sync()`` and deletes its data directory at
the end: dirty pages left by the previous test (or by another run) make
appends two to four times slower here once background writeback starts.
"""

from __future__ import annotations

import itertools
import os
import random
import shutil
import statistics
import time

import pytest

import txmq
from txmq.client.producer import Producer
from test_bench_send import payloads

ROUNDS, WARMUP = 300, 10


def alternate(measure, benchmark, results, group, first, second, *, ops_per_round, unit,
              rounds=ROUNDS, warmup=WARMUP, before_first=None):
    """Time two sides round by round, alternately.

    ``first`` and ``second`` are ``(side, fn)``. ``measure`` times
    ``second``; its untimed ``setup`` runs two rounds of ``first`` before
    every other round of ``second`` (warm-up rounds too), timed here with
    the same clock (``time.perf_counter``, pytest-benchmark's default). The
    order is A A B B A A B B ...: each side runs half its rounds after one
    of its own and half after one of the other's, so neither always runs
    first (which was worth a few percent either way in scratch runs).
    ``before_first``, if given, runs untimed before every round of
    ``first``. Medians and means of both sides go to ``results``. Returns
    how many rounds of each side ran, warm-up included."""
    assert rounds % 2 == 0 and warmup % 2 == 0
    (side_a, run_a), (side_b, run_b) = first, second
    clock = time.perf_counter
    times_a = []
    calls = itertools.count()
    runs_b = []

    def round_of_b():
        runs_b.append(None)
        run_b()

    def rounds_of_a():
        if next(calls) % 2:
            return
        for _ in range(2):
            if before_first is not None:
                before_first()
            t0 = clock()
            run_a()
            times_a.append(clock() - t0)

    measure(group, side_b, round_of_b, ops_per_round=ops_per_round, unit=unit, rounds=rounds,
            warmup=warmup, setup=rounds_of_a)
    timed = times_a[warmup:]
    rec_b = results.sides.get(group, {}).get(side_b)
    if rec_b is None or not timed:       # --benchmark-disable: nothing was timed
        return len(times_a), len(runs_b)
    results.add(group, side_a, statistics.median(timed), ops_per_round, unit, len(timed),
                {"mean_s_per_round": statistics.fmean(timed), "alternated_with": side_b,
                 "nodeid": rec_b.get("nodeid")}, timed)
    rec_b["mean_s_per_round"] = benchmark.stats.stats.mean
    rec_b["alternated_with"] = side_a
    return len(times_a), len(runs_b)


@pytest.fixture
def data_dir(tmp_path, request):
    """A data directory on a flushed page cache, deleted after the test."""
    os.sync()
    request.addfinalizer(lambda: shutil.rmtree(tmp_path, ignore_errors=True))
    return tmp_path / "data"


def open_broker(path, fsync, request, *topics):
    broker = txmq.Broker(path, fsync=fsync)
    request.addfinalizer(broker.close)
    for t in topics:
        broker.create_topic(t, 1)
    return broker


def looped(n: int, fn, *args, **kwargs):
    """One round: ``fn(*args, **kwargs)`` n times."""
    def run():
        for _ in range(n):
            fn(*args, **kwargs)
    return run


# -- 1. named vs anonymous producer ------------------------------------------------

# (fsync, messages per batch, batches per round): 10,000 messages of 100 B
# (~1.1 MB of log) per round, as in test_bench_send.
NAMED_CASES = [("never", 100, 100), ("never", 1000, 10), ("commit", 100, 100)]


@pytest.mark.parametrize("fsync,batch,per_round", NAMED_CASES,
                         ids=[f"{f}-{b}x100B" for f, b, _ in NAMED_CASES])
def test_named_vs_anonymous(fsync, batch, per_round, measure, benchmark, results, data_dir, request):
    """The same list of ``batch`` x 100 B sent ``per_round`` times per round
    to partition 0 of a topic of its own, by an anonymous and by a named
    producer. Both take the same path (producer id, epoch, sequence and
    the table's check); the named one also checks that no newer instance
    of its name fenced it."""
    broker = open_broker(data_dir, fsync, request, "anon", "named")
    values = payloads(batch, 100)
    anon = broker.producer("anon")
    named = broker.producer("named", name="svc-a")
    request.addfinalizer(named.close)
    n_anon, n_named = alternate(
        measure, benchmark, results, f"producers_named_{batch}_{fsync}",
        ("anonymous", looped(per_round, anon.send_batch, values, partition=0)),
        ("named", looped(per_round, named.send_batch, values, partition=0)),
        ops_per_round=per_round * batch, unit="msg")
    # Every batch went through the producer table: one sequence per message.
    assert anon.last_sequence == {0: n_anon * per_round * batch - 1}
    assert named.last_sequence == {0: n_named * per_round * batch - 1}


# -- 2. 10,000 live producer ids on a partition vs 1 -------------------------------

LIVE_IDS = {"1 id": 1, "10k ids": 10_000}
ROTATION = 10_000        # send slots per rotation on both sides
TABLE_BATCH = 100        # messages per batch in the timed rounds
TABLE_PER_ROUND = 100    # batches per round: 10,000 messages, ~1.1 MB


def live_producers(broker, topic: str, n: int, value: bytes, shared_objects: bool = False) -> list:
    """``n`` anonymous producers that have each appended to partition 0 of
    ``topic``, so its producer table holds ``n`` live ids; and ROTATION
    one-message batches in all on either side, so both logs start alike.
    With ``shared_objects`` (n = 1): ROTATION producer objects that all
    carry the one producer id, so the caller's side (cold producer objects)
    costs what it costs with 10,000 ids and only the table differs."""
    if shared_objects:
        pid = broker._producer_ids.allocate()
        producers = [Producer(broker, broker._topic(topic), pid) for _ in range(ROTATION)]
    else:
        producers = [broker.producer(topic) for _ in range(n)]
    for i in range(ROTATION):
        producers[i % len(producers)].send_batch([value], partition=0)
    return producers


@pytest.mark.parametrize("explicit,objects", [(False, "1 object"), (True, "1 object"),
                                              (False, "10k objects")],
                         ids=["next-seq", "explicit-seq", "next-seq-10k-objects"])
def test_live_producer_ids(explicit, objects, measure, benchmark, results, data_dir, request):
    """Per round, 100 ``send_batch`` calls of the same 100 x 100 B list to
    partition 0. The ``10k ids`` side takes each call's producer from a
    fixed shuffled rotation of its 10,000 producers (every table lookup a
    different, cache-cold entry); the ``1 id`` side from a rotation of the
    same length that names its one producer 10,000 times. With
    ``explicit``, each call passes ``sequence=`` (the producer's next one,
    tracked per slot on both sides), which runs the table's check against
    the producer's 5 cached batches instead of taking the next sequence.

    With ``objects="10k objects"`` the ``1 id`` side rotates over 10,000
    producer objects that share its one id (built with the internal
    ``Producer`` constructor): both sides then touch 10,000 cold producer
    objects, and the ratio is the cost of the table alone."""
    broker = open_broker(data_dir, "never", request, "ids1", "ids10k")
    values = payloads(TABLE_BATCH, 100)
    rnd = random.Random(7)
    loops = {}
    for side, topic in (("1 id", "ids1"), ("10k ids", "ids10k")):
        shared = side == "1 id" and objects == "10k objects"
        producers = live_producers(broker, topic, LIVE_IDS[side], values[0], shared)
        assert all(p.last_sequence[0] >= 0 for p in producers)
        order = list(range(ROTATION))
        rnd.shuffle(order)
        # slot -> (producer, key of its next sequence in `nxt`). The producer
        # object, not a bound send_batch: a caller holds producers, and a
        # stored bound method would add one more cold object per call.
        slots = [(producers[i % len(producers)], 0 if shared else i % len(producers)) for i in order]
        nxt = [p.last_sequence[0] + 1 for p in producers]
        loops[side] = (slots, nxt, producers)

    def make_round(slots, nxt):
        rotation = itertools.cycle(slots)
        if explicit:
            def run():
                for _ in range(TABLE_PER_ROUND):
                    producer, k = next(rotation)
                    seq = nxt[k]
                    producer.send_batch(values, partition=0, sequence=seq)
                    nxt[k] = seq + TABLE_BATCH
        else:
            def run():
                for _ in range(TABLE_PER_ROUND):
                    producer, k = next(rotation)
                    producer.send_batch(values, partition=0)
        return run

    group = ("producers_live_ids_explicit" if explicit else
             "producers_live_ids_objects" if objects == "10k objects" else "producers_live_ids")
    ran = alternate(measure, benchmark, results, group,
                    ("1 id", make_round(*loops["1 id"][:2])),
                    ("10k ids", make_round(*loops["10k ids"][:2])),
                    ops_per_round=TABLE_PER_ROUND * TABLE_BATCH, unit="msg")
    # Both sides appended every batch (none was taken for a retry), and the
    # 10,000 ids are all still in the partition's table.
    for side, rounds_run in zip(LIVE_IDS, ran):
        producers = loops[side][2]
        distinct = {p.producer_id: p for p in producers}.values()
        total = sum(p.last_sequence[0] + 1 for p in distinct)
        assert total == ROTATION + rounds_run * TABLE_PER_ROUND * TABLE_BATCH, (side, total)
        assert all(p.last_sequence[0] >= 0 for p in producers)
