"""Crash test of the exactly-once function runner (txmq.functions): a
windowed aggregation over two inputs, SIGKILLed at random moments.

A worker (tests/workers/function_crash_worker.py) runs one or two instances of the
function ``agg`` (inputs ``a`` and ``b``, 3 co-partitioned partitions each;
output ``totals``; tumbling or sliding event-time windows; state in
``agg-state``). The inputs carry keyed amounts whose event times are out of
order by at most the function's ``max_out_of_orderness_ms``, so no event is
ever late and the totals are a function of the inputs alone; a few poison
values make the function raise every time (they must end in ``agg-dlq``),
others fail once. Each cycle starts the worker on the data directory as
the last kill left it and SIGKILLs it at a random moment (start-up,
restore, or inside a step); then this process reopens the directory, adds
inputs (so the next run has work to be killed in) and now and then checks.
A last run goes until the function is idle. The checks:

- every window in ``totals`` (read_committed, from the start) came once,
  and its total and count are those recomputed from the inputs: in between
  the emitted windows are a subset of the final ones, at the end exactly
  the windows the final watermark of each lane has passed (G1, G6: a
  window emitted twice, a total missing an event or counting one twice
  fails);
- ``agg-dlq`` holds each poison message once (after the end: every one);
- at the end the function's subscriptions have no lag and nothing is left
  open in the output and state partitions.

The default run is short (few cycles, one fsync mode); ``-m slow`` runs
many cycles in every fsync mode.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys

import pytest

import txmq

import function_crash_worker as W
from killer import SETTLE_TIMEOUT, read_lines, start_and_kill, worker, worker_env
from test_functions import expected_totals, read_all, totals_of

WORKER = worker("function_crash_worker.py")
KEYS = [b"k%d" % i for i in range(10)]



class Model:
    def __init__(self):
        self.events = []            # (topic, partition, key, event time, amount): the counted inputs
        self.poison = {}            # "topic/partition@offset" of each poison message
        self.clock = {t: 0 for t in W.INPUTS}
        self.counts = {"runs": 0, "kills_working": 0, "finished": 0, "checks": 0, "windows_mid_way": 0}


def add_inputs(b, model: Model, n: int, rng: random.Random) -> None:
    """``n`` events per input, sent in small batches (some in a transaction,
    one aborted transaction whose events must never count), each event time
    a random 0..OOO_MS past a clock that moves up ~5 ms per event."""
    for topic in W.INPUTS:
        prod = b.producer(topic)
        aborted = b.new_transaction()
        i = 0
        while i < n:
            txn = b.new_transaction() if rng.random() < 0.2 else None
            sent = []
            for _ in range(rng.randint(1, 9)):
                model.clock[topic] += rng.randint(0, 10)
                t = model.clock[topic] + rng.randint(0, W.OOO_MS)
                key = rng.choice(KEYS)
                poison = rng.random() < 0.004
                value = b"x%d" % i if poison else b"%d" % rng.randint(-20, 100)
                mid = prod.send(value, key=key, event_time=t, txn=txn)
                sent.append((mid, key, t, value, poison))
                i += 1
                if rng.random() < 0.01:
                    prod.send(b"999999", key=key, event_time=t, txn=aborted)
            if txn is not None:
                txn.commit()
            for mid, key, t, value, poison in sent:
                if poison:
                    model.poison[str(mid)] = value
                else:
                    model.events.append((topic, mid.partition, key, t, int(value)))
        aborted.abort()


def setup(data, fsync: str, model: Model, n: int, rng: random.Random) -> None:
    with txmq.Broker(data, fsync=fsync) as b:
        for t in W.INPUTS:
            b.create_topic(t, W.PARTITIONS)
        add_inputs(b, model, n, rng)


def run_worker(model: Model, data, fsync: str, spec: str, run: int, rng: random.Random, tmp_path, *,
               kill: bool) -> list:
    instances = rng.choice((1, 2, 2))
    pace = rng.choice((0.002, 0.01, 0.03)) if kill else 0.0
    argv = [sys.executable, WORKER, str(data), fsync, str(rng.randrange(1 << 30)), spec, str(instances), str(pace)]
    out_path = tmp_path / f"out-{run}.txt"
    ctx = f"[fsync={fsync} run={run} instances={instances} pace={pace} seed={argv[4]}]"
    if kill:
        code, err, exited = start_and_kill(argv, worker_env(), out_path, rng, p_after_ready=0.8,
                                           after_ready=(0.0, 0.8), anytime=(0.0, 0.9))
        assert code in (0, -signal.SIGKILL), f"{ctx}: the worker exited by itself with {code}:\n{err}"
        exited = code == 0
    else:
        with open(out_path, "wb") as out:
            proc = subprocess.run(argv, stdout=out, stderr=subprocess.PIPE, env=worker_env(),
                                  timeout=4 * SETTLE_TIMEOUT)
        code, err, exited = proc.returncode, proc.stderr.decode(), True
        assert code == 0, f"{ctx}: the worker exited with {code}:\n{err}"
    lines = read_lines(out_path)
    if exited:
        assert lines and lines[-1] == "DONE", f"{ctx}: exited without DONE: {lines[-3:]}\n{err}"
    model.counts["runs"] += 1
    model.counts["kills_working"] += kill and not exited and "READY" in lines
    model.counts["finished"] += exited
    return [json.loads(line[2:]) for line in lines if line.startswith("M ")]


def check(b, model: Model, spec: str, ctx: str, final: bool) -> None:
    window = W.window_of(spec)
    want = expected_totals(model.events, window, W.INPUTS, W.OOO_MS, W.LATENESS_MS)
    got = totals_of(read_all(b, W.OUTPUT))          # asserts: no window twice
    for k, v in got.items():
        assert k in want, f"{ctx}: window {k} = {v} emitted, but the inputs never close it"
        assert v == want[k], f"{ctx}: window {k}: emitted (end, total, count) {v}, recomputed {want[k]}"
    dlq = read_all(b, f"{W.NAME}-dlq")
    origins = [dict(m.headers)["txmq-origin"].decode() for m in dlq]
    assert len(origins) == len(set(origins)), f"{ctx}: a poison message dead-lettered twice"
    for m, origin in zip(dlq, origins):
        assert model.poison.get(origin) == m.value, f"{ctx}: {origin}={m.value!r} in the DLQ is no poison message"
    model.counts["checks"] += 1
    model.counts["windows_checked"] = len(want)
    if not final:
        model.counts["windows_mid_way"] += len(got)
        return
    assert got == want, f"{ctx}: {len(want) - len(got)} windows missing: {sorted(set(want) - set(got))[:5]}"
    assert sorted(origins) == sorted(model.poison), f"{ctx}: poison messages not dead-lettered"
    for t in W.INPUTS:
        assert set(b.consumer_lag(t, W.NAME).values()) == {0}, f"{ctx}: lag on {t}"
    for t in (W.OUTPUT, f"{W.NAME}-state", f"{W.NAME}-dlq"):
        for p in range(b.describe_topic(t)["partitions"]):
            assert b.last_stable_offset(t, p) == b.high_watermark(t, p), f"{ctx}: {t}/{p} has an open transaction"


def reopen_and_check(data, fsync, model, spec, ctx, rng=None, top_up=0, final=False, checking=True) -> None:
    with txmq.Broker(data, fsync=fsync) as b:
        if checking:
            check(b, model, spec, ctx, final)
        if top_up:
            add_inputs(b, model, top_up, rng)


def function_crash(tmp_path, fsync: str, spec: str, cycles: int, seed: int, *, inputs: int, top_up: int,
                   p_check: float = 0.3) -> Model:
    rng = random.Random(seed)
    data = tmp_path / "data"
    model = Model()
    setup(data, fsync, model, inputs, rng)
    for run in range(cycles):
        run_worker(model, data, fsync, spec, run, rng, tmp_path, kill=True)
        # More inputs after every kill, so that the next run has work to be killed in.
        reopen_and_check(data, fsync, model, spec, f"[fsync={fsync} seed={seed} after run {run}]", rng, top_up,
                         checking=rng.random() < p_check)
    metrics = run_worker(model, data, fsync, spec, cycles, rng, tmp_path, kill=False)
    reopen_and_check(data, fsync, model, spec, f"[fsync={fsync} seed={seed} final]", final=True)
    c = model.counts
    print(f"function crash fsync={fsync} {spec} seed={seed}: events={len(model.events)} "
          f"poison={len(model.poison)} {c} final metrics={metrics}")
    # The run exercised what it claims to.
    assert c["kills_working"] >= cycles // 3, c
    assert metrics and model.poison and len(model.events) > 1000, c
    assert all(m["late"] == 0 for m in metrics), metrics      # events out of order within the bound only
    return model


def test_windowed_function_killed(tmp_path):
    function_crash(tmp_path, "commit", "sliding:300:100", cycles=10, seed=9100, inputs=800, top_up=300)


@pytest.mark.slow
@pytest.mark.parametrize("fsync", ("never", "commit", "always"))
@pytest.mark.parametrize("spec", ("tumbling:250", "sliding:400:150"))
def test_windowed_function_killed_many_times(tmp_path, fsync, spec):
    model = function_crash(tmp_path, fsync, spec, cycles=24, seed=9200 + len(spec) + len(fsync),
                           inputs=1000, top_up=400)
    assert model.counts["windows_mid_way"] > 0, model.counts
