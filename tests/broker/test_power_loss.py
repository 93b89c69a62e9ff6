"""Power loss at random instants (txmq.testing.power_loss): the directory
always opens; under fsync="always" / "commit" nothing acknowledged is lost
(every commit() that returned, every resolved commit_async future, G4), and
in every mode a consume-transform-produce transaction is whole or absent
(G1, G6). Also a power loss right after a segment roll and one during the
recovery of an earlier one."""

from __future__ import annotations

import os
import random
import sys

import pytest

import txmq
from txmq.testing.power_loss import PowerLoss
from txmq.transactions import coordinator

INPUTS = 240
PER_TXN = 6
SEGMENT_BYTES = 8192          # small segments: the workload rolls them


def _out_value(v: bytes) -> bytes:
    return b"out-" + v


def _setup(path, fsync):
    with txmq.Broker(path, fsync=fsync, num_coordinators=2, segment_bytes_max=SEGMENT_BYTES,
                     control_socket=False) as b:
        b.create_topic("in", 2)
        b.create_topic("out", 2)
        b.subscribe("in", "s", initial_position="earliest").close()
        p = b.producer("in")
        for i in range(INPUTS):
            p.send(b"in-%04d" % i, key=b"%d" % i)


def _workload(path, fsync, sim, rng, acked):
    """Consume-transform-produce transactions, some pipelined with
    commit_async, some aborted, with plain sends between. ``acked`` gets the
    input values of every commit acknowledged (returned, or future resolved)."""
    b = txmq.Broker(path, fsync=fsync, num_coordinators=2, segment_bytes_max=SEGMENT_BYTES, control_socket=False)
    try:
        c = b.subscribe("in", "s", initial_position="earliest")
        out = b.producer("out")
        plain = b.producer("out")
        futures = []
        while True:
            msgs = c.receive_many(PER_TXN, timeout=0.2)
            if not msgs:
                break
            txn = b.new_transaction()
            for m in msgs:
                out.send(_out_value(m.value), key=m.key, txn=txn)
            c.ack(msgs, txn=txn)
            values = [m.value for m in msgs]
            roll = rng.random()
            if roll < 0.1:
                txn.abort()
            elif roll < 0.45:
                f = txn.commit_async()
                f.add_done_callback(lambda f, values=values: f.exception() is None and acked.extend(values))
                futures.append(f)
            else:
                txn.commit()
                acked.extend(values)
            if rng.random() < 0.2:
                plain.send(b"plain")
        for f in futures:
            f.result()
    finally:
        b.close()


def _check(path, fsync, acked: list):
    """Open what a power loss left, and check the guarantees against
    ``acked`` (commits acknowledged before it)."""
    with txmq.Broker(path, fsync=fsync, num_coordinators=2, segment_bytes_max=SEGMENT_BYTES,
                     control_socket=False) as b:
        outputs = []
        reader = b.subscribe("out", "check", isolation="read_committed", initial_position="earliest")
        while True:
            ms = reader.receive_many(1000, timeout=0.05)
            if not ms:
                break
            outputs += [m.value for m in ms if m.value != b"plain"]
        assert len(outputs) == len(set(outputs)), "an output committed twice"
        c = b.subscribe("in", "s", initial_position="earliest")
        left = set()
        while True:
            ms = c.receive_many(1000, timeout=0.05)
            if not ms:
                break
            left |= {m.value for m in ms}
        inputs = {b"in-%04d" % i for i in range(INPUTS)}
        produced = {v[4:] for v in outputs}
        # G6: an input's output is committed if and only if its ack is.
        assert produced | left == inputs
        assert not produced & left
        if fsync != "never":
            missing = set(acked) - produced
            assert not missing, f"{len(missing)} acknowledged commits lost"


@pytest.mark.parametrize("fsync", ["always", "commit", "never"])
def test_power_loss_at_random_syncs(tmp_path, fsync, monkeypatch):
    monkeypatch.setattr(coordinator, "PREALLOCATE_BYTES", 16 * 1024)
    rng = random.Random(int(os.environ.get("TXMQ_POWER_LOSS_SEED", "0")) * 7 + len(fsync))
    path = tmp_path / "d"
    _setup(path, fsync)
    acked: list = []
    cuts = []
    cut_rng = random.Random(rng.random())
    with PowerLoss(path) as sim:
        def on_sync(n):
            # A power loss right after this sync, at about one sync in ten.
            if cut_rng.random() < 0.1 and len(cuts) < 30:
                cuts.append((sim.materialise(tmp_path / f"cut{n}"), list(acked)))

        sim.on_sync = on_sync
        _workload(path, fsync, sim, rng, acked)
        cuts.append((sim.materialise(tmp_path / "end"), list(acked)))
    if fsync != "never":
        assert len(cuts) > 5
    for where, acked_then in cuts:
        _check(where, fsync, acked_then)


def test_power_loss_right_after_a_segment_roll(tmp_path, monkeypatch):
    """The instant after each roll's directory sync: the new segment's name
    is durable, none of its bytes are."""
    monkeypatch.setattr(coordinator, "PREALLOCATE_BYTES", 16 * 1024)
    from txmq.storage import log as storage_log
    # The smallest segments: a transaction's sends go out as one batch per
    # partition, so the workload writes few bytes.
    monkeypatch.setattr(sys.modules[__name__], "SEGMENT_BYTES", 4096)
    path = tmp_path / "d"
    _setup(path, "commit")
    acked: list = []
    cuts = []
    with PowerLoss(path) as sim:
        real_roll = storage_log.SegmentLog._roll

        def roll(self):
            real_roll(self)
            if self.name.startswith("out/"):
                cuts.append((sim.materialise(tmp_path / f"roll{len(cuts)}"), list(acked)))

        monkeypatch.setattr(storage_log.SegmentLog, "_roll", roll)
        _workload(path, "commit", sim, random.Random(7), acked)
    assert len(cuts) >= 2
    for where, acked_then in cuts:
        _check(where, "commit", acked_then)


def test_power_loss_during_recovery(tmp_path, monkeypatch):
    """Cut once mid-run, then cut again at every sync of the recovery of
    that directory: each of those opens with the first cut's commits."""
    monkeypatch.setattr(coordinator, "PREALLOCATE_BYTES", 16 * 1024)
    path = tmp_path / "d"
    _setup(path, "commit")
    acked: list = []
    first = []
    with PowerLoss(path) as sim:
        sim.on_sync = lambda n: n == 25 and first.append((sim.materialise(tmp_path / "cut"), list(acked)))
        _workload(path, "commit", sim, random.Random(11), acked)
    assert first
    cut, acked_then = first[0]
    again = []
    with PowerLoss(cut) as sim:
        sim.on_sync = lambda n: again.append(sim.materialise(tmp_path / f"again{n}"))
        txmq.Broker(cut, fsync="commit", num_coordinators=2, segment_bytes_max=SEGMENT_BYTES,
                    control_socket=False).close()
    assert again
    for where in again:
        _check(where, "commit", acked_then)
    _check(cut, "commit", acked_then)


def test_a_deleted_topic_created_again_gets_no_old_commit_back(tmp_path, monkeypatch):
    """Decision records name partitions by topic and index: deleting a topic
    makes the coordinators forget the decisions that name it, so a power
    loss after the topic is created again does not write the old commits'
    batches into the new one."""
    monkeypatch.setattr(coordinator, "PREALLOCATE_BYTES", 16 * 1024)
    path = tmp_path / "d"
    txmq.Broker(path, fsync="commit", num_coordinators=1, control_socket=False).close()
    with PowerLoss(path) as sim:
        b = txmq.Broker(path, fsync="commit", num_coordinators=1, control_socket=False)
        b.create_topic("t", 1)
        p = b.producer("t")
        for i in range(3):
            with b.transaction() as txn:
                p.send(b"old-%d" % i, txn=txn)
        b.delete_topic("t")
        b.create_topic("t", 1)
        with b.transaction() as txn:
            b.producer("t").send(b"new", txn=txn)
        cut = sim.materialise(tmp_path / "cut")
        b.close()
    with txmq.Broker(cut, fsync="commit", num_coordinators=1, control_socket=False) as b:
        c = b.subscribe("t", "s", initial_position="earliest")
        assert [m.value for m in c.receive_many(100, timeout=0.2)] == [b"new"]


@pytest.mark.parametrize("how", ["commit", "commit_async"])
def test_a_commit_logs_accumulated_sends_and_ranged_acks_in_its_decision(tmp_path, monkeypatch, how):
    """Sends still accumulating when the transaction commits (``linger_ms``
    long) and acks held as ranges: the commit appends the batch and frames
    the acks before its decision record is built, so the record names the
    batch (with its copy) and the ack ranges. A power loss right after
    ``commit()`` returned (or its future resolved) keeps the whole
    transaction, though neither the segment nor the cursor was synced."""
    monkeypatch.setattr(coordinator, "PREALLOCATE_BYTES", 16 * 1024)
    path = tmp_path / "d"
    with txmq.Broker(path, fsync="commit", control_socket=False) as b:
        b.create_topic("in", 1)
        b.create_topic("out", 1)
        b.subscribe("in", "s", initial_position="earliest").close()
        b.producer("in").send_batch([b"in-%03d" % i for i in range(50)], partition=0)
    with PowerLoss(path) as sim:
        b = txmq.Broker(path, fsync="commit", linger_ms=60_000, batch_bytes=1 << 20, control_socket=False)
        try:
            c = b.subscribe("in", "s", initial_position="earliest")
            peek = b.subscribe("out", "peek", isolation="read_uncommitted", initial_position="earliest")
            out = b.producer("out")
            msgs = c.receive_many(50, 1.0)
            assert len(msgs) == 50
            txn = b.new_transaction()
            for m in msgs[:40]:
                out.send(b"out-" + m.value, partition=0, txn=txn)
                c.ack(m, txn=txn)
            assert peek.receive_many(100, 0.05) == []          # still accumulating
            if how == "commit":
                txn.commit()
            else:
                assert txn.commit_async().result(10) is None
            cut = sim.materialise(tmp_path / "cut")
        finally:
            b.close()
    with txmq.Broker(cut, fsync="commit", control_socket=False) as b:
        r = b.subscribe("out", "check", isolation="read_committed", initial_position="earliest")
        assert [m.value for m in r.receive_many(100, 0.2)] == [b"out-in-%03d" % i for i in range(40)]
        c = b.subscribe("in", "s", initial_position="earliest")
        assert [m.value for m in c.receive_many(100, 0.2)] == [b"in-%03d" % i for i in range(40, 50)]


def test_power_loss_keeps_prepared_transactions(tmp_path, monkeypatch):
    """Prepared consume-transform-produce transactions, some ended at once,
    some left prepared and ended later, cut at random syncs: after every cut,
    each transaction whose prepare() returned is still PREPARED — its
    outputs invisible, its inputs held, though neither its segments nor its
    pending-ack log were synced — or, if its end had begun, has the outcome
    chosen; one whose end returned has that outcome. Ending the prepared
    ones then leaves every input covered once or deliverable (G6)."""
    monkeypatch.setattr(coordinator, "PREALLOCATE_BYTES", 16 * 1024)
    path = tmp_path / "d"
    _setup(path, "commit")
    rng = random.Random(int(os.environ.get("TXMQ_POWER_LOSS_SEED", "0")) * 7 + 5)
    acked = {}                # txn id -> input values, prepare() returned
    ending = {}               # txn id -> commit (True) / abort: the end has begun
    ended = set()             # its end returned
    cuts = []
    cut_rng = random.Random(rng.random())
    with PowerLoss(path) as sim:
        def cut(name, p):
            if cut_rng.random() < p and len(cuts) < 40:
                cuts.append((sim.materialise(tmp_path / name), dict(acked), dict(ending), set(ended)))

        # A power loss right after a sync, or right after prepare() or an end returned.
        sim.on_sync = lambda n: cut(f"sync{n}", 0.1)
        b = txmq.Broker(path, fsync="commit", num_coordinators=2, segment_bytes_max=SEGMENT_BYTES,
                        control_socket=False)
        try:
            c = b.subscribe("in", "s", initial_position="earliest")
            out = b.producer("out")
            left = []
            while msgs := c.receive_many(PER_TXN, timeout=0.2):
                txn = b.new_transaction()
                for m in msgs:
                    out.send(_out_value(m.value), key=m.key, txn=txn)
                c.ack(msgs, txn=txn)
                txn.prepare()
                acked[txn.id] = [m.value for m in msgs]
                cut(f"prepared{len(acked)}", 0.3)
                left.append(txn.id)
                while left and (rng.random() < 0.6 or len(left) > 4):
                    txn_id = left.pop(rng.randrange(len(left)))
                    ending[txn_id] = commit = rng.random() < 0.8
                    (b.commit_prepared if commit else b.abort_prepared)(txn_id)
                    ended.add(txn_id)
                    cut(f"ended{len(ended)}", 0.3)
            cuts.append((sim.materialise(tmp_path / "end"), dict(acked), dict(ending), set(ended)))
        finally:
            b.close()
    assert len(cuts) > 5
    for where, acked_then, ending_then, ended_then in cuts:
        with txmq.Broker(where, fsync="commit", num_coordinators=2, segment_bytes_max=SEGMENT_BYTES,
                         control_socket=False) as b:
            held = set()
            for txn_id, values in acked_then.items():
                outcome = b.prepared_outcome(txn_id)
                if txn_id not in ending_then:
                    assert outcome is txmq.TxnState.PREPARED, (where, txn_id, outcome)
                    held |= set(values)
                    continue
                want = txmq.TxnState.COMMITTED if ending_then[txn_id] else txmq.TxnState.ABORTED
                if txn_id in ended_then:
                    assert outcome is want, (where, txn_id, outcome)
                else:
                    assert outcome in (txmq.TxnState.PREPARED, want), (where, txn_id, outcome)
                if outcome is txmq.TxnState.PREPARED:
                    held |= set(values)
            c = b.subscribe("in", "s", initial_position="earliest")
            again = {m.value for m in c.receive_many(10_000, timeout=0.05)}
            c.close()
            assert not again & held, (where, "inputs of a prepared transaction delivered again")
            for t in b.prepared_transactions():
                b.abort_prepared(t["id"]) if rng.random() < 0.5 else b.commit_prepared(t["id"])
        _check(where, "commit", [v for t, vs in acked_then.items() if t in ended_then and ending_then[t]
                                 for v in vs])


def test_power_loss_after_commits_only_their_decision_records_hold(tmp_path):
    """Under fsync="commit" a small transaction's outputs are durable only as
    the copies its decision record carries, taken as they were appended (a
    batch stored into the mapping, one written with pwritev, the small one
    after it); after retention took a transaction's first segment (no
    subscription holds it), the copies of the batches left. A power loss
    right after each commit keeps every output of it (G4)."""
    opts = dict(fsync="commit", segment_bytes_max=90_000, retention_bytes=1, retention_check_interval=3600.0,
                num_coordinators=1, control_socket=False)
    path = tmp_path / "d"
    with txmq.Broker(path, **opts) as b:
        b.create_topic("out", 1)
    cuts = []
    with PowerLoss(path) as sim:
        b = txmq.Broker(path, **opts)
        try:
            p = b.producer("out")
            first = [b"a" * 100, os.urandom(5_000), b"c"]
            txn = b.new_transaction()
            for v in first:
                p.send_batch([v], partition=0, txn=txn)
            txn.commit()
            cuts.append((sim.materialise(tmp_path / "cut0"), first))
            txn = b.new_transaction()
            for _ in range(2):                                # (with the first's 5 KB: 85 KB, one segment)
                p.send_batch([os.urandom(40_000)], partition=0, txn=txn)
            last = os.urandom(40_000)
            p.send_batch([last], partition=0, txn=txn)        # (the next segment: offset 6)
            assert b.enforce_retention() == 1 and b._topics["out"].partitions[0].start_offset == 6
            txn.commit()
            cuts.append((sim.materialise(tmp_path / "cut1"), [last]))
        finally:
            b.close()
    for where, expected in cuts:
        with txmq.Broker(where, **opts) as again:
            c = again.subscribe("out", "check", isolation="read_committed", initial_position="earliest")
            assert [m.value for m in c.receive_many(100, 0.5)] == expected
