"""The half-message store's state (storage/half_messages.py, the state
table and redo log of txmq._half) stays true to what happened to each
half message: across a compaction, a check answer racing the
application's end, a failed append of a commit, a close during a local
transaction, a power loss, and a reopen. Each test names the guarantee it
holds the store to."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import time

import pytest

import txmq
import txmq.storage.half_messages
from txmq import LocalTransactionState as S
from txmq import _half
from txmq._redolog import parse

OPTS = dict(fsync="never", half_check_interval=3600.0, half_check_immunity=0.0, half_max_checks=3)


def read_values(broker, topic):
    t = broker._topics[topic]
    return sorted(m[2] for p in t.partitions for m in p.read(p.start_offset, 1 << 20))


def test_compaction_keeps_prepared_records_checkable(tmp_path):
    """G10: a PREPARED half message after the compaction point is still
    checked: the StateTable that ``_compact`` reopens knows its PREPARED
    records (as ``load`` does on open), so ``due`` still finds it."""
    with txmq.Broker(tmp_path / "d", **OPTS, half_retention=0.0) as b:
        b.create_topic("orders", 1)
        hp = b.half_producer("orders", "svc", checker=lambda m: S.COMMIT)
        done = hp.send_in_transaction(b"done", lambda m, a: S.ROLLBACK)
        r = hp.send_in_transaction(b"waiting", lambda m, a: S.UNKNOWN)
        now = time.time() + 10
        assert b._half.due(now) == [r.half_id]
        b._half._compact(done.half_id + 1)        # what maybe_compact does past 10,000 frames
        assert b.stats()["half"]["by_state"]["prepared"] == 1
        assert b._half.due(now) == [r.half_id]
        assert b._half.check(now=now) == 1
        assert read_values(b, "orders") == [b"waiting"]


def test_check_answer_racing_an_end_transaction_does_not_abort_the_round(tmp_path):
    """A check's answer arrives after the application ended the message
    the other way (the checker runs outside the store's lock): ``end`` must
    drop the stale answer (``expect_checks``) before it raises for the
    contradiction, and the round goes on with the other messages."""
    with txmq.Broker(tmp_path / "d", **OPTS) as b:
        b.create_topic("orders", 1)
        hp = None

        def checker(m):
            if m.value == b"a":                    # the application rolls "a" back meanwhile
                hp.end_transaction(m.txn_id, S.ROLLBACK)
            return S.COMMIT

        hp = b.half_producer("orders", "svc", checker=checker)
        hp.send_in_transaction(b"a", lambda m, x: S.UNKNOWN)
        hp.send_in_transaction(b"b", lambda m, x: S.UNKNOWN)
        assert b._half.check(now=time.time() + 10) == 2          # both checked: the stale answer for "a" is dropped
        by = b.stats()["half"]["by_state"]
        assert (by["rolled_back"], by["committed"] + by["committing"], by["prepared"]) == (1, 1, 0)
        assert read_values(b, "orders") == [b"b"]


def test_failed_append_of_a_commit_loses_nothing(tmp_path):
    """G10 when the real partition's append fails (ENOSPC, a topic closed
    under it): the record stays COMMITTING with its intent (partition,
    sequence); after the application retries end_transaction, commits
    another message to that partition and reopens the broker, both
    messages are in the partition, once each."""
    d = tmp_path / "d"
    with txmq.Broker(d, **OPTS) as b:
        b.create_topic("orders", 1)
        hp = b.half_producer("orders", "svc")
        p = b._topics["orders"].partitions[0]
        real, calls = p.append, []

        def failing_once(*a, **k):
            calls.append(1)
            if len(calls) == 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(*a, **k)

        p.append = failing_once
        with pytest.raises(OSError):
            hp.send_in_transaction(b"first", lambda m, x: S.COMMIT)
        hp.end_transaction(0, S.COMMIT)         # the application retries its commit
        hp.send_in_transaction(b"second", lambda m, x: S.COMMIT)
        live = read_values(b, "orders")
    with txmq.Broker(d, **OPTS) as b:
        after = read_values(b, "orders")
        s = b.stats()["half"]
    assert after == [b"first", b"second"], (live, after, s["by_state"], s["problems_on_open"])


def test_closing_the_broker_during_a_local_transaction_is_a_clear_error(tmp_path):
    """A thread whose local transaction is running when the application
    closes the broker (shutdown) gets BrokerClosedError, never a segfault
    from ending the message in the closed (unmapped) StateTable. Runs in a
    subprocess, so a segfault fails this test rather than killing pytest."""
    script = textwrap.dedent(f"""
        import threading, txmq
        from txmq import LocalTransactionState as S
        from txmq.errors import BrokerClosedError
        b = txmq.Broker({str(tmp_path / "d")!r}, fsync="never", half_check_interval=3600)
        b.create_topic("orders", 1)
        hp = b.half_producer("orders", "svc")
        def local(m, arg):
            t = threading.Thread(target=b.close)
            t.start(); t.join()
            return S.COMMIT
        for immunity in (None, 5.0):
            try:
                hp.send_in_transaction(b"x", local, check_immunity=immunity)
                print("returned")
            except BrokerClosedError:
                print("closed")
            except Exception as e:
                print("other", type(e).__name__, e)
            b = txmq.Broker({str(tmp_path / "d")!r}, fsync="never", half_check_interval=3600)
            hp = b.half_producer("orders", "svc")
        b.close()
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    out = proc.stdout.decode().split()
    assert proc.returncode == 0, f"rc {proc.returncode}: {out} {proc.stderr.decode()[-1500:]}"
    assert out == ["closed", "closed"], out


def test_settled_commit_is_not_durable_before_its_message(tmp_path):
    """G4 / the module's promise under fsync="commit": a power loss never
    loses a committed half message. A COMMITTED record (its intent gone,
    so nothing would append the message again) must not be durable in the
    redo log before its message is durable in the partition. Checked at
    every fdatasync of the redo log."""
    with txmq.Broker(tmp_path / "d", fsync="commit", half_check_interval=3600.0, half_check_immunity=0.0) as b:
        b.create_topic("orders", 1)
        hp = b.half_producer("orders", "svc")
        store = b._half
        p = b._topics["orders"].partitions[0]
        where = {}
        real_sync, bad = store.redo.sync, []

        def checked_sync(force=False):
            real_sync(force)
            with open(store.redo.path, "rb") as f:
                frames, _, _ = parse(f.read())
            base, records, intents, _, _ = _half.replay([(t, payload) for t, payload, _ in frames])
            for half_id, offset in where.items():
                rec = records[(half_id - base) * 28:(half_id - base + 1) * 28]
                state = int.from_bytes(rec[20:24], "little") if len(rec) == 28 else 0
                if state == _half.COMMITTED and p._synced_offset <= offset:
                    bad.append((half_id, offset, p._synced_offset))

        store.redo.sync = checked_sync
        r = hp.send_in_transaction(b"a", lambda m, x: S.COMMIT)
        where[r.half_id] = r.message_id.offset
        b.check_half_messages()                  # settles "a": COMMITTED framed (page cache)
        r = hp.send_in_transaction(b"b", lambda m, x: S.COMMIT)    # its COMMITTING sync makes that durable
        where[r.half_id] = r.message_id.offset
        assert bad == [], f"COMMITTED durable before the message: (half id, offset, synced below) {bad}"


def test_own_check_immunity_is_the_same_before_and_after_reopen(tmp_path):
    """A message with its own check immunity, discarded and resumed, is due
    at the same time before a restart (the state in memory) and after it
    (the state replayed from the redo log)."""
    d = tmp_path / "d"
    opts = dict(OPTS, half_max_checks=0)
    now = time.time()
    with txmq.Broker(d, **opts) as b:
        b.create_topic("orders", 1)
        hp = b.half_producer("orders", "svc", checker=lambda m: S.UNKNOWN)
        hp.send_in_transaction(b"x", lambda m, a: S.UNKNOWN, check_immunity=3600)
        b._half.check(now=now + 7200)           # max_checks 0: discarded at once
        assert b.resume_half_checks() == [0]
        before = b._half.due(now + 10)
    with txmq.Broker(d, **opts) as b:
        after = b._half.due(now + 10)
    assert before == after, (before, after)
