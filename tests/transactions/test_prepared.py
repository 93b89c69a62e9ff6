"""Prepared transactions (docs/API.md, "Prepared transactions"): a
transaction made durable in the PREPARED state holds its outputs and acks
as an open one does, survives closing, killing and reopening, is aborted by
no timeout (only by ``prepared_timeout``, off by default), and ends only by
a commit or an abort of it, from any later owner of the directory.

The crash tests (a subprocess SIGKILLed at each step of prepare and of
commit_prepared, and at random) are in test_prepared_crash.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

import txmq
from txmq import TxnState
from txmq.errors import (BrokerClosedError, InvalidArgumentError, InvalidTxnStateError, TransactionConflictError,
                         TransactionNotFoundError)


def drain(consumer, timeout=0.2):
    out = []
    while got := consumer.receive_many(10_000, timeout):
        out += got
    return out


def values(messages):
    return sorted(m.value for m in messages)


def _ctp(b, n_in=3, take=2, timeout=60.0):
    """Topic ``in`` with ``n_in`` messages received by shared subscription
    ``s``; a transaction that sends the upper-cased values of the first
    ``take`` to ``out`` (two partitions) and acks them."""
    b.create_topic("in")
    b.create_topic("out", partitions=2)
    b.producer("in").send_batch([b"m%d" % i for i in range(n_in)])
    c = b.subscribe("in", "s", type="shared", initial_position="earliest")
    got = c.receive_many(n_in, timeout=1.0)
    assert len(got) == n_in
    out = b.producer("out")
    txn = b.new_transaction(timeout=timeout)
    for i, m in enumerate(got[:take]):
        out.send(m.value.upper(), partition=i % 2, txn=txn)
        c.ack(m, txn=txn)
    return c, got, txn


def test_a_prepared_transaction_holds_its_outputs_and_acks(tmp_path):
    with txmq.Broker(tmp_path / "d") as b:
        c, got, txn = _ctp(b)
        rc = b.subscribe("out", "rc", initial_position="earliest")
        ru = b.subscribe("out", "ru", isolation="read_uncommitted", initial_position="earliest")
        txn.prepare(xid="order-7")
        assert txn.state is TxnState.PREPARED
        assert drain(rc) == []                               # read_committed waits behind it
        assert values(drain(ru)) == [b"M0", b"M1"]           # read_uncommitted sees it, as an open one
        c.close()
        c = b.subscribe("in", "s", type="shared")
        assert [m.value for m in drain(c)] == [b"m2"]        # its acks hold: not delivered again
        with pytest.raises(TransactionConflictError):
            c.ack(got[0])                                    # nor acknowledged by another
        [info] = b.prepared_transactions()
        assert info["id"] == str(txn.id) and info["state"] == "PREPARED" and info["xid"] == "order-7"
        assert info["partitions"] == ["out/0", "out/1"] and info["subscriptions"] == ["in/s"]
        assert info["holds_back"] == ["out/0", "out/1"]
        assert 0 <= info["age_s"] < 60
        assert b.stats()["transactions"]["prepared"] == 1
        assert b.prepared_outcome(txn.id) is TxnState.PREPARED
        txn.commit()
        assert txn.state is TxnState.COMMITTED
        assert values(drain(rc)) == [b"M0", b"M1"]
        assert b.prepared_transactions() == []
        assert b.prepared_outcome(txn.id) is TxnState.COMMITTED
        assert b.stats()["transactions"]["prepared"] == 0


def test_an_aborted_prepared_transaction_drops_its_outputs_and_redelivers(tmp_path):
    with txmq.Broker(tmp_path / "d") as b:
        c, got, txn = _ctp(b)
        txn.prepare()
        txn.abort()
        assert txn.state is TxnState.ABORTED
        rc = b.subscribe("out", "rc", initial_position="earliest")
        assert drain(rc) == []
        again = drain(c)
        assert values(again) == [b"m0", b"m1"] and all(m.redelivery_count == 1 for m in again)
        assert b.prepared_outcome(txn.id) is TxnState.ABORTED


def test_no_transaction_timeout_aborts_a_prepared_transaction(tmp_path):
    with txmq.Broker(tmp_path / "d") as b:
        c, got, txn = _ctp(b, timeout=0.2)
        txn.prepare()
        time.sleep(0.6)                 # past its timeout; the broker checks every 0.05 s
        assert txn.state is TxnState.PREPARED
        txn.commit()
        assert txn.state is TxnState.COMMITTED


def test_prepared_timeout_aborts_a_prepared_transaction(tmp_path):
    with txmq.Broker(tmp_path / "d", prepared_timeout=0.2) as b:
        c, got, txn = _ctp(b)
        txn.prepare()
        deadline = time.monotonic() + 10
        while txn.state is not TxnState.ABORTED:
            assert time.monotonic() < deadline, "prepared_timeout never aborted it"
            time.sleep(0.01)
        assert b.prepared_outcome(txn.id) is TxnState.ABORTED
        with pytest.raises(InvalidTxnStateError):
            b.commit_prepared(txn.id)
        assert values(drain(c)) == [b"m0", b"m1"]


def test_prepared_timeout_aborts_one_restored_on_a_coordinator_past_num_coordinators(tmp_path):
    """A directory last opened with more coordinators keeps the extra ones
    for their restored prepared transactions: their prepared timeout runs
    there too, as on any coordinator."""
    path = tmp_path / "d"
    with txmq.Broker(path, num_coordinators=4) as b:
        c, got, txn = _ctp(b, take=1)
        txn.abort()
        done = []

        def prepare_one():             # (each thread's transactions: the next coordinator)
            t = b.new_transaction()
            if t.id.coordinator == 3:
                b.producer("out").send(got[0].value.upper(), partition=0, txn=t)
                c.ack(got[0], txn=t)
                t.prepare()
                done.append(t.id)
            else:
                t.abort()
        while not done:
            worker = threading.Thread(target=prepare_one)
            worker.start()
            worker.join()
        txn_id = done[0]
    with txmq.Broker(path, num_coordinators=1, prepared_timeout=0.2) as b:
        assert [p["id"] for p in b.prepared_transactions()] == [str(txn_id)]
        deadline = time.monotonic() + 10
        while b.prepared_outcome(txn_id) is not TxnState.ABORTED:
            assert time.monotonic() < deadline, "prepared_timeout never aborted it"
            time.sleep(0.01)
        assert b.prepared_transactions() == []
        c = b.subscribe("in", "s", type="shared")
        assert values(drain(c)) == [b"m0", b"m1", b"m2"]     # its ack dropped: m0 comes again


def test_a_prepared_transaction_survives_reopening_and_a_later_owner_ends_it(tmp_path):
    path = tmp_path / "d"
    with txmq.Broker(path) as b:
        c, got, txn = _ctp(b)
        txn.prepare(xid="é-1")
        first = txn.id
        txn2 = b.new_transaction()
        b.producer("out").send(b"second", partition=0, txn=txn2)
        txn2.prepare(xid="x-2")
        second = txn2.id
    with pytest.raises(BrokerClosedError):
        txn.commit()                    # its handle died with its broker; the transaction did not
    for life in range(2):               # (reopening twice: the first reopen's compaction keeps them)
        with txmq.Broker(path) as b:
            listed = b.prepared_transactions()
            assert [(t["id"], t["xid"]) for t in listed] == [(str(first), "é-1"), (str(second), "x-2")]
            assert listed[0]["holds_back"] == ["out/0", "out/1"] and listed[1]["holds_back"] == []
            assert b.stats()["transactions"]["recovered"] == {"committed": 0, "aborted": 0}
            c = b.subscribe("in", "s", type="shared")
            assert [m.value for m in drain(c)] == [b"m2"]
            assert drain(b.subscribe("out", f"rc{life}", initial_position="earliest")) == []
    with txmq.Broker(path) as b:
        b.commit_prepared(first)
        b.commit_prepared(str(first))                        # again: a no-op
        b.abort_prepared(second)
        rc = b.subscribe("out", "rc2", initial_position="earliest")
        assert values(drain(rc)) == [b"M0", b"M1"]
        with pytest.raises(InvalidTxnStateError):
            b.abort_prepared(first)
        with pytest.raises(InvalidTxnStateError):
            b.commit_prepared(second)
    with txmq.Broker(path) as b:
        assert b.prepared_transactions() == []
        assert b.prepared_outcome(first) is TxnState.COMMITTED
        assert b.prepared_outcome(second) is TxnState.ABORTED
        c = b.subscribe("in", "s", type="shared")
        assert [m.value for m in drain(c)] == [b"m2"]        # m0, m1 acked at commit; m2 never
        assert b.forget_prepared(first) is True
        assert b.forget_prepared(first) is False
        assert b.prepared_outcome(first) is None
    with txmq.Broker(path) as b:
        assert b.prepared_outcome(first) is None and b.prepared_outcome(second) is TxnState.ABORTED


def test_compaction_keeps_prepared_transactions_and_outcomes(tmp_path):
    path = tmp_path / "d"
    with txmq.Broker(path, num_coordinators=1) as b:
        c, got, txn = _ctp(b)
        txn.prepare(xid="kept")
        other = b.new_transaction()
        b.producer("out").send(b"x", partition=1, txn=other)
        other.prepare()
        other.commit()
        b._coordinators[0].compact()
        for _ in range(3):
            with b.transaction() as t:
                b.producer("in").send(b"more", txn=t)
        b._coordinators[0].compact()
    with txmq.Broker(path, num_coordinators=1) as b:
        assert [t["xid"] for t in b.prepared_transactions()] == ["kept"]
        assert b.prepared_outcome(other.id) is TxnState.COMMITTED
        b.commit_prepared(txn.id)
        assert values(drain(b.subscribe("out", "rc", initial_position="earliest"))) == [b"M0", b"M1", b"x"]


def test_what_a_prepared_transaction_refuses(tmp_path):
    with txmq.Broker(tmp_path / "d") as b:
        c, got, txn = _ctp(b)
        with pytest.raises(InvalidArgumentError):
            txn.prepare(xid=7)
        with pytest.raises(InvalidArgumentError):
            txn.prepare(xid="x" * 70_000)
        assert txn.state is TxnState.OPEN                    # a bad argument changes nothing
        txn.prepare()
        with pytest.raises(InvalidTxnStateError):
            txn.prepare()
        with pytest.raises(InvalidTxnStateError):
            b.producer("out").send(b"late", txn=txn)
        with pytest.raises(InvalidTxnStateError):
            c.ack(got[2], txn=txn)
        with pytest.raises(InvalidTxnStateError):
            b.abort_transaction(txn.id)                      # only abort_prepared ends it
        with pytest.raises(InvalidTxnStateError):
            b.forget_prepared(txn.id)
        with pytest.raises(TransactionNotFoundError):
            b.commit_prepared("(0,999)")
        assert b.prepared_outcome("(0,999)") is None
        plain = b.new_transaction()
        with pytest.raises(InvalidTxnStateError):
            b.commit_prepared(plain.id)                      # open, not prepared
        assert plain.state is TxnState.OPEN
        with pytest.raises(InvalidArgumentError):
            b.commit_prepared("not an id")
        assert txn.state is TxnState.PREPARED


def test_a_topic_in_a_prepared_transaction_is_not_deleted(tmp_path):
    """Its record names the topic's partitions: deleting the topic (and
    creating it again) would let recovery write the old batches into the
    new one. Refused, force or not, until the transaction ends."""
    with txmq.Broker(tmp_path / "d") as b:
        c, got, txn = _ctp(b)
        txn.prepare()
        for topic in ("out", "in"):          # an output, and the subscription it acked on
            for force in (False, True):
                with pytest.raises(txmq.errors.TopicBusyError) as e:
                    b.delete_topic(topic, force=force)
                assert e.value.prepared == [txn.id] and "prepared" in str(e.value)
        txn.abort()
        c.close()
        b.delete_topic("out")
        b.delete_topic("in")


def test_leaving_a_with_block_leaves_it_prepared(tmp_path):
    with txmq.Broker(tmp_path / "d") as b:
        b.create_topic("t")
        with b.transaction() as txn:
            b.producer("t").send(b"v", txn=txn)
            txn.prepare()
        assert txn.state is TxnState.PREPARED
        with pytest.raises(RuntimeError):
            with b.transaction() as txn2:
                b.producer("t").send(b"w", txn=txn2)
                txn2.prepare()
                raise RuntimeError("after prepare")
        assert txn2.state is TxnState.PREPARED
        b.commit_prepared(txn.id)
        b.abort_prepared(txn2.id)
        assert [m.value for m in drain(b.subscribe("t", "s", initial_position="earliest"))] == [b"v"]


def test_commit_async_of_a_prepared_transaction(tmp_path):
    with txmq.Broker(tmp_path / "d") as b:
        c, got, txn = _ctp(b)
        txn.prepare()
        assert txn.commit_async().result(10) is None
        assert txn.state is TxnState.COMMITTED


def test_fencing_leaves_a_prepared_transaction(tmp_path):
    """A newer instance of a transactional id aborts its older instance's
    open transaction, never a prepared one: that one waits for its commit
    or abort (commit_prepared works; the fenced handle does not)."""
    with txmq.Broker(tmp_path / "d") as b:
        b.create_topic("t")
        tp = b.transactional_producer("etl")
        txn = tp.begin()
        tp.producer("t").send(b"v", txn=txn)
        txn.prepare()
        b.transactional_producer("etl")
        assert txn.state is TxnState.PREPARED
        with pytest.raises(txmq.errors.ProducerFencedError):
            txn.commit()
        b.commit_prepared(txn.id)
        assert [m.value for m in drain(b.subscribe("t", "s", initial_position="earliest"))] == [b"v"]


def test_a_large_prepared_output_survives_reopening(tmp_path):
    """An output larger than a decision record copies (64 KiB) is synced
    to its segments before the PREPARED frame, as a commit's is."""
    path = tmp_path / "d"
    big = [bytes([i]) * 1000 for i in range(200)]
    with txmq.Broker(path) as b:
        b.create_topic("t")
        txn = b.new_transaction()
        b.producer("t").send_batch(big, txn=txn)
        txn.prepare()
    with txmq.Broker(path) as b:
        b.commit_prepared(txn.id)
        assert [m.value for m in drain(b.subscribe("t", "s", initial_position="earliest"))] == big


def test_cli_lists_prepared_transactions(tmp_path):
    path = tmp_path / "d"
    with txmq.Broker(path) as b:
        c, got, txn = _ctp(b)
        txn.prepare(xid="cli-1")
    out = subprocess.run([sys.executable, "-m", "txmq.cli", "transactions", "list", str(path), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    [t] = json.loads(out.stdout)
    assert t["id"] == str(txn.id) and t["state"] == "PREPARED" and t["xid"] == "cli-1"
    assert t["holds_back"] == ["out/0", "out/1"] and t["age_s"] >= 0
    text = subprocess.run([sys.executable, "-m", "txmq.cli", "transactions", "list", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert "PREPARED" in text.stdout and "cli-1" in text.stdout, text.stdout
    stats = subprocess.run([sys.executable, "-m", "txmq.cli", "stats", str(path)], capture_output=True, text=True,
                           timeout=120)
    assert "transactions: 0 open, 0 committing, 0 aborting, 1 prepared" in stats.stdout, stats.stdout
    done = subprocess.run([sys.executable, "-m", "txmq.cli", "transactions", "commit-prepared", str(path),
                           str(txn.id)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    with txmq.Broker(path) as b:
        assert b.prepared_transactions() == []
        assert values(drain(b.subscribe("out", "rc", initial_position="earliest"))) == [b"M0", b"M1"]


def test_cli_abort_refuses_a_prepared_transaction(tmp_path):
    path = tmp_path / "d"
    with txmq.Broker(path) as b:
        c, got, txn = _ctp(b)
        txn.prepare()
    out = subprocess.run([sys.executable, "-m", "txmq.cli", "transactions", "abort", str(path), str(txn.id)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 5 and "PREPARED" in out.stderr, (out.returncode, out.stderr)
    done = subprocess.run([sys.executable, "-m", "txmq.cli", "transactions", "abort-prepared", str(path),
                           str(txn.id), "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and json.loads(done.stdout) == {"aborted": str(txn.id)}, done.stderr
    again = subprocess.run([sys.executable, "-m", "txmq.cli", "transactions", "abort-prepared", str(path),
                            str(txn.id)], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    with txmq.Broker(path) as b:
        assert b.prepared_outcome(txn.id) is TxnState.ABORTED
