"""Staged ingest through the owner's control socket (docs/ARCHITECTURE.md): other
processes write a data directory only as one atomic step."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pyarrow as pa
import pytest

import txmq
from txmq import control, ingest
from txmq.errors import CorruptLogError, InvalidArgumentError, TopicNotFoundError

from killer import drain


def stage(path, job, attempt, topic, values, **kw):
    w = ingest.StagedWriter(path, job, attempt, topic)
    w.write(values, **kw)
    return w.close()


def run_elsewhere(code: str, *args) -> str:
    """Run ``code`` in another Python process (this checkout's txmq)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_another_process_ingests_atomically_into_an_open_broker(tmp_path):
    path = str(tmp_path / "d")
    with txmq.Broker(path, fsync="commit") as broker:
        broker.create_topic("orders", 3)
        c = broker.subscribe("orders", "billing", "shared", initial_position="earliest")
        assert os.path.exists(os.path.join(path, "control.sock"))
        assert oct(os.stat(os.path.join(path, "control.sock")).st_mode & 0o777) == "0o600"
        # Two attempts of one task: the second succeeded; the first is dropped.
        out = run_elsewhere("""
            import sys
            from txmq import ingest
            path = sys.argv[1]
            keys = [b"k%d" % (i % 11) for i in range(3000)]
            for attempt in ("t0-a0", "t0-a1"):
                w = ingest.StagedWriter(path, "job-1", attempt, "orders")
                w.write([b"%s-%d" % (attempt.encode(), i) for i in range(3000)], keys=keys)
                w.close()
            print(ingest.commit(path, "job-1", ["t0-a1"]))
            """, path)
        assert "'messages': 3000" in out
        got = drain(c)
        assert sorted(m.value for m in got) == sorted(b"t0-a1-%d" % i for i in range(3000))
        # keys hash to the partitions a producer would send them to
        p = broker.producer("orders")
        for m in got[:50]:
            assert m.message_id.partition == p.send(b"x", key=m.key).partition
        assert not os.path.exists(ingest.staging_dir(path, "job-1"))
        assert broker.stats()["transactions"]["committed"] == 1


def test_ingest_is_invisible_until_committed_and_all_at_once(tmp_path):
    path = str(tmp_path / "d")
    with txmq.Broker(path, fsync="never") as broker:
        broker.create_topic("t", 2)
        c = broker.subscribe("t", "s", initial_position="earliest", isolation="read_uncommitted")
        stage(path, "j", "a", "t", [b"v%d" % i for i in range(100)], partitions=[i % 2 for i in range(100)])
        assert drain(c) == []                          # staged: never visible, not even uncommitted
        assert broker.high_watermark("t", 0) == broker.high_watermark("t", 1) == 0
        r = ingest.commit(path, "j", ["a"])
        assert r == {"ok": True, "messages": 100, "skipped": False}
        got = drain(c)
        assert len(got) == 100 and {m.message_id.partition for m in got} == {0, 1}
        assert all(m.txn_id is not None and m.txn_id == got[0].txn_id for m in got)   # one transaction


def test_commit_without_an_owner_opens_the_directory_itself(tmp_path):
    path = str(tmp_path / "d")
    with txmq.Broker(path) as broker:
        broker.create_topic("t", 1)
    stage(path, "j", "a", "t", [b"x", b"y"], headers=[{"h": b"1"}, None], event_times=[5, 6])
    assert not os.path.exists(os.path.join(path, "control.sock"))
    assert ingest.commit(path, "j", ["a"])["messages"] == 2
    with txmq.Broker(path) as broker:
        c = broker.subscribe("t", "s", initial_position="earliest")
        got = drain(c)
        assert [(m.value, m.headers, m.event_time) for m in got] == [(b"x", [("h", b"1")], 5), (b"y", [], 6)]


def test_a_sink_batch_commits_once(tmp_path):
    path = str(tmp_path / "d")
    with txmq.Broker(path, fsync="never") as broker:
        broker.create_topic("out", 1)
        assert ingest.last_batch(path, "query-1") == -1
        stage(path, "q1-b0", "a", "out", [b"b0"])
        assert not ingest.commit(path, "q1-b0", ["a"], sink=("query-1", 0))["skipped"]
        # the same micro-batch again (a replay after a driver crash), staged under a new job id
        stage(path, "q1-b0-again", "a", "out", [b"b0"])
        assert ingest.commit(path, "q1-b0-again", ["a"], sink=("query-1", 0))["skipped"]
        assert not os.path.exists(ingest.staging_dir(path, "q1-b0-again"))
        stage(path, "q1-b1", "a", "out", [b"b1"])
        ingest.commit(path, "q1-b1", ["a"], sink=("query-1", 1))
        assert ingest.last_batch(path, "query-1") == 1
    with txmq.Broker(path, fsync="never") as broker:      # the progress is in the data, not in memory
        assert broker.sink_batch_id("query-1") == 1
        stage(path, "q1-b1-again", "a", "out", [b"b1"])
        assert broker.ingest_staged("q1-b1-again", ["a"], sink=("query-1", 1))["skipped"]
        c = broker.subscribe("out", "s", initial_position="earliest")
        assert [m.value for m in drain(c)] == [b"b0", b"b1"]


def test_failures_leave_nothing_visible(tmp_path):
    path = str(tmp_path / "d")
    with txmq.Broker(path, fsync="never") as broker:
        broker.create_topic("t", 1)
        c = broker.subscribe("t", "s", initial_position="earliest", isolation="read_uncommitted")
        stage(path, "j", "good", "t", [b"g%d" % i for i in range(50)])
        w = ingest.StagedWriter(path, "j", "open", "t")
        w.write([b"never closed"])
        with pytest.raises(txmq.errors.StagingError, match="COMPLETE"):
            ingest.commit(path, "j", ["good", "open"])
        stage(path, "j2", "bad", "t", [b"b%d" % i for i in range(50)])
        seg = os.path.join(ingest.staging_dir(path, "j2", "bad"), "t", "0-0.seg")
        with open(seg, "r+b") as f:
            f.seek(200)
            f.write(b"\xff\xff")
        stage(path, "j2", "good", "t", [b"x"])
        with pytest.raises(CorruptLogError) as e:
            ingest.commit(path, "j2", ["good", "bad"])
        assert e.value.path == seg
        assert drain(c) == []
        assert broker.stats()["transactions"]["open"] == 0
        with pytest.raises(InvalidArgumentError):
            control.request(path, {"op": "nope"})
        with pytest.raises(InvalidArgumentError):
            ingest.StagedWriter(path, "../escape", "a", "t")
        with pytest.raises(TopicNotFoundError):
            ingest.StagedWriter(path, "j3", "a", "missing")
        with pytest.raises(InvalidArgumentError):
            stage(path, "j3", "a", "t", [b"x"], partitions=[5])
        ingest.abort(path, "j")
        assert not os.path.exists(ingest.staging_dir(path, "j"))
        assert ingest.commit(path, "j2", ["good"])["messages"] == 1     # the good attempt alone is fine
        assert [m.value for m in drain(c)] == [b"x"]


def test_arrow_batches_with_spark_kafka_columns(tmp_path):
    path = str(tmp_path / "d")
    with txmq.Broker(path, fsync="never") as broker:
        broker.create_topic("t", 4)
        batch = pa.record_batch({
            "key": pa.array([b"a", None, b"c"], pa.binary()),
            "value": pa.array(["1", "2", "3"], pa.string()),
            "headers": pa.array([[{"key": "h", "value": b"x"}], None, []],
                                pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))),
            "partition": pa.array([3, 1, 3], pa.int32()),
        })
        w = ingest.StagedWriter(path, "j", "a", "t")
        assert w.write_arrow(batch) == 3
        w.close()
        ingest.commit(path, "j", ["a"])
        c = broker.subscribe("t", "s", initial_position="earliest")
        got = sorted((m.message_id.partition, m.key, m.value, m.headers) for m in drain(c))
        assert got == [(1, None, b"2", []), (3, b"a", b"1", [("h", b"x")]), (3, b"c", b"3", [])]
        with pytest.raises(InvalidArgumentError):
            ingest.StagedWriter(path, "j", "b", "t").write_arrow(pa.record_batch({"key": pa.array([b"k"])}))


def test_long_data_directory_path(tmp_path):
    deep = tmp_path
    while len(str(deep)) < 150:
        deep = deep / "a-rather-long-directory-name"
    path = str(deep / "d")
    with txmq.Broker(path, fsync="never") as broker:
        broker.create_topic("t", 1)
        assert control.request(path, {"op": "ping"})["pid"] == os.getpid()
        stage(path, "j", "a", "t", [b"x"])
        assert ingest.commit(path, "j", ["a"])["messages"] == 1


def test_abort_leaves_a_tombstone_that_late_attempts_obey(tmp_path):
    path = str(tmp_path / "d")
    with txmq.Broker(path, fsync="never") as broker:
        broker.create_topic("t", 1)
        late = ingest.StagedWriter(path, "j", "late", "t")      # a task still running when the job fails
        late.write([b"late"])
        ingest.abort(path, "j")
        with pytest.raises(txmq.errors.StagingError, match="aborted"):
            late.close()
        with pytest.raises(txmq.errors.StagingError, match="aborted"):
            ingest.StagedWriter(path, "j", "later", "t")
        staging = os.path.join(path, "staging")
        assert os.listdir(staging) == ["j" + ingest.ABORTED]
        stage(path, "old", "a", "t", [b"x"])                 # a writer that died before committing
        assert ingest.clean_staging(path, time.time()) == 0
        # A tombstone outlives only the tasks of its job (nothing visible
        # depends on it); a staged job nobody committed stays a day.
        assert ingest.TOMBSTONE_AGE_S < ingest.STAGED_AGE_S
        assert ingest.clean_staging(path, time.time() + ingest.TOMBSTONE_AGE_S + 60) == 1
        assert os.listdir(staging) == ["old"]
        assert ingest.clean_staging(path, time.time() + ingest.STAGED_AGE_S + 60) == 1
        assert os.listdir(staging) == []
