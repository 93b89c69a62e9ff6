"""Corrupted data directories (docs/GUARANTEES.md; fuzzing
every decoder"): seeded byte flips and truncations in segment logs, index
and time-index files, recovery points and subscription cursors of a closed
broker. Reopening must either succeed, every offset read back as written
or reported lost (quarantined bytes: only the batches holding a flipped
byte; a cut tail: reported), or raise CorruptLogError naming the file and
position; never crash, hang, or hand out wrong data.

Each reopen runs in a subprocess (a segfault must fail one case, not kill
pytest) under a timeout.
"""

from __future__ import annotations

import glob
import json
import os
import random
import shutil
import subprocess
import sys

import pytest

import txmq

TOPIC = "t"
PARTITIONS = 2
OPTS = dict(segment_bytes_max=8192, max_message_bytes=2048, index_interval_bytes=256)
SUBS = {"se": "earliest", "sl": "latest"}
CASES = 50
TIMEOUT = 60

READER = r"""
import json, sys, traceback
import txmq
from txmq.errors import CorruptLogError

path, opts = sys.argv[1], json.loads(sys.argv[2])
out = {}
def drain(c):
    got = {}
    while True:
        ms = c.receive_many(10000, timeout=0)
        if not ms:
            return got
        for m in ms:
            got.setdefault(str(m.partition), []).append([m.offset, m.value.decode("latin-1")])
try:
    b = txmq.Broker(path, fsync="never", **opts)
    try:
        st = b.stats()["topics"]["t"]
        out["truncated"] = [p["truncated_on_open"] for p in st["partitions"]]
        out["end"] = [p["end_offset"] for p in st["partitions"]]
        out["start"] = [p["start_offset"] for p in st["partitions"]]
        c = b.subscribe("t", "check", "exclusive", initial_position="earliest")
        out["log"] = drain(c)
        c.unsubscribe()
        # Quarantined ranges, including those the reads above found.
        out["lost"] = [[[q["first_offset"], q["end_offset"], q["path"], q["position"]] for q in p["quarantined"]]
                       for p in b.stats()["topics"]["t"]["partitions"]]
        out["unacked"] = {}
        consumers = {}
        for sub in ("se", "sl"):
            consumers[sub] = b.subscribe("t", sub, "exclusive")
            out["unacked"][sub] = {p: [o for o, _ in ms] for p, ms in drain(consumers[sub]).items()}
        # Appends after recovery get fresh offsets, and no subscription
        # takes them for already acknowledged.
        prod = b.producer("t")
        out["appended"] = [list(prod.send(b"after-%d" % p, partition=p)) for p in range(2)]
        out["after"] = {sub: {p: [[o, v] for o, v in ms] for p, ms in drain(c).items()}
                        for sub, c in consumers.items()}
    finally:
        b.close()
    out["result"] = "ok"
except CorruptLogError as e:
    out = {"result": "corrupt", "path": e.path, "position": e.position, "reason": e.reason}
print("RESULT " + json.dumps(out))
"""


def value_of(p: int, i: int) -> bytes:
    return (f"p{p}-m{i}-".encode() + bytes(range(i % 7, i % 7 + 40)) * (i % 5 + 1))


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return build_template(tmp_path_factory.mktemp("corruption") / "data")


def build_template(path):
    """A closed data directory with several segments per partition and two
    subscriptions with cumulative and individual acks; plus what it holds."""
    rng = random.Random(7)
    expected = {p: [] for p in range(PARTITIONS)}
    with txmq.Broker(path, fsync="never", **OPTS) as b:
        b.create_topic(TOPIC, PARTITIONS)
        for sub, pos in SUBS.items():
            b.subscribe(TOPIC, sub, "exclusive", initial_position=pos).close()
        prod = b.producer(TOPIC)
        for p in range(PARTITIONS):
            while len(expected[p]) < 260:
                i = len(expected[p])
                if rng.random() < 0.5:
                    prod.send(value_of(p, i), key=b"k%d" % (i % 3) if i % 2 else None,
                              headers={"i": str(i)} if i % 3 == 0 else None, partition=p)
                    expected[p].append(value_of(p, i))
                else:
                    n = rng.randint(2, 9)
                    prod.send_batch([value_of(p, i + j) for j in range(n)], partition=p)
                    expected[p].extend(value_of(p, i + j) for j in range(n))
        acked = {}
        for sub in SUBS:
            c = b.subscribe(TOPIC, sub, "exclusive")
            ms = []
            while batch := c.receive_many(10000, timeout=0):
                ms.extend(batch)
            acked[sub] = {p: set() for p in range(PARTITIONS)}
            for p in range(PARTITIONS):
                mine = [m for m in ms if m.partition == p]
                assert [m.offset for m in mine] == list(range(len(expected[p])))
                if sub == "se":
                    cut = 60 + 20 * p
                    c.ack_cumulative(mine[cut - 1])
                    acked[sub][p].update(range(cut))
                for m in mine:
                    if rng.random() < 0.3 and m.offset not in acked[sub][p]:
                        c.ack(m)
                        acked[sub][p].add(m.offset)
            c.close()
        stats = b.stats()["topics"][TOPIC]
        assert all(p["segments"] >= 4 for p in stats["partitions"])
    files = {
        "log": sorted(glob.glob(str(path / "topics" / TOPIC / "*" / "*.log"))),
        "index": sorted(glob.glob(str(path / "topics" / TOPIC / "*" / "*.index"))),
        "timeindex": sorted(glob.glob(str(path / "topics" / TOPIC / "*" / "*.timeindex"))),
        "recovery-point": sorted(glob.glob(str(path / "topics" / TOPIC / "*" / "recovery-point"))),
        "cursor": sorted(glob.glob(str(path / "subscriptions" / TOPIC / "*" / "cursor-*.log"))),
    }
    files = {k: [os.path.relpath(f, path) for f in v if os.path.getsize(f)] for k, v in files.items()}
    assert all(files.values()), files
    return path, expected, acked, files


def run_reader(path, debug: bool):
    env = dict(os.environ)
    env.pop("TXMQ_DEBUG", None)
    if debug:
        env["TXMQ_DEBUG"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(txmq.__path__[0])]
                                        + [x for x in [os.environ.get("PYTHONPATH")] if x])
    proc = subprocess.run([sys.executable, "-c", READER, str(path), json.dumps(OPTS)],
                          capture_output=True, timeout=TIMEOUT, env=env)
    assert proc.returncode == 0, (
        f"reopen died with {proc.returncode}:\n{proc.stdout.decode()[-2000:]}\n{proc.stderr.decode()[-4000:]}")
    lines = [ln for ln in proc.stdout.decode().splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, proc.stdout.decode()[-2000:]
    return json.loads(lines[0][len("RESULT "):])


def mutate(rng, path: str):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        if rng.random() < 0.5:
            n = rng.randint(1, 4)
            spots = sorted(rng.randrange(size) for _ in range(n))
            for pos in spots:
                f.seek(pos)
                b = f.read(1)[0]
                f.seek(pos)
                f.write(bytes([b ^ rng.randint(1, 255)]))
            return f"flip bytes {spots}"
        new = rng.randrange(size)
        f.truncate(new)
        return f"truncate {size} -> {new}"


KINDS = ["log", "log", "log", "index", "timeindex", "recovery-point", "cursor", "cursor"]


def make_case(template, tmp_path, seed):
    src, expected, acked, files = template
    rng = random.Random(seed)
    kind = KINDS[seed % len(KINDS)]
    rel = rng.choice(files[kind])
    dst = tmp_path / "data"
    shutil.copytree(src, dst)
    if kind == "log":
        ORIGINALS[rel] = (dst / rel).read_bytes()
    what = mutate(rng, str(dst / rel))
    return dst, kind, rel, what


def check_outcome(out, dst, kind, rel, expected, acked, what=""):
    if out["result"] == "corrupt":
        # Damage the broker cannot repair is named precisely.
        assert kind in ("log", "cursor"), f"derived {kind} data must be rebuilt, not fatal: {out}"
        assert os.path.realpath(out["path"]).startswith(os.path.realpath(dst)), out
        assert os.path.exists(out["path"]) or out["path"].endswith(".log"), out
        assert 0 <= out["position"], out
        if os.path.exists(out["path"]):
            assert out["position"] <= max(os.path.getsize(out["path"]), 8192), out
        return
    assert out["result"] == "ok"
    damaged_partition = int(rel.split(os.sep)[2]) if kind != "cursor" else None
    for p in range(PARTITIONS):
        got = out["log"].get(str(p), [])
        lost = out["lost"][p]
        offsets = [o for o, _ in got]
        for o, v in got:
            assert v.encode("latin-1") == expected[p][o], f"partition {p}: offset {o} read back wrong"
        # Every offset below the end is read or reported lost, once.
        covered = sorted(offsets + [o for first, end, _, _ in lost for o in range(first, end)])
        assert covered == list(range(out["end"][p])), f"partition {p}: offsets neither read nor reported lost"
        if kind in ("index", "timeindex", "recovery-point", "cursor") or p != damaged_partition:
            assert len(offsets) == len(expected[p]) and not lost, \
                f"partition {p} lost {len(expected[p]) - len(offsets)} messages to {kind} damage"
            continue
        for first, end, path_, pos in lost:
            assert os.path.realpath(path_) == os.path.realpath(dst / rel) and pos >= 0, lost
        if what.startswith("flip"):
            # Only the batches holding a flipped byte are lost; the rest reads.
            assert set(covered) - set(offsets) <= damaged_offsets(dst, rel, what), \
                f"partition {p}: offsets outside the damaged batches were lost"
        if out["end"][p] < len(expected[p]):
            assert out["truncated"][p], f"partition {p} silently lost {len(expected[p]) - out['end'][p]} messages"
    for sub in SUBS:
        for p in range(PARTITIONS):
            n = out["end"][p]
            unacked = out["unacked"][sub].get(str(p), [])
            assert unacked == sorted(set(unacked))
            assert set(unacked) <= set(range(n))
            # Never acknowledged by accident: whatever was not acked is delivered.
            lost = {o for first, end, _, _ in out["lost"][p] for o in range(first, end)}
            missing = (set(range(n)) - acked[sub][p]) - set(unacked) - lost
            assert not missing, f"{sub}/{p}: unacknowledged offsets {sorted(missing)[:10]} not delivered"
            if kind != "cursor":
                assert set(unacked) == set(range(n)) - acked[sub][p] - lost, f"{sub}/{p}: cursor changed"
            # A message appended after the reopen is new to every subscription.
            new_off = out["appended"][p][2]
            assert out["appended"][p][1] == p and new_off == n
            after = out["after"][sub].get(str(p), [])
            assert [new_off, f"after-{p}"] in after, f"{sub}/{p}: message appended at {new_off} was not delivered"


def damaged_offsets(dst, rel, what) -> set:
    """The offsets of the batches of segment ``rel`` (as the template has
    it) that hold a byte ``what`` ("flip bytes [..]") flipped."""
    spots = json.loads(what[len("flip bytes "):])
    base = int(os.path.basename(rel)[:-4])
    src_raw = ORIGINALS[rel]
    out, pos, offset = set(), 0, base
    while pos + 88 <= len(src_raw) and src_raw[pos:pos + 4] == b"TXMB":
        length = int.from_bytes(src_raw[pos + 12:pos + 16], "little")
        count = int.from_bytes(src_raw[pos + 24:pos + 28], "little")
        if any(pos <= s < pos + length for s in spots):
            out.update(range(offset, offset + count))
        pos += length
        offset += count
    return out


ORIGINALS: dict = {}   # segment (relative path) -> its template bytes


KNOWN_BUGS: dict = {}   # seed -> reason, for a known open bug


@pytest.mark.parametrize("seed", [pytest.param(s, marks=pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[s]))
                                  if s in KNOWN_BUGS else s for s in range(CASES)])
def test_corrupted_file(template, tmp_path, seed):
    src, expected, acked, files = template
    dst, kind, rel, what = make_case(template, tmp_path, seed)
    out = run_reader(dst, debug=bool(seed % 2))
    try:
        check_outcome(out, dst, kind, rel, expected, acked, what)
    except AssertionError as e:
        raise AssertionError(f"{kind} {rel}: {what}: {e}\noutcome: {json.dumps(out)[:1500]}") from None


def test_template_reads_back_whole(template, tmp_path):
    """The undamaged directory reads back exactly (the checks above are meaningful)."""
    src, expected, acked, files = template
    dst = tmp_path / "data"
    shutil.copytree(src, dst)
    out = run_reader(dst, debug=False)
    assert out["result"] == "ok"
    assert out["truncated"] == [[] for _ in range(PARTITIONS)]
    check_outcome(out, dst, "index", os.path.join("topics", TOPIC, "0", "x"), expected, acked)


# -- single damages, deterministically (in process: none of them crash) --

def _no_debug(monkeypatch):
    # TXMQ_DEBUG's full verification on open hides what production does.
    monkeypatch.delenv("TXMQ_DEBUG", raising=False)


def test_flipped_byte_below_the_recovery_point_is_not_delivered(tmp_path, monkeypatch):
    _no_debug(monkeypatch)
    with txmq.Broker(tmp_path / "d", fsync="never") as b:
        b.create_topic("t", 1)
        b.producer("t").send(b"hello world")
    seg = tmp_path / "d" / "topics" / "t" / "0" / ("0" * 20 + ".log")
    data = bytearray(seg.read_bytes())
    data[data.index(b"hello")] ^= 0x20
    seg.write_bytes(bytes(data))
    try:
        with txmq.Broker(tmp_path / "d", fsync="never") as b:
            m = b.subscribe("t", "s", "exclusive", initial_position="earliest").receive(timeout=0)
    except txmq.errors.CorruptLogError as e:
        assert e.path == str(seg)
        return
    assert m is None or m.value == b"hello world", f"corrupted bytes delivered as data: {m.value!r}"


def test_truncated_log_does_not_swallow_new_messages(tmp_path, monkeypatch):
    _no_debug(monkeypatch)
    with txmq.Broker(tmp_path / "d", fsync="never") as b:
        b.create_topic("t", 1)
        c = b.subscribe("t", "s", "exclusive", initial_position="earliest")
        prod = b.producer("t")
        for i in range(10):
            prod.send(b"m%d" % i)
        ms = c.receive_many(10, timeout=0)
        c.ack_cumulative(ms[-1])
        cut = b._topics["t"].partitions[0].segment_for(5)[1]   # where offset 5's batch starts
    os.truncate(tmp_path / "d" / "topics" / "t" / "0" / ("0" * 20 + ".log"), cut + 20)   # torn tail
    with txmq.Broker(tmp_path / "d", fsync="never") as b:
        part = b.stats()["topics"]["t"]["partitions"][0]
        assert part["end_offset"] == 5 and part["truncated_on_open"]
        new = [b.producer("t").send(b"new%d" % i) for i in range(3)]
        got = b.subscribe("t", "s", "exclusive").receive_many(10, timeout=0.2)
        assert [m.message_id for m in got] == new


def test_corrupt_cursor_of_latest_subscription_does_not_skip_messages(tmp_path, monkeypatch):
    _no_debug(monkeypatch)
    with txmq.Broker(tmp_path / "d", fsync="never") as b:
        b.create_topic("t", 1)
        b.subscribe("t", "s", "exclusive").close()           # latest: at offset 0
        ids = [b.producer("t").send(b"m%d" % i) for i in range(5)]
    cur = tmp_path / "d" / "subscriptions" / "t" / "s" / "cursor-0.log"
    data = bytearray(cur.read_bytes())
    data[8 + 9 + 1] ^= 1                                        # inside the first frame's payload
    cur.write_bytes(bytes(data))
    try:
        with txmq.Broker(tmp_path / "d", fsync="never") as b:
            got = b.subscribe("t", "s", "exclusive").receive_many(10, timeout=0.1)
    except txmq.errors.CorruptLogError as e:
        assert e.path == str(cur)
        return
    assert [m.message_id for m in got] == ids


def test_cut_cursor_tail_is_reported(tmp_path, monkeypatch, caplog):
    _no_debug(monkeypatch)
    with txmq.Broker(tmp_path / "d", fsync="never") as b:
        b.create_topic("t", 1)
        c = b.subscribe("t", "s", "exclusive", initial_position="earliest")
        for i in range(5):
            b.producer("t").send(b"m%d" % i)
        for m in c.receive_many(5, timeout=0):
            c.ack(m)
    cur = tmp_path / "d" / "subscriptions" / "t" / "s" / "cursor-0.log"
    os.truncate(cur, cur.stat().st_size - 3)                   # the last ack is torn
    with caplog.at_level("DEBUG"):
        with txmq.Broker(tmp_path / "d", fsync="never") as b:
            st = b.stats()["topics"]["t"]["subscriptions"]["s"]
            got = b.subscribe("t", "s", "exclusive").receive_many(10, timeout=0)
    assert [m.offset for m in got] == [4]                      # the torn ack is redelivered
    reported = str(cur) in caplog.text or str(cur) in json.dumps(st)
    assert reported, "the cut cursor tail was not reported"
