"""Staged ingest across a SIGKILL of the directory's owner (G1, G4): a
commit with a sink key, interrupted anywhere, is asked again (by the
requester, through the next owner or itself) and takes effect once; a
commit without one raises RequestInterruptedError rather than guess.

The owner is a subprocess holding the broker; it is killed at the named
ingest steps (``ingest.appended``: appended, not committed;
``ingest.committed``: committed, staging not yet removed) and at random
moments while this process commits job after job.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time

import pytest

import txmq
from txmq import ingest
from txmq.errors import RequestInterruptedError

from killer import drain, worker

OWNER = worker("ingest_owner_worker.py")
ROWS = 200


def start_owner(path, fsync, crash_at=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("TXMQ_CRASH_AT", None)
    if crash_at:
        env["TXMQ_CRASH_AT"] = crash_at
    proc = subprocess.Popen([sys.executable, OWNER, path, fsync], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "READY"
    return proc


def stage_job(path, job):
    w = ingest.StagedWriter(path, job, "a0", "t")
    w.write([b"%s/%d" % (job.encode(), i) for i in range(ROWS)], keys=[b"k%d" % (i % 7) for i in range(ROWS)])
    w.close()


def rows(path, isolation):
    with txmq.Broker(path, fsync="never") as b:
        c = b.subscribe("t", f"check-{time.monotonic_ns()}", initial_position="earliest", isolation=isolation)
        out = [m.value for m in drain(c)]
        c.unsubscribe()
        return out


def check_exactly_once(path, jobs) -> int:
    """Every row of ``jobs`` committed once and nothing else committed;
    returns how many rows of aborted transactions read_uncommitted shows."""
    committed = rows(path, "read_committed")
    assert len(committed) == len(set(committed)), "a staged row appended twice"
    assert sorted(committed) == sorted(b"%s/%d" % (j.encode(), i) for j in jobs for i in range(ROWS))
    return len(rows(path, "read_uncommitted")) - len(committed)


def staged(path) -> list:
    return sorted(n for n in os.listdir(os.path.join(path, "staging")) if not n.endswith(ingest.ABORTED))


@pytest.mark.parametrize("point", ["ingest.appended", "ingest.committed"])
def test_owner_killed_at_each_ingest_step(tmp_path, point):
    path = str(tmp_path / "d")
    with txmq.Broker(path) as b:
        b.create_topic("t", 3)
    owner = start_owner(path, "commit", point)
    try:
        # With a sink key: the owner dies inside the commit, the requester
        # asks again (here: no owner, so it opens the directory itself).
        stage_job(path, "j1")
        r = ingest.commit(path, "j1", ["a0"], sink=("txmq.job/j1", 0))
        assert owner.wait(10) == -9
        assert r["skipped"] == (point == "ingest.committed")   # committed before the kill: not again
        assert staged(path) == []
        assert check_exactly_once(path, ["j1"]) == (ROWS if point == "ingest.appended" else 0)
        # Without one, the outcome is not guessed.
        stage_job(path, "j2")
        owner = start_owner(path, "commit", point)
        with pytest.raises(RequestInterruptedError):
            ingest.commit(path, "j2", ["a0"])
        assert owner.wait(10) == -9
    finally:
        owner.kill()
    assert staged(path) == ["j2"]                  # the kill came before the staging was removed
    if point == "ingest.appended":                 # not committed: it can be committed now, once
        check_exactly_once(path, ["j1"])
        with txmq.Broker(path) as b:
            assert b.ingest_staged("j2", ["a0"])["messages"] == ROWS
    check_exactly_once(path, ["j1", "j2"])


def _commit_jobs(path, jobs, stop, errors):
    try:
        for job in jobs:
            if stop.is_set():
                return
            stage_job(path, job)
            ingest.commit(path, job, ["a0"], sink=(f"txmq.job/{job}", 0), timeout=60)
    except BaseException as e:                    # reported to the test thread
        errors.append(e)


@pytest.mark.parametrize("fsync", ["never", "commit"])
def test_owner_killed_at_random_while_jobs_commit(tmp_path, fsync):
    path = str(tmp_path / "d")
    with txmq.Broker(path) as b:
        b.create_topic("t", 3)
    rng = random.Random(fsync)
    jobs = [f"job{i}" for i in range(300)]
    stop, errors = threading.Event(), []
    committer = threading.Thread(target=_commit_jobs, args=(path, jobs, stop, errors))
    owner = start_owner(path, fsync)
    committer.start()
    kills = 0
    try:
        while committer.is_alive() and kills < 8:
            time.sleep(rng.uniform(0.05, 0.25))
            owner.kill()
            owner.wait()
            kills += 1
            owner = start_owner(path, fsync)
        committer.join(120)
    finally:
        stop.set()
        owner.kill()
        owner.wait()
    assert not errors, errors
    assert kills >= 3
    check_exactly_once(path, jobs)
    assert staged(path) == []
