"""Crash tests for transactions (docs/GUARANTEES.md: G1, G2, G4, G6): a real
broker process runs transactions and is SIGKILLed — by itself at an
application step or at a named crash point of the commit protocol
(``TXMQ_CRASH_AT``, py/txmq/crashpoints.py), or by this process at a random
moment; after every kill this process reopens the data directory (which
recovers it) and checks the guarantees from the data alone.

Consume-process-produce (G6): the worker aggregates what the
``agg`` subscriptions of A1 and A2 deliver into B and acknowledges the
inputs, all in one transaction. Killed before the sends, between send and
ack, between ack and commit, and at each crash point of the commit, then run
again until every input is processed. After every restart:

- B, read with a fresh READ_COMMITTED subscription, holds every aggregate of
  a transaction or none (G1), each once, and every input is covered by at
  most one committed aggregate (at the end: exactly one);
- the inputs' acks match the covered inputs exactly: the ``agg``
  subscriptions deliver again precisely the inputs no committed aggregate
  covers (nothing acked is redelivered, nothing unacked is skipped), and
  never an input of an aborted transaction (G2);
- every commit that returned is there (G4); the transaction killed in
  flight is aborted when the kill came before the commit point and
  committed when it came after it;
- no transaction is left open and nothing holds maxReadPosition back;
- after the last run every input is covered exactly once, and a reopen
  reports no backlog (test_backlog_stat_matches_delivery_after_crash
  checks the backlog statistic after every reopen).

Consume-process-produce out of order (G2, G6 under
``allow_out_of_order_delivery``): the ``aggo`` subscriptions are shared and
read past open transactions, while feeder threads of the same process keep
input transactions open a while and then commit or abort them; the worker is
SIGKILLed at random moments (now and then at a crash point). After every
reopen: no input of an aborted or still-open transaction was ever delivered
(live or after), none before its commit began, each committed input is
covered by at most one committed aggregate, the subscriptions deliver again
exactly the committed inputs no aggregate covers (each once), their backlog
counts exactly those, and at the end every committed input is covered once.

Random crash matrix (G1, G2, G4): threads run transactions across the
partitions of two topics and four subscriptions (one of them out of
order), commit, abort, get force-aborted or time out, and the process is
killed at random moments (or at a crash point). The checker then proves from the worker's lines and the
reopened broker: all-or-nothing per transaction for messages and acks,
READ_COMMITTED delivers only committed data (also what the worker received
live), every returned commit and send is there, committed acks are in the
cursors (never redelivered) and acks of aborted transactions are not (those
messages come again). Random seeds are in the failure messages.
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

import txn_crash_worker as W
from killer import drain, read_lines, start_and_kill, worker, worker_env

WORKER = worker("txn_crash_worker.py")
SETTLE_TIMEOUT = 60.0



def view(broker, topic: str, isolation: str) -> dict:
    """Every message of ``topic`` a fresh subscription at ``isolation``
    delivers: {partition: [Message, ...]} in delivery order."""
    c = broker.subscribe(topic, f"audit-{isolation}", "exclusive", isolation=isolation,
                         initial_position="earliest")
    try:
        ms = drain(c)
    finally:
        c.unsubscribe()
    out = {}
    for m in ms:
        out.setdefault(m.partition, []).append(m)
    for p, pms in out.items():
        offs = [m.offset for m in pms]
        assert offs == sorted(set(offs)), f"{topic}/{p} ({isolation}): not in offset order: {offs[:20]}"
    return out


def backlog(broker, topic: str, sub: str, type: str, isolation: str = "read_committed", out_of_order: bool = False):
    """What ``sub`` delivers right after a reopen (everything it has not
    acknowledged), and its backlog in stats() before that."""
    stats = broker.stats()["topics"][topic]["subscriptions"][sub]
    c = broker.subscribe(topic, sub, type, isolation=isolation, initial_position="earliest",
                         allow_out_of_order_delivery=out_of_order)
    try:
        ms = drain(c)
    finally:
        c.close()
    return ms, stats["backlog"]


def check_no_open_transactions(broker, topics) -> None:
    assert broker.transactions() == [], f"transactions still live after recovery: {broker.transactions()}"
    st = broker.stats()
    assert st["transactions"]["open"] == 0
    for t in topics:
        for p in st["topics"][t]["partitions"]:
            assert p["open_transactions"] == 0 and p["blocked_by"] is None, (t, p)
            assert p["max_read_position"] == p["end_offset"], (t, p)


# ======================================================================================
# (2) consume-process-produce
# ======================================================================================

# (txn.recorded: the decision is in the page cache, which SIGKILL keeps)
COMMITTED_AT_CRASH = {"txn.recorded", "txn.decided", "txn.markers_half", "txn.applied"}
STAGES = W.APP_STAGES + W.CRASH_POINTS
FSYNCS = ("commit", "never", "always")


class CppModel:
    def __init__(self):
        self.inputs = {}          # (topic, partition, offset) -> v, the committed inputs
        self.aborted_inputs = set()
        self.outputs = {}         # (run, step, part) -> value dict, committed in B
        self.covered = {}         # input id -> (run, step, part)
        self.rc_seen = {p: [] for p in range(W.OUT_PARTITIONS)}   # B's committed view so far
        self.crashed_steps = 0
        self.stat_problems = []   # stats() that disagree with what is delivered
        self.check_backlog_stat = False


def setup_cpp(data, fsync: str, rng: random.Random) -> CppModel:
    """Topics, the ``agg`` subscriptions, and inputs: plain sends, committed
    transactions, and one aborted transaction interleaved with them whose
    inputs must never be processed."""
    model = CppModel()
    with txmq.Broker(data, fsync=fsync) as b:
        for t in W.IN_TOPICS:
            b.create_topic(t, W.IN_PARTITIONS)
        b.create_topic(W.OUT_TOPIC, W.OUT_PARTITIONS)
        for t in W.IN_TOPICS:
            b.subscribe(t, W.CPP_SUB, "exclusive", initial_position="earliest").close()
        for t in W.IN_TOPICS:
            prod = b.producer(t)
            n = 0

            def send(txn=None, aborted=False):
                nonlocal n
                v = -1 if aborted else rng.randint(0, 1000)
                mid = prod.send(W.input_value(t, n, v), partition=rng.randrange(W.IN_PARTITIONS), txn=txn)
                n += 1
                key = (t, mid.partition, mid.offset)
                if aborted:
                    model.aborted_inputs.add(key)
                return key, v

            pending = {}
            for _ in range(15):
                k, v = send()
                model.inputs[k] = v
            bad = b.new_transaction()
            for _ in range(3):
                send(bad, aborted=True)
            for _ in range(3):
                txn = b.new_transaction()
                for _ in range(9):
                    k, v = send(txn)
                    pending[k] = v
                    if rng.random() < 0.2:
                        k, v = send()
                        model.inputs[k] = v
                    if rng.random() < 0.2:
                        send(bad, aborted=True)
                txn.commit()
                model.inputs.update(pending)
                pending.clear()
            bad.abort()
            for _ in range(10):
                k, v = send()
                model.inputs[k] = v
    return model


def run_cpp_worker(data, fsync, run, seed, stage, nth, tmp_path):
    """Run the worker to its end or its crash; return (returncode, lines)."""
    crash_at = f"{stage}@{nth}" if stage in W.CRASH_POINTS else None
    app_stage = stage if stage in W.APP_STAGES else "none"
    out_path = tmp_path / f"cpp-{run}.txt"
    with open(out_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, WORKER, "cpp", str(data), fsync, str(run), str(seed),
                                 app_stage, str(nth)],
                                stdout=out, stderr=subprocess.PIPE, env=worker_env(crash_at))
    try:
        _, err = proc.communicate(timeout=SETTLE_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, read_lines(out_path), err.decode()


def check_cpp(b, model: CppModel, run: int | None, lines: list, stage: str | None, nth: int, ctx: str) -> None:
    """The guarantees after a reopen; ``stage`` is where the run was killed
    (None: it ran to its end)."""
    check_no_open_transactions(b, W.IN_TOPICS + (W.OUT_TOPIC,))
    # -- what the worker says happened -------------------------------------------
    steps = {}
    for line in lines:
        kind, *rest = line.split()
        if kind in ("READY", "DONE"):
            continue
        steps.setdefault(int(rest[0]), []).append((kind, rest[1:]))
    returned = {s for s, ev in steps.items() if any(k == "K" for k, _ in ev)}
    txn_of = {s: ev[0][1][0] for s, ev in steps.items()}
    in_flight = None
    if run is None:        # a reopen with no run before it: only the invariants
        pass
    elif stage is None:
        assert lines and lines[-1] == "DONE", f"{ctx}: the worker did not finish: {lines[-3:]}"
        assert returned == set(steps), f"{ctx}: steps without a returned commit: {set(steps) - returned}"
    else:
        in_flight = max(steps) if steps else None
        assert in_flight == nth, f"{ctx}: killed at step {in_flight}, armed for step {nth}: {lines[-4:]}"
        assert returned == set(range(1, nth)), f"{ctx}: returned commits {sorted(returned)}"
        want_last = {"before_send": "T", "send_ack": "S", "ack_commit": "A"}.get(stage, "C")
        assert steps[nth][-1][0] == want_last, f"{ctx}: the kill came after {steps[nth][-1]}"
    # -- B, as READ_COMMITTED and READ_UNCOMMITTED readers see it ---------------------
    rc = view(b, W.OUT_TOPIC, "read_committed")
    ru = view(b, W.OUT_TOPIC, "read_uncommitted")
    for p in range(W.OUT_PARTITIONS):
        old, now = model.rc_seen[p], [(m.offset, m.value) for m in rc.get(p, [])]
        assert now[:len(old)] == old, f"{ctx}: B/{p}: committed data that survived a reopen changed"
        model.rc_seen[p] = now
    for p, ms in rc.items():
        for m in ms:
            src = json.loads(m.value)["src"]
            assert p == W.IN_TOPICS.index(src), f"{ctx}: aggregate of {src} on B/{p}"
    committed_steps = cover_aggregates(rc, model, run, ctx, model.inputs, model.aborted_inputs)
    if run is None:
        committed_steps = returned = set()
    assert returned <= committed_steps, f"{ctx}: returned commits lost: {sorted(returned - committed_steps)}"
    if in_flight is not None:
        if stage in COMMITTED_AT_CRASH:
            assert in_flight in committed_steps, \
                f"{ctx}: step {in_flight} ({txn_of[in_flight]}) was past its commit point but is not in B"
        else:
            assert in_flight not in committed_steps, \
                f"{ctx}: step {in_flight} ({txn_of[in_flight]}) was killed before its commit point but is in B"
        extra = committed_steps - returned - {in_flight}
        model.crashed_steps += 1
    else:
        extra = committed_steps - returned
    assert not extra, f"{ctx}: steps {sorted(extra)} are in B but never began their commit"
    # The aborted attempt really wrote its aggregates (READ_UNCOMMITTED sees them).
    if in_flight is not None and stage not in ("before_send",) + tuple(COMMITTED_AT_CRASH):
        written = {(v["run"], v["step"]) for ms in ru.values() for v in map(json.loads, (m.value for m in ms))}
        assert (run, in_flight) in written, f"{ctx}: the aborted step's aggregates are not in the log"
    # -- the inputs' acks match exactly the covered inputs ---------------------------------
    for t in W.IN_TOPICS:
        again, stat_backlog = backlog(b, t, W.CPP_SUB, "exclusive")
        got = {(t, m.partition, m.offset) for m in again}
        assert len(got) == len(again), f"{ctx}: {t}: a message delivered twice"
        if model.check_backlog_stat and stat_backlog != len(again):
            model.stat_problems.append(f"{ctx}: {t}/{W.CPP_SUB}: stats() backlog {stat_backlog} right "
                                       f"after the reopen, but {len(again)} messages are delivered")
        assert not got & model.aborted_inputs, f"{ctx}: {t}: input of an aborted transaction delivered"
        mine = {k for k in model.inputs if k[0] == t}
        acked_twice = got & set(model.covered)
        assert not acked_twice, \
            f"{ctx}: {t}: covered inputs not acknowledged (would be counted again): {sorted(acked_twice)[:8]}"
        lost = mine - set(model.covered) - got
        assert not lost, f"{ctx}: {t}: inputs acknowledged but covered by no output (lost): {sorted(lost)[:8]}"
        for m in again:
            assert json.loads(m.value)["v"] == model.inputs[(t, m.partition, m.offset)]


def cover_aggregates(rc: dict, model, run, ctx: str, inputs: dict, aborted: set) -> set:
    """Check the aggregates read_committed shows in B (``rc``, as
    :func:`view` gives it) and note what they cover in ``model``
    (``outputs``, ``covered``): every aggregate of a step whole (G1) and
    once, the new ones of this run only, each covering committed inputs
    (``inputs``: input -> its value; never one of ``aborted``) that no other
    aggregate covers, with their sum. Returns the steps of ``run`` in B."""
    groups = {}
    for ms in rc.values():
        for m in ms:
            v = json.loads(m.value)
            assert str(m.txn_id) == v["txn"], f"{ctx}: {m.message_id} carries {m.txn_id}, value says {v['txn']}"
            groups.setdefault((v["run"], v["step"]), {}).setdefault(v["part"], []).append(v)
    for (r, s), parts in sorted(groups.items()):
        nparts = next(iter(parts.values()))[0]["nparts"]
        assert sorted(parts) == list(range(nparts)), \
            f"{ctx}: run {r} step {s}: committed parts {sorted(parts)} of {nparts} (all or nothing, G1)"
        for part, vs in parts.items():
            assert len(vs) == 1, f"{ctx}: run {r} step {s} part {part} is in B {len(vs)} times"
            v, key = vs[0], (r, s, part)
            if key in model.outputs:
                assert model.outputs[key] == v
                continue
            assert r == run, f"{ctx}: an aggregate of run {r} appeared after run {run}"
            model.outputs[key] = v
            total = 0
            for pi, off in v["inputs"]:
                inp = (v["src"], pi, off)
                assert inp not in aborted, f"{ctx}: {inp} of an aborted transaction was processed (G2)"
                assert inp in inputs, f"{ctx}: {key} covers {inp}, which is no committed input (G2)"
                assert inp not in model.covered, \
                    f"{ctx}: input {inp} counted twice: by {model.covered[inp]} and by {key} (G6)"
                model.covered[inp] = key
                total += inputs[inp]
            assert v["sum"] == total, f"{ctx}: {key}: sum {v['sum']} != {total}"
    return {s for (r, s) in groups if r == run}


def cpp_cycles(tmp_path, stage: str, fsync: str, crash_runs: int, seed: int,
               check_backlog_stat: bool = False) -> CppModel:
    rng = random.Random(seed)
    data = tmp_path / "data"
    model = setup_cpp(data, fsync, rng)
    model.check_backlog_stat = check_backlog_stat
    for run in range(crash_runs + 1):
        crash = run < crash_runs
        nth = rng.randint(1, 2)
        ctx = f"[stage={stage} fsync={fsync} seed={seed} run={run}]"
        rc, lines, err = run_cpp_worker(data, fsync, run, rng.randrange(1 << 30),
                                        stage if crash else "none", nth, tmp_path)
        if crash:
            assert rc == -signal.SIGKILL, f"{ctx}: worker exited with {rc}, not at {stage}: {err}"
        else:
            assert rc == 0, f"{ctx}: worker exited with {rc}: {err}"
        with txmq.Broker(data, fsync=fsync) as b:
            check_cpp(b, model, run, lines, stage if crash else None, nth, ctx)
    # Everything processed exactly once, and a second open finds it as it was.
    assert set(model.covered) == set(model.inputs), \
        f"inputs never processed: {sorted(set(model.inputs) - set(model.covered))[:8]}"
    assert model.crashed_steps == crash_runs
    ctx = f"[stage={stage} fsync={fsync} seed={seed} reopen]"
    with txmq.Broker(data, fsync=fsync) as b:
        # Before anything reads: nothing is left to deliver, so no backlog.
        left = {t: b.stats()["topics"][t]["subscriptions"][W.CPP_SUB]["backlog"] for t in W.IN_TOPICS}
        check_cpp(b, model, None, [], None, 0, ctx)
    if any(left.values()):
        model.stat_problems.insert(0, f"{ctx}: every input is processed and acknowledged, yet stats() "
                                      f"reports a backlog {left}")
    return model


def assert_no_backlog(*models: CppModel) -> None:
    """Checked after everything else (the statistic must not hide what the
    other checks find)."""
    problems = [p for m in models for p in m.stat_problems]
    assert not problems, "; ".join(problems[:6])


@pytest.mark.parametrize("fsync", ["commit", "never"])
@pytest.mark.parametrize("stage", STAGES)
def test_consume_process_produce_crash(tmp_path, stage, fsync):
    seed = 4000 + STAGES.index(stage) * 10 + FSYNCS.index(fsync)
    model = cpp_cycles(tmp_path, stage, fsync, crash_runs=3, seed=seed)
    assert_no_backlog(model)


@pytest.mark.parametrize("stage", ["ack_commit", "txn.markers_half"])
def test_backlog_stat_matches_delivery_after_crash(tmp_path, stage):
    """The backlog in stats(), right after a reopen, counts exactly the
    messages the subscription then delivers (as tests/storage/test_crash.py checks
    without transactions): transaction markers and aborted messages are
    never delivered, so they are no backlog."""
    model = cpp_cycles(tmp_path, stage, "commit", crash_runs=1, seed=4900 + len(stage), check_backlog_stat=True)
    assert_no_backlog(model)


@pytest.mark.slow
@pytest.mark.parametrize("fsync", FSYNCS)
@pytest.mark.parametrize("stage", STAGES)
def test_consume_process_produce_crash_many(tmp_path, stage, fsync):
    models = [cpp_cycles(tmp_path / str(i), stage, fsync, crash_runs=4,
                         seed=4500 + STAGES.index(stage) * 100 + FSYNCS.index(fsync) * 10 + i) for i in range(5)]
    assert_no_backlog(*models)


# ======================================================================================
# (2b) consume-process-produce out of order, killed at random
# ======================================================================================

class CppoModel:
    def __init__(self):
        self.outputs = {}         # (run, step, part) -> value dict, committed in B
        self.covered = {}         # input (topic, partition, offset) -> (run, step, part)
        self.aborted = set()      # inputs of feeder transactions known aborted
        self.counts = {"kills": 0, "crash_points": 0, "past_open": 0, "received": 0, "redelivered": 0}


def parse_cppo(lines: list, ctx: str) -> dict:
    """What the worker's lines say: feeder transactions (items, and IC / IK
    / IA seen), plain inputs, live receipts, steps (T, C, K)."""
    feeds, plain, received, steps, past = {}, set(), set(), {}, set()
    for line in lines:
        kind, *f = line.split()
        if kind in ("READY", "DONE"):
            continue
        if kind == "IS":
            feeds[f[0]] = {"items": {tuple((x.split(":")[0], *map(int, x.split(":")[1:]))) for x in f[2:]},
                           "events": set()}
        elif kind in ("IC", "IK", "IA"):
            feeds[f[0]]["events"].add(kind)
        elif kind == "IN":
            t, p, off = f[0].split(":")
            plain.add((t, int(p), int(off)))
        elif kind == "R":
            received.update((f[0], *map(int, x.split(":"))) for x in f[1:])
        elif kind == "G2":
            raise AssertionError(f"{ctx}: {f[0]} {f[1]} of feeder transaction {f[2]} was delivered (out of order) "
                                 f"before its commit began (G2)")
        elif kind == "P":
            past.add((f[0], *map(int, f[1].split(":"))))
        elif kind in ("T", "S", "A", "C", "K"):
            steps.setdefault(int(f[0]), set()).add(kind)
        else:
            raise AssertionError(f"{ctx}: unknown worker line {line!r}")
    return {"feeds": feeds, "plain": plain, "received": received, "steps": steps, "past": past}


def check_cppo(b, model: CppoModel, run: int, lines: list, ctx: str, final: bool) -> None:
    check_no_open_transactions(b, W.IN_TOPICS + (W.OUT_TOPIC,))
    said = parse_cppo(lines, ctx)
    # -- the inputs, as read_committed shows them after recovery -----------------------
    inputs = {}
    for t in W.IN_TOPICS:
        for p, ms in view(b, t, "read_committed").items():
            for m in ms:
                inputs[(t, p, m.offset)] = json.loads(m.value)
    for key, fd in said["feeds"].items():
        shown = fd["items"] & set(inputs)
        if "IK" in fd["events"]:
            assert shown == fd["items"], f"{ctx}: feeder {key} committed, but {sorted(fd['items'] - shown)} lost (G4)"
        elif "IA" in fd["events"] or "IC" not in fd["events"]:
            assert not shown, f"{ctx}: feeder {key} aborted or open at the kill, yet {sorted(shown)} are committed"
            model.aborted |= fd["items"]
        else:                                       # killed in its commit: all or nothing
            assert shown in (set(), fd["items"]), f"{ctx}: feeder {key}: {len(shown)} of {len(fd['items'])} (G1)"
            if not shown:
                model.aborted |= fd["items"]
    for loc in said["plain"]:
        assert loc in inputs, f"{ctx}: plain input {loc} lost"
    stray = said["received"] - set(inputs)
    assert not stray, f"{ctx}: delivered out of order, yet not committed: {sorted(stray)[:5]} (G2)"
    model.counts["received"] += len(said["received"])
    model.counts["past_open"] += len(said["past"])
    # -- the aggregates in B ----------------------------------------------------------------
    committed_steps = cover_aggregates(view(b, W.OUT_TOPIC, "read_committed"), model, run, ctx,
                                       {k: v["v"] for k, v in inputs.items()}, model.aborted)
    returned = {step for step, ev in said["steps"].items() if "K" in ev}
    began = {step for step, ev in said["steps"].items() if "C" in ev}
    assert returned <= committed_steps <= began, \
        f"{ctx}: returned commits {sorted(returned - committed_steps)} lost, or {sorted(committed_steps - began)} " \
        f"committed without a commit call"
    # -- the acks: exactly the uncovered committed inputs come again, once each ---------------
    for t in W.IN_TOPICS:
        again, stat = backlog(b, t, W.OOO_SUB, "shared", out_of_order=True)
        got = {(t, m.partition, m.offset) for m in again}
        assert len(got) == len(again), f"{ctx}: {t}: an input delivered twice after the reopen"
        assert not got & model.aborted, f"{ctx}: {t}: input of an aborted transaction delivered"
        want = {k for k in inputs if k[0] == t} - set(model.covered)
        assert got == want, (f"{ctx}: {t}: delivered again {sorted(got - want)[:5]} (acked or not an input), "
                             f"missing {sorted(want - got)[:5]} (acknowledged, but covered by no aggregate)")
        assert stat == len(again), f"{ctx}: {t}: stats() backlog {stat}, but {len(again)} messages came again"
        model.counts["redelivered"] += len(again)
    if final:
        assert set(model.covered) == set(inputs), f"inputs never processed: {sorted(set(inputs) - set(model.covered))[:8]}"


def cppo_cycles(tmp_path, fsync: str, crash_runs: int, seed: int) -> CppoModel:
    rng = random.Random(seed)
    data = tmp_path / "data"
    with txmq.Broker(data, fsync=fsync) as b:
        for t in W.IN_TOPICS:
            b.create_topic(t, W.IN_PARTITIONS)
            b.subscribe(t, W.OOO_SUB, "shared", initial_position="earliest", allow_out_of_order_delivery=True).close()
        b.create_topic(W.OUT_TOPIC, W.OUT_PARTITIONS)
    model = CppoModel()
    for run in range(crash_runs + 1):
        crash = run < crash_runs
        out_path = tmp_path / f"cppo-{run}.txt"
        argv = [sys.executable, WORKER, "cppo", str(data), fsync, str(run), str(rng.randrange(1 << 30))]
        crash_at = None
        if crash and rng.random() < 0.3:
            crash_at = f"{rng.choice(W.CRASH_POINTS)}@{rng.randint(1, 8)}"
            model.counts["crash_points"] += 1
        ctx = f"[cppo fsync={fsync} seed={seed} run={run} crash_at={crash_at}]"
        if crash:
            code, err, exited = start_and_kill(argv, worker_env(crash_at), out_path, rng, p_after_ready=0.9,
                                               after_ready=(0.1, 1.5))
            assert code == -signal.SIGKILL or (exited and code == 0), f"{ctx}: worker exited with {code}: {err}"
            model.counts["kills"] += code == -signal.SIGKILL
        else:
            proc = subprocess.run(argv, stdout=open(out_path, "wb"), stderr=subprocess.PIPE, env=worker_env(),
                                  timeout=SETTLE_TIMEOUT)
            assert proc.returncode == 0, f"{ctx}: worker exited with {proc.returncode}: {proc.stderr.decode()}"
        lines = read_lines(out_path)
        if not crash:
            assert lines[-1] == "DONE", f"{ctx}: the worker did not finish: {lines[-3:]}"
        with txmq.Broker(data, fsync=fsync) as b:
            check_cppo(b, model, run, lines, ctx, final=not crash)
    print("cppo:", model.counts)
    # The run exercised what it claims to: kills, and deliveries past open transactions.
    assert model.counts["kills"] >= 1 and model.counts["received"] > 0 and model.counts["past_open"] > 0, model.counts
    return model


@pytest.mark.parametrize("fsync", ["commit", "never"])
def test_consume_process_produce_out_of_order_crash(tmp_path, fsync):
    cppo_cycles(tmp_path, fsync, crash_runs=4, seed=5100 + FSYNCS.index(fsync))


@pytest.mark.slow
@pytest.mark.parametrize("fsync", FSYNCS)
def test_consume_process_produce_out_of_order_crash_many(tmp_path, fsync):
    for i in range(5):
        cppo_cycles(tmp_path / str(i), fsync, crash_runs=8, seed=5200 + FSYNCS.index(fsync) * 10 + i)


# ======================================================================================
# (7) random crash matrix
# ======================================================================================

class Txn:
    """One transaction of the matrix, as its worker's lines tell it."""

    __slots__ = ("key", "id", "kind", "sends", "acks", "cums", "events", "fate")

    def __init__(self, key: str, txn_id: str, kind: str):
        self.key = key
        self.id = txn_id
        self.kind = kind
        self.sends = {}                      # (topic, p, off) -> value
        self.acks = {s: set() for s in W.M_SUBS}      # sub -> {(p, off)} individually
        self.cums = {s: {} for s in W.M_SUBS}         # sub -> {p: highest cumulative offset}
        self.events = set()                  # the worker's event lines: C K F AB D W TO E FA? FA FAX
        self.fate = None                     # True committed, False aborted, None unknown

    def must(self):
        """What the lines alone decide: True (commit returned), False (it
        never reached commit, or was aborted or timed out), None (killed
        between "about to commit" and the return: either, all or nothing)."""
        if "K" in self.events:
            return True
        if "C" in self.events and "F" not in self.events:
            return None
        return False


class MatrixModel:
    def __init__(self):
        self.txns: dict[str, Txn] = {}
        self.ids: dict[str, str] = {}          # txn id -> key: ids never repeat
        self.plain = {}                        # (topic, p, off) -> value of returned plain sends
        self.acked = {s: {} for s in W.M_SUBS}  # sub -> {(p, off): key of the committed txn}
        self.cums = {s: {} for s in W.M_SUBS}   # sub -> {p: (offset, key)} committed cumulative acks
        self.views = {}                        # (topic, isolation) -> {p: [(off, value)]} at the last check
        self.worker_errors = []                # a worker call raised: checked after every cycle ran
        self.counts = dict.fromkeys(["committed", "aborted", "timed_out", "forced", "undetermined",
                                     "in_doubt_committed", "acks_committed", "acks_redelivered",
                                     "received_live", "checks", "kills_working", "crash_points", "reaped",
                                     "crash_points_fired"], 0)


def parse_matrix_lines(model: MatrixModel, lines: list, ctx: str) -> tuple:
    """Fold a worker's lines into ``model``; return (the new transactions,
    live receipts [(sub, p, off, value)])."""
    new = {}
    received = []
    reaped = []
    for line in lines:
        kind, _, rest = line.partition(" ")
        f = rest.split()
        if kind == "READY":
            continue
        if kind == "B":
            key, txn_id, tkind = f
            assert txn_id not in model.ids, \
                f"{ctx}: txn id {txn_id} of {key} was already used by {model.ids[txn_id]}"
            model.ids[txn_id] = key
            new[key] = model.txns[key] = Txn(key, txn_id, tkind)
        elif kind == "S":
            t = model.txns[f[0]]
            for item in f[2:]:
                loc, _, value = item.partition("=")
                p, off = map(int, loc.split(":"))
                t.sends[(f[1], p, off)] = value
        elif kind == "N":
            for item in f[1:]:
                loc, _, value = item.partition("=")
                p, off = map(int, loc.split(":"))
                model.plain[(f[0], p, off)] = value
        elif kind == "R":
            for item in f[1:]:
                loc, _, value = item.partition("=")
                p, off = map(int, loc.split(":"))
                received.append((f[0], p, off, value))
        elif kind == "A":
            t = model.txns[f[0]]
            for item in f[2:]:
                t.acks[f[1]].add(tuple(map(int, item.split(":"))))
        elif kind == "AC":
            t = model.txns[f[0]]
            p, off = map(int, f[2].split(":"))
            t.cums[f[1]][p] = max(off, t.cums[f[1]].get(p, -1))
        elif kind == "X":
            pass
        elif kind == "G2":
            raise AssertionError(f"{ctx}: {f[0]} (read_committed) delivered {f[1]} while its transaction "
                                 f"had not begun to commit (G2)")
        elif kind in ("C", "K", "F", "AB", "D", "W", "TO", "E"):
            model.txns[f[0]].events.add(kind)
            if kind == "TO" and f[1] == "InvalidTxnStateError":
                model.txns[f[0]].events.add("TO-reaped")
        elif kind in ("FA?", "FA", "FAX"):
            reaped.append((kind, f[0]))    # may come before the owner's B line
        else:
            raise AssertionError(f"{ctx}: unknown worker line {line!r}")
    for kind, txn_id in reaped:
        if txn_id in model.ids:       # else killed before its owner printed it began
            model.txns[model.ids[txn_id]].events.add(kind)
    return new, received


def check_matrix(b, model: MatrixModel, lines: list, ctx: str) -> None:
    check_no_open_transactions(b, tuple(W.M_TOPICS))
    new, received = parse_matrix_lines(model, lines, ctx)
    # -- the logs, as both isolation levels read them --------------------------------------
    views = {}
    for topic in W.M_TOPICS:
        for iso in ("read_committed", "read_uncommitted"):
            v = view(b, topic, iso)
            now = {p: [(m.offset, m.value.decode(), str(m.txn_id) if m.txn_id else None)
                       for m in v.get(p, [])] for p in range(W.M_TOPICS[topic])}
            old = model.views.get((topic, iso), {})
            for p, items in now.items():
                before = old.get(p, [])
                assert items[:len(before)] == before, \
                    f"{ctx}: {topic}/{p} ({iso}): data that survived a reopen changed"
            model.views[(topic, iso)] = now
            views[(topic, iso)] = {(topic, p, off): (value, tid) for p, items in now.items()
                                   for off, value, tid in items}
    rc = {k: v for topic in W.M_TOPICS for k, v in views[(topic, "read_committed")].items()}
    ru = {k: v for topic in W.M_TOPICS for k, v in views[(topic, "read_uncommitted")].items()}
    extra = set(rc) - set(ru)
    assert not extra, f"{ctx}: READ_COMMITTED delivers what READ_UNCOMMITTED does not: {sorted(extra)[:5]}"
    visible = {}                                   # txn key -> {(topic, p, off): value} under READ_COMMITTED
    for loc, (value, tid) in rc.items():
        f = W.parse_value(value.encode())
        if f["kind"] == "N":
            assert tid is None, f"{ctx}: plain message {loc} carries txn {tid}"
            continue
        t = model.txns.get(f["key"])
        assert t is not None, f"{ctx}: READ_COMMITTED shows {loc}={value} of a transaction that never began"
        assert tid == t.id == f["txn"], f"{ctx}: {loc}={value} carries txn {tid}, began as {t.id}"
        visible.setdefault(f["key"], {})[loc] = value
    for loc, (value, tid) in ru.items():
        W.parse_value(value.encode())              # whole and well-formed
    # -- G4: every returned send is in the log; returned plain sends are visible --------------
    for loc, value in model.plain.items():
        assert rc.get(loc, (None,))[0] == value, f"{ctx}: returned plain send {loc}={value} lost"
    # -- fates of the new transactions, then all-or-nothing for each --------------------------
    observed = {}
    universes = {}
    for sub, (topic, stype, iso) in W.M_SUBS.items():
        again, _ = backlog(b, topic, sub, stype, iso, sub in W.M_OUT_OF_ORDER)
        universe = {(p, off) for (t_, p, off) in (rc if iso == "read_committed" else ru) if t_ == topic}
        universes[sub] = universe
        got = [(m.partition, m.offset) for m in again]
        assert len(set(got)) == len(got), f"{ctx}: {sub}: a message delivered twice after the reopen"
        stray = set(got) - universe
        assert not stray, f"{ctx}: {sub} ({iso}) delivers {sorted(stray)[:5]}, which its isolation hides"
        observed[sub] = universe - set(got)       # acknowledged
        model.counts["acks_redelivered"] += len(got)
    for key, t in new.items():
        for loc, value in t.sends.items():
            assert ru.get(loc, (None,))[0] == value, f"{ctx}: {key}: returned send {loc}={value} is not in the log"
        t.fate = t.must()
        if t.kind in ("abort", "forced", "timeout"):
            assert t.fate is False, f"{ctx}: {key} ({t.kind}) reached commit: {t.events}"
        if "FA" in t.events:
            assert t.fate is not True, f"{ctx}: {key} {t.id}: both its commit and a force-abort returned"
            t.fate = False
        if ("F" in t.events or "E" in t.events) and t.kind != "timeout" or "TO-reaped" in t.events:
            assert "FA?" in t.events, \
                f"{ctx}: {key} {t.id} ({t.kind}) failed ({t.events}) though nothing aborted it"
        if t.fate:
            count_acks(model, t, ctx)
    # Killed between "about to commit" and its return: the data tells, or
    # else the acks (after every decided transaction's acks are counted).
    undetermined = [t for t in new.values() if t.fate is None]
    for t in sorted(undetermined, key=lambda t: not t.sends):
        model.counts["undetermined"] += 1
        if t.sends:
            t.fate = t.key in visible
        else:
            t.fate = undetermined_fate_by_acks(model, t, observed, universes)
        model.counts["in_doubt_committed"] += bool(t.fate)
        if t.fate:
            count_acks(model, t, ctx)
    for key, t in new.items():
        shown = visible.get(key, {})
        if t.fate:
            assert shown == t.sends, (
                f"{ctx}: {key} {t.id} committed ({t.events}) but READ_COMMITTED shows "
                f"{len(shown)} of its {len(t.sends)} messages: missing {sorted(set(t.sends) - set(shown))[:5]}, "
                f"extra {sorted(set(shown) - set(t.sends))[:5]} (G1/G4)")
            model.counts["committed"] += 1
        else:
            how = "was aborted" if t.fate is False else "is undetermined"
            assert not shown, (f"{ctx}: READ_COMMITTED shows {sorted(shown)[:5]} of {key} {t.id}, which "
                               f"{how} ({t.kind}, {t.events}) (G2)")
            model.counts["aborted"] += t.fate is False
            model.counts["timed_out"] += "TO" in t.events and "TO-reaped" not in t.events
            model.counts["forced"] += t.kind == "forced"
            model.counts["reaped"] += "FA" in t.events
    for key in visible:
        t = model.txns[key]
        assert t.fate, f"{ctx}: READ_COMMITTED shows data of {key} {t.id} ({t.kind}, {t.events}), not committed"
    # -- live receipts under READ_COMMITTED were committed data -------------------------------
    for sub, p, off, value in received:
        topic, _, iso = W.M_SUBS[sub]
        seen = (rc if iso == "read_committed" else ru).get((topic, p, off), (None,))[0]
        assert seen == value, (f"{ctx}: {sub} ({iso}) delivered {topic}/{p}@{off}={value} while the worker ran, "
                               f"but after recovery {iso} shows {seen} there (G2)")
        model.counts["received_live"] += 1
    # -- acks: committed ones are in the cursor, aborted ones are not ---------------------------
    for sub in W.M_SUBS:
        expected = {po for po in universes[sub] if po in model.acked[sub]
                    or po[1] <= model.cums[sub].get(po[0], (-1, None))[0]}
        lost = expected - observed[sub]
        assert not lost, "\n".join([f"{ctx}: {sub}: committed acks lost (delivered again after the reopen):"] + [
            f"  {po} acked by {ack_owner(model, sub, po)}" for po in sorted(lost)[:8]])
        applied = observed[sub] - expected
        assert not applied, "\n".join([f"{ctx}: {sub}: acknowledged, but no committed transaction acked them:"] + [
            f"  {po} acked by " + ", ".join(f"{k} {t.id} ({t.kind}, {sorted(t.events)}, fate {t.fate})"
                                           for k, t in model.txns.items() if po in t.acks[sub])
            for po in sorted(applied)[:8]])
    model.counts["checks"] += 1


def ack_owner(model: MatrixModel, sub: str, po) -> str:
    if po in model.acked[sub]:
        key = model.acked[sub][po]
    else:
        key = model.cums[sub][po[0]][1]
    t = model.txns[key]
    return f"{key} {t.id} ({t.kind}, {sorted(t.events)})"


def committed_ack(model: MatrixModel, sub: str, po) -> bool:
    return po in model.acked[sub] or po[1] <= model.cums[sub].get(po[0], (-1, None))[0]


def count_acks(model: MatrixModel, t: Txn, ctx: str) -> None:
    """Add the acks of committed ``t`` to what the cursors must hold. Two
    committed transactions never both acknowledge one message individually:
    whichever came second had to meet a conflict."""
    for sub in W.M_SUBS:
        for po in t.acks[sub]:
            other = model.acked[sub].setdefault(po, t.key)
            assert other == t.key, (f"{ctx}: {sub} {po} acknowledged by two committed transactions, "
                                    f"{other} {model.txns[other].id} and {t.key} {t.id} (processed twice)")
        for p, off in t.cums[sub].items():
            if off > model.cums[sub].get(p, (-1, None))[0]:
                model.cums[sub][p] = (off, t.key)
        model.counts["acks_committed"] += len(t.acks[sub]) + len(t.cums[sub])


def undetermined_fate_by_acks(model: MatrixModel, t: Txn, observed: dict, universes: dict):
    """A transaction killed during its commit with no messages: its acks
    tell. No committed transaction acked what it acked individually (that
    would have been a conflict while it was pending, and before it the
    message was not acknowledged), so those are acknowledged iff it
    committed; a cumulative ack is, if everything up to it is. None when
    nothing tells (the cursors are then the same either way)."""
    for sub in W.M_SUBS:
        own = [po for po in t.acks[sub] if not committed_ack(model, sub, po)]
        if own:
            return own[0] in observed[sub]
    for sub in W.M_SUBS:
        for p, off in t.cums[sub].items():
            below = {po for po in universes[sub] if po[0] == p and po[1] <= off}
            return below <= observed[sub]
    return None


def run_matrix_worker(data, fsync, cycle, seed, threads, tmp_path, rng, crash_at, small):
    """Start the worker and SIGKILL it at a random moment (or let a crash
    point kill it); return (lines, killed after READY, killed itself,
    None or what went wrong if it exited otherwise)."""
    out_path = tmp_path / f"matrix-{cycle}.txt"
    code, err, self_killed = start_and_kill(
        [sys.executable, WORKER, "matrix", str(data), fsync, str(cycle), str(seed), str(threads),
         "small" if small else "default"],
        worker_env(crash_at), out_path, rng, p_after_ready=0.85, after_ready=(0.05, 0.4))
    lines = read_lines(out_path)
    error = None
    if code != -signal.SIGKILL:
        # A call raised what it must not (the worker printed the traceback
        # and exited): the broker must still recover from this exit.
        error = f"worker exited with {code}: {err.strip()[-1500:]}"
    return lines, "READY" in lines, self_killed, error


def matrix_cycles(tmp_path, cycles: int, seed: int, fsyncs=("commit", "never"), threads: int = 4) -> MatrixModel:
    rng = random.Random(seed)
    data = tmp_path / "data"
    with txmq.Broker(data, segment_bytes_max=W.M_SEGMENT_BYTES) as b:
        for topic, n in W.M_TOPICS.items():
            b.create_topic(topic, n)
        for sub, (topic, stype, iso) in W.M_SUBS.items():
            b.subscribe(topic, sub, stype, isolation=iso, initial_position="earliest",
                        allow_out_of_order_delivery=sub in W.M_OUT_OF_ORDER).close()
    model = MatrixModel()
    pending_lines = []
    for cycle in range(cycles):
        fsync = rng.choice(fsyncs)
        crash_at = None
        if rng.random() < 0.3:
            crash_at = f"{rng.choice(W.CRASH_POINTS)}@{rng.randint(1, 12)}"
            model.counts["crash_points"] += 1
        small = rng.random() < 0.5
        ctx = f"[matrix seed={seed} cycle={cycle} fsync={fsync} crash_at={crash_at} small={small}]"
        lines, working, self_killed, error = run_matrix_worker(data, fsync, cycle, rng.randrange(1 << 30),
                                                               threads, tmp_path, rng, crash_at, small)
        if error:
            model.worker_errors.append(f"{ctx}: {error}")
        model.counts["kills_working"] += working
        model.counts["crash_points_fired"] += self_killed and not error
        pending_lines += lines
        # Now and then the next worker recovers what this one left (and may
        # itself be killed while it does) before this process looks.
        if cycle < cycles - 1 and rng.random() < 0.2:
            continue
        with txmq.Broker(data, fsync=fsync, segment_bytes_max=W.M_SEGMENT_BYTES) as b:
            check_matrix(b, model, pending_lines, ctx)
        pending_lines = []
    c = model.counts
    print("matrix:", c)
    assert not model.worker_errors, \
        f"{len(model.worker_errors)} of {cycles} workers failed; the first:\n{model.worker_errors[0]}"
    # The run exercised what it claims to.
    assert c["kills_working"] >= cycles // 2
    assert c["committed"] >= cycles and c["aborted"] >= cycles // 2, c
    assert c["timed_out"] >= 3 and c["forced"] >= 3 and c["reaped"] >= 3 and c["crash_points_fired"] >= 3, c
    assert c["acks_committed"] > 0 and c["acks_redelivered"] > 0 and c["received_live"] > 0, c
    return model


def test_random_crash_matrix(tmp_path):
    matrix_cycles(tmp_path, cycles=50, seed=7001)


@pytest.mark.slow
@pytest.mark.timeout(1500)     # (about 9 minutes a seed on 2 cores: past the suite's 300 s)
@pytest.mark.parametrize("seed", [7100, 7200, 7300])
def test_random_crash_matrix_many(tmp_path, seed):
    matrix_cycles(tmp_path, cycles=300, seed=seed, fsyncs=("commit", "never", "always"))
