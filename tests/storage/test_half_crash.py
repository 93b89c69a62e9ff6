"""G10 across SIGKILL: a half message is visible at most once, and exactly
once when its local transaction committed (directly or by check-back).

A worker (tests/workers/half_crash_worker.py) sends half messages whose outcome is fixed
by their number, and is killed at every named step of a half message's
life and at random moments. A last, clean opening then lets check-back
resolve everything, and the topic, the check-max topic and the half log
are compared with what the outcomes say.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import pytest

import txmq
from half_crash_worker import NEVER, TOPIC, checker, committed, decision, k_of, open_broker
from killer import drain, read_lines, start_and_kill, worker

WORKER = worker("half_crash_worker.py")
# Each named step, at a visit that a run of 40 sends (and its checks) reaches.
NAMED = ["half.stored@7", "half.local_done@5", "half.committing@4", "half.appended@6",
         "half.check_counted@2", "half.discarding@1"]


def _run(tmp_path, fsync: str, rng: random.Random, named: list, random_cycles: int) -> dict:
    data = str(tmp_path / "data")
    tried, sent = set(), {}
    next_k = 0
    kills = {"named": 0, "random": 0}
    plan = [(p, 40) for p in named] + [(None, rng.randint(30, 120)) for _ in range(random_cycles)]
    for cycle, (point, count) in enumerate(plan):
        env = dict(os.environ)
        env.pop("TXMQ_CRASH_AT", None)
        if point:
            env["TXMQ_CRASH_AT"] = point
        out = tmp_path / f"out-{cycle}"
        argv = [sys.executable, WORKER, data, fsync, str(next_k), str(count), "6" if point else "2"]
        if point:      # only the crash point kills it
            with open(out, "wb") as f:
                proc = subprocess.run(argv, env=env, stdout=f, stderr=subprocess.PIPE, timeout=60)
            rc, err = proc.returncode, proc.stderr.decode()
            assert rc == -9, f"crash point {point} was not reached (rc {rc}): {err[-2000:]}"
            kills["named"] += 1
        else:
            rc, err, exited = start_and_kill(argv, env, out, rng, p_after_ready=0.8, after_ready=(0.0, 1.2),
                                             anytime=(0.0, 0.8))
            assert rc in (0, -9), err[-2000:]
            kills["random"] += rc == -9
        for line in read_lines(out):
            word, *rest = line.split()
            if word == "TRY":
                tried.add(int(rest[0]))
            elif word == "SENT":
                k, half_id, state, part, off = rest
                sent[int(k)] = (int(half_id), state, int(part), int(off))
        next_k = max(tried, default=next_k - 1) + 1
    return _verify(data, fsync, tried, sent) | kills


def _verify(data: str, fsync: str, tried: set, sent: dict) -> dict:
    with open_broker(data, fsync) as broker:
        hp = broker.half_producer(TOPIC, "order-svc", checker=checker)
        deadline = time.monotonic() + 30
        while True:
            broker.check_half_messages()
            by = broker.stats()["half"]["by_state"]
            if by["prepared"] == by["committing"] == by["discarding"] == 0:
                break
            assert time.monotonic() < deadline, f"half messages never resolved: {by}"
            time.sleep(0.1)
        half = broker._half.log
        stored = {}
        for offset, _, value, *_ in half.read(half.start_offset, 1 << 30):
            assert k_of(value) not in stored, f"h-{k_of(value)} stored twice"
            stored[k_of(value)] = offset
        c = broker.subscribe(TOPIC, "check", isolation="read_uncommitted", initial_position="earliest")
        visible = [(k_of(m.value), m.message_id) for m in drain(c)]
        dead = []
        if txmq.storage.half_messages.CHECK_MAX_TOPIC in broker.topics():
            d = broker.subscribe(txmq.storage.half_messages.CHECK_MAX_TOPIC, "check", initial_position="earliest")
            dead = [k_of(m.value) for m in drain(d)]
        hp.close()
    ks = [k for k, _ in visible]
    assert len(ks) == len(set(ks)), f"visible twice: {sorted(k for k in ks if ks.count(k) > 1)}"
    assert len(dead) == len(set(dead)), "discarded twice"
    assert set(stored) <= tried
    assert set(sent) <= set(stored), "a send that returned lost its half message"
    assert set(ks) == {k for k in stored if committed(k)}, "visible differs from the committed half messages"
    assert set(dead) == {k for k in stored if decision(k) == NEVER}
    where = dict(visible)
    for k, (half_id, state, part, off) in sent.items():
        assert stored[k] == half_id
        if state == "commit":
            assert where[k][1:] == (part, off), f"h-{k} returned {(part, off)} but is at {where[k]}"
    return {"tried": len(tried), "stored": len(stored), "visible": len(ks), "dead": len(dead),
            "sent": len(sent)}


@pytest.mark.parametrize("fsync", ["commit"])
def test_half_messages_survive_kills_at_every_step(tmp_path, fsync):
    r = _run(tmp_path, fsync, random.Random(11), NAMED, random_cycles=4)
    assert r["named"] == len(NAMED)
    assert r["visible"] > 0 and r["dead"] > 0 and r["stored"] < r["tried"] + 1


@pytest.mark.slow
@pytest.mark.parametrize("fsync", ["never", "commit", "always"])
def test_half_messages_survive_many_kills(tmp_path, fsync):
    r = _run(tmp_path, fsync, random.Random(fsync), NAMED, random_cycles=24)
    assert r["named"] == len(NAMED) and r["random"] >= 10, r
