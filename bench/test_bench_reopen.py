"""Reopening after SIGKILL: the cost of ``txmq.Broker(path)`` (+ close) on a
100 MiB and a 2 GiB single-partition topic. The goal is that it does not
grow with the log: time(2 GiB) <= 2 x time(100 MiB).

A child process fills the topic (fsync="never", 1 KiB messages, send_batch
of pyarrow arrays), says so on stdout and is SIGKILLed with the broker open.
Every timed round must see that same just-killed directory, so the state
after the kill is snapshotted and restored before each round (untimed):
the index, recovery-point and other small files by content, the segment
files by size (opening only trims or extends them; their bytes are never
rewritten), and the active segment is read back into the page cache as the
child left it. Then ``os.sync()`` so no round pays for the child's writeback.

The page cache cannot be dropped here (no root), so these are warm-cache
figures; see README.md.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import txmq
from dirsnap import DirSnapshot

pytestmark = [pytest.mark.reopen, pytest.mark.timeout(1800)]

MiB = 1024 * 1024
GiB = 1024 * MiB
MIN_FREE = 10 * GiB
SIZES = {"100MiB": 100 * MiB, "2GiB": 2 * GiB}
MESSAGE = 1024
BATCH = 1024          # 1 MiB of payload per send_batch

CHILD = r"""
import os, sys, time
import pyarrow as pa
import txmq
path, total = sys.argv[1], int(sys.argv[2])
b = txmq.Broker(path, fsync="never")
b.create_topic("t", 1)
p = b.producer("t")
rnd = os.urandom(%(batch)d * %(message)d)
arr = pa.Array.from_buffers(pa.binary(), %(batch)d, [None,
    pa.py_buffer(__import__("numpy").arange(0, (%(batch)d + 1) * %(message)d, %(message)d,
                                            dtype="int32").tobytes()),
    pa.py_buffer(rnd)])
written = 0
while written < total:
    p.send_batch(arr)
    written += %(batch)d * %(message)d
print("written", written // %(message)d, flush=True)
time.sleep(3600)   # keep the broker open until the parent kills us
""" % {"batch": BATCH, "message": MESSAGE}


def build_killed(path: str, total: int) -> int:
    """Fill a topic in a child and SIGKILL it; return the message count."""
    env = dict(os.environ)
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(txmq.__file__)))
    env["PYTHONPATH"] = pkg_root + os.pathsep + env.get("PYTHONPATH", "")
    child = subprocess.Popen([sys.executable, "-c", CHILD, path, str(total)],
                             stdout=subprocess.PIPE, env=env, text=True)
    try:
        line = child.stdout.readline()
        if not line.startswith("written"):
            raise RuntimeError(f"child did not finish writing (exit {child.poll()}): {line!r}")
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(30)
    assert child.returncode == -signal.SIGKILL
    return int(line.split()[1])


@pytest.fixture
def free_disk(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    if free < MIN_FREE:
        pytest.skip(f"reopen benchmark needs >= 10 GiB free under {tmp_path}, "
                    f"{free / GiB:.1f} GiB free")


@pytest.mark.parametrize("size", list(SIZES))
def test_reopen_after_sigkill(size, measure, results, tmp_path, free_disk):
    path = str(tmp_path / "data")
    try:
        t0 = time.perf_counter()
        count = build_killed(path, SIZES[size])
        build_s = time.perf_counter() - t0
        snap = DirSnapshot(path)
        os.sync()
        open_times = []

        def run():
            t = time.perf_counter()
            b = txmq.Broker(path)
            open_times.append(time.perf_counter() - t)
            part = b.stats()["topics"]["t"]["partitions"][0]
            b.close()
            return part

        parts = []
        measure("reopen", size, lambda: parts.append(run()), ops_per_round=1, unit="s",
                rounds=15, warmup=1, setup=snap.restore,
                extra={"messages": count, "build_s": build_s})
        # Every open must have recovered the whole log, cutting nothing.
        assert all(p["end_offset"] == count and not p["truncated_on_open"] for p in parts), parts[-1]
        open_times.sort()
        rec = results.sides.get("reopen", {}).get(size)
        if rec is not None:
            rec["open_only_median_s"] = open_times[len(open_times) // 2]
            rec["log_bytes"] = parts[-1]["bytes"]
            rec["segments"] = parts[-1]["segments"]
        print(f"\n{size}: {count} messages built in {build_s:.1f}s; "
              f"median open {open_times[len(open_times) // 2] * 1000:.1f} ms (without close)")
    finally:
        shutil.rmtree(path, ignore_errors=True)
