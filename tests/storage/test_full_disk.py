"""A full disk (docs/GUARANTEES.md, "A full disk"): on a small tmpfs
filled to the brim, sends, commits, acks and half messages fail with
StorageFullError; nothing acknowledged before is lost, nothing half
written is visible after reopening, reads go on, and writing resumes by
itself once space is freed. The tests run as root: they mount a tmpfs and
are skipped, saying why, where mounting is refused."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

import txmq
from txmq import LocalTransactionState
from txmq.cli.check import check_directory
from txmq.errors import StorageFullError

SIZE = "6m"


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SIZE}", "tmpfs", str(mnt)],
                              capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no mount(8) on this machine: cannot make a small file system")
    if proc.returncode != 0:
        pytest.skip(f"mounting a {SIZE} tmpfs was refused ({proc.stderr.strip()}): the full-disk tests need root")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(path) -> None:
    """Write ``path`` until the file system is full."""
    with open(path, "wb", buffering=0) as f:
        chunk = b"\xff" * 65536
        try:
            while True:
                f.write(chunk)
        except OSError:
            pass
        for n in (4096, 512, 64, 8, 1):
            try:
                while True:
                    f.write(chunk[:n])
            except OSError:
                continue


def _until_full(op, limit: int = 10_000):
    """Run ``op`` until it raises StorageFullError (returned); what it
    returned before, in a list."""
    done = []
    for _ in range(limit):
        try:
            done.append(op())
        except StorageFullError as e:
            return done, e
    raise AssertionError(f"{limit} writes on a full file system and no StorageFullError")


def test_full_disk_fails_typed_keeps_what_was_acknowledged_and_resumes(small_fs):
    path = str(small_fs / "d")
    b = txmq.Broker(path, fsync="commit", segment_bytes_max=1 << 20)
    try:
        b.create_topic("t", 2)
        c = b.subscribe("t", "s", "exclusive", initial_position="earliest")
        p = b.producer("t")
        sent = {}
        # Enough to read and ack past the point where an ack finds the disk
        # full (sends stop there soon: a segment reserves little ahead).
        for i in range(2000):
            mid = p.send(b"before-%d" % i)
            sent[(mid.partition, mid.offset)] = b"before-%d" % i
        _fill(small_fs / "pad")

        i = iter(range(1 << 30))

        def send():
            v = b"full-%d" % next(i) + b"z" * 900
            mid = p.send(v)
            sent[(mid.partition, mid.offset)] = v
        _, e = _until_full(send)
        assert e.path.startswith(path) and e.errno == 28

        def commit():
            txn = b.new_transaction()
            try:
                p.send(b"in-txn" + b"z" * 900, txn=txn)
                txn.commit()
            except StorageFullError:
                txn.abort()
                raise
        _until_full(commit)

        got = c.receive_many(1000, timeout=0)            # reads go on
        assert got and all(sent[(m.partition, m.offset)] == m.value for m in got)

        def ack():
            m = c.receive(timeout=0)
            assert m is not None
            c.ack(m)
        c.ack(got[:10])
        _until_full(ack)

        half = b.half_producer("t", "g")
        _until_full(lambda: half.send_in_transaction(b"half" + b"z" * 900,
                                                     lambda m, a: LocalTransactionState.COMMIT))

        os.unlink(small_fs / "pad")                       # space again: writing resumes by itself
        mid = p.send(b"after")
        sent[(mid.partition, mid.offset)] = b"after"
        with b.transaction() as txn:
            mid = p.send(b"after-txn", txn=txn)
        sent[(mid.partition, mid.offset)] = b"after-txn"
        assert half.send_in_transaction(b"after-half", lambda m, a: LocalTransactionState.COMMIT).message_id
    finally:
        b.close()

    with txmq.Broker(path, fsync="commit") as b:
        c = b.subscribe("t", "check", "exclusive", initial_position="earliest")
        read = {}
        while ms := c.receive_many(10_000, timeout=0):
            read.update({(m.partition, m.offset): m.value for m in ms})
    values = set(read.values())
    # Every acknowledged send is there, at its offset; nothing half written is.
    assert all(read.get(k) == v for k, v in sent.items())
    assert {v for v in values if not v.startswith((b"in-txn", b"half", b"after-half"))} == set(sent.values())
    assert b"after-half" in values
    assert not [p for p in check_directory(path).problems if p.kind == "corrupt"]


# A writer on a full file system, killed with SIGKILL while its sends and
# commits keep failing: prints every commit that returned, then a ready
# line, then keeps trying (half a transaction a time) until it is killed.
_KILLED_WRITER = r"""
import sys
import txmq
from txmq.errors import StorageFullError

path, pad = sys.argv[1], sys.argv[2]
b = txmq.Broker(path, fsync="commit", segment_bytes_max=1 << 20)
if "t" not in b.topics():
    b.create_topic("t", 2)
p = b.producer("t")
n, full, filled = 0, 0, False
while True:
    txn = None
    try:
        txn = b.new_transaction()                 # its BEGIN record may not fit either
        p.send_batch([b"c%d-%d" % (n, i) + b"z" * 700 for i in range(3)], partition=n % 2, txn=txn)
        txn.commit()
        print("COMMITTED", n, flush=True)
    except StorageFullError:
        if txn is not None:
            txn.abort()
        full += 1
        if full == 3:
            print("FULL", flush=True)
    n += 1
    if n == 20 and not filled:
        filled = True
        with open(pad, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\xff" * 4096)
            except OSError:
                pass
"""


def test_killed_on_a_full_disk_keeps_every_returned_commit_and_nothing_half_written(small_fs):
    path, pad = str(small_fs / "d"), str(small_fs / "pad")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, path, pad], stdout=subprocess.PIPE, text=True)
    committed = []
    try:
        for line in proc.stdout:
            if line.startswith("COMMITTED"):
                committed.append(int(line.split()[1]))
            elif line.startswith("FULL"):
                break
        else:
            raise AssertionError(f"the writer ended ({proc.wait()}) before the disk was full")
        time.sleep(random.uniform(0.0, 0.2))               # killed somewhere in its failing commits
        proc.send_signal(signal.SIGKILL)
        committed += [int(line.split()[1]) for line in proc.stdout if line.startswith("COMMITTED")]
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL            # it was still trying, not ended by an error
    assert len(committed) >= 20

    os.unlink(pad)                                          # space again; the next owner recovers
    with txmq.Broker(path, fsync="commit") as b:
        c = b.subscribe("t", "check", "exclusive", initial_position="earliest")
        read = []
        while ms := c.receive_many(10_000, timeout=0):
            read += [m.value for m in ms]
    by_txn: dict = {}
    for v in read:
        by_txn.setdefault(int(v[1:v.index(b"-")]), []).append(v)
    # Every commit that returned is there, whole and once; no other
    # transaction shows a part of itself (a commit that failed is aborted).
    assert set(committed) <= set(by_txn)
    assert all(len(vs) == 3 and len(set(vs)) == 3 for vs in by_txn.values()), \
        {n: len(vs) for n, vs in by_txn.items() if len(vs) != 3}
    assert not [p for p in check_directory(path).problems if p.kind == "corrupt"]
