"""Damage in the middle of a log is contained (docs/FORMAT.md,
"Quarantine"): a batch that fails its checks between sound ones loses its
own offsets only; the rest of the partition and the other partitions read
as before; the loss is reported (stats, ``txmq check``, DataLossError for
readers who ask); a subscription moves past it only when told."""

from __future__ import annotations

import json
import os
import shutil

import pytest

import txmq
from txmq import readonly
from txmq.cli.app import main
from txmq.errors import DataLossError
from damage import batch_positions, flip

PARTITIONS = 4
PER_PARTITION = 400


@pytest.fixture
def no_debug(monkeypatch):
    monkeypatch.delenv("TXMQ_DEBUG", raising=False)




@pytest.fixture
def damaged(tmp_path, no_debug):
    """A closed directory of 4 partitions (several segments each) with one
    byte flipped in a batch in the middle of partition 0's first segment;
    returns (path, segment, batch position, lost offsets)."""
    path = str(tmp_path / "d")
    with txmq.Broker(path, fsync="commit", segment_bytes_max=32 * 1024) as b:
        b.create_topic("t", PARTITIONS)
        p = b.producer("t")
        for i in range(PER_PARTITION):
            for q in range(PARTITIONS):
                p.send(b"m-%d-%d" % (q, i) + b"x" * 40, partition=q)
    seg = os.path.join(path, "topics", "t", "0", "0" * 20 + ".log")
    batches = batch_positions(seg)
    pos, base, count = batches[len(batches) // 2]
    assert base > 50
    flip(seg, pos + 100)
    return path, seg, pos, set(range(base, base + count))


def _drain(c):
    out = []
    while ms := c.receive_many(1000, timeout=0):
        out += ms
    return out


def test_a_flipped_byte_loses_its_batch_only(damaged):
    path, seg, pos, lost = damaged
    with txmq.Broker(path, fsync="commit") as b:
        c = b.subscribe("t", "s", "exclusive", initial_position="earliest")
        got = _drain(c)
        by_part = {}
        for m in got:
            by_part.setdefault(m.partition, []).append(m.offset)
        assert by_part[0] == [o for o in range(PER_PARTITION) if o not in lost]
        for q in range(1, PARTITIONS):
            assert by_part[q] == list(range(PER_PARTITION))
        assert all(m.value == b"m-%d-%d" % (m.partition, m.offset) + b"x" * 40 for m in got)
        part = b.stats()["topics"]["t"]["partitions"][0]
        (q,) = part["quarantined"]
        assert (q["path"], q["position"]) == (seg, pos)
        assert set(range(q["first_offset"], q["end_offset"])) == lost and part["lost_offsets"] == len(lost)
        c.ack(got)
        sub = b.stats()["topics"]["t"]["subscriptions"]["s"]["partitions"][0]
        # Not acknowledged by itself: the cursor stops below the loss until told.
        assert sub["mark_delete"] == min(lost) and sub["lost_unacked"] == len(lost)
    # Persisted: the next open lists it before any read.
    with open(os.path.join(path, "topics", "t", "0", "quarantine.json")) as f:
        assert json.load(f)["ranges"][0]["position"] == pos
    with txmq.Broker(path, fsync="commit") as b:
        assert b.stats()["topics"]["t"]["partitions"][0]["quarantined"][0]["position"] == pos
        c = b.subscribe("t", "s", "exclusive")
        assert _drain(c) == []
        assert c.skip_data_loss() == len(lost)
        sub = b.stats()["topics"]["t"]["subscriptions"]["s"]["partitions"][0]
        assert sub["mark_delete"] == PER_PARTITION and sub["lost_unacked"] == 0


def test_fail_on_data_loss_raises_until_skipped(damaged):
    path, seg, pos, lost = damaged
    with txmq.Broker(path, fsync="commit") as b:
        c = b.subscribe("t", "s", "exclusive", initial_position="earliest", fail_on_data_loss=True)
        got = []
        with pytest.raises(DataLossError) as e:
            while ms := c.receive_many(1000, timeout=0):
                got += ms
        assert (e.value.path, e.value.position, e.value.wanted) == (seg, pos, min(lost))
        assert max(m.offset for m in got if m.partition == 0) < min(lost)
        with pytest.raises(DataLossError):          # again: nothing moved past it
            c.receive_many(1000, timeout=0)
        c.ack(got)
        c.skip_data_loss(0)
        rest = _drain(c)
        assert sorted(m.offset for m in rest if m.partition == 0) == list(range(max(lost) + 1, PER_PARTITION))


def test_read_only_readers_skip_or_raise(damaged):
    path, seg, pos, lost = damaged
    with readonly.open(path, wait_s=0) as ro:
        offsets = [m.offset for m in ro.read("t", 0, 0)]
        assert offsets == [o for o in range(PER_PARTITION) if o not in lost]
        with pytest.raises(DataLossError) as e:
            list(ro.read("t", 0, 0, fail_on_data_loss=True))
        assert (e.value.path, e.value.position) == (seg, pos)
        rows = sum(b.num_rows for b in ro.read_arrow("t", 0, 0))
        assert rows == PER_PARTITION - len(lost)
        with pytest.raises(DataLossError):
            list(ro.read_arrow("t", 0, 0, fail_on_data_loss=True))
        assert [m.offset for m in ro.read("t", 1, 0)] == list(range(PER_PARTITION))


def test_cli_consume_check_and_repair(damaged, capsys):
    path, seg, pos, lost = damaged
    assert main(["consume", path, "t", "--json"]) == 0
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert len(out) == PARTITIONS * PER_PARTITION - len(lost)
    # A consume that fails leaves no subscription behind.
    assert main(["consume", path, "t", "-s", "newsub", "--fail-on-data-loss", "--timeout", "0.1"]) != 0
    err = capsys.readouterr().err
    assert seg in err and "Traceback" not in err
    assert main(["subscriptions", "list", path, "t"]) == 0
    assert "newsub" not in capsys.readouterr().out
    assert main(["consume", path, "t", "-s", "newsub", "--timeout", "0.1"]) == 0
    capsys.readouterr()
    assert main(["check", path, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [(p["path"], p["position"]) for p in report["problems"]] == [(seg, pos)]
    assert "quarantined" in report["problems"][0]["reason"]
    assert main(["topics", "describe", path, "t", "--json"]) == 0
    assert "quarantined" in capsys.readouterr().out
    # Derived data damaged too: --repair rebuilds it and says so.
    index = os.path.join(path, "topics", "t", "1", "0" * 20 + ".index")
    os.unlink(index)
    flip(os.path.join(path, "topics", "t", "2", "txnbuffer.snap"), 3)
    assert main(["check", path, "--json"]) == 1
    kinds = sorted(p["kind"] for p in json.loads(capsys.readouterr().out)["problems"])
    assert kinds == ["corrupt", "repairable", "repairable"]
    assert main(["check", path, "--repair"]) == 1     # the bad bytes stay: repair is no guess at data
    out = capsys.readouterr().out
    assert f"repair: {index} at byte 0: rebuilt" in out and "txnbuffer.snap at byte" in out
    assert main(["check", path, "--json"]) == 1
    assert [p["kind"] for p in json.loads(capsys.readouterr().out)["problems"]] == ["corrupt"]
    assert main(["consume", path, "t", "-s", "newsub", "--skip-data-loss", "--timeout", "0.1"]) == 0
    capsys.readouterr()
    assert main(["subscriptions", "describe", path, "t", "newsub", "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["partitions"][0]["mark_delete"] == PER_PARTITION     # moved past the loss: told to


def test_never_gap_after_a_roll_keeps_the_consistent_prefix(tmp_path, no_debug):
    """fsync="never", power loss right after a roll: the older segment lost
    its unsynced tail (zeros where batches were), the new one survived."""
    path = str(tmp_path / "d")
    with txmq.Broker(path, fsync="never", segment_bytes_max=8192) as b:
        b.create_topic("t", 1)
        p = b.producer("t")
        for i in range(300):
            p.send(b"v%d" % i + b"y" * 30)
    pdir = os.path.join(path, "topics", "t", "0")
    segs = sorted(n for n in os.listdir(pdir) if n.endswith(".log"))
    older = os.path.join(pdir, segs[-2])
    batches = batch_positions(older)
    keep_pos, keep_base, _ = batches[len(batches) // 2]
    size = os.path.getsize(older)
    with open(older, "r+b") as f:                   # write-back never reached these pages
        f.seek(keep_pos)
        f.write(b"\0" * (size - keep_pos))
    with txmq.Broker(path, fsync="never") as b:
        # Not opened yet (partitions open on first use): stats reads no
        # segment, so what opening will find is not known yet.
        assert b.stats()["topics"]["t"]["partitions"][0]["open"] is False
        got = _drain(b.subscribe("t", "s", "exclusive", initial_position="earliest"))
        assert [m.value for m in got] == [b"v%d" % i + b"y" * 30 for i in range(keep_base)]
        part = b.stats()["topics"]["t"]["partitions"][0]
        assert part["end_offset"] == keep_base and not part["quarantined"]
        assert any(segs[-1] in d for d in part["truncated_on_open"])   # what was dropped is said
        assert b.producer("t").send(b"after").offset == keep_base


def test_gap_in_a_durable_log_is_quarantined(tmp_path, no_debug):
    """The same gap under fsync="commit" is damage (the roll synced the
    older segment): its offsets are reported lost, the newer segment kept."""
    path = str(tmp_path / "d")
    with txmq.Broker(path, fsync="commit", segment_bytes_max=8192) as b:
        b.create_topic("t", 1)
        p = b.producer("t")
        for i in range(300):
            p.send(b"v%d" % i + b"y" * 30)
    pdir = os.path.join(path, "topics", "t", "0")
    segs = sorted(n for n in os.listdir(pdir) if n.endswith(".log"))
    older = os.path.join(pdir, segs[-2])
    keep_pos, keep_base, _ = batch_positions(older)[3]
    os.truncate(older, keep_pos)
    with txmq.Broker(path, fsync="commit") as b:
        c = b.subscribe("t", "s", "exclusive", initial_position="earliest")   # opens the partition
        part = b.stats()["topics"]["t"]["partitions"][0]
        assert part["end_offset"] == 300 and part["open"] is True
        (q,) = part["quarantined"]
        assert q["first_offset"] == keep_base and q["end_offset"] == int(segs[-1][:-4])
        got = _drain(c)
        assert [m.offset for m in got] == list(range(keep_base)) + list(range(q["end_offset"], 300))
    with txmq.Broker(path, fsync="commit") as b:
        # Not opened since: quarantine.json makes stats and describe open
        # it to report the range as opening finds it.
        assert b.stats()["topics"]["t"]["partitions"][0]["quarantined"] == [q]
        assert b.describe_topic("t")["quarantined"] == {"0": [q]}
    shutil.rmtree(path)


def test_never_a_torn_batch_past_the_recovery_point_ends_the_log(tmp_path, no_debug):
    """fsync="never", power loss: write-back kept the later pages of a
    committed transaction (its second batch and its COMMIT marker) and lost
    part of its first batch. Quarantining the torn batch would show the
    transaction without it; the log ends there instead, and says so."""
    from txmq._batch import BatchSpec
    from txmq.storage.partition import Partition
    from txmq.transactions.records import TxnID

    class Meta:                                     # the coordinator's record, reduced
        words = TxnID(0, 1).words

        def check_open(self, doing):
            pass

    live = tmp_path / "p"
    part = Partition(live, "t", 0, fsync="never")   # the recovery point: the empty log
    try:
        part.append(BatchSpec([b"a" * 3000]), txn=Meta())
        part.append(BatchSpec([b"b" * 3000]), txn=Meta())
        part.end_txn(TxnID(0, 1), True)
        assert part.max_read_position == 3
        shutil.copytree(live, tmp_path / "lost")    # what a power loss may leave, torn below
    finally:
        part.close()
    seg = str(tmp_path / "lost" / ("0" * 20 + ".log"))
    (first, _, _), (second, _, _), _ = batch_positions(seg)
    with open(seg, "r+b") as f:                     # a page of the first batch never written back
        f.seek(first + 2048)
        f.write(b"\0" * (second - first - 2048))
    again = Partition(tmp_path / "lost", "t", 0, fsync="never")
    try:
        st = again.stats()
        assert st["end_offset"] == 0 and not st["quarantined"] and st["truncated_on_open"]
        assert again.max_read_position == 0
    finally:
        again.close()
