"""What a transaction writes to its coordinator log and its pending-ack
logs (docs/FORMAT.md, "Coordinator log"): BEGIN goes out with the first
ADD_PARTITION (a send's, or with the decision), a commit frames no ACK, a
transaction that only acknowledged aborts without a frame, and
sequences come from synced RESERVE blocks so none is handed out twice."""

import os
import signal
import subprocess
import sys

import pytest

import txmq
import txmq.readonly as readonly
from txmq import _redolog, _txnlog as L
from txmq.transactions import coordinator
import txmq.broker.broker as broker_module


def frames(path) -> list:
    with open(path, "rb") as f:
        data = f.read()
    found, _, reason = _redolog.parse(data, len(_redolog.FILE_HEADER), True)
    assert reason is None
    return [(kind, payload) for kind, payload, _ in found]


def kinds_of(path, txn) -> list:
    """The frame types of ``txn`` in the log at ``path``, in order."""
    words = L.pack_txn(*txn.id.words)
    return [kind for kind, payload in frames(path) if payload[:16] == words]


def tc_log(data) -> str:
    return os.path.join(data, "coordinator", "tc-0.log")


@pytest.fixture
def ctp(tmp_path):
    data = str(tmp_path / "d")
    b = txmq.Broker(data, fsync="never", num_coordinators=1)
    b.create_topic("in")
    b.create_topic("out")
    b.producer("in").send_batch([b"m%d" % i for i in range(20)])
    c = b.subscribe("in", "s", initial_position="earliest")
    yield b, c, b.producer("out"), data
    b.close()


def final_records_written(b) -> None:
    """What the scheduler's periodic expire does: the final records that
    wait for the log's next write are written."""
    for tc in b._coordinators:
        tc.expire()


def test_a_consume_process_produce_commit_writes_three_coordinator_frames_and_no_ack_frame(ctp):
    b, c, p, data = ctp
    previous = None
    for per_message in (False, True):
        msgs = c.receive_many(5, 1.0)
        txn = b.new_transaction()
        assert kinds_of(tc_log(data), txn) == []                 # beginning writes nothing
        if per_message:
            for m in msgs:
                p.send(m.value.upper(), txn=txn)
                c.ack(m, txn=txn)
        else:
            p.send_batch([m.value.upper() for m in msgs], txn=txn)
            c.ack(msgs, txn=txn)
        txn.commit()
        # BEGIN rides with the first ADD_PARTITION; no ADD_SUBSCRIPTION: the
        # DECIDED record names the acks. COMMITTED waits for the log's next
        # write: the next transaction's first frame carries it.
        assert kinds_of(tc_log(data), txn) == [L.TC_BEGIN, L.TC_ADD_PARTITION, L.TC_DECIDED]
        if previous is not None:
            assert kinds_of(tc_log(data), previous) == [L.TC_BEGIN, L.TC_ADD_PARTITION, L.TC_DECIDED,
                                                        L.TC_COMMITTED]
        previous = txn
        pending = os.path.join(data, "subscriptions", "in", "s", "pending-0.log")
        assert L.PA_ACK not in [k for k, payload in frames(pending) if payload[:16] == L.pack_txn(*txn.id.words)]
    b.close()                                          # (writes the last COMMITTED)
    assert kinds_of(tc_log(data), previous) == [L.TC_BEGIN, L.TC_ADD_PARTITION, L.TC_DECIDED, L.TC_COMMITTED]
    with txmq.Broker(data, fsync="never", num_coordinators=1) as again:
        out = again.subscribe("out", "o", initial_position="earliest").receive_many(100, 1.0)
        assert [m.value for m in out] == [b"M%d" % i for i in range(10)]
        left = again.subscribe("in", "s").receive_many(100, 1.0)
        assert [m.value for m in left] == [b"m%d" % i for i in range(10, 20)]


def test_an_acks_only_commit_writes_begin_with_its_decision(ctp):
    b, c, _, data = ctp
    msgs = c.receive_many(3, 1.0)
    txn = b.new_transaction()
    c.ack(msgs, txn=txn)
    txn.commit()
    assert kinds_of(tc_log(data), txn) == [L.TC_BEGIN, L.TC_DECIDED]
    final_records_written(b)
    assert kinds_of(tc_log(data), txn) == [L.TC_BEGIN, L.TC_DECIDED, L.TC_COMMITTED]


def test_an_abort_before_any_append_writes_nothing(ctp):
    b, c, _, data = ctp
    b.new_transaction().abort()                       # (the first reserves a block of sequences)
    size = os.path.getsize(tc_log(data))
    before = frames(tc_log(data))
    msgs = c.receive_many(3, 1.0)
    txn = b.new_transaction()
    c.ack(msgs, txn=txn)
    txn.abort()
    assert frames(tc_log(data)) == before and os.path.getsize(tc_log(data)) == size
    # The aborted acks come again.
    assert [m.offset for m in c.receive_many(3, 1.0)] == [m.offset for m in msgs]


def test_an_abort_after_an_append_is_logged(ctp):
    b, _, p, data = ctp
    txn = b.new_transaction()
    p.send(b"x", txn=txn).offset                       # appended now
    txn.abort()
    final_records_written(b)
    assert kinds_of(tc_log(data), txn) == [L.TC_BEGIN, L.TC_ADD_PARTITION, L.TC_ABORTING, L.TC_ABORTED]


def test_flush_logs_the_transactions_subscriptions(ctp):
    b, c, _, data = ctp
    txn = b.new_transaction()
    c.ack(c.receive_many(2, 1.0), txn=txn)
    assert kinds_of(tc_log(data), txn) == []
    txn.flush()
    assert kinds_of(tc_log(data), txn) == [L.TC_BEGIN, L.TC_ADD_SUBSCRIPTION]
    txn.flush()                                        # (once)
    txn.abort()
    final_records_written(b)
    assert kinds_of(tc_log(data), txn) == [L.TC_BEGIN, L.TC_ADD_SUBSCRIPTION, L.TC_ABORTING, L.TC_ABORTED]


def test_sequences_come_from_synced_reserved_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(coordinator, "RESERVE_BLOCK", 4)
    data = str(tmp_path / "d")
    with txmq.Broker(data, fsync="never", num_coordinators=1) as b:
        ids = [b.new_transaction() for _ in range(10)]
        for t in ids:
            t.abort()
        reserved = [int.from_bytes(payload, "little") for kind, payload in frames(tc_log(data))
                    if kind == L.TC_RESERVE]
        first = ids[0].id.sequence
        assert reserved == [first + 4, first + 8, first + 12]
        assert [t.id.sequence for t in ids] == list(range(first, first + 10))
    with txmq.Broker(data, fsync="never", num_coordinators=1) as b:
        assert b.new_transaction().id.sequence >= first + 12


CRASH = r"""
import os, signal, sys, txmq
b = txmq.Broker(sys.argv[1], fsync="never", num_coordinators=1)
b.create_topic("t")
c = b.subscribe("t", "s", initial_position="earliest")
b.producer("t").send(b"in")
m = c.receive(1.0)
seen = []
for i in range(int(sys.argv[2])):
    txn = b.new_transaction()
    c.ack(m, txn=txn)                  # never framed: the abort leaves no trace
    txn.abort()
    seen.append(txn.id.sequence)
print(max(seen), flush=True)
os.kill(os.getpid(), signal.SIGKILL)   # a real kill: nothing closed, nothing flushed
"""


@pytest.mark.parametrize("n", [3, 1500])
def test_no_sequence_is_handed_out_again_after_a_crash(tmp_path, n):
    data = str(tmp_path / "d")
    out = subprocess.run([sys.executable, "-c", CRASH, data, str(n)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    highest = int(out.stdout.split()[-1])
    with txmq.Broker(data, fsync="never", num_coordinators=1) as b:
        assert b.new_transaction().id.sequence > highest


def run_child(script: str, data: str) -> str:
    """Run ``script`` (argv[1]: the data directory) in a new process that
    ends without closing its broker, as a crash would; its stdout."""
    out = subprocess.run([sys.executable, "-c", script, data], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


REFUSED_COMPACTION = r"""
import errno, os, sys, txmq
from txmq.transactions import coordinator
b = txmq.Broker(sys.argv[1], fsync="commit", num_coordinators=1)
b.create_topic("out")
p = b.producer("out")
x = b.new_transaction()                        # nothing written for it yet
real_open = os.open
def full(path, *args, **kwargs):               # the disk is full for the snapshot
    if str(path).endswith(".compact"):
        raise OSError(errno.ENOSPC, "No space left on device")
    return real_open(path, *args, **kwargs)
os.open = full
coordinator.COMPACT_FRAMES = coordinator.LIVE_FRAMES = 0      # a compaction is due at every end
t = b.new_transaction(); p.send(b"other", txn=t); t.commit()    # its compaction is refused
os.open = real_open
print(x._meta.logged)
p.send(b"x", txn=x).offset                     # BEGIN must still come with this ADD_PARTITION
x.commit()
os._exit(0)
"""


def test_a_compaction_the_disk_refused_leaves_its_transactions_unlogged(tmp_path):
    data = str(tmp_path / "d")
    assert run_child(REFUSED_COMPACTION, data).split() == ["False"]
    with txmq.Broker(data, fsync="commit", num_coordinators=1) as b:     # (the log replays)
        got = b.subscribe("out", "s", initial_position="earliest").receive_many(10, 1.0)
        assert [m.value for m in got] == [b"other", b"x"]


FAILED_FLUSH = r"""
import os, sys, txmq
from txmq.errors import StorageFullError
b = txmq.Broker(sys.argv[1], fsync="commit", num_coordinators=1)
b.create_topic("in")
b.producer("in").send_batch([b"m%d" % i for i in range(5)])
c = b.subscribe("in", "s", initial_position="earliest")
ms = c.receive_many(5, 1.0)
tc = b._coordinators[0]
class FullOnce:                                # one coordinator write finds the disk full
    def __init__(self, log):
        self._log, self.fail = log, True
    def __getattr__(self, name):
        return getattr(self._log, name)
    def append_many(self, frames):
        if self.fail:
            self.fail = False
            raise StorageFullError(self._log.path, 100)
        return self._log.append_many(frames)
tc.log = FullOnce(tc.log)
t = b.new_transaction()
c.ack(ms[:3], txn=t)
try:
    t.flush()
except StorageFullError:
    print("refused")
t.flush()                                      # space is back
t.prepare("xid-1")
print(t.id)
os._exit(0)
"""


def test_a_refused_flush_does_not_count_its_subscriptions_logged(tmp_path):
    data = str(tmp_path / "d")
    refused, txn = run_child(FAILED_FLUSH, data).split()
    assert refused == "refused"
    with txmq.Broker(data, fsync="commit", num_coordinators=1) as b:
        (prepared,) = b.prepared_transactions()
        assert prepared["id"] == txn and prepared["subscriptions"] == ["in/s"]
        b.commit_prepared(txmq.TxnID.parse(txn))
        assert [m.value for m in b.subscribe("in", "s").receive_many(10, 1.0)] == [b"m3", b"m4"]


COMPACTION_IN_PREPARE = r"""
import os, sys, txmq
from txmq import crashpoints
b = txmq.Broker(sys.argv[1], fsync="commit", num_coordinators=1)
b.create_topic("out")
tc = b._coordinators[0]
crashpoints.ARMED = True                       # another thread compacts right after the PREPARED frame
crashpoints.reached = lambda name: tc.compact() if name == "txn.prepare_recorded" else None
t = b.new_transaction()
b.producer("out").send(b"x", txn=t)
t.prepare("xid")
crashpoints.ARMED = False
print(t.id)
os._exit(0)
"""


def test_a_compaction_during_prepare_keeps_the_transaction_prepared(tmp_path):
    data = str(tmp_path / "d")
    txn = run_child(COMPACTION_IN_PREPARE, data).split()[-1]
    with txmq.Broker(data, fsync="commit", num_coordinators=1) as b:
        assert [p["id"] for p in b.prepared_transactions()] == [txn]
        assert b.prepared_transactions()[0]["xid"] == "xid"
        b.commit_prepared(txmq.TxnID.parse(txn))
        got = b.subscribe("out", "s", initial_position="earliest").receive_many(10, 1.0)
        assert [m.value for m in got] == [b"x"]


DECIDED_ACKS_ONLY = r"""
import sys, txmq
b = txmq.Broker(sys.argv[1], fsync="never", num_coordinators=1)
b.create_topic("in")
b.producer("in").send_batch([b"m0", b"m1"])
c = b.subscribe("in", "s", initial_position="earliest")
txn = b.new_transaction()
c.ack(c.receive_many(2, 1.0), txn=txn)
print(txn.id, flush=True)
txn.commit()                                   # killed once its decision is written (TXMQ_CRASH_AT)
"""


def test_inspection_names_what_a_decided_commit_covers(tmp_path):
    """A commit logs no ADD_SUBSCRIPTION: a read-only view of a directory
    whose owner died between the decision and its fan-out takes the
    subscriptions from the decision record."""
    from txmq import readonly
    data = str(tmp_path / "d")
    out = subprocess.run([sys.executable, "-c", DECIDED_ACKS_ONLY, data], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "TXMQ_CRASH_AT": "txn.decided"})
    assert out.returncode != 0
    txn = out.stdout.split()[0]
    with readonly.open(data) as ro:
        (info,) = ro.transactions()
    assert (info["id"], info["state"], info["subscriptions"]) == (txn, "COMMITTING", ["in/s"])
    with txmq.Broker(data, fsync="never", num_coordinators=1) as b:     # the commit is completed
        assert b.subscribe("in", "s").receive_many(10, 0.3) == []


DEFERRED_LOST = r"""
import os, signal, sys, txmq
import txmq.broker.broker as broker_module
broker_module.TIMEOUT_CHECK_INTERVAL = 3600     # (no periodic write of the deferred frames)
b = txmq.Broker(sys.argv[1], fsync="never", num_coordinators=1)
b.create_topic("in")
b.create_topic("out")
b.producer("in").send_batch([b"m%d" % i for i in range(10)])
c = b.subscribe("in", "s", initial_position="earliest")
p = b.producer("out")
cursor = os.path.join(sys.argv[1], "subscriptions", "in", "s", "cursor-0.log")
for k in range(int(sys.argv[2])):
    msgs = c.receive_many(2, 1.0)
    txn = b.new_transaction()
    for m in msgs:
        p.send(m.value.upper(), txn=txn)
        c.ack(m, txn=txn)
    before = os.path.getsize(cursor)
    txn.commit()
    assert os.path.getsize(cursor) == before      # its cursor frame waits for the log's next write
print(txn.id, flush=True)
os.kill(os.getpid(), signal.SIGKILL)   # the deferred COMMITTED and cursor frames are lost with the process
"""


@pytest.mark.parametrize("n", [1, 3])
def test_a_commit_whose_deferred_frames_a_crash_lost_is_applied_by_recovery(tmp_path, n):
    """A committed transaction's COMMITTED frame and its cursor frame have
    no write of their own: a SIGKILL right after the commit loses both.
    Reopening applies its decision again: its outputs are there once, its
    inputs never come again (exactly once)."""
    data = str(tmp_path / "d")
    out = subprocess.run([sys.executable, "-c", DEFERRED_LOST, data, str(n)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    last = out.stdout.split()[-1]
    assert L.TC_COMMITTED not in [k for k, payload in frames(tc_log(data))
                                  if payload[:16] == L.pack_txn(*txmq.TxnID.parse(last).words)]
    with txmq.Broker(data, fsync="never", num_coordinators=1) as b:
        outs = b.subscribe("out", "o", initial_position="earliest").receive_many(100, 1.0)
        assert [m.value for m in outs] == [b"M%d" % i for i in range(2 * n)]
        left = b.subscribe("in", "s").receive_many(100, 1.0)
        assert [m.value for m in left] == [b"m%d" % i for i in range(2 * n, 10)]
        assert b.recovered_transactions["aborted"] == 0


def test_a_refused_write_of_deferred_frames_stops_no_timeout(tmp_path, monkeypatch):
    """The timeout check writes the deferred final records after its
    aborts: a full disk refusing that write aborts the timed-out
    transactions all the same, and the records go out once there is room."""
    import errno
    import time
    from txmq import TxnState
    data = str(tmp_path / "d")
    b = txmq.Broker(data, fsync="never", num_coordinators=1)
    try:
        b.create_topic("t")
        p = b.producer("t")
        done = b.new_transaction()
        p.send(b"a", txn=done).offset
        done.commit()                                  # its COMMITTED frame waits for the next write

        def full(fd, data, pos):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(_redolog, "pwrite_all", full)
        late = b.new_transaction(0.1)
        deadline = time.monotonic() + 10
        while late.state is TxnState.OPEN and time.monotonic() < deadline:
            time.sleep(0.02)
        assert late.state is TxnState.ABORTED
        assert L.TC_COMMITTED not in kinds_of(tc_log(data), done)
        monkeypatch.undo()
        final_records_written(b)
        assert kinds_of(tc_log(data), done)[-1] == L.TC_COMMITTED
    finally:
        b.close()


def commit_acks(b, n: int, acked: int):
    """Topic "in" with ``n`` messages, subscription "s", and a committed
    transaction that acknowledged the first ``acked``: (consumer, txn)."""
    b.create_topic("in")
    b.producer("in").send_batch([b"m%d" % i for i in range(n)])
    c = b.subscribe("in", "s", initial_position="earliest")
    txn = b.new_transaction()
    c.ack(c.receive_many(acked, 1.0), txn=txn)
    txn.commit()
    return c, txn


def test_a_compaction_whose_participant_cannot_be_made_durable_forgets_nothing(tmp_path, monkeypatch):
    """Compaction makes the participants that applied commits durable
    before the log forgets their decisions. When one cannot be (a full
    disk refusing its deferred cursor frames), a housekeeping compaction
    forgets nothing and keeps every participant to make durable later; the
    next compaction does it, cursor frames included."""
    from txmq.errors import StorageFullError
    data = str(tmp_path / "d")
    b = txmq.Broker(data, fsync="never", num_coordinators=1)
    try:
        _, txn = commit_acks(b, 5, 2)
        tc = b._coordinators[0]
        pending = b._topics["in"].subscriptions["s"].pending_acks
        assert list(tc._touched.values()) == [pending]
        real_flush = pending.flush

        def full():
            raise StorageFullError(pending.name, 100)

        monkeypatch.setattr(pending, "flush", full)
        with tc.lock:
            tc._compact(housekeeping=True)             # refused: nothing forgotten, nothing raised
        assert list(tc._touched.values()) == [pending]
        assert L.TC_DECIDED in kinds_of(tc_log(data), txn)
        monkeypatch.setattr(pending, "flush", real_flush)
        tc.compact()
        assert kinds_of(tc_log(data), txn) == []       # forgotten now, its acks durable first
        ro = readonly.open(data)
        assert ro.subscription("in", "s")["partitions"][0]["mark_delete"] == 2
    finally:
        b.close()


SEEK_THEN_KILL = r"""
import os, signal, sys, txmq
b = txmq.Broker(sys.argv[1], fsync="never", num_coordinators=1)
b.create_topic("in")
b.producer("in").send_batch([b"m%d" % i for i in range(10)])
c = b.subscribe("in", "s", initial_position="earliest")
txn = b.new_transaction()
c.ack(c.receive_many(10, 1.0), txn=txn)
txn.commit()
c.seek("earliest")
assert len(c.receive_many(20, 1.0)) == 10
os.kill(os.getpid(), signal.SIGKILL)   # right after the seek: nothing closed
"""


@pytest.mark.parametrize("move", ["seek", "resubscribe", "seek, then SIGKILL"])
def test_a_seek_after_a_commit_holds_after_a_reopen(tmp_path, move):
    """Recovery applies every decision its coordinator log still holds.
    A subscription that moves its cursor back after a commit (a seek, or
    removed and made again) has the log forget the decisions it applied
    first, so reopening does not apply them again over the move, after a
    close or a kill."""
    data = str(tmp_path / "d")
    if move == "seek, then SIGKILL":
        out = subprocess.run([sys.executable, "-c", SEEK_THEN_KILL, data], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    else:
        with txmq.Broker(data, fsync="never", num_coordinators=1) as b:
            c, _ = commit_acks(b, 10, 10)
            if move == "seek":
                c.seek("earliest")
            else:
                c.unsubscribe()
                c = b.subscribe("in", "s", initial_position="earliest")
            assert len(c.receive_many(20, 1.0)) == 10
    with txmq.Broker(data, fsync="never", num_coordinators=1) as b:
        assert len(b.subscribe("in", "s").receive_many(20, 1.0)) == 10


def test_a_first_append_has_no_coordinator_write_of_its_own(tmp_path, monkeypatch):
    """ADD_PARTITION (with BEGIN) waits for the log's next write: the
    transaction's DECIDED frame goes out in the same write. Without one,
    the broker's timeout check writes it (``TransactionCoordinator.expire``,
    every TIMEOUT_CHECK_INTERVAL), so a read-only view names the partition
    soon; ``Transaction.flush()`` writes it at once."""
    monkeypatch.setattr(broker_module, "TIMEOUT_CHECK_INTERVAL", 3600.0)    # (the test runs the check)
    data = str(tmp_path / "d")
    with txmq.Broker(data, fsync="never", num_coordinators=1) as b:
        b.create_topic("out")
        p = b.producer("out")
        b.new_transaction().abort()                   # (the first reserves a block of sequences)
        txn = b.new_transaction()
        size = os.path.getsize(tc_log(data))
        p.send_batch([b"a", b"b"], txn=txn)
        assert kinds_of(tc_log(data), txn) == [] and os.path.getsize(tc_log(data)) == size
        txn.commit()
        assert kinds_of(tc_log(data), txn) == [L.TC_BEGIN, L.TC_ADD_PARTITION, L.TC_DECIDED]
        flushed = b.new_transaction()
        p.send(b"c", txn=flushed).offset
        assert kinds_of(tc_log(data), flushed) == []
        flushed.flush()
        assert kinds_of(tc_log(data), flushed) == [L.TC_BEGIN, L.TC_ADD_PARTITION]
        waiting = b.new_transaction()
        p.send(b"d", txn=waiting).offset
        assert kinds_of(tc_log(data), waiting) == []
        final_records_written(b)                      # the timeout check
        assert kinds_of(tc_log(data), waiting) == [L.TC_BEGIN, L.TC_ADD_PARTITION]
        with readonly.open(data) as ro:
            (seen,) = [t for t in ro.transactions() if t["id"] == str(waiting.id)]
            assert seen["partitions"] == ["out/0"]


UNNAMED_OPEN = r"""
import os, signal, sys, txmq, txmq.broker.broker
txmq.broker.broker.TIMEOUT_CHECK_INTERVAL = 3600.0      # (no timeout check writes its frames)
b = txmq.Broker(sys.argv[1], fsync="commit", num_coordinators=1)
for name in ("a", "b"):
    b.create_topic(name, 2)
b.create_topic("in")
b.producer("in").send(b"input")
c = b.subscribe("in", "s", initial_position="earliest")
done = b.new_transaction()
b.producer("a").send(b"kept", partition=0, txn=done)
done.commit()
t = b.new_transaction()
for name in ("a", "b"):
    for i in (0, 1):
        b.producer(name).send_batch([b"lost-%s%d" % (name.encode(), i)], partition=i, txn=t)
c.ack(c.receive(1.0), txn=t)
if sys.argv[2] == "aborted":
    t.abort()                                  # (its markers written; BEGIN to ABORTED all deferred)
b.flush()                                      # (its data durable: only its coordinator log misses it)
print(t.id, flush=True)
os.kill(os.getpid(), signal.SIGKILL)           # a real kill: nothing closed, nothing flushed
"""


@pytest.mark.parametrize("state", ["open", "aborted"])
def test_a_transaction_killed_before_its_frames_went_out_is_aborted_where_its_data_is(tmp_path, state):
    """A SIGKILL before the deferred ADD_PARTITION frames are written
    leaves a transaction's data in partitions no log names: each partition
    aborts it when it opens (here at first use, after recovery),
    read_committed readers move past it, and its ack is dropped. The same
    after its abort returned, whose ABORTING frame was deferred too: its
    markers hold, and its ack is dropped."""
    data = str(tmp_path / "d")
    out = subprocess.run([sys.executable, "-c", UNNAMED_OPEN, data, state], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    txn = out.stdout.split()[-1]
    assert L.pack_txn(*txmq.TxnID.parse(txn).words) not in {p[:16] for _, p in frames(tc_log(data))}
    with txmq.Broker(data, fsync="commit", num_coordinators=1) as b:
        # Its ack went with it (G1, G6): the input comes again.
        assert [m.value for m in b.subscribe("in", "s").receive_many(10, 0.5)] == [b"input"]
        for name in ("a", "b"):
            for i in (0, 1):
                c = b.subscribe(name, f"s{i}", isolation="read_committed", initial_position="earliest")
                got = [m.value for m in c.receive_many(10, 0.5) if m.partition == i]
                assert got == ([b"kept"] if (name, i) == ("a", 0) else [])
                assert b.stats()["topics"][name]["partitions"][i]["open_transactions"] == 0
        # (once, though four partitions held it; none held an aborted one)
        assert b.recovered_transactions["aborted"] == (1 if state == "open" else 0)
        after = b.new_transaction()
        b.producer("b").send(b"after", partition=1, txn=after)
        after.commit()
        c = b.subscribe("b", "late", isolation="read_committed", initial_position="earliest")
        assert [m.value for m in c.receive_many(10, 0.5)] == [b"after"]


@pytest.mark.parametrize("compact_bytes,compacted", [(200_000, True), (10**9, False)])
def test_decisions_with_copies_compact_the_log_by_bytes(tmp_path, monkeypatch, compact_bytes, compacted):
    """At fsync="commit" a small output is copied into its decision record
    (~11 KB for 100 x 100 B), so the log compacts after COMPACT_BYTES of
    frames (plus LIVE_BYTES per live transaction), long before
    COMPACT_FRAMES frames."""
    monkeypatch.setattr(coordinator, "COMPACT_BYTES", compact_bytes)
    monkeypatch.setattr(coordinator, "LIVE_BYTES", 0)
    with txmq.Broker(tmp_path / "d", fsync="commit", num_coordinators=1) as b:
        b.create_topic("t")
        p = b.producer("t")
        tc = b._coordinators[0]
        start = tc.log.frames_since_snapshot
        for _ in range(30):
            txn = b.new_transaction()
            p.send_batch([b"v" * 100] * 100, txn=txn)
            txn.commit()
        # (each commit adds a DECIDED frame of ~11 KB and BEGIN, ADD_PARTITION, COMMITTED)
        if compacted:
            assert tc.log.bytes_since_snapshot < compact_bytes
        else:
            assert tc.log.bytes_since_snapshot > 30 * 11_000 and tc.log.frames_since_snapshot >= start + 90
        assert len(b.subscribe("t", "s", initial_position="earliest").receive_many(5000, 0.5)) == 3000


def test_a_full_disk_stops_no_abort_and_a_refused_decision_aborts(tmp_path, monkeypatch):
    """An abort's ABORTING frame is not needed by recovery (a transaction
    with no decision logged is aborted on open): a full disk refusing it
    aborts the transaction all the same, and the frame goes out with the
    log's next write. A commit whose DECIDED frame a full disk refuses
    raises StorageFullError and leaves the transaction aborted, not stuck."""
    import errno
    from txmq import TxnState
    from txmq.errors import StorageFullError
    data = str(tmp_path / "d")
    with txmq.Broker(data, fsync="never", num_coordinators=1) as b:
        b.create_topic("t")
        p = b.producer("t")
        rc = b.subscribe("t", "rc", initial_position="earliest")
        dropped, refused = b.new_transaction(), b.new_transaction()
        p.send_batch([b"dropped"], txn=dropped)
        p.send_batch([b"refused"], txn=refused)

        def full(fd, data, pos):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(_redolog, "pwrite_all", full)
        dropped.abort()
        assert dropped.state is TxnState.ABORTED
        with pytest.raises(StorageFullError):
            refused.commit()
        assert refused.state is TxnState.ABORTED
        monkeypatch.undo()
        kept = b.new_transaction()
        p.send_batch([b"kept"], txn=kept)
        kept.commit()                                    # (its write carries the deferred ABORTING frames)
        for txn in (dropped, refused):
            assert kinds_of(tc_log(data), txn)[-2:] == [L.TC_ABORTING, L.TC_ABORTED]
        assert [m.value for m in rc.receive_many(10, 0.5)] == [b"kept"]
    with txmq.Broker(data, fsync="never", num_coordinators=1) as b:
        rc = b.subscribe("t", "rc2", initial_position="earliest")
        assert [m.value for m in rc.receive_many(10, 0.5)] == [b"kept"]
