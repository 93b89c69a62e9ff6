"""Bytes flipped at random offsets of every file of a populated, closed
data directory (segments, indexes, .txnindex, snapshots, recovery points,
read views, cursor and pending-ack logs, coordinator logs, the producer
registry, the half-message files, the JSON files). For each: opening as
owner, ``txmq.readonly`` and ``txmq check`` run in subprocesses and must
not crash or print a traceback; every partition the damage is not in reads
back whole; a damaged segment loses at most the batches holding a flipped
byte, and the reader says where (path and byte); the writer and the
read-only view read the same; what opening reports about the damaged file,
``txmq check`` reports at a byte of that file."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys

import pytest

import txmq
from txmq import LocalTransactionState, readonly

CASES = 60
TIMEOUT = 120
OPTS = dict(segment_bytes_max=8192, index_interval_bytes=256)

OPEN = r"""
import json, sys
import txmq
from txmq import readonly
from txmq.errors import CorruptLogError, DataDirError, TxmqError

path, opts, topics = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
out = {"ro": {}, "writer": {}}
try:
    with readonly.open(path, wait_s=0) as ro:
        for t, n in topics.items():
            for p in range(n):
                msgs = list(ro.read(t, p, 0))
                out["ro"][f"{t}/{p}"] = [[m.offset, m.value.decode("latin-1")] for m in msgs]
except (CorruptLogError, DataDirError) as e:
    out["ro"] = {"error": type(e).__name__, "path": getattr(e, "path", None), "position": getattr(e, "position", None)}
try:
    b = txmq.Broker(path, fsync="commit", **opts)
except (CorruptLogError, DataDirError) as e:
    out["writer"] = {"error": type(e).__name__, "path": str(getattr(e, "path", "")),
                     "position": getattr(e, "position", None), "message": str(e)}
else:
    try:
        reports = []
        for t, n in topics.items():
            c = b.subscribe(t, "damage-check", "exclusive", initial_position="earliest")
            got = {}
            while ms := c.receive_many(10000, timeout=0):
                for m in ms:
                    got.setdefault(str(m.partition), []).append([m.offset, m.value.decode("latin-1")])
            for p in range(n):
                out["writer"][f"{t}/{p}"] = got.get(str(p), [])
            c.unsubscribe()
            st = b.stats()["topics"][t]
            for part in st["partitions"]:
                reports += part["truncated_on_open"]
                reports += ["%s at byte %d: quarantined" % (q["path"], q["position"]) for q in part["quarantined"]]
            for s in st["subscriptions"].values():
                for part in s["partitions"]:
                    reports += [str(x) for x in part["cursor_problems_on_open"]]
        out["reports"] = reports
        out["half_problems"] = [str(x) for x in b.stats()["half"]["problems_on_open"]]
        b.producer("t").send(b"after")            # the opened directory takes writes
    finally:
        b.close()
print("RESULT " + json.dumps(out))
"""


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(txmq.__path__[0])]
                                        + [x for x in [os.environ.get("PYTHONPATH")] if x])
    env.pop("TXMQ_DEBUG", None)
    return env


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A closed directory holding every kind of file, and what each
    partition reads back (read_committed)."""
    path = str(tmp_path_factory.mktemp("everywhere") / "data")
    rng = random.Random(11)
    debug = os.environ.pop("TXMQ_DEBUG", None)
    try:
        with txmq.Broker(path, fsync="commit", **OPTS) as b:
            b.create_topic("t", 2)
            b.create_topic("u", 1)
            c = b.subscribe("t", "se", "exclusive", initial_position="earliest")
            b.subscribe("u", "su", "exclusive", initial_position="earliest").close()
            p = b.producer("t", name="named")
            q = b.producer("u")
            for i in range(150):
                p.send(b"t-%d-" % i + bytes(rng.randrange(256) for _ in range(rng.randint(0, 120))))
                if i % 3 == 0:
                    q.send_batch([b"u-%d-%d" % (i, j) for j in range(rng.randint(1, 6))])
                if i % 25 == 7:
                    with b.transaction() as txn:
                        p.send(b"txn-%d" % i, txn=txn)
                        ms = c.receive_many(5, timeout=0)
                        if ms:
                            c.ack(ms, txn=txn)
                if i % 25 == 17:
                    txn = b.new_transaction()
                    p.send(b"aborted-%d" % i, txn=txn)
                    txn.abort()
            ms = c.receive_many(40, timeout=0)
            c.ack(ms[::2])
            c.close()
            half = b.half_producer("t", "g")
            for i, state in enumerate([LocalTransactionState.COMMIT, LocalTransactionState.ROLLBACK,
                                       LocalTransactionState.UNKNOWN] * 3):
                half.send_in_transaction(b"half-%d" % i, lambda m, a, s=state: s)
        expected = {}
        with readonly.open(path, wait_s=0) as ro:
            for t, n in (("t", 2), ("u", 1)):
                for part in range(n):
                    expected[f"{t}/{part}"] = {m.offset: m.value for m in ro.read(t, part, 0)}
    finally:
        if debug is not None:
            os.environ["TXMQ_DEBUG"] = debug
    files = sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs
                   if f not in ("LOCK", "control.sock") and os.path.getsize(os.path.join(d, f)))
    kinds = {os.path.basename(f).rsplit(".", 1)[-1] if "." in os.path.basename(f) else os.path.basename(f)
             for f in files}
    assert {"log", "index", "timeindex", "snap", "json", "readview", "recovery-point", "statetable"} <= kinds, kinds
    return path, expected, files


def _batches(raw: bytes, base: int):
    pos, offset = 0, base
    while pos + 88 <= len(raw) and raw[pos:pos + 4] == b"TXMB":
        length = int.from_bytes(raw[pos + 12:pos + 16], "little")
        count = int.from_bytes(raw[pos + 24:pos + 28], "little")
        yield pos, length, offset, count
        pos += length
        offset += count


@pytest.mark.parametrize("seed", range(CASES))
def test_flipped_bytes_anywhere(template, tmp_path, seed):
    src, expected, files = template
    rng = random.Random(1000 + seed)
    rel = files[seed % len(files)] if seed < len(files) else rng.choice(files)
    dst = str(tmp_path / "data")
    shutil.copytree(src, dst)
    target = os.path.join(dst, rel)
    original = open(target, "rb").read()
    spots = sorted(rng.randrange(len(original)) for _ in range(rng.randint(1, 3)))
    raw = bytearray(original)
    for s in spots:
        raw[s] ^= rng.randint(1, 255)
    open(target, "wb").write(bytes(raw))
    what = f"{rel}: flipped bytes {spots}"

    check = subprocess.run([sys.executable, "-m", "txmq.cli", "check", dst, "--json"], capture_output=True,
                           text=True, timeout=TIMEOUT, env=_env())
    assert check.returncode in (0, 1) and "Traceback" not in check.stderr, f"{what}: check: {check.stderr[-3000:]}"
    problems = json.loads(check.stdout)["problems"]
    proc = subprocess.run([sys.executable, "-c", OPEN, dst, json.dumps(OPTS), json.dumps({"t": 2, "u": 1})],
                          capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, f"{what}: open died:\n{proc.stderr[-3000:]}"
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    out = json.loads(line[len("RESULT "):])
    writer = out["writer"]
    if "error" in writer:
        # Refused: only a file that is not derived data, named with its byte
        # (the directory's marker: the directory, naming the marker).
        if rel == "txmq.json":
            assert writer["error"] == "DataDirError" and "txmq.json" in writer["message"], f"{what}: {writer}"
        else:
            assert os.path.realpath(writer["path"]) == os.path.realpath(target), f"{what}: {writer}"
        assert any(os.path.realpath(p["path"]) == os.path.realpath(target) for p in problems), f"{what}: {problems}"
        return
    damaged_part = None
    parts = rel.split(os.sep)
    if parts[0] == "topics":
        damaged_part = f"{parts[1]}/{parts[2]}"
    for key, want in expected.items():
        got = {o: v.encode("latin-1") for o, v in writer[key]}
        assert all(want.get(o) == v for o, v in got.items()), f"{what}: {key} read back wrong bytes"
        if "error" not in out["ro"]:
            assert out["ro"][key] == writer[key], f"{what}: {key}: the read-only view read otherwise"
        missing = set(want) - set(got)
        if key != damaged_part or not rel.endswith(".log"):
            assert not missing, f"{what}: {key} lost {sorted(missing)[:10]} to damage elsewhere"
            continue
        base = int(os.path.basename(rel)[:-4])
        hit = {o for pos, length, off, n in _batches(original, base) if any(pos <= s < pos + length for s in spots)
               for o in range(off, off + n)}
        if missing - hit:
            # More than the hit batches: only a cut (a damaged tail) may do that, and it is said.
            assert any(rel in r for r in out["reports"]), f"{what}: lost {sorted(missing - hit)[:10]} unreported"
        if missing:
            assert any(rel in r and " at byte " in r for r in out["reports"]), f"{what}: loss not reported"
    for r in out["reports"] + out["half_problems"]:
        if rel in r:
            named = [p for p in problems if p["path"].endswith(rel)]
            assert named and all(0 <= p["position"] for p in named), f"{what}: opening said {r}; check: {problems}"
