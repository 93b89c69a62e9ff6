"""A commit's decision record cut at every byte (a power loss tearing the
one sync a commit makes), compared with a small reference: a torn record is
no decision, so the transaction is aborted (its outputs never appear, its
inputs are delivered again); a whole one is a commit, and recovery puts
back its outputs and acks from the record, though none of the
participants' writes was synced."""

from __future__ import annotations

import os
import shutil

import pytest

import txmq
from txmq import _redolog
from txmq.testing.power_loss import PowerLoss
from txmq.transactions import coordinator

OPTS = dict(fsync="commit", num_coordinators=1, control_socket=False)


def _read_all(b, topic, sub, isolation="read_committed"):
    c = b.subscribe(topic, sub, isolation=isolation, initial_position="earliest")
    got = []
    while True:
        ms = c.receive_many(1000, timeout=0.05)
        if not ms:
            return got
        got += [m.value for m in ms]


def _cut_and_check(tmp_path, monkeypatch, every_byte: bool):
    monkeypatch.setattr(coordinator, "PREALLOCATE_BYTES", 4096)
    path = tmp_path / "d"
    with txmq.Broker(path, **OPTS) as b:
        b.create_topic("in", 1)
        b.create_topic("out", 2)
        b.subscribe("in", "s", initial_position="earliest").close()
        b.producer("in").send_batch([b"i%d" % i for i in range(6)], partition=0)
    with PowerLoss(path) as sim:
        b = txmq.Broker(path, **OPTS)
        c = b.subscribe("in", "s", initial_position="earliest")
        out = b.producer("out")
        reference = {"committed": [], "acked": set()}

        def txn_of(ms):
            txn = b.new_transaction()
            for k, m in enumerate(ms):
                out.send(b"o" + m.value, partition=k % 2, txn=txn)
            c.ack(ms, txn=txn)
            return txn

        first = c.receive_many(2, timeout=1.0)
        txn_of(first).commit()                       # durable: the state every cut starts from
        reference["committed"] += [b"o" + m.value for m in first]
        reference["acked"] |= {m.value for m in first}
        last = c.receive_many(2, timeout=1.0)
        txn = txn_of(last)
        tc = b._coordinators[0]
        log_path = os.path.realpath(tc.log.path)
        seen = {}
        real_sync_to = tc.log.sync_to

        def sync_to(mark):
            if not seen:       # the commit point of ``txn``: what is durable before it, and what it syncs
                seen["pre"] = sim.materialise(tmp_path / "pre")
                durable = sim.durable_bytes(log_path)
                seen["from"] = _redolog.parse(durable, len(_redolog.FILE_HEADER), True)[1]
                with open(log_path, "rb") as f:
                    seen["bytes"] = f.read(tc.log.size)
                seen["record"] = (tc.log.size - len(txn._meta.record) - 16 - _redolog.FRAME_HEADER_BYTES,
                                  tc.log.size)
            real_sync_to(mark)

        tc.log.sync_to = sync_to
        txn.commit()
        b.close()
    start, end = seen["from"], seen["record"][1]
    record_at = seen["record"][0]
    assert start <= record_at < end, (start, record_at, end)
    # Every byte of the decision frame (or, in the quick run, of its header,
    # its transaction id and its last 48 bytes, and every 9th between), and
    # a few of the frames the same sync carried before it.
    frame = range(record_at, end + 1)
    if not every_byte:
        frame = [c for c in frame if c < record_at + 25 or c > end - 48 or c % 9 == 0]
    cuts = sorted(set(frame) | set(range(start, record_at, 11)))
    for cut in cuts:
        where = tmp_path / f"cut{cut}"
        shutil.copytree(seen["pre"], where)
        log = where / "coordinator" / "tc-0.log"
        with open(log, "r+b") as f:
            f.seek(start)
            f.write(seen["bytes"][start:cut])
        # Bytes the tear lost that were zeros anyway leave the frame whole.
        committed = not seen["bytes"][cut:end].strip(b"\0")
        want_out = reference["committed"] + ([b"o" + m.value for m in last] if committed else [])
        want_acked = reference["acked"] | ({m.value for m in last} if committed else set())
        with txmq.Broker(where, **OPTS) as b2:
            got = _read_all(b2, "out", "check")
            assert sorted(got) == sorted(want_out), cut
            left = set(_read_all(b2, "in", "s"))
            assert left == {b"i%d" % i for i in range(6)} - want_acked, cut
            if cut < record_at:
                assert not committed


def test_decision_record_cut_at_every_byte_quick(tmp_path, monkeypatch):
    _cut_and_check(tmp_path, monkeypatch, every_byte=False)


@pytest.mark.slow
def test_decision_record_cut_at_every_byte(tmp_path, monkeypatch):
    _cut_and_check(tmp_path, monkeypatch, every_byte=True)
