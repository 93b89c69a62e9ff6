"""Spark writing into txmq exactly once (DESIGN.md §9): batch writes commit
the successful task attempts as one transaction through the directory's
owner; a failed job leaves nothing; streaming micro-batches commit once
per batch id, across restarts of the query."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pyarrow as pa
import pytest
from pyspark import cloudpickle

import txmq
from killer import drain
from spark_fixtures import spark  # noqa: F401  (pytest fixture)
from txmq import ingest


# Spark's Python workers do not have tests/ on their path: ship this
# module's functions (the injected failures) by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def values_in(path, topic, isolation="read_committed"):
    with txmq.Broker(path, fsync="never") as b:
        c = b.subscribe(topic, "check", initial_position="earliest", isolation=isolation)
        return [m for m in drain(c)]


def test_write_into_a_directory_another_process_holds(spark, tmp_path):  # noqa: F811
    path = str(tmp_path / "d")
    with txmq.Broker(path) as b:
        b.create_topic("out", 3)
    # The owner: a broker in another process, consuming what arrives.
    owner = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, txmq
        with txmq.Broker(sys.argv[1]) as b:
            c = b.subscribe("out", "app", "shared", initial_position="earliest")
            print("READY", flush=True)
            got = []
            while len(got) < 5000:
                got += c.receive_many(5000, timeout=60)
            c.ack(got)
            print(len(got), len({m.value for m in got}), len({m.txn_id for m in got}),
                  sum(m.key == b"k7" for m in got), flush=True)
        """), path], stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    try:
        assert owner.stdout.readline().strip() == "READY"
        df = spark.range(5000).selectExpr("concat('k', cast(id % 10 as string)) as key",
                                          "concat('v', cast(id as string)) as value")
        df.repartition(4).write.format("txmq").option("path", path).option("topic", "out").mode("append").save()
        out = owner.stdout.readline().split()
        assert owner.wait(60) == 0
    finally:
        owner.kill()
    # every row once, all in one transaction, received by the owner's consumer
    assert out == ["5000", "5000", "1", "500"]
    assert os.listdir(os.path.join(path, "staging")) == []


def _failing_first_attempt(batches):
    from pyspark import TaskContext
    ctx = TaskContext.get()
    for i, batch in enumerate(batches):
        yield batch
        if ctx.partitionId() == 0 and ctx.attemptNumber() == 0 and i == 0:
            raise RuntimeError("injected: first attempt of partition 0 fails after staging a batch")


def test_task_failure_on_the_first_attempt_writes_each_row_once(spark, tmp_path):  # noqa: F811
    path = str(tmp_path / "d")
    with txmq.Broker(path) as b:
        b.create_topic("out", 2)
    df = (spark.range(0, 20000, numPartitions=3).selectExpr("cast(id as string) as value")
          .mapInArrow(_failing_first_attempt, "value string"))
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "1000")
    try:
        df.write.format("txmq").option("path", path).option("topic", "out").mode("append").save()
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    got = sorted(int(m.value) for m in values_in(path, "out", "read_uncommitted"))
    assert got == list(range(20000))


def _always_failing(batches):
    from pyspark import TaskContext
    for batch in batches:
        yield batch
        if TaskContext.get().partitionId() == 1:
            raise RuntimeError("injected: partition 1 always fails")


def test_a_failed_job_leaves_nothing_visible(spark, tmp_path):  # noqa: F811
    path = str(tmp_path / "d")
    with txmq.Broker(path) as b:
        b.create_topic("out", 1)
    df = (spark.range(0, 3000, numPartitions=3).selectExpr("cast(id as string) as value")
          .mapInArrow(_always_failing, "value string"))
    with pytest.raises(Exception, match="partition 1 always fails"):
        df.write.format("txmq").option("path", path).option("topic", "out").mode("append").save()
    assert values_in(path, "out", "read_uncommitted") == []
    time.sleep(1)                       # tasks of the failed job still running stage nothing that stays
    left = os.listdir(os.path.join(path, "staging"))
    assert len(left) == 1 and left[0].endswith(ingest.ABORTED)     # the job's tombstone, nothing staged


def test_write_options_and_columns(spark, tmp_path):  # noqa: F811
    path = str(tmp_path / "d")
    with txmq.Broker(path) as b:
        b.create_topic("out", 4)
    schema = "key binary, value binary, headers array<struct<key:string,value:binary>>, partition int"
    rows = [(b"a", b"1", [("h", b"x")], 3), (None, b"2", None, 1), (b"c", b"3", [], 3)]
    df = spark.createDataFrame(rows, schema)
    w = df.write.format("txmq").option("path", path).option("topic", "out")
    with pytest.raises(Exception, match="append-only"):
        w.mode("overwrite").save()
    with pytest.raises(Exception, match="TopicNotFoundError|missing"):
        df.write.format("txmq").option("path", path).option("topic", "missing").mode("append").save()
    with pytest.raises(Exception, match="'value' column"):
        df.select("key").write.format("txmq").option("path", path).option("topic", "out").mode("append").save()
    w.mode("append").save()
    got = sorted((m.message_id.partition, m.key, m.value, m.headers) for m in values_in(path, "out"))
    assert got == [(1, None, b"2", []), (3, b"a", b"1", [("h", b"x")]), (3, b"c", b"3", [])]


STREAM_DRIVER = """
import os, sys, time
sys.path.insert(0, sys.argv[4])
from spark_fixtures import build_session
path, ckpt, mode = sys.argv[1], sys.argv[2], sys.argv[3]
spark = build_session("txmq-stream-" + mode)
spark.sparkContext.setLogLevel("ERROR")
src = (spark.readStream.format("txmq").option("path", path).option("subscribe", "in").option("startingOffsets", "earliest")
       .option("maxOffsetsPerTrigger", "700").load())
out = src.selectExpr("key", "concat(cast(value as string), '!') as value")
q = (out.writeStream.format("txmq").option("path", path).option("topic", "out")
     .option("checkpointLocation", ckpt).trigger(processingTime="200 milliseconds").start())
print("STARTED", flush=True)
if mode == "drain":
    q.processAllAvailable()
    q.stop()
    print("DRAINED", flush=True)
else:
    q.awaitTermination()
"""


@pytest.mark.slow
def test_streaming_read_transform_write_survives_killed_queries(tmp_path):
    """A streaming query txmq -> txmq is SIGKILLed twice mid-stream and
    restarted from its checkpoint: the output is the transform of the
    input, each exactly once."""
    path = str(tmp_path / "d")
    ckpt = str(tmp_path / "ckpt")
    n = 6000
    with txmq.Broker(path) as b:
        b.create_topic("in", 3)
        b.create_topic("out", 3)
        p = b.producer("in")
        for i in range(0, n, 100):
            with b.transaction() as txn:
                p.send_batch([b"m%d" % j for j in range(i, i + 100)], keys=[b"k%d" % (j % 13) for j in range(i, i + 100)],
                             txn=txn)
        t = b.new_transaction()                      # an aborted batch the stream must never copy
        p.send_batch([b"aborted"] * 50, txn=t)
        t.abort()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    tests_dir = os.path.dirname(__file__)
    written = []                       # output rows after each kill
    for kill_after in (6.0, 9.0):      # seconds after the query started: some micro-batches in
        proc = subprocess.Popen([sys.executable, "-c", STREAM_DRIVER, path, ckpt, "kill", tests_dir],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        assert proc.stdout.readline().strip() == "STARTED"
        time.sleep(kill_after)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        time.sleep(2)                  # its JVM notices its driver is gone and exits
        written.append(len(values_in(path, "out")))
    done = subprocess.run([sys.executable, "-c", STREAM_DRIVER, path, ckpt, "drain", tests_dir],
                          capture_output=True, text=True, env=env, timeout=600)
    assert "DRAINED" in done.stdout, done.stderr[-3000:]
    got = [(m.key, m.value) for m in values_in(path, "out")]
    want = sorted((b"k%d" % (j % 13), b"m%d!" % j) for j in range(n))
    assert len(got) == len(set(got)), "a message written twice"
    assert sorted(got) == want
    assert any(0 < w < n for w in written), f"no kill landed mid-stream: {written}"


def test_streaming_micro_batches_commit_once_per_batch_id(tmp_path):
    """The stream writer's commit is keyed by (sink, batchId): Spark
    replaying a committed micro-batch (after a driver crash between the
    commit and its checkpoint) appends nothing."""
    from pyspark_txmq.sink import StagedAttempt, TxmqStreamArrowWriter
    path = str(tmp_path / "d")
    with txmq.Broker(path) as b:
        b.create_topic("out", 1)
        w = TxmqStreamArrowWriter(path, "out", str(tmp_path / "ckpt"))

        def task(values):
            s = ingest.StagedWriter(path, w.job, f"t{time.monotonic_ns()}", "out")
            s.write_arrow(pa.record_batch({"value": pa.array(values, pa.binary())}))
            return StagedAttempt(**s.close())

        w.commit([task([b"a", b"b"]), None], 0)
        w.commit([task([b"a", b"b"])], 0)            # replayed batch 0
        w.commit([task([b"c"])], 1)
        w.abort([task([b"never"])], 2)
        c = b.subscribe("out", "s", initial_position="earliest")
        assert [m.value for m in drain(c)] == [b"a", b"b", b"c"]
        assert b.sink_batch_id(str(tmp_path / "ckpt")) == 1
        assert os.listdir(os.path.join(path, "staging")) == []
