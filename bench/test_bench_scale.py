"""Thousands of partitions under the common descriptor limit: the figures
of a 10,000-partition topic with ``ulimit -n 1024`` (set in each child
with ``resource.setrlimit`` before txmq is imported).

Reported (printed, and kept in the results under "scale"):

- ``create_s``: ``create_topic("t", partitions=10000)`` (fsync="commit");
- ``first_send_ms``: the first ``send`` after it (opens one partition);
- ``open_send_ms``: ``txmq.Broker(path)`` + one ``send`` + ``close`` on
  that directory (what ``echo hi | txmq produce`` does, without the
  interpreter's start);
- ``cli_*_s``: wall time of ``txmq topics list`` / ``stats`` / ``topics
  describe`` / ``consume -n 1`` (a child each, interpreter start included),
  after every partition holds a message;
- ``idle_partition_disk_bytes``: blocks allocated (``du``) per partition
  folder that holds one message, largest and mean, after close;
- ``stub_rss_bytes`` / ``open_partition_rss_bytes``: memory per partition
  of a broker that has not opened it, and per opened idle partition;
- ``reopen_after_sigkill_s``: ``txmq.Broker(path)`` on the directory a
  child left when it was SIGKILLed after sending to every partition.

No gate reads these yet; README.md lists them with their goals.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import txmq

pytestmark = [pytest.mark.timeout(3600)]

PARTITIONS = 10_000
NOFILE = 1024

PRELUDE = f"""
import resource
resource.setrlimit(resource.RLIMIT_NOFILE, ({NOFILE}, {NOFILE}))
import json, os, sys, time
import txmq
"""

FILL = PRELUDE + r"""
path, n = sys.argv[1], int(sys.argv[2])
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
out = {}
b = txmq.Broker(path)
t = time.perf_counter(); b.create_topic("t", partitions=n); out["create_s"] = time.perf_counter() - t
p = b.producer("t")
t = time.perf_counter(); p.send(b"first"); out["first_send_ms"] = (time.perf_counter() - t) * 1000
b.close()
t = time.perf_counter()
with txmq.Broker(path) as b:
    b.producer("t").send(b"hi")
out["open_send_ms"] = (time.perf_counter() - t) * 1000
r0 = rss()
b = txmq.Broker(path, fsync="never")
r1 = rss()
out["stub_rss_bytes"] = (r1 - r0) / n
p = b.producer("t")
for i in range(n):
    p.send(b"m%d" % i, partition=i)
out["open_partition_rss_bytes"] = (rss() - r1) / n
b.close()
print(json.dumps(out), flush=True)
"""

KILLED = PRELUDE + r"""
path, n = sys.argv[1], int(sys.argv[2])
b = txmq.Broker(path, fsync="never")
p = b.producer("t")
for i in range(n):
    p.send(b"k%d" % i, partition=i)
txn = b.new_transaction()
for i in range(0, n, 1000):
    p.send(b"open", partition=i, txn=txn)
print("written", flush=True)
time.sleep(3600)
"""

REOPEN = PRELUDE + r"""
path = sys.argv[1]
t = time.perf_counter(); b = txmq.Broker(path); opened = time.perf_counter() - t
lso = [b.last_stable_offset("t", i) == b.high_watermark("t", i) for i in range(0, 10000, 1000)]
b.close()
print(json.dumps({"reopen_after_sigkill_s": opened, "transactions_ended": all(lso)}), flush=True)
"""


def _env():
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(txmq.__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _child(code, *args) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                         env=_env(), timeout=3000)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cli_s(*args) -> float:
    code = PRELUDE + f"from txmq.cli.app import main\nsys.exit(main({list(map(str, args))!r}))"
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=600)
    took = time.perf_counter() - t
    assert out.returncode == 0, out.stderr[-3000:]
    return took


def _allocated(folder: str) -> int:
    return sum(os.stat(os.path.join(folder, n)).st_blocks * 512 for n in os.listdir(folder))


def test_ten_thousand_partitions(tmp_path, results):
    path = str(tmp_path / "data")
    figures = _child(FILL, path, PARTITIONS)
    for cmd in (("topics", "list", path), ("stats", path), ("topics", "describe", path, "t"),
                ("consume", path, "t", "-n", "1")):
        figures["cli_" + "_".join(cmd[:2 if cmd[0] == "topics" else 1]).replace(path, "").strip("_") + "_s"] = \
            _cli_s(*cmd)
    tdir = os.path.join(path, "topics", "t")
    sizes = [_allocated(os.path.join(tdir, d)) for d in os.listdir(tdir) if d.isdigit()]
    figures["idle_partition_disk_bytes"] = {"max": max(sizes), "mean": sum(sizes) / len(sizes)}

    child = subprocess.Popen([sys.executable, "-c", KILLED, path, str(PARTITIONS)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=_env())
    try:
        line = child.stdout.readline()
        assert line == "written\n", child.stderr.read()[-3000:]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    figures.update(_child(REOPEN, path))
    assert figures.pop("transactions_ended")
    results.sides.setdefault("scale", {})["10k partitions, ulimit -n 1024"] = figures
    print("\n" + json.dumps(figures, indent=1))
