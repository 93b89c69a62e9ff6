"""Spark writing into txmq exactly once (docs/SPARK.md): batch writes commit
the successful task attempts as one transaction through the directory's
owner; a failed job leaves nothing; streaming micro-batches commit once
per batch id, across restarts of the query."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pyarrow as pa
import pytest
from pyspark import cloudpickle

import txmq
from killer import HELPERS, drain
from spark_fixtures import spark  # noqa: F401  (pytest fixture)
from pyspark_txmq.sink import sink_key
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
    written = []                       # output rows after each kill
    for kill_after in (6.0, 9.0):      # seconds after the query started: some micro-batches in
        proc = subprocess.Popen([sys.executable, "-c", STREAM_DRIVER, path, ckpt, "kill", HELPERS],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        assert proc.stdout.readline().strip() == "STARTED"
        time.sleep(kill_after)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        time.sleep(2)                  # its JVM notices its driver is gone and exits
        written.append(len(values_in(path, "out")))
    done = subprocess.run([sys.executable, "-c", STREAM_DRIVER, path, ckpt, "drain", HELPERS],
                          capture_output=True, text=True, env=env, timeout=600)
    assert "DRAINED" in done.stdout, done.stderr[-3000:]
    got = [(m.key, m.value) for m in values_in(path, "out")]
    want = sorted((b"k%d" % (j % 13), b"m%d!" % j) for j in range(n))
    assert len(got) == len(set(got)), "a message written twice"
    assert sorted(got) == want
    assert any(0 < w < n for w in written), f"no kill landed mid-stream: {written}"


def test_streaming_micro_batches_commit_once_per_batch_id(tmp_path):
    """The stream writer's commit is keyed by (sink key, batchId): Spark
    replaying a committed micro-batch (after a driver crash between the
    commit and its checkpoint) appends nothing; another query's batch 0
    (a fresh checkpoint) is its own."""
    from pyspark_txmq.sink import StagedAttempt, TxmqStreamArrowWriter, _stream_job
    path = str(tmp_path / "d")
    with txmq.Broker(path) as b:
        b.create_topic("out", 1)
        w = TxmqStreamArrowWriter(path, "out", "s")

        def task(values, query="q1"):
            s = ingest.StagedWriter(path, _stream_job(sink_key("s", query)), f"t{time.monotonic_ns()}", "out")
            s.write_arrow(pa.record_batch({"value": pa.array(values, pa.binary())}))
            return StagedAttempt(**s.close(), query=query)

        w.commit([task([b"a", b"b"]), None], 0)
        w.commit([task([b"a", b"b"])], 0)            # replayed batch 0
        w.commit([task([b"c"])], 1)
        w.abort([task([b"never"])], 2)
        w.commit([task([b"d"], "q2")], 0)            # a new query: its batch 0 is written
        w.commit([], 3)                              # no task ran: nothing to record
        with pytest.raises(txmq.errors.StagingError, match="different queries"):
            w.commit([task([b"x"], "q1"), task([b"y"], "q2")], 2)
        c = b.subscribe("out", "s", initial_position="earliest")
        assert [m.value for m in drain(c)] == [b"a", b"b", b"c", b"d"]
        assert b.sink_batch_id(sink_key("s", "q1")) == 1
        assert b.sink_batch_id(sink_key("s", "q2")) == 0
        shutil.rmtree(os.path.join(path, "staging", _stream_job(sink_key("s", "q1"))))   # the refused batch's
        shutil.rmtree(os.path.join(path, "staging", _stream_job(sink_key("s", "q2"))))
        assert os.listdir(os.path.join(path, "staging")) == []

def _send(path, topic, values):
    with txmq.Broker(path, fsync="never") as b:
        b.producer(topic).send_batch(values)


def _copy_stream(spark, path, *, ckpt=None, sink_id=None, name=None):  # noqa: F811
    """Copy ``in`` to ``out`` with Trigger.AvailableNow until the input's
    end; returns the finished query."""
    src = (spark.readStream.format("txmq").option("path", path).option("subscribe", "in")
           .option("startingOffsets", "earliest").load())
    w = (src.select("key", "value").writeStream.format("txmq").option("path", path).option("topic", "out")
         .trigger(availableNow=True))
    if ckpt is not None:
        w = w.option("checkpointLocation", ckpt)
    if sink_id is not None:
        w = w.option("sinkId", sink_id)
    if name is not None:
        w = w.queryName(name)
    q = w.start()
    q.awaitTermination(120)
    assert q.exception() is None, q.exception()
    return q


def _out_counts(path) -> dict:
    counts: dict = {}
    for m in values_in(path, "out"):
        counts[m.value] = counts.get(m.value, 0) + 1
    return counts


def test_streaming_sink_on_a_fresh_checkpoint_writes_every_batch(spark, tmp_path):  # noqa: F811
    """Deleting the checkpoint starts a new query (a new persistent id):
    its micro-batches 0, 1, ... are written, not taken for the old query's;
    a restart from the same checkpoint still writes each row once."""
    path, ckpt = str(tmp_path / "d"), str(tmp_path / "ckpt")
    with txmq.Broker(path) as b:
        b.create_topic("in", 2)
        b.create_topic("out", 1)
    _send(path, "in", [b"a%d" % i for i in range(100)])
    first = _copy_stream(spark, path, ckpt=ckpt)
    assert sum(_out_counts(path).values()) == 100
    shutil.rmtree(ckpt)                                  # reprocess from scratch
    _send(path, "in", [b"b%d" % i for i in range(100)])
    second = _copy_stream(spark, path, ckpt=ckpt)
    assert second.id != first.id
    counts = _out_counts(path)
    assert sum(counts.values()) == 300
    assert {v: n for v, n in counts.items() if n != 1} == {b"a%d" % i: 2 for i in range(100)}
    _send(path, "in", [b"c%d" % i for i in range(10)])
    third = _copy_stream(spark, path, ckpt=ckpt)         # restarted: the same query
    with open(os.path.join(ckpt, "metadata")) as f:
        assert third.id == second.id == json.load(f)["id"]
    assert sum(_out_counts(path).values()) == 310
    with txmq.Broker(path, fsync="never") as b:
        assert b.sink_batch_id(sink_key(None, second.id)) >= 0
        assert b.sink_batch_id(sink_key(None, first.id)) >= 0


def test_two_queries_with_one_sink_id_are_kept_apart(spark, tmp_path):  # noqa: F811
    """Two queries (two checkpoints) given the same sinkId both write all
    their rows: their commits are keyed by each query's own id."""
    path = str(tmp_path / "d")
    with txmq.Broker(path) as b:
        b.create_topic("in", 1)
        b.create_topic("out", 1)
    _send(path, "in", [b"v%d" % i for i in range(50)])
    one = _copy_stream(spark, path, ckpt=str(tmp_path / "c1"), sink_id="copy")
    two = _copy_stream(spark, path, ckpt=str(tmp_path / "c2"), sink_id="copy")
    assert _out_counts(path) == {b"v%d" % i: 2 for i in range(50)}
    with txmq.Broker(path, fsync="never") as b:
        assert b.sink_batch_id(sink_key("copy", one.id)) >= 0
        assert b.sink_batch_id(sink_key("copy", two.id)) >= 0


def test_streaming_sink_takes_the_session_checkpoint_location(spark, tmp_path):  # noqa: F811
    """``spark.sql.streaming.checkpointLocation`` with a query name and no
    per-query option: the query writes, and a restart resumes."""
    path = str(tmp_path / "d")
    with txmq.Broker(path) as b:
        b.create_topic("in", 1)
        b.create_topic("out", 1)
    _send(path, "in", [b"v%d" % i for i in range(40)])
    spark.conf.set("spark.sql.streaming.checkpointLocation", str(tmp_path / "root"))
    try:
        first = _copy_stream(spark, path, name="txmq_copy")
        _send(path, "in", [b"w%d" % i for i in range(5)])
        again = _copy_stream(spark, path, name="txmq_copy")
    finally:
        spark.conf.unset("spark.sql.streaming.checkpointLocation")
    assert again.id == first.id
    assert _out_counts(path) == {**{b"v%d" % i: 1 for i in range(40)}, **{b"w%d" % i: 1 for i in range(5)}}


def test_topic_option_overrides_the_topic_column(spark, tmp_path):  # noqa: F811
    """A DataFrame read from txmq (its topic column says ``src``) writes to
    the topic the option names, as Spark's Kafka sink does (the partition
    column is kept, as there)."""
    path = str(tmp_path / "d")
    with txmq.Broker(path) as b:
        b.create_topic("src", 2)
        b.create_topic("dst", 2)
    _send(path, "src", [b"v%d" % i for i in range(20)])
    df = spark.read.format("txmq").option("path", path).option("subscribe", "src").load()
    df.write.format("txmq").option("path", path).option("topic", "dst").mode("append").save()
    assert (sorted((m.message_id.partition, m.value) for m in values_in(path, "dst"))
            == sorted((m.message_id.partition, m.value) for m in values_in(path, "src")))


@pytest.mark.parametrize("column, sql, expected", [
    ("value", "cast(id as int) as value", "value column.*int.*binary or string"),
    ("key", "array(1) as key", "key column.*array<int>.*binary or string"),
    ("headers", "map('h', cast('x' as binary)) as headers", "headers column.*map<string,binary>"),
    ("headers", "array(named_struct('key', 1, 'value', cast('x' as binary))) as headers",
     "headers column.*array<struct<key:int,value:binary>>"),
    ("partition", "'0' as partition", "partition column.*string.*int"),
    ("topic", "1 as topic", "topic column.*int.*string"),
])
def test_column_types_are_refused_before_any_task_runs(spark, tmp_path, column, sql, expected):  # noqa: F811
    """Every column of the wrong type is refused when the writer is made,
    with a typed error naming the column — not in tasks (retried
    spark.task.maxFailures times) nor converted silently."""
    from pyspark_txmq import DefaultSource
    path = str(tmp_path / "d")
    with txmq.Broker(path) as b:
        b.create_topic("out", 1)
    exprs = [sql] + ([] if column == "value" else ["cast(id as string) as value"])
    df = spark.range(3).selectExpr(*exprs)
    source = DefaultSource({"path": path, "topic": "out"})
    with pytest.raises(txmq.errors.InvalidArgumentError, match=expected):
        source.writer(df.schema, False)
    with pytest.raises(txmq.errors.InvalidArgumentError, match=expected):
        source.streamWriter(df.schema, False)
    with pytest.raises(Exception, match=expected) as e:
        df.write.format("txmq").option("path", path).option("topic", "out").mode("append").save()
    assert "stage failure" not in str(e.value)          # refused in planning, no task ran
    assert values_in(path, "out", "read_uncommitted") == []


def test_unknown_sink_options_are_refused(spark, tmp_path):  # noqa: F811
    path = str(tmp_path / "d")
    with txmq.Broker(path) as b:
        b.create_topic("out", 1)
    df = spark.range(3).selectExpr("cast(id as string) as value")
    with pytest.raises(Exception, match="invalid option 'topik'"):
        df.write.format("txmq").option("path", path).option("topic", "out").option("topik", "x").mode("append").save()
    with pytest.raises(Exception, match="invalid option 'kafka.bootstrap.servers'"):
        (df.write.format("txmq").option("path", path).option("topic", "out")
         .option("kafka.bootstrap.servers", "h:9092").mode("append").save())


BATCH_DRIVER = """
import sys
sys.path.insert(0, sys.argv[3])
from spark_fixtures import build_session
path, n = sys.argv[1], int(sys.argv[2])
spark = build_session("txmq-batch-kill")
spark.sparkContext.setLogLevel("OFF")
df = spark.range(0, n, numPartitions=3).selectExpr("cast(id as string) as value")
df.write.format("txmq").option("path", path).option("topic", "out").mode("append").save()
print("WRITTEN", flush=True)
"""


# Slow (two Spark drivers, 40-70 s): the default run covers both crash
# points of the commit without Spark (tests/requester/test_ingest_crash.py).
@pytest.mark.slow
@pytest.mark.parametrize("point", ["ingest.appended", "ingest.committed"])
def test_driver_killed_during_a_batch_write_commit(tmp_path, point):
    """The commit of a batch write (no owner: the commit process opens the
    directory) is SIGKILLed at ``point`` — its transaction appended, or
    committed — and the driver with it (its whole process group) at once.
    Nothing is doubled and nothing half-visible: before the commit point
    nothing of the job is visible and running the job again writes each
    row once; after it, each row is there once and the job's leftover
    staging is never ingested."""
    from txmq.readonly import writer_pid
    path = str(tmp_path / "d")
    n = 3000
    with txmq.Broker(path) as b:
        b.create_topic("out", 2)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), TXMQ_CRASH_AT=point)
    driver = subprocess.Popen([sys.executable, "-c", BATCH_DRIVER, path, str(n), HELPERS],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                              start_new_session=True)
    try:
        seen = None
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and driver.poll() is None:
            holder = writer_pid(path)
            if holder:
                seen = holder                  # the commit process holds the directory
            elif seen is not None:
                break                          # ... and was killed at the crash point
            time.sleep(0.002)
        assert seen is not None, "the commit never opened the directory"
    finally:
        os.killpg(driver.pid, signal.SIGKILL)  # the driver: its Python process and its JVM
        driver.wait(30)
    assert "WRITTEN" not in driver.stdout.read()
    got = sorted(int(m.value) for m in values_in(path, "out"))
    if point == "ingest.appended":
        assert got == []                       # the open transaction never commits
        rerun = subprocess.run([sys.executable, "-c", BATCH_DRIVER, path, str(n), HELPERS],
                               capture_output=True, text=True, timeout=300,
                               env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
        assert "WRITTEN" in rerun.stdout, rerun.stderr[-3000:]
        got = sorted(int(m.value) for m in values_in(path, "out"))
    assert got == list(range(n))
    with txmq.Broker(path) as b:           # an owner again: leftovers are never ingested
        b.enforce_retention()
    assert sorted(int(m.value) for m in values_in(path, "out")) == list(range(n))
