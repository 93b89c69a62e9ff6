"""Crash test of named producers (docs/GUARANTEES.md: G4, G5): a named producer
SIGKILLed mid-stream, restarted, resends its last N batches from
``last_sequence``: no duplicates, no gaps, in order.

Three named producers (tests/workers/producer_crash_worker.py, ``STREAMS``) send
fixed, endless streams of batches to a two-partition topic, two of them
interleaved on partition 0. Each cycle starts the worker on the data
directory as the last kill left it (the parent reopens it in between only
now and then, so most restarts recover in the worker itself), lets it
resend its last 1..5 batches with their sequences (each must answer with
the original offsets and append nothing) and go on, and SIGKILLs it at a
random moment: during start-up, recovery or the resends, or while it
sends. After the kills a clean run ends the test. The parent checks, from
the log alone:

- each stream's part of its partition is exactly its batches 0, 1, 2, ...
  in order: no batch twice (G5), none missing, none torn, each one batch
  with this producer's id, base sequence and count; the offsets are dense;
- every batch the worker saw acknowledged is there, at the offset it was
  acknowledged with (G4), and data that survived a reopen never changes;
- the batch a restarted worker found from ``last_sequence`` is the last
  acknowledged one or the one in flight at the kill (one per stream);
- ``last_sequence`` of every named producer, after a reopen, is the last
  sequence of its last batch in the log, and its producer id never changes.

Two more tests restart after a kill and then probe the edges: resending a
batch older than the last 5 raises DuplicateSequenceError (the last 5 still
answer with their offsets, a mismatching count or a sequence inside a batch
is refused) and a gap raises OutOfOrderSequenceError naming the expected
sequence; none of them appends anything.

The default run covers the three fsync modes with a few cycles each; the
slow run (``-m slow``) does many more.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys

import pytest

import txmq

import producer_crash_worker as W
from killer import HELPERS, SETTLE_TIMEOUT, read_lines, start_and_kill, worker, worker_env

WORKER = worker("producer_crash_worker.py")
FSYNCS = ("never", "commit", "always")
PARTITION_OF = {s: part for s, (_, part) in W.STREAMS.items()}



class Model:
    """What the parent knows, across every cycle."""

    def __init__(self):
        self.where = {s: [] for s in W.STREAMS}        # k -> base offset of batch k, as checked in the log
        self.batches = {p: [] for p in range(W.PARTITIONS)}   # (base offset, stream, k) in log order
        self.checked_end = dict.fromkeys(range(W.PARTITIONS), 0)
        self.pids = {}                                 # stream -> producer id (never changes)
        self.acked = {s: {} for s in W.STREAMS}        # k -> offset the worker was told
        self.known = dict.fromkeys(W.STREAMS, -1)      # highest batch known to be in the log
        self.exact = None                              # {stream: last batch} right after a check
        self.counts = dict.fromkeys(["runs", "kills_after_ready", "restarts_with_data", "resent",
                                     "old_refused", "acked", "checks", "gaps_refused", "mismatch_refused"], 0)


def run_worker(model: Model, data, fsync: str, cycle: int, rng: random.Random, tmp_path, *, mode: str = "stream",
               kill: bool = True, clean: int | None = None) -> list:
    threads = rng.choice((1, 3))
    small = int(rng.random() < 0.5)
    argv = [sys.executable, WORKER, mode, str(data), fsync, str(cycle), str(rng.randrange(1 << 30)),
            str(threads), str(small)] + ([str(clean)] if clean is not None else [])
    out_path = tmp_path / f"out-{cycle}.txt"
    ctx = f"[fsync={fsync} cycle={cycle} mode={mode} threads={threads} small={small}]"
    if kill:
        code, err, exited = start_and_kill(argv, worker_env(), out_path, rng,
                                           p_after_ready=0.75, after_ready=(0.0, 0.3), anytime=(0.0, 0.7))
        if exited:
            pytest.fail(f"{ctx}: the worker exited by itself with {code}:\n{err}")
        assert code == -signal.SIGKILL, (ctx, code, err)
    else:
        with open(out_path, "wb") as out:
            proc = subprocess.run(argv, stdout=out, stderr=subprocess.PIPE, env=worker_env(),
                                  timeout=SETTLE_TIMEOUT * 4)
        assert proc.returncode == 0, f"{ctx}: the worker exited with {proc.returncode}:\n{proc.stderr.decode()}"
    lines = read_lines(out_path)
    if not kill:
        assert lines and lines[-1] == "DONE", f"{ctx}: {lines[-3:]}"
    model.counts["runs"] += 1
    model.counts["kills_after_ready"] += kill and "READY" in lines
    parse_lines(model, lines, ctx)
    return lines


def parse_lines(model: Model, lines: list, ctx: str) -> None:
    """Fold one run's lines into ``model``, checking what they alone show."""
    nxt = {}                     # stream -> the next batch this run must acknowledge
    exact, model.exact = model.exact, None
    for line in lines:
        kind, *f = line.split()
        if kind in ("READY", "DONE"):
            continue
        s = f[0]
        if kind == "R":
            K = int(f[1])
            # What the restart found is the last acknowledged batch, or the one
            # that was in flight at the kill (one at a time per stream).
            if exact is not None:
                assert K == exact[s], f"{ctx}: {s}: last_sequence names batch {K}, the log ends at {exact[s]}"
            assert model.known[s] <= K <= model.known[s] + 1, \
                f"{ctx}: {s}: restarted at batch {K}, but batch {model.known[s]} was the last known one (G4/G5)"
            model.known[s] = K
            nxt[s] = K + 1
            ks = [] if f[2] == "-" else [int(x) for x in f[2].split(",")]
            assert sorted(ks) == list(range(K - len(ks) + 1, K + 1)) and (len(ks) >= 1 or K == -1), (ctx, line)
            model.counts["restarts_with_data"] += K >= 0
            model.counts["resent"] += len(ks)
        elif kind == "D":
            assert int(f[1]) < model.known[s] - W.CACHED + 1, (ctx, line)
            model.counts["old_refused"] += 1
        elif kind == "A":
            k, off = int(f[1]), int(f[2])
            assert k == nxt.get(s), f"{ctx}: {s}: batch {k} acknowledged, expected batch {nxt.get(s)}"
            nxt[s] = k + 1
            model.acked[s][k] = off
            model.known[s] = max(model.known[s], k)
            model.counts["acked"] += 1
        elif kind == "O":
            model.counts["gaps_refused"] += 1
        elif kind == "X":
            model.counts["mismatch_refused"] += 1
        else:
            raise AssertionError(f"{ctx}: unknown worker line {line!r}")


def read_partition(b, p: int, start: int) -> list:
    """(offset, value, batch info) of every message of partition ``p`` from ``start``."""
    part = b._topic(W.TOPIC).partitions[p]
    end = part.end_offset
    out = []
    off = start
    while off < end:
        got = part.read(off, 20000)
        assert got, f"partition {p}: nothing readable at {off} below the end {end}"
        out.extend((m[0], m[2], m[-1]) for m in got)
        off = got[-1][0] + 1
    return out


def check(b, model: Model, ctx: str, full: bool = False) -> None:
    """The guarantees after a reopen: the part of the log appended since the
    last check (all of it with ``full``), the acknowledged batches, and
    last_sequence."""
    for p in range(W.PARTITIONS):
        start = 0 if full else model.checked_end[p]
        msgs = read_partition(b, p, start)
        offs = [m[0] for m in msgs]
        assert offs == list(range(start, start + len(offs))), \
            f"{ctx}: {W.TOPIC}/{p}: offsets not dense from {start}: {offs[:3]}..."
        seen = []                                   # (base offset, stream, k)
        nexts = {s: 0 for s in W.STREAMS} if full else {s: len(model.where[s]) for s in W.STREAMS}
        i = 0
        while i < len(msgs):
            off, v, info = msgs[i]
            try:
                s, k, _ = W.parse(v)
            except ValueError as e:
                raise AssertionError(f"{ctx}: {W.TOPIC}/{p}@{off}: {e}") from None
            n = W.size(k)
            where = f"{ctx}: {W.TOPIC}/{p}@{off}: batch {k} of {s}"
            assert PARTITION_OF[s] == p, f"{where} is on the wrong partition"
            assert info.base_offset == off and info.count == n, \
                f"{where}: not one whole batch ({info!r}, {n} messages expected)"
            assert [m[1] for m in msgs[i:i + n]] == W.batch_values(s, k), f"{where}: torn or damaged"
            pid = model.pids.setdefault(s, info.producer_id)
            assert (info.producer_id, info.producer_epoch, info.base_sequence) == (pid, 0, W.base(k)), \
                (f"{where}: producer {info.producer_id} epoch {info.producer_epoch} base sequence "
                 f"{info.base_sequence}, expected producer {pid} epoch 0 base sequence {W.base(k)}")
            want = nexts[s]
            if k < want:
                raise AssertionError(f"{where} is in the log twice: first at {model.where[s][k]} (G5)")
            assert k == want, f"{where}: batches {want}..{k - 1} of {s} are missing before it (a gap)"
            if full and k < len(model.where[s]):
                assert model.where[s][k] == off, \
                    f"{where}: was at {model.where[s][k]} at an earlier check (surviving data changed)"
            else:
                model.where[s].append(off)
            nexts[s] = k + 1
            seen.append((off, s, k))
            i += n
        if full:
            old = model.batches[p]
            assert seen[:len(old)] == old, f"{ctx}: {W.TOPIC}/{p}: data that survived a reopen changed"
            model.batches[p] = seen
        else:
            model.batches[p].extend(seen)
        model.checked_end[p] = start + len(msgs)
    # G4: every acknowledged batch is in the log where it was acknowledged.
    for s, acked in model.acked.items():
        for k, off in acked.items():
            assert k < len(model.where[s]), \
                f"{ctx}: batch {k} of {s} was acknowledged at offset {off} but is not in the log (G4)"
            assert model.where[s][k] == off, \
                f"{ctx}: batch {k} of {s} was acknowledged at {off}, the log has it at {model.where[s][k]}"
        # Beyond what was acknowledged or found by a restart, at most the
        # batch in flight at the last kill (one at a time per stream).
        last = len(model.where[s]) - 1
        assert model.known[s] <= last <= model.known[s] + 1, \
            f"{ctx}: {s}: batch {model.known[s]} was acknowledged or found last, the log ends at batch {last}"
        model.known[s] = last
    # last_sequence after the reopen is where the log ends, per producer and partition.
    for s, (name, part) in W.STREAMS.items():
        prod = b.producer(W.TOPIC, name=name)
        try:
            if s in model.pids:
                assert prod.producer_id == model.pids[s], \
                    f"{ctx}: named producer {name} has id {prod.producer_id}, wrote as {model.pids[s]}"
            last = len(model.where[s]) - 1
            want = {p: -1 for p in range(W.PARTITIONS)}
            want[part] = W.last_seq(last)
            assert prod.last_sequence == want, \
                f"{ctx}: {name}: last_sequence {prod.last_sequence}, the log ends with batch {last}: {want}"
        finally:
            prod.close()
    model.exact = {s: len(model.where[s]) - 1 for s in W.STREAMS}
    model.counts["checks"] += 1


def reopen_and_check(data, fsync: str, model: Model, ctx: str, full: bool = False) -> None:
    with txmq.Broker(data, fsync=fsync, **W.BROKER_OPTS) as b:
        check(b, model, ctx, full)
        truncated = [p["truncated_on_open"] for p in b.stats()["topics"][W.TOPIC]["partitions"]]
    # A second open finds what the first left: recovery converged.
    with txmq.Broker(data, fsync=fsync, **W.BROKER_OPTS) as b:
        parts = b.stats()["topics"][W.TOPIC]["partitions"]
        assert all(not p["truncated_on_open"] for p in parts), (ctx, truncated, parts)
        assert [p["end_offset"] for p in parts] == [model.checked_end[p] for p in range(W.PARTITIONS)], ctx


def setup(tmp_path):
    data = tmp_path / "data"
    with txmq.Broker(data, fsync="never", **W.BROKER_OPTS) as b:
        b.create_topic(W.TOPIC, W.PARTITIONS)
    return data


def crash_cycles(model: Model, data, fsync: str, cycles: int, rng: random.Random, tmp_path, first: int = 0,
                 p_check: float = 0.4) -> None:
    """``cycles`` start-kill cycles; the parent reopens and checks after
    some of them (the others leave recovery to the next worker)."""
    for cycle in range(first, first + cycles):
        run_worker(model, data, fsync, cycle, rng, tmp_path)
        if rng.random() < p_check:
            reopen_and_check(data, fsync, model, f"[fsync={fsync} after cycle {cycle}]")


def finish(model: Model, data, fsync: str, rng: random.Random, tmp_path, cycle: int) -> None:
    """A clean last run, then the whole log checked from its start."""
    run_worker(model, data, fsync, cycle, rng, tmp_path, kill=False, clean=rng.randint(5, 30))
    reopen_and_check(data, fsync, model, f"[fsync={fsync} final]", full=True)


def producer_crash(tmp_path, fsync: str, cycles: int, seed: int) -> Model:
    rng = random.Random(seed)
    data = setup(tmp_path)
    model = Model()
    crash_cycles(model, data, fsync, cycles, rng, tmp_path)
    finish(model, data, fsync, rng, tmp_path, cycles)
    # The run exercised what it claims to.
    c = model.counts
    assert c["kills_after_ready"] >= cycles // 3, c
    assert c["restarts_with_data"] > 0 and c["resent"] > 0 and c["acked"] > 0, c
    return model


@pytest.mark.parametrize("fsync", FSYNCS)
def test_named_producer_killed_resends_last_batches(tmp_path, fsync):
    producer_crash(tmp_path, fsync, cycles=8, seed=7100 + FSYNCS.index(fsync))


@pytest.mark.slow
@pytest.mark.parametrize("fsync", FSYNCS)
def test_named_producer_killed_many_times(tmp_path, fsync):
    model = producer_crash(tmp_path, fsync, cycles=120, seed=7200 + FSYNCS.index(fsync))
    assert model.counts["old_refused"] > 0, model.counts


def probe_after_crash(tmp_path, fsync: str, mode: str, seed: int) -> Model:
    """A clean run gives every stream more than 5 batches; then kill cycles,
    and the probe runs straight on the killed directory (no parent reopen in
    between); then more kills and a clean end."""
    rng = random.Random(seed)
    data = setup(tmp_path)
    model = Model()
    run_worker(model, data, fsync, 0, rng, tmp_path, kill=False, clean=W.CACHED + 10)
    crash_cycles(model, data, fsync, 3, rng, tmp_path, first=1, p_check=0.0)
    run_worker(model, data, fsync, 4, rng, tmp_path, mode=mode, kill=False)
    reopen_and_check(data, fsync, model, f"[fsync={fsync} after the {mode} probe]")
    crash_cycles(model, data, fsync, 2, rng, tmp_path, first=5, p_check=0.0)
    finish(model, data, fsync, rng, tmp_path, 7)
    return model


def test_resend_older_than_last_five_after_crash(tmp_path):
    """After a kill and restart, batches older than the producer's last 5 on
    the partition raise DuplicateSequenceError and append nothing, while
    each of the last 5 answers with its original offsets."""
    model = probe_after_crash(tmp_path, "commit", "dup", seed=7301)
    assert model.counts["old_refused"] >= 2 * len(W.STREAMS), model.counts
    assert model.counts["mismatch_refused"] >= len(W.STREAMS), model.counts


def test_gap_after_crash(tmp_path):
    """After a kill and restart, a sequence past the next one raises
    OutOfOrderSequenceError (with the expected next sequence) and appends
    nothing; the right next batch then appends."""
    model = probe_after_crash(tmp_path, "never", "gap", seed=7302)
    assert model.counts["gaps_refused"] == 4 * len(W.STREAMS), model.counts


@pytest.mark.slow
@pytest.mark.parametrize("fsync", FSYNCS)
@pytest.mark.parametrize("mode", ["dup", "gap"])
def test_probes_after_crash_many(tmp_path, fsync, mode):
    for i in range(5):
        probe_after_crash(tmp_path / str(i), fsync, mode, seed=7400 + 10 * FSYNCS.index(fsync) + i + len(mode))


# -- producer ids across SIGKILL ------------------------------------------------------------

ID_WORKER = r"""
import sys
import txmq
from worker_io import Out

out = Out()
with txmq.Broker(sys.argv[1], fsync=sys.argv[2]) as b:
    if "ids" not in b.topics():
        b.create_topic("ids", 1)
    out.line("READY")
    while True:
        p = b.producer("ids")
        # Sequence 0 of a fresh id: were the id handed out before, this
        # would be answered as a resend of an old batch and append nothing.
        mid = p.send(str(p.producer_id).encode(), partition=0, sequence=0)
        out.line(f"{p.producer_id} {mid.offset}")
"""


@pytest.mark.parametrize("fsync", ["never", "commit"])
def test_anonymous_producer_ids_survive_kills(tmp_path, fsync):
    """The producer-id counter across SIGKILLs (G4, G5): an id is never
    handed out twice, so a fresh producer's first batch is always appended,
    never mistaken for a resend of another producer's."""
    rng = random.Random(11)
    data = tmp_path / "data"
    env = dict(worker_env(), PYTHONPATH=os.pathsep.join([HELPERS, worker_env()["PYTHONPATH"]]))
    acked, offsets = {}, set()                       # producer id -> offset; the offsets
    for cycle in range(6):
        out_path = tmp_path / f"ids-{cycle}.txt"
        code, err, exited = start_and_kill([sys.executable, "-c", ID_WORKER, str(data), fsync], env,
                                           out_path, rng, p_after_ready=1.0, after_ready=(0.05, 0.4))
        assert not exited and code == -signal.SIGKILL, (code, err)
        for line in read_lines(out_path)[1:]:
            pid, offset = map(int, line.split())
            assert pid not in acked, f"producer id {pid} handed out twice"
            assert offset not in offsets, f"offset {offset} answered twice"
            acked[pid] = offset
            offsets.add(offset)
    assert len(acked) > 100
    with txmq.Broker(data, fsync=fsync) as b:
        part = b._topic("ids").partitions[0]
        log = {int(m[2]): m[0] for m in part.read(0, 10**9)}
        assert all(log.get(pid) == off for pid, off in acked.items())     # every acked send is there
        assert len(log) == part.end_offset                                 # and no id wrote twice
