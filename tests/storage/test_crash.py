"""Crash tests (docs/GUARANTEES.md: G4 and durability): a real broker process is SIGKILLed at
random moments while it produces, or while it consumes and acknowledges;
the parent reopens the data directory after every kill and checks:

- every acknowledged send is in the log exactly once, at the offset it was
  acknowledged with, with its exact key, headers and value;
- the log is dense, its surviving prefix never changes, and every value in
  it is complete and well-formed (no torn batch: each batch's part on a
  partition is there whole or not at all);
- sends of one process appear in send order on each partition;
- the subscription's cursor resumes right after the acks: a fresh receive
  never returns an acknowledged message and never skips one that was not
  acknowledged (only the ack in flight at the kill may go either way), and
  the backlog in stats() counts exactly what is redelivered.

The worker is tests/workers/crash_worker.py; it prints each operation only after
the call returned, so what it printed is what the broker acknowledged.
"""

from __future__ import annotations

import os
import random
import signal
import sys

import pytest

import txmq

import crash_worker as W
from killer import SETTLE_TIMEOUT, start_and_kill, worker

WORKER = worker("crash_worker.py")


class Model:
    """What the parent knows the broker acknowledged, across every cycle."""

    def __init__(self):
        self.history = {p: [] for p in range(W.PARTITIONS)}   # every value, by offset
        self.where = {}                                        # id -> (partition, offset) in the log
        self.last_seq = {p: {} for p in range(W.PARTITIONS)}   # partition -> cycle -> last seq
        self.sends = {}                                        # acknowledged: id -> (partition, offset)
        self.acked = {p: set() for p in range(W.PARTITIONS)}   # acked offsets of WORK_SUB
        self.kills_after_ready = 0
        self.sends_seen = 0
        self.acks_seen = 0
        self.redelivered_seen = 0


def run_and_kill(mode, data, fsync, cycle, rng, tmp_path):
    """Start the worker, SIGKILL it at a random moment, return its output lines."""
    out_path = tmp_path / f"out-{cycle}.txt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(txmq.__path__[0])] + [x for x in [os.environ.get("PYTHONPATH")] if x]))
    code, err, exited = start_and_kill(
        [sys.executable, WORKER, mode, str(data), fsync, str(cycle), str(rng.randrange(1 << 30))],
        env, out_path, rng, p_after_ready=0.8, after_ready=(0.0, 0.3))
    if exited:
        pytest.fail(f"worker exited by itself with {code}: {err}")
    assert code == -signal.SIGKILL
    text = out_path.read_bytes().decode()
    lines = text.split("\n")[:-1]     # a line without its newline was cut by the kill
    return lines, "READY" in lines


def drain(consumer):
    got = {p: [] for p in range(W.PARTITIONS)}
    while True:
        ms = consumer.receive_many(5000, timeout=0)
        if not ms:
            return got
        for m in ms:
            got[m.partition].append(m)


def read_all(broker):
    """Every message of every partition in offset order, through a fresh
    subscription that is deleted afterwards."""
    c = broker.subscribe(W.TOPIC, "full-audit", "exclusive", initial_position="earliest")
    try:
        return drain(c)
    finally:
        c.unsubscribe()


def check_log(broker, model: Model, lines, full: bool):
    """The produce guarantees, after a reopen. The persistent "audit"
    subscription hands over what was appended since the last check (and acks
    it); ``full`` re-reads the whole log through a fresh subscription too."""
    new_sends = {}
    for line in lines:
        if line.startswith("A "):
            _, mid, p, off = line.split()
            assert mid not in model.sends and mid not in new_sends
            new_sends[mid] = (int(p), int(off))
    model.sends.update(new_sends)
    model.sends_seen += len(new_sends)
    parts = broker.stats()["topics"][W.TOPIC]["partitions"]
    audit = broker.subscribe(W.TOPIC, "audit", "exclusive", initial_position="earliest")
    try:
        got = drain(audit)
        for p, msgs in got.items():
            if msgs:
                audit.ack_cumulative(msgs[-1])
    finally:
        audit.close()
    groups = {}
    for p in range(W.PARTITIONS):
        msgs = got[p]
        old = model.history[p]
        assert parts[p]["start_offset"] == 0
        # The log still holds everything seen before, and continues densely.
        assert parts[p]["end_offset"] >= len(old), f"partition {p} lost data that survived a reopen"
        assert [m.offset for m in msgs] == list(range(len(old), parts[p]["end_offset"])), \
            f"partition {p}: new data is not dense after offset {len(old)}"
        last_seq = model.last_seq[p]
        for m in msgs:
            f = W.check_message(m.key, m.value, m.headers)     # complete and well-formed
            assert f["id"] not in model.where, \
                f"{f['id']} is in the log twice: {model.where[f['id']]} and {p}@{m.offset}"
            model.where[f["id"]] = (p, m.offset)
            # one process sends in order: on a partition its seqs increase with the offset
            assert f["seq"] > last_seq.get(f["cycle"], -1), f"{f['id']} out of send order on {p}"
            last_seq[f["cycle"]] = f["seq"]
            if f["bid"] >= 0:
                groups.setdefault((f["cycle"], f["bid"], p), []).append((m.offset, f["gi"], f["gn"]))
            old.append(m.value)
    for mid, loc in new_sends.items():
        assert model.where.get(mid) == loc, \
            f"acknowledged send {mid} at {loc} is at {model.where.get(mid)} after the kill"
    for (c, bid, p), members in groups.items():
        offs = [o for o, _, _ in members]
        gn = members[0][2]
        assert [gi for _, gi, _ in members] == list(range(gn)), \
            f"torn batch {c}/{bid} on partition {p}: {members}"
        assert offs == list(range(offs[0], offs[0] + gn)), f"batch {c}/{bid} is not contiguous"
    if full:
        everything = read_all(broker)
        for p in range(W.PARTITIONS):
            assert [m.value for m in everything[p]] == model.history[p], \
                f"partition {p}: data that survived a reopen changed"
        for mid, (p, off) in model.sends.items():
            assert W.parse_value(everything[p][off].value)["id"] == mid


def check_cursor(broker, model: Model, lines):
    """The consume guarantees, after a reopen (after check_log)."""
    possible = {p: set() for p in range(W.PARTITIONS)}
    for line in lines:
        kind, _, rest = line.partition(" ")
        if kind == "T":
            possible = {p: set() for p in range(W.PARTITIONS)}
            for item in rest.split():
                p, off = map(int, item.split(":"))
                possible[p].add(off)
        elif kind == "K":
            for item in rest.split():
                p, off = map(int, item.split(":"))
                model.acked[p].add(off)
                model.acks_seen += 1
            possible = {p: set() for p in range(W.PARTITIONS)}
        elif kind == "TC":
            p, off = map(int, rest.split())
            possible = {q: set() for q in range(W.PARTITIONS)}
            possible[p] = set(range(off + 1))
        elif kind == "KC":
            p, off = map(int, rest.split())
            model.acked[p].update(range(off + 1))
            model.acks_seen += 1
            possible = {q: set() for q in range(W.PARTITIONS)}
    sub_stats = broker.stats()["topics"][W.TOPIC]["subscriptions"][W.WORK_SUB]
    c = broker.subscribe(W.TOPIC, W.WORK_SUB, "exclusive", initial_position="earliest")
    try:
        received = drain(c)
    finally:
        c.close()
    assert sub_stats["backlog"] == sum(len(v) for v in received.values())
    for p in range(W.PARTITIONS):
        offs = [m.offset for m in received[p]]
        assert offs == sorted(set(offs)), f"partition {p}: redelivery out of order or duplicated"
        again = set(offs) & model.acked[p]
        assert not again, f"partition {p}: acknowledged offsets {sorted(again)[:10]} delivered again"
        for m in received[p]:
            assert m.value == model.history[p][m.offset]
        skipped = set(range(len(model.history[p]))) - set(offs) - model.acked[p] - possible[p]
        assert not skipped, f"partition {p}: unacknowledged offsets {sorted(skipped)[:10]} skipped"
        if offs:
            below = set(range(offs[0])) - model.acked[p] - possible[p]
            assert not below
        # Now we know exactly: everything not redelivered is acknowledged.
        model.acked[p] = set(range(len(model.history[p]))) - set(offs)
        model.redelivered_seen += len(offs)


def crash_cycles(tmp_path, mode, fsync, cycles, seed, full_every=4):
    rng = random.Random(seed)
    data = tmp_path / "data"
    with txmq.Broker(data, fsync=fsync, **W.BROKER_OPTS) as b:
        b.create_topic(W.TOPIC, W.PARTITIONS)
        if mode == "consume":
            b.subscribe(W.TOPIC, W.WORK_SUB, "exclusive", initial_position="earliest").close()
            prod = b.producer(W.TOPIC)
            for s in range(2000):   # something to consume from the first moment, over a few segments
                prod.send(W.make_value(-1, s, -1, 0, 1, ""))
    model = Model()
    for cycle in range(cycles):
        lines, killed_working = run_and_kill(mode, data, fsync, cycle, rng, tmp_path)
        model.kills_after_ready += killed_working
        with txmq.Broker(data, fsync=fsync, **W.BROKER_OPTS) as b:
            check_log(b, model, lines, full=cycle % full_every == full_every - 1)
            if mode == "consume":
                check_cursor(b, model, lines)
            truncated = [p["truncated_on_open"] for p in b.stats()["topics"][W.TOPIC]["partitions"]]
        # A second open after recovery finds a clean log: recovery converged.
        with txmq.Broker(data, fsync=fsync, **W.BROKER_OPTS) as b:
            parts = b.stats()["topics"][W.TOPIC]["partitions"]
            assert all(not p["truncated_on_open"] for p in parts), (truncated, parts)
            assert [p["end_offset"] for p in parts] == [len(model.history[p]) for p in range(W.PARTITIONS)]
    # The run exercised what it claims to: kills landed during real work.
    assert model.kills_after_ready >= cycles // 3
    assert model.sends_seen > 0
    assert max(p["segments"] for p in parts) > 2     # segments rolled (64 KiB each)
    if mode == "consume":
        assert model.acks_seen > 0 and model.redelivered_seen > 0
    return model


@pytest.mark.parametrize("fsync", ["never", "commit"])
def test_kill_while_producing(tmp_path, fsync):
    crash_cycles(tmp_path, "produce", fsync, cycles=20, seed=1000 + len(fsync))


@pytest.mark.parametrize("fsync", ["never", "commit"])
def test_kill_while_consuming(tmp_path, fsync):
    crash_cycles(tmp_path, "consume", fsync, cycles=16, seed=2000 + len(fsync))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["produce", "consume"])
@pytest.mark.parametrize("fsync", ["never", "commit", "always"])
def test_kill_many_times(tmp_path, fsync, mode):
    crash_cycles(tmp_path, mode, fsync, cycles=200, seed=3000 + len(fsync) + len(mode),
                 full_every=25)
