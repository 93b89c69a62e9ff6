"""Read-only opening of a data directory (docs/ARCHITECTURE.md, ``txmq.readonly``).

A writer in a separate process (tests/workers/readonly_writer.py) holds the
directory open and keeps appending plain messages and transactions that it
commits or aborts (values say which: ``P|n``, ``C|txn|i``, ``A|txn|i``),
with small segments and retention deleting the oldest ones, while this
process opens the directory read-only over and over. Each round takes one
view per partition and checks, against what the values say and against
the earlier rounds:

- read_committed: offsets strictly increase and lie below the view's
  maxReadPosition; no aborted data (``A``), no marker (empty value); every
  ``C`` value's transaction was already being committed (the writer logs it
  to the status file before calling ``commit()``, so a ``C`` seen before
  its name is there is an open transaction's data); the messages below an
  earlier round's maxReadPosition are exactly those that round saw (minus
  what retention deleted): a committed prefix never changes.
- read_uncommitted (a later view): every data message up to the log end,
  markers never; below the committed view's maxReadPosition it is the
  committed read plus exactly the ``A`` messages.
- read_arrow returns the same rows as read, and the value column's data
  buffer lies inside a mapped segment (no copy).
- log start, maxReadPosition and log end never move back.

Then: after SIGKILL of the writer (the view starts from the last published
readview and scans past it; it must be a prefix of what a recovering writer
then shows), after a clean close, and with the readview files deleted
(read-only recovery from the segments); the reader changes no file and
creates none. Torn readview slots are passed over; a partition a live
writer is recovering is waited for, never scanned.
"""

import hashlib
import os
import stat
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest

import txmq
import txmq.readonly as readonly
from txmq.errors import DataDirLockedError, InvalidArgumentError
from txmq._readview import READVIEW_HEAD, READVIEW_SLOT, RV_LIVE, RV_RECOVERING
from killer import worker

WRITER = worker("readonly_writer.py")
PARTITIONS = (0, 1, 2)


def start_writer(data, status, seconds, seed, retention=None):
    args = [sys.executable, str(WRITER), str(data), str(status), str(seconds), str(seed)]
    if retention is not None:
        args.append(str(retention))
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def files_of(root) -> dict:
    """name -> (size, mtime_ns, sha256) of every file under ``root``."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            full = os.path.join(dirpath, n)
            st = os.stat(full)
            if not stat.S_ISREG(st.st_mode):
                continue                 # the owner's control socket
            with open(full, "rb") as f:
                out[os.path.relpath(full, root)] = (st.st_size, st.st_mtime_ns, hashlib.sha256(f.read()).hexdigest())
    return out


def committed_names(status) -> set:
    try:
        return set(Path(status).read_text().split())
    except FileNotFoundError:
        return set()


def mapped_ranges(view):
    out = []
    for s in view.segments:
        if s.segment.mapping is None:
            continue              # an empty file (a segment just rolled): nothing mapped
        whole = memoryview(s.segment.mapping)
        out.append((pa.py_buffer(whole).address, len(whole)))
    return out


class History:
    """What earlier rounds saw of one partition."""

    def __init__(self):
        self.seen = {}            # offset -> value, read_committed
        self.lso = 0
        self.hwm = 0
        self.start = 0


def check_round(ro, status, histories, arrow=True):
    """One round of reads over every partition; the checks of the module
    docstring. Returns how many committed messages it saw."""
    total = 0
    for p in PARTITIONS:
        h = histories[p]
        view = ro.view("t", p)
        assert view.log_start >= h.start and view.max_read_position >= h.lso and view.log_end >= h.hwm
        assert view.log_start <= view.max_read_position <= view.log_end
        msgs = [(m.offset, m.value) for m in view.read(0)]
        names = committed_names(status)          # read after: a commit logged before the data showed
        offsets = [o for o, _ in msgs]
        assert offsets == sorted(set(offsets))
        assert all(view.log_start <= o < view.max_read_position for o in offsets)
        for o, v in msgs:
            kind = v.split(b"|")
            assert kind[0] in (b"P", b"C"), (p, o, v)
            if kind[0] == b"C":
                assert kind[1].decode() in names, f"{p}@{o}: {v!r} seen before its commit began"
        # A committed prefix never changes: same messages below the old LSO.
        now = dict(msgs)
        for o, v in now.items():
            if o < h.lso:
                assert h.seen.get(o) == v, (p, o, v, h.seen.get(o))
        for o, v in h.seen.items():
            if o >= view.log_start:
                assert now.get(o) == v, (p, o, v)
        if arrow:
            ranges = mapped_ranges(view)
            rows = []
            for rb in view.read_arrow(0, max_rows=7, gather_below=0):       # every batch a view
                col = rb.column("value")
                addr = col.buffers()[2].address
                assert any(lo <= addr < lo + n for lo, n in ranges), "value bytes were copied"
                rows.extend(zip(rb.column("offset").to_pylist(), col.to_pylist()))
                assert rb.column("partition").to_pylist() == [p] * rb.num_rows
            assert rows == msgs
            gathered = list(view.read_arrow(0, max_rows=7))               # small batches copied together
            assert [(o, v) for rb in gathered for o, v in zip(rb.column("offset").to_pylist(),
                                                             rb.column("value").to_pylist())] == msgs
            assert all(rb.num_rows <= 7 for rb in gathered)
        later = ro.view("t", p)
        unc = [(m.offset, m.value) for m in later.read(0, isolation="read_uncommitted")]
        assert all(v and v[:1] in b"PCA" for _, v in unc), "a marker was delivered"
        assert all(o < later.log_end for o, _ in unc)
        lo = max(view.log_start, later.log_start)
        below = [(o, v) for o, v in unc if lo <= o < view.max_read_position]
        assert [x for x in below if not x[1].startswith(b"A")] == [x for x in msgs if x[0] >= lo]
        h.seen = {o: v for o, v in now.items()}
        h.lso, h.hwm, h.start = view.max_read_position, view.log_end, view.log_start
        total += len(msgs)
    return total


def test_reads_are_committed_prefixes_while_a_writer_runs(tmp_path):
    data, status = tmp_path / "data", tmp_path / "status"
    writer = start_writer(data, status, 10, seed=7, retention=48 * 1024)
    try:
        ro = readonly.open(data)
        assert ro.topics() == ["t"] and ro.partitions("t") == [0, 1, 2]
        assert readonly.writer_pid(data) == writer.pid
        histories = {p: History() for p in PARTITIONS}
        rounds = seen = 0
        while writer.poll() is None:
            seen += check_round(ro, status, histories)
            rounds += 1
        assert writer.returncode == 0
        assert rounds >= 5 and seen > 0
        assert any(h.start > 0 for h in histories.values()), "retention never deleted a segment"
        # The writer closed cleanly: its last view is exact, from the readview.
        final = {p: ro.view("t", p) for p in PARTITIONS}
        assert all(v.source == "readview" for v in final.values())
        assert all(v.max_read_position == v.log_end for v in final.values())   # nothing left open
        check_round(ro, status, histories)
    finally:
        writer.kill()
        writer.wait()


def test_after_sigkill_a_prefix_of_what_recovery_shows(tmp_path):
    data, status = tmp_path / "data", tmp_path / "status"
    writer = start_writer(data, status, 60, seed=11)
    time.sleep(1.5)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    assert readonly.writer_pid(data) is None
    before = files_of(data)
    ro = readonly.open(data)
    histories = {p: History() for p in PARTITIONS}
    check_round(ro, status, histories)
    views = {p: ro.view("t", p) for p in PARTITIONS}
    assert all(v.source == "readview+scan" for v in views.values())
    # Reading a dead writer's directory changes and creates nothing.
    assert files_of(data) == before
    # Without readviews: read-only recovery from the segments alone agrees.
    scanned = tmp_path / "scanned"
    shutil.copytree(data, scanned, ignore=shutil.ignore_patterns("control.sock"))
    for p in PARTITIONS:
        os.unlink(scanned / "topics" / "t" / str(p) / "readview")
    ro_scan = readonly.open(scanned)
    for p in PARTITIONS:
        v = ro_scan.view("t", p)
        assert v.source == "scan"
        assert (v.log_end, v.max_read_position) == (views[p].log_end, views[p].max_read_position)
        assert [(m.offset, m.value) for m in v.read(0)] == [(m.offset, m.value) for m in views[p].read(0)]
    # The next writer recovers (aborting what was open): what the reader
    # saw is a prefix of what it then shows.
    recovered = tmp_path / "recovered"
    shutil.copytree(data, recovered, ignore=shutil.ignore_patterns("control.sock"))
    with txmq.Broker(recovered, fsync="never") as b:
        for p in PARTITIONS:
            b.high_watermark("t", p)      # partitions open (and recover) on first use
    ro_rec = readonly.open(recovered)
    for p in PARTITIONS:
        v = ro_rec.view("t", p)
        assert v.source == "readview" and v.max_read_position >= views[p].max_read_position
        mine = [(m.offset, m.value) for m in views[p].read(0)]
        theirs = [(m.offset, m.value) for m in v.read(0, views[p].max_read_position)]
        assert mine == theirs


def test_closed_directory_and_files_untouched(tmp_path):
    data = tmp_path / "data"
    with txmq.Broker(data, fsync="never", linger_ms=0) as b:    # (the aborted send is in the log)
        b.create_topic("t", 1)
        prod = b.producer("t")
        prod.send(b"one", key=b"k", headers={"h": b"1"})
        prod.send_batch([b"two", b"three"])
        t = b.new_transaction()
        prod.send(b"gone", txn=t)
        t.abort()
        t = b.new_transaction()
        prod.send(b"four", txn=t)
        t.commit()
    before = files_of(data)
    with readonly.open(data) as ro:
        assert ro.offsets("t", 0) == {"log_start": 0, "last_stable": 7, "high_watermark": 7, "source": "readview"}
        msgs = list(ro.read("t", 0, 0))
        assert [m.value for m in msgs] == [b"one", b"two", b"three", b"four"]
        assert [m.offset for m in msgs] == [0, 1, 2, 5]
        assert msgs[0].key == b"k" and msgs[0].headers == [("h", b"1")] and msgs[3].txn_id is not None
        unc = [m.value for m in ro.read("t", 0, 0, isolation="read_uncommitted")]
        assert unc == [b"one", b"two", b"three", b"gone", b"four"]
        rb1, rb3 = ro.read_arrow("t", 0, 1, 6, include_headers=True, timestamp_unit="us",
                                 gather_below=0)                         # 3, 4: the abort
        assert rb1.to_pydict()["value"] == [b"two", b"three"] and rb1.to_pydict()["key"] == [None, None]
        assert rb3.num_rows == 1 and rb3.column("offset").to_pylist() == [5]
        assert rb1.schema.field("timestamp").type == pa.timestamp("us", tz="UTC")
        (together,) = ro.read_arrow("t", 0, 1, 6, include_headers=True, timestamp_unit="us")
        assert together.to_pydict() == {k: rb1.to_pydict()[k] + rb3.to_pydict()[k] for k in rb1.schema.names}
        first = next(iter(ro.read_arrow("t", 0, 0, 1, include_headers=True)))
        assert first.to_pydict()["headers"] == [[{"key": "h", "value": b"1"}]]
        assert first.to_pydict()["timestamp"][0].timestamp() * 1000 == pytest.approx(msgs[0].event_time)
        with pytest.raises(InvalidArgumentError):
            ro.read("t", 0, 0, isolation="dirty")
    assert files_of(data) == before


def test_arrays_outlive_retention_of_their_segment(tmp_path):
    data = tmp_path / "data"
    b = txmq.Broker(data, fsync="never", segment_bytes_max=4096)
    try:
        b.create_topic("t", 1, retention_bytes=4096)
        prod = b.producer("t")
        for i in range(20):
            prod.send(b"%03d" % i + b"x" * 500)
        ro = readonly.open(data)
        batches = list(ro.read_arrow("t", 0, 0))
        first_file = data / "topics" / "t" / "0" / f"{0:020d}.log"
        assert first_file.exists()
        assert b.enforce_retention() > 0 and not first_file.exists()
        assert [v[:3] for rb in batches for v in rb.column("value").to_pylist()] == [b"%03d" % i for i in range(20)]
        v = ro.view("t", 0)
        assert v.log_start > 0
        assert [m.offset for m in v.read(0)] == list(range(v.log_start, 20))
    finally:
        b.close()


def test_torn_slots_and_a_partition_being_recovered(tmp_path):
    data = tmp_path / "data"
    b = txmq.Broker(data, fsync="never")
    try:
        b.create_topic("t", 1)
        b.producer("t").send(b"x")
        rv_path = data / "topics" / "t" / "0" / "readview"
        raw = bytearray(rv_path.read_bytes())
        good = readonly.read_readview(bytes(raw))
        assert good.state == RV_LIVE and good.log_end == 1
        # The newest slot torn (opening generation ahead of the closing one):
        # the older whole slot is taken.
        newest = READVIEW_HEAD.size + READVIEW_SLOT.size * (good.generation & 1)
        torn = bytearray(raw)
        torn[newest:newest + 8] = (good.generation + 2).to_bytes(8, "little")
        older = readonly.read_readview(bytes(torn))
        assert older is not None and older.generation == good.generation - 1
        other = READVIEW_HEAD.size + READVIEW_SLOT.size * (1 - (good.generation & 1))
        torn[other:other + 8] = (good.generation + 3).to_bytes(8, "little")
        assert readonly.read_readview(bytes(torn)) is None
        # A live writer recovering the partition is waited for, not scanned.
        part = b._topics["t"].partitions[0]
        part._readview.publish(RV_RECOVERING, 0, 0, 0, 0, 0, 0)
        ro = readonly.open(data, wait_s=0.2)
        with pytest.raises(DataDirLockedError):
            ro.view("t", 0)
        with part.lock:
            part._publish(part.end_offset)
        assert [m.value for m in ro.read("t", 0, 0)] == [b"x"]
    finally:
        b.close()


def test_inspection_of_subscriptions_and_transactions(tmp_path):
    data = tmp_path / "data"
    b = txmq.Broker(data, fsync="never")
    try:
        b.create_topic("t", 1)
        prod = b.producer("t")
        prod.send_batch([b"a", b"b", b"c", b"d"])
        c = b.subscribe("t", "s", initial_position="earliest")
        ms = c.receive_many(4, timeout=1.0)
        c.ack(ms[0])
        c.ack(ms[2])
        t = b.new_transaction()
        c.ack(ms[1], txn=t)
        prod.send(b"e", txn=t)
        t.flush()                  # its send and ack reach the files another process reads
        ro = readonly.open(data)
        info = ro.subscription("t", "s")
        assert ro.subscriptions("t") == ["s"]
        assert info["partitions"][0]["mark_delete"] == 1
        assert info["partitions"][0]["pending_transactions"] == 1
        assert info["partitions"][0]["backlog"] == 2          # offsets 1 and 3; 4 is not committed
        (open_txn,) = ro.transactions()
        assert open_txn["id"] == str(t.id) and open_txn["state"] == "OPEN"
        assert open_txn["partitions"] == ["t/0"] and open_txn["subscriptions"] == ["t/s"]
        t.commit()
        # Its COMMITTED frame and its cursor frame wait for their logs' next
        # write, which the broker's scheduler makes within one timeout check.
        deadline = time.monotonic() + 10
        while ((ro.transactions() or ro.subscription("t", "s")["partitions"][0]["mark_delete"] != 3)
               and time.monotonic() < deadline):
            time.sleep(0.01)
        assert ro.transactions() == []
        assert ro.subscription("t", "s")["partitions"][0]["mark_delete"] == 3
    finally:
        b.close()


def test_out_of_order_reads_and_backlog_past_an_open_transaction(tmp_path):
    """``allow_out_of_order_delivery``: a read to the log end that skips the
    transactions open (and aborted) as of a view, the same whatever they
    became since (``as_of``); and the backlog of an out-of-order
    subscription counts committed data past an open transaction and not the
    open one's, as the owner's stats() does."""
    data = tmp_path / "data"
    with txmq.Broker(data, fsync="never", linger_ms=0) as b:
        b.create_topic("t", 1)
        prod = b.producer("t")
        c = b.subscribe("t", "o", "shared", initial_position="earliest", allow_out_of_order_delivery=True)
        prod.send(b"a")                                      # 0
        held = b.new_transaction()
        prod.send_batch([b"h0", b"h1"], txn=held)            # 1, 2
        prod.send(b"b")                                      # 3
        bad = b.new_transaction()
        prod.send(b"x", txn=bad)                             # 4
        bad.abort()                                          # marker 5
        with b.transaction() as txn:
            prod.send(b"c", txn=txn)                         # 6, marker 7
        c.ack(c.receive_many(1, timeout=1.0))               # a
        with readonly.open(data) as ro:
            view = ro.view("t", 0)
            as_of = (view.max_read_position, view.log_end)
            assert as_of == (1, 8)
            past = [m.value for m in ro.read("t", 0, 0, allow_out_of_order_delivery=True)]
            assert past == [b"a", b"b", b"c"]
            assert [m.value for m in ro.read("t", 0, 0)] == [b"a"]
            arrow = ro.read_arrow("t", 0, 0, allow_out_of_order_delivery=True, gather_below=0)
            assert [v for rb in arrow for v in rb.column("value").to_pylist()] == [b"a", b"b", b"c"]
            info = ro.subscription("t", "o")
            assert info["allow_out_of_order_delivery"] is True
            assert info["partitions"][0]["backlog"] == 2 == b.consumer_lag("t", "o")[0]     # b, c
            with pytest.raises(InvalidArgumentError):
                ro.read("t", 0, 0, isolation="read_uncommitted", allow_out_of_order_delivery=True)
        held.commit()
        with readonly.open(data) as ro:
            # Pinned to the earlier view, the transaction open then stays skipped.
            pinned = [m.value for m in ro.read("t", 0, 0, as_of=as_of, allow_out_of_order_delivery=True)]
            assert pinned == [b"a", b"b", b"c"]
            now = [m.value for m in ro.read("t", 0, 0, allow_out_of_order_delivery=True)]
            assert now == [b"a", b"h0", b"h1", b"b", b"c"]
            assert ro.subscription("t", "o")["partitions"][0]["backlog"] == 4 == b.consumer_lag("t", "o")[0]


def test_a_directory_nobody_holds_closes_its_files_without_a_collection(tmp_path):
    """No reference cycle keeps a read-only directory's descriptors and
    mappings alive until the garbage collector runs (a long-lived process
    that opens views in a loop would run out of descriptors first)."""
    import gc

    data = tmp_path / "data"
    with txmq.Broker(data, fsync="never") as b:
        b.create_topic("t", 3)
        b.producer("t").send_batch([b"v%d" % i for i in range(30)])

    def fds():
        return len(os.listdir("/proc/self/fd"))

    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        before = fds()
        for _ in range(20):
            ro = readonly.open(data)
            assert sum(len(list(ro.view("t", p).read(0))) for p in range(3)) == 30
            del ro
        assert fds() == before
    finally:
        if enabled:
            gc.enable()
