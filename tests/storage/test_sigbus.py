"""A file truncated under a mapping never kills the process (csrc/sigbus.h):
the owner whose segment another process truncated stops with
CorruptLogError, and a read-only reader whose segment shrank under its
mapping gets CorruptLogError, instead of dying of SIGBUS. Each runs in a
real subprocess, which the parent damages between two steps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

import txmq

OWNER = r"""
import json, sys
import txmq
from txmq.errors import CorruptLogError
path = sys.argv[1]
b = txmq.Broker(path, fsync="never", segment_bytes_max=1 << 20)
b.create_topic("t", 1)
p = b.producer("t")
for i in range(500):
    p.send(b"m%d" % i)
print("READY", flush=True)
sys.stdin.readline()
out = {}
for what, op in (("send", lambda: [p.send(b"after-%d" % i) for i in range(50)]),
                 ("read", lambda: b.subscribe("t", "s", "exclusive", initial_position="earliest")
                                   .receive_many(1000, timeout=0))):
    try:
        op()
        out[what] = "ok"
    except CorruptLogError as e:
        out[what] = ["CorruptLogError", e.path, e.position, e.reason]
# The handler took a real SIGBUS (else this test proves nothing).
out["faulted"] = b._topics["t"].partitions[0].active.mapping.faulted
try:
    b.close()
    out["close"] = "ok"
except CorruptLogError as e:
    out["close"] = ["CorruptLogError", e.path]
print("RESULT " + json.dumps(out), flush=True)
"""

READER = r"""
import json, sys
from txmq import readonly
from txmq.errors import CorruptLogError
path = sys.argv[1]
ro = readonly.open(path, wait_s=0)
view = ro.view("t", 0)
n = len(list(view.read(0)))
print("READY %d" % n, flush=True)
sys.stdin.readline()
out = {}
for what, op in (("read", lambda: list(view.read(0))), ("arrow", lambda: list(view.read_arrow(0)))):
    try:
        op()
        out[what] = "ok"
    except CorruptLogError as e:
        out[what] = ["CorruptLogError", e.path, e.position, e.reason]
out["faulted"] = any(s.segment.mapping.faulted for s in view.segments)
print("RESULT " + json.dumps(out), flush=True)
"""


def _run(script, path, damage):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(txmq.__path__[0]),
                                                        os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", script, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        ready = proc.stdout.readline()
        assert ready.startswith("READY"), proc.stderr.read()
        damage()
        out, err = proc.communicate("go\n", timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != -signal.SIGBUS, f"died of SIGBUS:\n{err[-3000:]}"
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{err[-3000:]}"
    (line,) = [x for x in out.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


def _segments(path):
    pdir = os.path.join(path, "topics", "t", "0")
    return [os.path.join(pdir, n) for n in sorted(os.listdir(pdir)) if n.endswith(".log")]


def test_owner_whose_segment_was_truncated_stops_with_an_error(tmp_path):
    path = str(tmp_path / "d")
    out = _run(OWNER, path, lambda: os.truncate(_segments(path)[-1], 0))
    seg = _segments(path)[-1]
    for what in ("send", "read"):
        assert out[what][0] == "CorruptLogError" and out[what][1] == seg, out
        assert "changed under its mapping" in out[what][3]
    assert out["faulted"] and out["close"] == ["CorruptLogError", seg]


REMOVER = r"""
import json, sys
import txmq
from txmq.errors import CorruptLogError
path = sys.argv[1]
b = txmq.Broker(path, fsync="never", segment_bytes_max=8192)
b.create_topic("t", 1)
p = b.producer("t")
p.send(b"first")
print("READY", flush=True)
sys.stdin.readline()
out = {}
try:
    for i in range(2000):
        p.send(b"m%d" % i + b"x" * 100)
    out["send"] = "ok"
except CorruptLogError as e:
    out["send"] = ["CorruptLogError", e.path, e.reason]
try:
    b.close()
    out["close"] = "ok"
except CorruptLogError as e:
    out["close"] = ["CorruptLogError", e.path]
print("RESULT " + json.dumps(out), flush=True)
"""


def test_owner_whose_segment_was_removed_stops_with_an_error(tmp_path):
    path = str(tmp_path / "d")
    seg = os.path.join(path, "topics", "t", "0", "0" * 20 + ".log")
    out = _run(REMOVER, path, lambda: os.unlink(seg))
    assert out["send"][:2] == ["CorruptLogError", seg] and "removed by another process" in out["send"][2], out


def test_read_only_reader_whose_segment_shrank_gets_an_error(tmp_path):
    path = str(tmp_path / "d")
    with txmq.Broker(path, fsync="never", segment_bytes_max=8192) as b:
        b.create_topic("t", 1)
        p = b.producer("t")
        for i in range(400):
            p.send(b"m%d" % i + b"x" * 40)
    seg = _segments(path)[1]
    out = _run(READER, path, lambda: os.truncate(seg, 100))
    for what in ("read", "arrow"):
        assert out[what][0] == "CorruptLogError" and out[what][1] == seg, out
    assert out["faulted"]


def test_read_only_reader_whose_read_view_shrank_goes_on(tmp_path):
    """The read view file is mapped too: cut under a reader, the reader
    finds no whole slot and builds its view from the log."""
    path = str(tmp_path / "d")
    with txmq.Broker(path, fsync="never", segment_bytes_max=8192) as b:
        b.create_topic("t", 1)
        b.producer("t").send_batch([b"m%d" % i for i in range(50)])
    rv = os.path.join(path, "topics", "t", "0", "readview")
    out = _run(READER.replace('"faulted"] = any(s.segment.mapping.faulted for s in view.segments)',
                              '"faulted"] = len(list(ro.view("t", 0).read(0)))'),
               path, lambda: os.truncate(rv, 0))
    assert out["read"] == "ok" and out["faulted"] == 50
