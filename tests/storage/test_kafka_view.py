"""The Kafka-facing view of a partition against a brute-force scan of its
log: ``Broker.aborted_transactions``, ``Broker.last_stable_offset`` and
``Broker.high_watermark`` (the transaction buffer; idempotent producers,
producers).

The oracle never asks the broker's transaction tables (``ongoing``,
``aborted``, the ``.txnindex`` files): it parses the segment files
``<data>/topics/<topic>/<p>/<base>.log`` byte by byte with the layout of
docs/FORMAT.md (88-byte batch header, CRC, dense offsets, zero tail), checks
that the partition's own batch-header walk (``segment_for`` / ``batch_at`` /
``next_batch``) sees exactly the same batches, and derives per transaction
its first data batch (offset, producer id) and its one COMMIT / ABORT
marker. Then

- aborted list = the transactions with an ABORT marker, as
  ``(producer id of the first batch, first offset, marker offset)``, sorted
  by first offset; ``aborted_transactions(t, p, f, u)`` must equal the
  entries with ``first < u and marker >= f`` (``u`` defaults to the LSO),
  none when ``u <= f``;
- LSO = the least first offset of a transaction with data and no marker,
  else the log end; high watermark = the log end.

A small model of the workload (which transaction is open / committed /
aborted, which producer wrote its first batch where, how many offsets each
partition holds) is checked against the scan too, so the oracle itself is
held to what the workload did.

Workload (Hypothesis rule-based state machine): transactions from
``new_transaction`` and from transactional producers (several open at once,
each on several partitions of two topics, written by several producers:
anonymous, named, the transactional producer's own); opening a
transactional id again (fences the older instance and aborts its open
transaction) and a named producer again (fences the older instance); plain
sends; commit, abort, force-abort; ``flush`` (indexes and snapshots as of
now); reopen (recovery aborts every open transaction) after a close, or of
a copy of the live directory (a kill -9 between two calls: recovery replays
from the last roll or flush), either optionally after deleting the
``.txnindex`` files (all or some), ``txnbuffer.snap``, ``producers.snap``
or ``recovery-point``. Segments are 4 or 8 KiB and some messages ~1 KiB,
so transactions span segments. After every step: the high watermark, the
LSO and ``aborted_transactions`` on ranges drawn around every transaction
boundary; now and then on every pair of boundaries (every pair of offsets
while the partition is short). The fixed scenarios at the end delete the
derived files for certain.

The default run is 30 examples of up to 150 steps (~3,800 steps, ~15 s);
the slow variant 600 of up to 200 (~6 min). Shrinking is off by default, as
in tests/transactions/test_txn_model.py (set TXMQ_MODEL_SHRINK=1 and --timeout=0 for a minimal
example); a failure is reported at once with its step list.
"""

import glob
import os
import random
import shutil
import struct
import tempfile
from collections import defaultdict
from dataclasses import dataclass

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

import txmq
from txmq import AbortedTransaction, TxnState
from txmq._batch import FLAG
from txmq._crc32c import crc32c_of
from txmq.errors import InvalidTxnStateError, ProducerFencedError

TOPICS = {"a": 2, "b": 1}
PARTITION_KEYS = [(t, p) for t, n in TOPICS.items() for p in range(n)]
TIDS = ("tid0", "tid1", "tid2")
NAMES = ("n0", "n1")
MAX_OPEN = 5
SEGMENT_SIZES = (4096, 4096, 8192)
DAMAGE = ("none", "none", "txnindex", "txnindex_some", "txnbuffer", "producers", "snapshots",
          "txnindex+snapshots", "recovery_point")

EXAMPLES = 30
STEPS_PER_EXAMPLE = 150
MIN_STEPS = 2700                # Hypothesis ends some examples early: ~3,800 steps run
SLOW_EXAMPLES = 600
SLOW_STEPS_PER_EXAMPLE = 200
SAMPLED_PAIRS = 24              # random (from, to) pairs per partition after every step

# -- the brute force: the segment files, read with docs/FORMAT.md ------------------------------

# magic, version, reserved, flags, crc, length, base offset, count, base sequence, txn hi, txn lo,
# producer id, producer epoch, reserved, header bytes, first event time, max event time, publish time
HEADER = struct.Struct("<IBBHIIqiiQQqhHIqqq")
assert HEADER.size == 88
MAGIC = 0x424D5854               # b"TXMB"
TRANSACTIONAL, CONTROL, COMMIT, ABORT, NULL_KEYS, HEADERS = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
KNOWN_FLAGS = TRANSACTIONAL | CONTROL | COMMIT | ABORT | NULL_KEYS | HEADERS
assert FLAG == {"transactional": TRANSACTIONAL, "control": CONTROL, "marker_commit": COMMIT,
                "marker_abort": ABORT, "null_keys": NULL_KEYS, "headers": HEADERS}, FLAG
assert crc32c_of(b"123456789") == 0xE3069283         # CRC-32C (Castagnoli), as FORMAT.md says


@dataclass(frozen=True)
class Batch:
    base: int
    count: int
    flags: int
    hi: int
    lo: int
    pid: int


@dataclass
class TxnScan:
    first: int = -1                 # offset of its first data batch here
    pid: int = -1                   # producer id of that batch
    marker: int = -1                # offset of its COMMIT / ABORT marker, -1: open
    commit: bool = False


@dataclass
class PartitionScan:
    batches: list
    end: int
    txns: dict                      # (hi, lo) -> TxnScan
    aborted: list                   # [AbortedTransaction], sorted by first offset
    lso: int
    seg_bases: list

    def expected(self, lo: int, hi: int) -> list:
        if hi <= lo:
            return []                   # an empty range holds no data
        return [a for a in self.aborted if a.first_offset < hi and a.last_offset >= lo]


def scan_files(pdir: str):
    """Every batch of every segment file, parsed from the bytes (none for a
    partition never opened: its folder comes with its first use)."""
    if not os.path.isdir(pdir):
        return [], 0, []
    bases = sorted(int(n[:-4]) for n in os.listdir(pdir) if n.endswith(".log") and n[:-4].isdigit())
    assert bases, f"{pdir}: no segment"
    assert bases[0] == 0, f"{pdir}: first segment {bases[0]} (no retention here)"
    batches, expected = [], 0
    for base in bases:
        path = os.path.join(pdir, f"{base:020d}.log")
        assert base == expected, f"{path}: segment starts at {base}, the previous one ends at {expected}"
        with open(path, "rb") as f:
            raw = f.read()
        view = memoryview(raw)
        pos = 0
        while pos + HEADER.size <= len(raw):
            (magic, version, reserved, flags, crc, length, base_offset, count, _seq, hi, lo, pid, _epoch,
             reserved2, _hbytes, _fet, _met, _pub) = HEADER.unpack_from(raw, pos)
            if magic == 0:
                break
            where = f"{path} at byte {pos}"
            assert magic == MAGIC and version == 1 and reserved == 0 and reserved2 == 0, where
            assert not flags & ~KNOWN_FLAGS, (where, flags)
            assert length >= HEADER.size and length % 8 == 0 and pos + length <= len(raw), (where, length)
            assert crc == crc32c_of(view[pos + 12:pos + length], crc32c_of(view[pos + 4:pos + 8])), where
            assert base_offset == expected and count >= 1, (where, base_offset, expected, count)
            batches.append(Batch(base_offset, count, flags, hi, lo, pid))
            expected += count
            pos += length
        assert not raw[pos:].strip(b"\0"), f"{path}: bytes after the last batch at {pos} are not zero"
    return batches, expected, bases


def scan_walk(part) -> list:
    """The same batches through the partition's header walk."""
    out = []
    seg, pos = part.segment_for(part.start_offset)
    while seg is not None:
        info = seg.batch_at(pos)
        out.append(Batch(info.base_offset, info.count, info.flags, info.txn_hi, info.txn_lo, info.producer_id))
        assert info.next_offset == info.base_offset + info.count
        seg, pos = part.next_batch(seg, pos)
    return out


def brute_force(broker, topic: str, p: int) -> PartitionScan:
    pdir = os.path.join(broker.path, "topics", topic, str(p))
    if os.path.isdir(pdir):
        # Opened first: a partition holding a transaction no coordinator log
        # names (a crash came before its deferred frames) aborts it when it
        # opens, which appends the marker.
        broker._topic(topic).open_partition(p)
    batches, end, bases = scan_files(pdir)
    walked = scan_walk(broker._topic(topic).partitions[p])
    assert walked == batches, f"{topic}/{p}: the header walk and the file bytes disagree"
    txns = {}
    for b in batches:
        where = f"{topic}/{p}@{b.base}"
        if not b.flags & TRANSACTIONAL:
            assert not b.flags & (CONTROL | COMMIT | ABORT) and (b.hi, b.lo) == (0, 0), (where, b)
            continue
        assert (b.hi, b.lo) != (0, 0), (where, b)
        t = txns.setdefault((b.hi, b.lo), TxnScan())
        assert t.marker < 0, f"{where}: a batch of {b.hi, b.lo} after its marker at {t.marker}"
        if b.flags & CONTROL:
            assert b.count == 1 and bool(b.flags & COMMIT) != bool(b.flags & ABORT), (where, b)
            assert t.first >= 0, f"{where}: a marker of {b.hi, b.lo} without data before it"
            assert b.pid == t.pid, f"{where}: marker producer {b.pid}, first batch's {t.pid}"
            t.marker, t.commit = b.base, bool(b.flags & COMMIT)
        else:
            assert not b.flags & (COMMIT | ABORT), (where, b)
            if t.first < 0:
                t.first, t.pid = b.base, b.pid
    aborted = sorted((AbortedTransaction(t.pid, t.first, t.marker) for t in txns.values()
                      if t.marker >= 0 and not t.commit), key=lambda a: a.first_offset)
    lso = min((t.first for t in txns.values() if t.marker < 0), default=end)
    return PartitionScan(batches, end, txns, aborted, lso, bases)


def boundaries(scan: PartitionScan) -> list:
    """Offsets where an answer can change, and their neighbours."""
    pts = {0, 1, scan.lso, scan.end, scan.end + 1, scan.end + 7}
    for a in scan.aborted:
        for o in (a.first_offset, a.last_offset):
            pts.update((o - 1, o, o + 1))
    pts.update(t.first for t in scan.txns.values())      # committed and open ones too
    pts.update(scan.seg_bases)
    return sorted(x for x in pts if x >= 0)


def compare(broker, topic: str, p: int, scan: PartitionScan, pairs) -> None:
    where = f"{topic}/{p}"
    assert broker.high_watermark(topic, p) == scan.end, (where, broker.high_watermark(topic, p), scan.end)
    lso = broker.last_stable_offset(topic, p)
    assert lso == scan.lso, f"{where}: last_stable_offset {lso}, brute force {scan.lso} (end {scan.end})"
    for lo in (0, scan.lso, scan.end):
        got = broker.aborted_transactions(topic, p, lo)
        assert got == scan.expected(lo, scan.lso), \
            f"{where}: aborted_transactions({lo}) = {got}, brute force {scan.expected(lo, scan.lso)}"
    for lo, hi in pairs:
        got = broker.aborted_transactions(topic, p, lo, hi)
        want = scan.expected(lo, hi)
        assert got == want, f"{where}: aborted_transactions({lo}, {hi}) = {got}, brute force {want}"
        assert all(type(a) is AbortedTransaction for a in got)


def sampled_pairs(scan: PartitionScan, rng: random.Random) -> list:
    pts = boundaries(scan)
    pairs = [(0, scan.end), (0, scan.lso), (scan.lso, scan.end), (scan.end, scan.end + 1), (0, scan.end + 7)]
    for a in scan.aborted:                       # around and inside every aborted transaction
        pairs += [(a.first_offset, a.first_offset + 1), (a.last_offset, a.last_offset + 1),
                  (a.first_offset + 1, a.last_offset), (a.last_offset + 1, scan.end + 1),
                  (0, a.first_offset), (0, a.first_offset + 1)]
    for _ in range(SAMPLED_PAIRS):
        x, y = rng.choice(pts), rng.choice(pts)
        pairs.append((min(x, y), max(x, y)))
    for _ in range(4):
        x = rng.randrange(scan.end + 2)
        pairs.append((x, x + rng.randrange(1, 30)))
    return pairs


def all_pairs(scan: PartitionScan) -> list:
    pts = boundaries(scan) if scan.end > 40 else list(range(scan.end + 2))
    return [(x, y) for i, x in enumerate(pts) for y in pts[i:]]


def check_partition(broker, topic, p, rng=None, exhaustive=False) -> PartitionScan:
    scan = brute_force(broker, topic, p)
    compare(broker, topic, p, scan, all_pairs(scan) if exhaustive else sampled_pairs(scan, rng))
    return scan


def copy_live_dir(src: str, dst: str) -> None:
    """Copy a live broker's data directory file by file (its LOCK, its
    control socket and the temporary files of a snapshot being written
    excepted)."""
    for root, _, files in os.walk(src):
        out = os.path.join(dst, os.path.relpath(root, src))
        os.makedirs(out, exist_ok=True)
        for name in files:
            if name in ("LOCK", "control.sock") or name.endswith(".tmp"):
                continue
            try:
                shutil.copyfile(os.path.join(root, name), os.path.join(out, name))
            except FileNotFoundError:       # renamed over meanwhile by the snapshot timer
                pass


# -- the workload ------------------------------------------------------------------------------

class MTxn:
    """The model of one transaction."""

    def __init__(self, handle, tp=None):
        self.handle = handle
        self.words = handle.id.words
        self.tp = tp                      # the TransactionalProducer instance that began it, or None
        self.state = "open"               # open | committed | aborted
        self.how = None
        self.first = {}                   # (topic, p) -> (first offset, producer id)

    def __repr__(self):
        return f"MTxn({self.handle.id}, {self.state}, {self.how}, {self.first})"


class KafkaViewMachine(RuleBasedStateMachine):
    steps = 0                             # summed over every example of a run
    rule_counts = {}                      # operation (and reopen:<damage>, reopen:crash|close) -> times run

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="txmq-kafkaview-")
        self.broker = None
        self.length = {k: 0 for k in PARTITION_KEYS}     # offsets (data + markers) per partition
        self.txns = []                                   # MTxn, every broker life
        self.named_pid = {}                              # (topic, name) -> producer id, every life
        self.tid_pid = {}                                # tid -> (producer id, epoch), every life
        self.serial = 0
        self.life_steps = 0

    @initialize(seg=st.sampled_from(SEGMENT_SIZES), seed=st.integers(0, 2**32 - 1))
    def start(self, seg, seed):
        self.seg = seg
        self.rng = random.Random(seed)
        self._open()
        for t, n in TOPICS.items():
            self.broker.create_topic(t, partitions=n)

    def _open(self):
        self.broker = txmq.Broker(self.dir, fsync="never", segment_bytes_max=self.seg)
        self.anon = defaultdict(list)     # topic -> anonymous producers of this life
        self.named = {}                   # (topic, name) -> live named producer
        self.tps = {}                     # tid -> live TransactionalProducer
        self.life_steps = 0

    def teardown(self):
        if self.broker is not None:
            self.broker.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _count(self, name):
        counts = type(self).rule_counts
        counts[name] = counts.get(name, 0) + 1

    # -- model helpers --------------------------------------------------------------------------

    def open_txns(self):
        return [T for T in self.txns if T.state == "open"]

    def _value(self, data):
        self.serial += 1
        # Some large messages (a batch of 3 still fits a 4 KiB segment), so
        # that segments roll often and transactions span them.
        pad = data.draw(st.one_of(st.integers(0, 64), st.integers(256, 1000)), label="pad")
        return b"v%06d-" % self.serial + b"x" * pad

    def _end_model(self, T, commit, how):
        assert T.state == "open", T
        T.state = "committed" if commit else "aborted"
        T.how = how
        for tp in T.first:
            self.length[tp] += 1          # its marker

    def _senders(self, t, T, data):
        """Producers that may write into ``T`` (None: plain) on topic ``t``."""
        out = list(self.anon[t]) + [p for (tt, _), p in self.named.items() if tt == t]
        if T is not None and T.tp is not None:
            out.append(T.tp.producer(t))
        if not out or data.draw(st.integers(0, 7), label="fresh anonymous") == 0:
            p = self.broker.producer(t)
            self.anon[t].append(p)
            out.append(p)
        return out

    def _send(self, data, T):
        """1-3 messages to a random partition (one batch, or one send each),
        by a random producer allowed to write into ``T``."""
        tp = data.draw(st.sampled_from(PARTITION_KEYS), label="partition")
        n = data.draw(st.integers(1, 3), label="n")
        batch = data.draw(st.booleans(), label="batch")
        t, p = tp
        producer = data.draw(st.sampled_from(self._senders(t, T, data)), label="producer")
        h = T.handle if T else None
        values = [self._value(data) for _ in range(n)]
        if batch:
            offsets = [int(o) for o in producer.send_batch(values, partition=p, txn=h).offsets]
        else:
            offsets = [producer.send(v, partition=p, txn=h).offset for v in values]
        end = self.length[tp]
        assert offsets == list(range(end, end + n)), (offsets, end)
        self.length[tp] = end + n
        if T is not None:
            T.first.setdefault(tp, (end, producer.producer_id))

    # -- rules ------------------------------------------------------------------------------------

    # One rule draws the operation, with weights: Hypothesis' per-rule swarm
    # testing would spend whole examples on the cheap rules (opening named
    # producers, flushing) and starve the transactions.
    OPS = (["begin"] * 4 + ["send_txn"] * 8 + ["send_plain"] * 3 + ["end"] * 5 + ["reopen"] * 2
           + ["fence_tid", "named_producer", "flush", "check_every_pair"])

    def _applicable(self, op):
        if op == "begin":
            return len(self.open_txns()) < MAX_OPEN
        if op in ("send_txn", "end"):
            return bool(self.open_txns())
        if op == "reopen":
            return self.life_steps >= 4
        return True

    @rule(data=st.data())
    def step(self, data):
        ops = [op for op in self.OPS if self._applicable(op)]
        op = data.draw(st.sampled_from(ops), label="op")
        type(self).steps += 1
        self.life_steps += 1
        self._count(op)
        getattr(self, op)(data)

    def begin(self, data):
        """Begin a transaction: new_transaction(), or the next transaction of
        a transactional producer (opened first if it has no live instance;
        one whose transaction is still open refuses a second)."""
        tp = None
        if data.draw(st.sampled_from(["new", "tp"]), label="kind") == "tp":
            tid = data.draw(st.sampled_from(TIDS), label="tid")
            tp = self.tps.get(tid) or self._open_tid(tid)
            cur = [T for T in self.open_txns() if T.tp is tp]
            if cur:
                with pytest.raises(InvalidTxnStateError):
                    tp.begin()
                return
            h = tp.begin()
        else:
            h = self.broker.new_transaction()
        assert h.state is TxnState.OPEN
        assert all(T.words != h.id.words for T in self.txns), f"TxnID {h.id} handed out twice"
        self.txns.append(MTxn(h, tp))

    def _open_tid(self, tid):
        """Open (again) a transactional id: the older instance is fenced and
        its open transaction aborted; the id keeps its producer id with the
        next epoch."""
        old = self.tps.get(tid)
        tp = self.broker.transactional_producer(tid)
        if tid in self.tid_pid:
            pid, epoch = self.tid_pid[tid]
            assert (tp.producer_id, tp.epoch) == (pid, epoch + 1), (tid, tp.producer_id, tp.epoch, pid, epoch)
        self.tid_pid[tid] = (tp.producer_id, tp.epoch)
        self.tps[tid] = tp
        if old is not None:
            for T in self.open_txns():
                if T.tp is old:
                    self._end_model(T, False, "fenced")
                    assert T.handle.state is TxnState.ABORTED, T
            with pytest.raises(ProducerFencedError):
                old.begin()
        return tp

    def fence_tid(self, data):
        """Open a transactional id again while the older instance may have
        a transaction open (it is aborted) and may still try to send."""
        tid = data.draw(st.sampled_from(TIDS), label="tid")
        old = self.tps.get(tid)
        stale = old.producer(data.draw(st.sampled_from(sorted(TOPICS)), label="topic")) if old else None
        old_txn = next((T for T in self.open_txns() if old is not None and T.tp is old), None)
        self._open_tid(tid)
        if stale is not None:
            with pytest.raises(ProducerFencedError):
                stale.send(b"fenced", partition=0, txn=old_txn.handle if old_txn else None)

    def named_producer(self, data):
        """Open a named producer (again): same producer id in every life; an
        older instance is fenced and appends nothing."""
        t = data.draw(st.sampled_from(sorted(TOPICS)), label="topic")
        name = data.draw(st.sampled_from(NAMES), label="name")
        old = self.named.get((t, name))
        p = self.broker.producer(t, name=name)
        assert self.named_pid.setdefault((t, name), p.producer_id) == p.producer_id
        self.named[(t, name)] = p
        if old is not None:
            with pytest.raises(ProducerFencedError):
                old.send(b"fenced", partition=0)

    def send_txn(self, data):
        """1-3 messages into an open transaction (one batch, or one send each),
        by any producer allowed to."""
        T = data.draw(st.sampled_from(self.open_txns()), label="txn")
        self._send(data, T)

    def send_plain(self, data):
        self._send(data, None)

    def end(self, data):
        """Commit, abort, or force-abort (broker.abort_transaction)."""
        how = data.draw(st.sampled_from(["commit", "abort", "abort", "forced"]), label="how")
        T = data.draw(st.sampled_from(self.open_txns()), label="txn")
        if how == "commit":
            T.handle.commit()
        elif how == "abort":
            T.handle.abort()
        else:
            self.broker.abort_transaction(T.handle.id)
        self._end_model(T, how == "commit", how)
        assert T.handle.state is (TxnState.COMMITTED if how == "commit" else TxnState.ABORTED)

    def flush(self, data):
        """Indexes, recovery point and both snapshots as of now: a reopen
        then replays only what follows."""
        self.broker.flush()

    def reopen(self, data):
        """Close, optionally delete derived files, reopen: recovery aborts
        every transaction still open (an ABORT marker on each of its
        partitions) and rebuilds what was deleted.

        ``crash``: instead of closing, reopen a copy of the live data
        directory (what a kill -9 between two calls leaves under
        fsync="never": the page cache survives). Its snapshots and
        recovery points are those of the last roll or flush, so recovery
        replays the log after them and keeps only the .txnindex entries
        below them."""
        damage = data.draw(st.sampled_from(DAMAGE), label="damage")
        crash = data.draw(st.sampled_from([False, False, True]), label="crash")
        self._count(f"reopen:{damage}")
        self._count("reopen:crash" if crash else "reopen:close")
        if crash:
            image = tempfile.mkdtemp(prefix="txmq-kafkaview-")
            copy_live_dir(self.dir, image)
            self.broker.close()
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = image
        else:
            self.broker.close()
        doomed = []
        for t, p in PARTITION_KEYS:
            pdir = os.path.join(self.dir, "topics", t, str(p))
            idx = sorted(glob.glob(os.path.join(pdir, "*.txnindex")))
            if damage in ("txnindex", "txnindex+snapshots"):
                doomed += idx
            elif damage == "txnindex_some":
                doomed += [f for f in idx if data.draw(st.booleans(), label=f"delete {os.path.basename(f)}")]
            if damage in ("txnbuffer", "snapshots", "txnindex+snapshots"):
                doomed.append(os.path.join(pdir, "txnbuffer.snap"))
            if damage in ("producers", "snapshots", "txnindex+snapshots"):
                doomed.append(os.path.join(pdir, "producers.snap"))
            if damage == "recovery_point":
                doomed.append(os.path.join(pdir, "recovery-point"))
        for f in doomed:
            os.remove(f)
        self._open()
        for T in self.open_txns():
            self._end_model(T, False, "recovery")

    def check_every_pair(self, data):
        """aborted_transactions on every pair of boundary offsets (every pair
        of offsets while the partition is short)."""
        for t, p in PARTITION_KEYS:
            check_partition(self.broker, t, p, exhaustive=True)

    # -- the invariant ----------------------------------------------------------------------------

    @invariant()
    def agrees_with_brute_force(self):
        if self.broker is None:
            return
        for t, p in PARTITION_KEYS:
            scan = check_partition(self.broker, t, p, self.rng)
            # The oracle against the workload.
            assert scan.end == self.length[(t, p)], (t, p, scan.end, self.length[(t, p)])
            mine = {T.words: T for T in self.txns if (t, p) in T.first}
            assert set(scan.txns) == set(mine), (t, p, sorted(scan.txns), mine)
            for words, T in mine.items():
                s = scan.txns[words]
                assert (s.first, s.pid) == T.first[(t, p)], (t, p, T, s)
                assert (s.marker < 0) == (T.state == "open"), (t, p, T, s)
                if s.marker >= 0:
                    assert s.commit == (T.state == "committed"), (t, p, T, s)


PHASES = [Phase.explicit, Phase.reuse, Phase.generate]
if os.environ.get("TXMQ_MODEL_SHRINK") == "1":
    PHASES.append(Phase.shrink)


def _run(examples, steps, min_steps):
    KafkaViewMachine.steps = 0
    KafkaViewMachine.rule_counts = {}
    run_state_machine_as_test(KafkaViewMachine, settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, phases=PHASES,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]))
    counts = KafkaViewMachine.rule_counts
    print(f"\n{KafkaViewMachine.steps} steps: {dict(sorted(counts.items()))}")
    assert KafkaViewMachine.steps >= min_steps, f"only {KafkaViewMachine.steps} steps ran: {counts}"
    # The rebuild paths ran: every kind of damage before a reopen.
    missing = [d for d in set(DAMAGE) | {"crash", "close"} if not counts.get(f"reopen:{d}")]
    assert not missing, f"no reopen after {missing}: {counts}"


def test_kafka_view_matches_brute_force():
    _run(EXAMPLES, STEPS_PER_EXAMPLE, MIN_STEPS)


@pytest.mark.slow
def test_kafka_view_matches_brute_force_long():
    _run(SLOW_EXAMPLES, SLOW_STEPS_PER_EXAMPLE, SLOW_EXAMPLES * SLOW_STEPS_PER_EXAMPLE // 2)


# -- fixed scenarios: the rebuild paths, for certain ----------------------------------------------

def _workload(broker):
    """Aborted, committed and open transactions spanning several segments,
    several producers per transaction, plain sends between."""
    broker.create_topic("a", partitions=2)
    anon = broker.producer("a")
    named = broker.producer("a", name="n")
    tp = broker.transactional_producer("tid")
    txns = []
    for round_ in range(12):
        t1 = broker.new_transaction()
        t2 = tp.begin()
        for i in range(6):
            for p in range(2):
                anon.send(b"plain-%d-%d" % (round_, i) + b"x" * 50, partition=p)
                (named if i % 2 else anon).send(b"t1" + b"y" * 60, partition=p, txn=t1)
                (tp.producer("a") if i % 3 else named).send(b"t2" + b"z" * 40, partition=p, txn=t2)
        txns += [t1, t2]
        (t1.abort if round_ % 3 else t1.commit)()
        if round_ % 2:
            t2.abort()
        elif round_ % 4:
            broker.abort_transaction(t2.id)
        else:
            t2.commit()
    txns.append(broker.new_transaction())            # left open: recovery aborts it
    anon.send(b"open", partition=0, txn=txns[-1])
    named.send(b"open", partition=1, txn=txns[-1])
    return txns


def _check_all(broker):
    scans = []
    for p in range(2):
        scans.append(check_partition(broker, "a", p, exhaustive=True))
    return scans


@pytest.mark.parametrize("damage", [
    (),
    ("*.txnindex",),
    ("txnbuffer.snap", "producers.snap"),
    ("*.txnindex", "txnbuffer.snap", "producers.snap"),
    ("*.txnindex", "producers.snap"),
    ("*.txnindex", "recovery-point"),
])
def test_rebuild_after_deleting_derived_files(tmp_path, damage):
    broker = txmq.Broker(tmp_path, fsync="never", segment_bytes_max=4096, linger_ms=0)
    try:
        _workload(broker)
        before = _check_all(broker)
        assert all(len(s.seg_bases) >= 3 for s in before), [s.seg_bases for s in before]
        assert all(len(s.aborted) >= 10 for s in before)
        assert all(s.lso < s.end for s in before)               # the open transaction holds it back
        # A transaction whose first batch is in one segment and marker in a later one.
        assert any(any(s.seg_bases[i] <= a.first_offset < s.seg_bases[i + 1] <= a.last_offset
                       for i in range(len(s.seg_bases) - 1) for a in s.aborted) for s in before)
    finally:
        broker.close()
    removed = 0
    for p in range(2):
        for pattern in damage:
            for f in glob.glob(os.path.join(tmp_path, "topics", "a", str(p), pattern)):
                os.remove(f)
                removed += 1
    assert removed >= len(damage) * 2
    broker = txmq.Broker(tmp_path, fsync="never", segment_bytes_max=4096, linger_ms=0)
    try:
        after = _check_all(broker)
        for b, a in zip(before, after):
            # Recovery appended one ABORT marker for the open transaction.
            assert a.end == b.end + 1 and a.lso == a.end
            assert a.aborted[:-1] == [x for x in b.aborted]
            assert a.aborted[-1].first_offset == b.lso and a.aborted[-1].last_offset == b.end
    finally:
        broker.close()
    broker = txmq.Broker(tmp_path, fsync="never", segment_bytes_max=4096, linger_ms=0)    # and once more, undamaged
    try:
        assert [s.aborted for s in _check_all(broker)] == [s.aborted for s in after]
    finally:
        broker.close()
