"""The writer (``Partition``), the read-only view (``txmq.readonly``) and
``txmq check`` walk a partition's files with one loader
(``txmq.storage.loader``): fed the same damaged directory, they agree on
where the log ends, what is read and delivered, what is refused, and check
says what opening does (docs/FORMAT.md, "Opening a partition").

Each damage is applied to three directories: one closed cleanly (its
recovery point at the log end, its read view CLOSED), the same without its
read view (a writer that died before publishing one), and one whose writer
died after appending past its recovery point (its read view LIVE and ahead
of the recovery point)."""

from __future__ import annotations

import os
import shutil
import struct

import pytest

import txmq
from txmq import readonly
from txmq._batch import BatchSpec
from txmq._readview import RV_CLOSED, RV_LIVE
from txmq.cli.check import check_directory
from txmq.errors import CorruptLogError
from txmq.storage.layout import RECOVERY_POINT_FILE, parse_recovery_point, segment_bases
from txmq.storage.partition import Partition
from txmq.transactions.records import TxnID, TxnMeta
from damage import batch_positions, flip

pytestmark = pytest.mark.usefixtures("no_debug")

STATES = ["closed", "none", "dead"]
OPTIONS = dict(fsync="never", segment_bytes_max=4096, index_interval_bytes=256)


@pytest.fixture
def no_debug(monkeypatch):
    # TXMQ_DEBUG's full verification on open hides what production does.
    monkeypatch.delenv("TXMQ_DEBUG", raising=False)


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    """{state: data directory} (module docstring): four or more segments of
    plain batches and of transactions, committed and aborted; the dead
    writer's also holds one left open."""
    root = tmp_path_factory.mktemp("agree")
    closed = str(root / "closed")
    debug = os.environ.pop("TXMQ_DEBUG", None)
    try:
        with txmq.Broker(closed, **OPTIONS) as b:
            b.create_topic("t")
            p = b.producer("t")
            for i in range(60):
                p.send_batch([b"value-%d-%d" % (i, j) for j in range(4)])
                if i % 10 in (3, 7):
                    txn = b.new_transaction()
                    p.send(b"in-txn-%d" % i, txn=txn)
                    if i % 10 == 3:
                        txn.abort()
                    else:
                        txn.commit()
        dead = str(root / "dead")
        shutil.copytree(closed, dead)
        _die_past_the_recovery_point(_pdir(dead))
    finally:
        if debug is not None:
            os.environ["TXMQ_DEBUG"] = debug
    assert len(_bases(_pdir(closed))) >= 4
    return {"closed": closed, "dead": dead}


def _die_past_the_recovery_point(pdir):
    """Leave in ``pdir`` the files of a writer killed after it appended
    four batches past its recovery point, the second in a transaction it
    left open (its read view LIVE)."""
    part = Partition(pdir, "t", 0, **OPTIONS)
    try:
        bases = _bases(pdir)
        txn = TxnMeta(TxnID.from_words(7, 7), 60.0, 0, 0)
        part.append(BatchSpec([b"late-0"]))
        part.append(BatchSpec([b"open"]), txn=txn)
        for i in (1, 2):
            part.append(BatchSpec([b"late-%d" % i]))
        assert _bases(pdir) == bases, "the late batches must stay in the active segment"
        died = pdir + ".died"
        shutil.copytree(pdir, died)                     # what a SIGKILL leaves
    finally:
        part.close()
    shutil.rmtree(pdir)
    os.rename(died, pdir)
    rv = readonly.read_readview(open(os.path.join(pdir, "readview"), "rb").read())
    point = _recovery_point(pdir)
    assert rv.state == RV_LIVE and point[0] == rv.active_base and point[1] < rv.active_size


def _pdir(path):
    return os.path.join(path, "topics", "t", "0")


def _bases(pdir):
    return sorted(n for n in os.listdir(pdir) if n.endswith(".log"))


def _recovery_point(pdir):
    path = os.path.join(pdir, RECOVERY_POINT_FILE)
    with open(path, "rb") as f:
        return parse_recovery_point(path, f.read(), segment_bases(pdir))


def _starts(seg):
    return [pos for pos, _, _ in batch_positions(seg)]


# -- the damage --------------------------------------------------------------------

def gap(pdir):
    """A middle segment's files are gone."""
    stem = os.path.join(pdir, _bases(pdir)[1][:-4])
    for suffix in (".log", ".index", ".timeindex", ".txnindex"):
        os.unlink(stem + suffix)


def torn_tail(pdir):
    """The last segment ends inside a batch header."""
    seg = os.path.join(pdir, _bases(pdir)[-1])
    os.truncate(seg, _starts(seg)[-2] + 40)


def torn_sealed_segment(pdir):
    """A sealed segment below the recovery point lost its last batch's tail."""
    seg = os.path.join(pdir, _bases(pdir)[1])
    os.truncate(seg, _starts(seg)[-1] + 40)


def flipped_byte(pdir):
    """A byte inside a batch of the first (sealed, trusted) segment."""
    seg = os.path.join(pdir, _bases(pdir)[0])
    flip(seg, _starts(seg)[3] + 100)


def flipped_byte_bad_recovery_point(pdir):
    """A flipped byte in a sealed segment, and a recovery point that fails
    its CRC: every segment is scanned, so the log is cut there."""
    flipped_byte(pdir)
    flip(os.path.join(pdir, "recovery-point"), 20)


def flipped_last_batch(pdir):
    """A byte inside the last batch of the active segment: below the
    recovery point of a clean close, past that of a writer that died."""
    seg = os.path.join(pdir, _bases(pdir)[-1])
    flip(seg, _starts(seg)[-1] + 70)


def bad_index(pdir):
    """An entry of a sealed segment's offset index points past its batches."""
    index = os.path.join(pdir, _bases(pdir)[1][:-4] + ".index")
    with open(index, "r+b") as f:
        f.seek(16 + 8)
        f.write(struct.pack("<q", 1 << 40))


def bad_index_and_flipped_byte(pdir):
    """A sealed segment's index is wrong, so opening rebuilds it by a scan,
    which finds a batch that fails its CRC below the recovery point."""
    bad_index(pdir)
    seg = os.path.join(pdir, _bases(pdir)[1])
    flip(seg, _starts(seg)[2] + 100)


def bad_active_index_and_flipped_byte(pdir):
    """The active segment's index below the recovery point is wrong, so
    opening scans that segment from byte 0 and meets a flipped byte."""
    stem = os.path.join(pdir, _bases(pdir)[-1][:-4])
    assert os.path.getsize(stem + ".index") >= 16
    with open(stem + ".index", "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<q", 8))                 # not a batch boundary
    flip(stem + ".log", _starts(stem + ".log")[0] + 70)


def bad_snapshot(pdir):
    flip(os.path.join(pdir, "txnbuffer.snap"), 20)


def bad_producer_snapshot(pdir):
    flip(os.path.join(pdir, "producers.snap"), 20)


def bad_recovery_point(pdir):
    flip(os.path.join(pdir, "recovery-point"), 20)


def missing_recovery_point(pdir):
    os.unlink(os.path.join(pdir, "recovery-point"))


DAMAGE = [gap, torn_tail, torn_sealed_segment, flipped_byte, flipped_byte_bad_recovery_point, flipped_last_batch,
          bad_index, bad_index_and_flipped_byte, bad_active_index_and_flipped_byte, bad_snapshot,
          bad_producer_snapshot, bad_recovery_point, missing_recovery_point]

# What opening does, per damage (and per state where they differ): "cut"
# (the log ends at the damage: a torn tail, or a hole or gap of a log
# written with fsync="never", whose consistent prefix is kept),
# "quarantined" (the bad bytes' offsets are lost, the log around them is
# kept and read; found by opening or by the first read), "rebuilt"
# (derived data only), "refused" (CorruptLogError: segments that overlap).
EXPECTED = {
    "gap": "cut", "torn_tail": "cut", "torn_sealed_segment": "cut", "flipped_byte": "quarantined",
    "flipped_byte_bad_recovery_point": "quarantined", "flipped_last_batch": "quarantined",
    "flipped_last_batch/dead": "cut", "bad_index": "rebuilt", "bad_index_and_flipped_byte": "quarantined",
    "bad_active_index_and_flipped_byte": "quarantined", "bad_snapshot": "rebuilt",
    "bad_producer_snapshot": "rebuilt", "bad_recovery_point": "rebuilt", "missing_recovery_point": "rebuilt",
}


# -- what each of the three makes of it ----------------------------------------------

def _walk(batches, limit):
    """Per batch below ``limit`` until one fails its check: (base offset,
    next offset, delivered to read_committed, delivered to
    read_uncommitted), and where the one that failed is."""
    out = []
    try:
        for info, never_rc, never_ru in batches:
            if info.base_offset >= limit:
                break
            out.append((info.base_offset, info.next_offset, not never_rc, not never_ru))
    except CorruptLogError as e:
        return out, (e.path, e.position)
    return out, None


def _writer(pdir):
    try:
        part = Partition(pdir, "t", 0, **OPTIONS)
    except CorruptLogError as e:
        return {"refused": (e.path, e.position)}
    try:
        headers = ((info, part.never_delivered(info, True), part.never_delivered(info, False))
                   for info in part.headers(part.start_offset, part.end_offset))
        read, fault = _walk(headers, part.end_offset)
        cuts = [(d.path, d.position) for d in part.dropped if d.path.endswith(".log") and "quarantined" not in d.reason]
        lost = [(os.path.join(pdir, "%020d.log" % q.segment), q.position, q.first_offset, q.end_offset)
                for q in part.quarantined()]
        return {"start": part.start_offset, "end": part.end_offset, "lso": part.max_read_position,
                "read": read, "fault": fault, "cut": cuts[:1], "lost": lost}
    finally:
        part.close()


def _read_only(path):
    with readonly.open(path, wait_s=0) as ro:
        try:
            view = ro.view("t", 0)
        except CorruptLogError as e:
            return {"refused": (e.path, e.position)}
        headers = ((info, view.skipped(info, True), view.skipped(info, False))
                   for _, _, info in view.batches(view.log_start, view.log_end))
        read, fault = _walk(headers, view.log_end)
        lost = [(s.segment.path, q[0], q[2], q[3]) for s in view.segments for q in s.segment.quarantined()]
        out = {"start": view.log_start, "end": view.log_end, "lso": view.max_read_position, "read": read,
               "fault": fault, "source": view.source, "lost": lost}
        if fault is None:
            out["committed"] = [m.offset for m in view.read(0)]
            out["uncommitted"] = [m.offset for m in view.read(0, isolation="read_uncommitted")]
        return out


def _delivered(writer, committed: bool) -> list:
    """The offsets the writer's delivery rule hands a reader: below the
    last stable offset (read_committed) or the log end, not in a batch it
    never delivers."""
    limit = writer["lso"] if committed else writer["end"]
    return [o for base, nxt, rc, ru in writer["read"] if (rc if committed else ru)
            for o in range(base, min(nxt, limit))]


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("damage", DAMAGE, ids=[d.__name__ for d in DAMAGE])
def test_writer_read_only_and_check_agree(templates, tmp_path, damage, state):
    path = str(tmp_path / "data")
    shutil.copytree(templates["closed" if state == "none" else state], path)
    pdir = _pdir(path)
    damage(pdir)
    if state == "none":
        os.unlink(os.path.join(pdir, "readview"))     # a writer that died before publishing one
    before = {n: open(os.path.join(pdir, n), "rb").read() for n in os.listdir(pdir)}

    problems = check_directory(path).problems
    ro = _read_only(path)
    assert {n: open(os.path.join(pdir, n), "rb").read() for n in os.listdir(pdir)} == before, \
        "check or the read-only view wrote"
    writer = _writer(pdir)                              # last: it repairs
    at = {(p.path, p.position): p for p in problems}
    expected = EXPECTED.get(f"{damage.__name__}/{state}", EXPECTED[damage.__name__])

    if "refused" in writer:
        assert expected == "refused"
        assert ro == writer, "the read-only view must refuse what opening refuses, at the same byte"
        assert "opening refuses the partition" in at[writer["refused"]].reason
        assert at[writer["refused"]].kind == "corrupt"
        return
    assert expected != "refused", f"opening did not refuse: {writer}"
    source = ro.pop("source")
    committed, uncommitted = ro.pop("committed", None), ro.pop("uncommitted", None)
    assert ro == {k: writer[k] for k in ro}, "the read-only view must show what the writer opens"
    assert writer["read"] and writer["end"] > 0
    assert writer["fault"] is None, "a read met bad bytes it did not skip"
    if writer["cut"]:
        assert expected == "cut"
        (cut,) = writer["cut"]
        assert "opening cuts the log here" in at[cut].reason and at[cut].kind == "corrupt"
        assert source == "scan", "cut short of the read view: the transaction state is rebuilt as opening does"
    else:
        assert source == {"closed": "readview", "none": "scan", "dead": "readview+scan"}[state]
    if writer["lost"]:
        assert expected == "quarantined"
        for path_, pos, first, end in writer["lost"]:
            assert "quarantined" in at[(path_, pos)].reason and at[(path_, pos)].kind == "corrupt"
            # Exactly the bad batch's offsets are lost; the rest is read.
            assert not any(base < end and nxt > first for base, nxt, _, _ in writer["read"])
        covered = sorted([(b, n) for b, n, _, _ in writer["read"]] + [(f, e) for _, _, f, e in writer["lost"]])
        assert [b for b, _ in covered] == [writer["start"]] + [n for _, n in covered[:-1]], "offsets not dense"
    # One delivery rule: the read-only view hands out what a subscription of
    # the writer would.
    assert committed == _delivered(writer, True) and uncommitted == _delivered(writer, False)
    if not writer["cut"] and not writer["lost"]:
        # Nothing lost: what is wrong is derived data, which opening rebuilds.
        assert expected == "rebuilt"
        assert problems and all(p.kind == "repairable" for p in problems)
        assert writer["end"] == _end(templates["closed" if state == "none" else state])
    kinds = {os.path.basename(p.path).split(".")[-1] for p in problems}
    named = {"bad_index": "index", "bad_snapshot": "snap", "bad_producer_snapshot": "snap",
             "bad_recovery_point": "recovery-point", "missing_recovery_point": "recovery-point"}
    if damage.__name__ in named:
        assert named[damage.__name__] in kinds
    # One open repairs what it can; quarantined bytes are still reported.
    left = [(p.path, p.position) for p in check_directory(path).problems]
    assert left == [(p, pos) for p, pos, _, _ in writer["lost"]]
    # And the read-only view of the repaired directory shows the same log.
    after = _read_only(path)
    assert after.pop("source") == "readview"
    assert after == dict(ro, committed=committed, uncommitted=uncommitted)


def _end(path):
    """The log end the read view of ``path`` publishes."""
    with open(os.path.join(_pdir(path), "readview"), "rb") as f:
        return readonly.read_readview(f.read()).log_end


def test_a_dead_writer_leaves_a_live_read_view_ahead_of_its_recovery_point(templates):
    """The "dead" directory is what the module docstring says, and the
    read-only view reads it from the files as opening would."""
    pdir = _pdir(templates["dead"])
    with open(os.path.join(pdir, "readview"), "rb") as f:
        rv = readonly.read_readview(f.read())
    assert rv.state == RV_LIVE and _recovery_point(pdir)[1] < rv.active_size
    with open(os.path.join(_pdir(templates["closed"]), "readview"), "rb") as f:
        assert readonly.read_readview(f.read()).state == RV_CLOSED
    late = rv.log_end - 4
    with readonly.open(templates["dead"], wait_s=0) as ro:
        view = ro.view("t", 0)
        assert view.source == "readview+scan"
        assert (view.log_end, view.max_read_position) == (rv.log_end, rv.max_read_position) == (late + 4, late + 1)
        assert [m.value for m in ro.read("t", 0, late, isolation="read_uncommitted")] == [
            b"late-0", b"open", b"late-1", b"late-2"]
        assert [m.value for m in ro.read("t", 0, late)] == [b"late-0"]
