"""More partitions than the process may open files: the owner and the
read-only view keep their descriptors and mappings within a budget
(segments and redo logs are parked when idle and reopened on use), topics
open their partitions lazily, and recovery after a SIGKILL still ends
every transaction and keeps every acknowledged message.

Each scenario runs in a subprocess whose ``RLIMIT_NOFILE`` is set before
txmq is imported (many_partitions_worker.py)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

import txmq
from txmq import readonly
from txmq.storage.topic import PartitionStub

from killer import read_lines, start_and_kill, worker

WORKER = worker("many_partitions_worker.py")
NOFILE = 128            # the worker's descriptor limit
PARTITIONS = 300        # well above it (and above what two redo logs a partition would need)
ROUNDS = 3


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(txmq.__file__).parents[1]), env.get("PYTHONPATH")]))
    return env


def _run(*args, nofile=NOFILE, timeout=600):
    out = subprocess.run([sys.executable, WORKER, str(nofile), *map(str, args)], capture_output=True, text=True,
                         env=_env(), timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _cli(*args, nofile=NOFILE):
    code = f"import resource; resource.setrlimit(resource.RLIMIT_NOFILE, ({nofile}, {nofile}))\n" \
           f"import sys; from txmq.cli.app import main; sys.exit(main({list(map(str, args))!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _expected(partitions, rounds):
    return {str(i): [f"{i}-{r}" for r in range(rounds)] for i in range(partitions)}


def _owner_and_reader(path, partitions, rounds, nofile):
    owner = subprocess.Popen([sys.executable, WORKER, str(nofile), "owner", path, str(partitions), str(rounds)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=_env())
    try:
        line = owner.stdout.readline()
        assert line.startswith("READY "), owner.stderr.read()[-3000:]
        state = json.loads(line[6:])
        assert {k: sorted(v) for k, v in state["got"].items()} == _expected(partitions, rounds)
        assert state["lag"] == 0
        assert state["most_fds"] < nofile
        # A reader of the same limit while the owner holds the directory ...
        live = json.loads(_run("reader", path, rounds, nofile=nofile))
        owner.stdin.write("\n")
        owner.stdin.flush()
        assert owner.stdout.readline() == "DONE\n", owner.stderr.read()[-3000:]
        assert owner.wait(timeout=600) == 0
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
    # ... and after it closed.
    closed = json.loads(_run("reader", path, rounds, nofile=nofile))
    for seen in (live, closed):
        assert seen["values"] == _expected(partitions, rounds)
        assert seen["arrow_rows"] == partitions * rounds
        assert seen["most_fds"] < nofile


def test_owner_and_readers_work_across_more_partitions_than_descriptors(tmp_path):
    path = str(tmp_path / "data")
    _owner_and_reader(path, PARTITIONS, ROUNDS, NOFILE)
    listed = _cli("topics", "list", path, "--json")
    assert json.loads(listed)[0]["partitions"] == PARTITIONS
    stats = json.loads(_cli("stats", path, "--json"))
    parts = stats["topics"]["t"]["partitions"]
    assert [p["end_offset"] for p in parts] == [ROUNDS] * PARTITIONS
    assert _cli("consume", path, "t", "-n", "1").splitlines()[0] in {f"{i}-0" for i in range(PARTITIONS)}


@pytest.mark.slow
def test_ten_thousand_partitions_under_the_common_descriptor_limit(tmp_path):
    """The new user's case: ``ulimit -n 1024`` and a topic of 10,000
    partitions (bench/test_bench_scale.py times it)."""
    path = str(tmp_path / "data")
    _owner_and_reader(path, 10_000, 2, 1024)
    for args in (("topics", "list", path), ("stats", path), ("topics", "describe", path, "t"),
                 ("consume", path, "t", "-n", "1")):
        _cli(*args, nofile=1024)


def test_a_sigkill_midway_loses_nothing_acknowledged(tmp_path):
    path = str(tmp_path / "data")
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    out = tmp_path / "out"
    sent = {}                     # (partition, offset) -> value, acknowledged or committed
    for attempt in range(3):
        rc, err, exited = start_and_kill([sys.executable, WORKER, str(NOFILE), "crash", path, str(PARTITIONS)],
                                         _env(), out, rng, p_after_ready=0.9, after_ready=(0.5, 2.5))
        assert not exited, err[-3000:]
        for line in read_lines(out):
            if line.startswith("SENT "):
                _, p, off, value = line.split()
                sent[(int(p), int(off))] = value
            elif line.startswith("COMMITTED "):
                for item in line.split()[1:]:
                    p, off, value = item.split(":")
                    sent[(int(p), int(off))] = value
    assert sent, "the worker acknowledged nothing"
    with txmq.Broker(path, fsync="never") as b:
        by_partition = {}
        for (p, off), value in sent.items():
            by_partition.setdefault(p, {})[off] = value
        for p, offsets in by_partition.items():
            assert b.last_stable_offset("t", p) == b.high_watermark("t", p), "a transaction left open"
        with readonly.open(path) as ro:
            pass
    with readonly.open(path) as ro:
        for p, offsets in by_partition.items():
            got = {m.offset: m.value.decode() for m in ro.read("t", p, 0)}
            for off, value in offsets.items():
                assert got.get(off) == value, f"acknowledged {value} at t/{p}@{off} lost"


def test_opening_touches_only_the_partitions_recovery_needs(tmp_path):
    path = str(tmp_path / "data")
    with txmq.Broker(path, fsync="never") as b:
        b.create_topic("t", partitions=50)
        assert not os.path.exists(os.path.join(path, "topics", "t", "7"))   # folders come with use
        b.producer("t").send(b"x", partition=7)
        assert os.path.isdir(os.path.join(path, "topics", "t", "7"))
    with txmq.Broker(path, fsync="never") as b:
        t = b._topics["t"]
        assert all(type(p) is PartitionStub for p in t.partitions)
        assert b.describe_topic("t")["end_offsets"][6:9] == [0, 1, 0]      # from the readviews
        assert all(type(p) is PartitionStub for p in t.partitions)
        assert b.high_watermark("t", 7) == 1 and type(t.partitions[7]) is not PartitionStub
        assert [m.value for m in readonly.open(path).read("t", 8, 0)] == []  # never opened: empty


CRASHED_IN_TXN = r"""
import sys, txmq
b = txmq.Broker(sys.argv[1], fsync="commit")
b.create_topic("t", partitions=50)
p = b.producer("t")
p.send(b"before", partition=7)
txn = b.new_transaction(timeout=600)
p.send(b"in-txn", partition=7, txn=txn)
txn.flush()                                    # its coordinator log names partition 7 now
p.send(b"after", partition=7)
print("READY", flush=True)
sys.stdin.readline()
"""


def _crash_in_open_transaction(path):
    proc = subprocess.Popen([sys.executable, "-c", CRASHED_IN_TXN, path], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        assert proc.stdout.readline() == "READY\n", proc.stderr.read()[-3000:]
    finally:
        proc.kill()
        proc.wait()


def test_a_transaction_a_crash_left_open_is_aborted_at_reopen(tmp_path):
    """Its coordinator logs partition 7 as a participant: recovery opens
    that partition (and only it) and aborts the transaction there."""
    path = str(tmp_path / "data")
    _crash_in_open_transaction(path)
    with txmq.Broker(path, fsync="never") as b:
        t = b._topics["t"]
        assert [i for i, p in enumerate(t.partitions) if type(p) is not PartitionStub] == [7]
        assert b.last_stable_offset("t", 7) == b.high_watermark("t", 7) == 4      # 3 messages and the ABORT
        assert b.stats()["transactions"]["recovered"]["aborted"] == 1
    with readonly.open(path) as ro:
        assert [m.value for m in ro.read("t", 7, 0)] == [b"before", b"after"]


def test_a_transaction_unknown_to_every_coordinator_is_aborted_when_its_partition_opens(tmp_path):
    """A coordinator log that lost the transaction (its frames cut off, as
    damage or a power loss under fsync="never" may): recovery cannot know
    partition 7 holds it, so the partition stays shut until used, and then
    the transaction is aborted as recovery would have, never left to block
    read_committed readers."""
    path = str(tmp_path / "data")
    _crash_in_open_transaction(path)
    cdir = os.path.join(path, "coordinator")
    for name in os.listdir(cdir):
        os.truncate(os.path.join(cdir, name), 8)          # the redo-log header only
    with txmq.Broker(path, fsync="never") as b:
        t = b._topics["t"]
        assert all(type(p) is PartitionStub for p in t.partitions)
        assert b.last_stable_offset("t", 7) == b.high_watermark("t", 7) == 4
        assert b.stats()["transactions"]["recovered"]["aborted"] == 1
        txn = b.new_transaction()                          # a fresh id, never the lost one's
        b.producer("t").send(b"new", partition=7, txn=txn)
        txn.commit()
    with readonly.open(path) as ro:
        assert [m.value for m in ro.read("t", 7, 0)] == [b"before", b"after", b"new"]


@pytest.mark.parametrize("bad", [True, 3, 2.0, "64", -1])
def test_open_files_max_is_checked(tmp_path, bad):
    with pytest.raises(txmq.errors.InvalidArgumentError) as e:
        txmq.Broker(tmp_path / "d", open_files_max=bad)
    assert e.value.name == "open_files_max" and not (tmp_path / "d").exists()
    with txmq.Broker(tmp_path / "ok", fsync="never", open_files_max=4) as b:
        b.create_topic("t", partitions=20)
        p = b.producer("t")
        for i in range(20):
            p.send(b"%d" % i, partition=i)
        assert b._partition_options["budget"].stats()["open"] <= 4
    with pytest.raises(txmq.errors.InvalidArgumentError):
        readonly.open(tmp_path / "ok", open_files_max=bad)
    with readonly.open(tmp_path / "ok", open_files_max=4) as ro:
        assert [m.value for i in range(20) for m in ro.read("t", i, 0)] == [b"%d" % i for i in range(20)]
        assert ro.budget.stats()["open"] <= 4
