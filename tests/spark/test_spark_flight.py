"""Spark reading and writing txmq through the owner's Arrow Flight service
(``option("flight", "grpc://host:port")``, no ``path``): the same rows,
offsets and guarantees as the local path (tests/test_spark_read.py,
tests/test_spark_write.py), in the shared local Spark session.

The broker and its Flight service run in this process; Spark's Python
workers reach them over loopback. tests/spark/test_spark_cluster.py runs the
same through a standalone cluster whose worker cannot open the directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile

import pyarrow as pa
import pytest
from pyspark import cloudpickle

import txmq
import txmq.readonly
from pyspark_txmq.remote import Fallback, task_target
from pyspark_txmq.sink import batch_writer, stream_writer
from pyspark_txmq.source import TxmqReader, TxmqStreamReader, read_options
from txmq.errors import DataDirUnreadableError, InvalidArgumentError
from txmq.flight import serve_flight
from txmq.flight.client import published_target
from killer import drain
from unprivileged import others_can_enter, relocate_python
from spark_fixtures import spark  # noqa: F401  (pytest fixture)
from test_spark_read import Workload, rows_of

cloudpickle.register_pickle_by_value(sys.modules[__name__])     # the injected failures, for the workers


@pytest.fixture
def owner(tmp_path):
    """A broker holding ``tmp_path/data``, served over Flight on a free port."""
    broker = txmq.Broker(tmp_path / "data", fsync="never")
    service = serve_flight(broker, "127.0.0.1", 0)
    try:
        yield broker, service
    finally:
        broker.close()


def remote(reader, service, token_file=None):
    reader = reader.format("txmq").option("flight", service.location)
    if token_file is not None:
        return reader.option("flight.tokenFile", str(token_file))
    return reader.option("flight.token", service.token)


def load(spark, service, **options):  # noqa: F811
    reader = remote(spark.read, service)
    for k, v in options.items():
        reader = reader.option(k, v)
    return reader.load()


def test_batch_read_through_flight_is_the_local_read(spark, owner, tmp_path):  # noqa: F811
    broker, service = owner
    broker.create_topic("orders", 3)
    orders = broker.producer("orders")
    w = Workload(broker)
    for p in range(3):
        w.send(orders, "orders", [b"plain-%d-%d" % (p, i) for i in range(40)], p, keys=[b"k%d" % i for i in range(40)],
               headers=[{"i": b"%d" % i} if i % 3 else None for i in range(40)], t=p * 100)
    committed, aborted = broker.new_transaction(), broker.new_transaction()
    for p in range(3):
        w.send(orders, "orders", [b"C-%d-%d" % (p, i) for i in range(5)], p, txn=committed, t=1000)
        w.send(orders, "orders", [b"A-%d-%d" % (p, i) for i in range(4)], p, txn=aborted, t=2000)
    committed.commit()
    aborted.abort()
    still_open = broker.new_transaction(timeout=600)
    w.send(orders, "orders", [b"O-1-%d" % i for i in range(3)], 1, txn=still_open, t=3000)
    for p in range(3):
        w.send(orders, "orders", [b"after-%d-%d" % (p, i) for i in range(6)], p, t=4000 + p)
    open_first = min(r[2] for r, txn in w.sent if txn is still_open)

    def visible(row, txn):
        if txn is aborted or txn is still_open:
            return False
        return not (row[1] == 1 and row[2] >= open_first)

    want = sorted(row for row, txn in w.sent if visible(row, txn))
    got = rows_of(load(spark, service, subscribe="orders", includeHeaders="true", maxOffsetsPerPartition="20"),
                  headers=True)
    assert got == want                              # committed only, every column as sent
    local = rows_of(spark.read.format("txmq").option("path", broker.path).option("subscribe", "orders")
                    .option("includeHeaders", "true").load(), headers=True)
    assert got == local
    # read_uncommitted: every data message; the token from the owner's file
    df = remote(spark.read, service, token_file=os.path.join(broker.path, "flight.token")) \
        .option("subscribe", "orders").option("isolation", "read_uncommitted").load()
    assert sorted(r[:7] for r in rows_of(df)) == sorted(row[:7] for row, _ in w.sent)
    assert df.rdd.getNumPartitions() == 3


def test_streaming_read_through_flight(spark, owner, tmp_path):  # noqa: F811
    broker, service = owner
    broker.create_topic("s", 2)
    producer = broker.producer("s")
    producer.send_batch([b"p0-%d" % i for i in range(230)], partition=0)
    producer.send_batch([b"p1-%d" % i for i in range(90)], partition=1)
    txn = broker.new_transaction()
    producer.send_batch([b"a-%d" % i for i in range(10)], partition=0, txn=txn)
    txn.abort()
    still_open = broker.new_transaction(timeout=600)
    producer.send_batch([b"o-%d" % i for i in range(5)], partition=0, txn=still_open)
    producer.send_batch([b"late-%d" % i for i in range(5)], partition=0)

    def run(**options):
        batches = []

        def collect(df, batch_id):
            batches.append(sorted((r.partition, r.offset, bytes(r.value))
                                  for r in df.select("partition", "offset", "value").collect()))

        reader = remote(spark.readStream, service).option("subscribe", "s").option("maxOffsetsPerTrigger", "100")
        for k, v in options.items():
            reader = reader.option(k, v)
        query = (reader.load().writeStream.foreachBatch(collect)
                 .option("checkpointLocation", str(tmp_path / "ckpt")).trigger(availableNow=True).start())
        assert query.awaitTermination(180), "the availableNow stream did not end in 180 s"
        assert query.exception() is None, query.exception()
        return batches

    batches = run(startingOffsets="earliest")
    rows = sorted(r for b in batches for r in b)
    assert rows == sorted([(0, i, b"p0-%d" % i) for i in range(230)] + [(1, i, b"p1-%d" % i) for i in range(90)])
    assert all(len(b) <= 100 for b in batches) and len([b for b in batches if b]) >= 4
    still_open.commit()
    rows = sorted(r for b in run() for r in b)        # restarted from its checkpoint: goes on where it ended
    assert rows == sorted([(0, 241 + i, b"o-%d" % i) for i in range(5)]
                          + [(0, 246 + i, b"late-%d" % i) for i in range(5)])


def _failing_first_attempt(batches):
    from pyspark import TaskContext
    ctx = TaskContext.get()
    for i, batch in enumerate(batches):
        yield batch
        if ctx.partitionId() == 0 and ctx.attemptNumber() == 0 and i == 0:
            raise RuntimeError("injected: first attempt of partition 0 fails after sending a batch")


def _always_failing(batches):
    from pyspark import TaskContext
    for batch in batches:
        yield batch
        if TaskContext.get().partitionId() == 1:
            raise RuntimeError("injected: partition 1 always fails")


def test_batch_write_through_flight_commits_each_row_once(spark, owner):  # noqa: F811
    broker, service = owner
    broker.create_topic("out", 2)
    consumer = broker.subscribe("out", "check", initial_position="earliest")
    df = (spark.range(0, 20000, numPartitions=3)
          .selectExpr("cast(id % 7 as string) as key", "cast(id as string) as value")
          .mapInArrow(_failing_first_attempt, "key string, value string"))
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "1000")
    try:
        remote(df.write, service).option("topic", "out").mode("append").save()
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    got = list(drain(consumer))
    assert sorted(int(m.value) for m in got) == list(range(20000))      # the failed attempt's batch: not written
    assert len({m.txn_id for m in got}) == 1                            # one transaction
    assert {m.key for m in got if m.partition == 0} & {m.key for m in got if m.partition == 1} == set()
    assert os.listdir(os.path.join(broker.path, "staging")) == []
    # a failed job leaves nothing visible
    bad = spark.range(0, 3000, numPartitions=3).selectExpr("cast(id as string) as value") \
        .mapInArrow(_always_failing, "value string")
    with pytest.raises(Exception, match="partition 1 always fails"):
        remote(bad.write, service).option("topic", "out").mode("append").save()
    assert list(drain(consumer)) == []
    assert all(n.endswith(".aborted") for n in os.listdir(os.path.join(broker.path, "staging")))


def test_streaming_write_through_flight_once_per_batch(spark, owner, tmp_path):  # noqa: F811
    broker, service = owner
    broker.create_topic("in", 2)
    broker.create_topic("out", 2)
    p = broker.producer("in")
    p.send_batch([b"m%d" % i for i in range(500)], keys=[b"k%d" % (i % 5) for i in range(500)])

    def copy():
        src = remote(spark.readStream, service).option("subscribe", "in").option("startingOffsets", "earliest") \
            .option("maxOffsetsPerTrigger", "150").load()
        q = (remote(src.selectExpr("key", "concat(cast(value as string), '!') as value").writeStream, service)
             .option("topic", "out").option("checkpointLocation", str(tmp_path / "ckpt"))
             .trigger(availableNow=True).start())
        q.awaitTermination(180)
        assert q.exception() is None, q.exception()
        return q

    q = copy()
    p.send_batch([b"m%d" % i for i in range(500, 600)], keys=[b"k%d" % (i % 5) for i in range(500, 600)])
    copy()                                     # the same checkpoint: only what came since
    got = [(m.key, m.value) for p_ in range(2) for m in txmq.readonly.open(broker.path).read("out", p_, 0)]
    assert sorted(got) == sorted((b"k%d" % (i % 5), b"m%d!" % i) for i in range(600))
    sink = f"txmq.query/{q.id}"
    assert broker.sink_batch_id(sink) >= 4          # 500 offsets / 150 per micro-batch, then the rest


def test_bad_flight_options_and_token_fail_the_query(spark, owner, tmp_path):  # noqa: F811
    broker, service = owner
    broker.create_topic("t", 1)
    broker.producer("t").send(b"x")
    with pytest.raises(Exception, match="Unauthenticated|Bearer"):
        spark.read.format("txmq").option("flight", service.location).option("flight.token", "w" * 43) \
            .option("subscribe", "t").load().collect()
    with pytest.raises(Exception, match="no path with flight"):
        load(spark, service, subscribe="t", path=broker.path).collect()
    with pytest.raises(Exception, match="exactly one of flight.token and flight.tokenFile"):
        spark.read.format("txmq").option("flight", service.location).option("subscribe", "t").load().collect()
    with pytest.raises(Exception, match="grpc://HOST:PORT"):
        spark.read.format("txmq").option("flight", "http://x").option("flight.token", service.token) \
            .option("subscribe", "t").load().collect()
    with pytest.raises(Exception, match="TopicNotFoundError|'nope'"):
        load(spark, service, subscribe="nope").collect()
    with pytest.raises(Exception, match="TopicNotFoundError|'nope'"):
        remote(spark.range(1).selectExpr("'v' as value").write, service).option("topic", "nope") \
            .mode("append").save()
    with pytest.raises(Exception, match="only with a grpc\\+tls"):
        load(spark, service, subscribe="t", **{"flight.tlsRootCerts": "/etc/hostname"}).collect()
    assert load(spark, service, subscribe="t").count() == 1
    # a service that went away: a clear Flight error, not a hang
    service.stop()
    with pytest.raises(Exception, match="Unavailable|unavailable|failed to connect|Connection refused"):
        spark.read.format("txmq").option("flight", service.location).option("flight.token", service.token) \
            .option("subscribe", "t").load().collect()


# -- the fallback: a job given only path, whose executors cannot open the directory ----------

SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(txmq.__file__)))      # the py/ folder with txmq
NOBODY = 65534
_TASK = """
import pickle, sys
what, path, obj = pickle.load(sys.stdin.buffer)
from pyspark_txmq.remote import directory_error
try:
    if what == "read":
        reader, parts = obj
        out = [list(reader.read(p)) for p in parts]
    else:
        writer, tasks = obj
        out = [writer.write(iter(batches)) for batches in tasks]
    result = ("ok", out, type(directory_error(path)).__name__)
except Exception as e:
    result = ("error", type(e).__name__, str(e))
pickle.dump(result, sys.stdout.buffer)
"""


@pytest.fixture(scope="module")
def unprivileged_python():
    """A Python that user ``nobody`` can run (tests/helpers/unprivileged.py), or a skip."""
    if os.geteuid() != 0:
        pytest.skip("a task run as another user needs root (setpriv)")
    if shutil.which("setpriv") is None:
        pytest.skip("a task run as another user needs setpriv (util-linux)")
    if not others_can_enter(SOURCE):
        pytest.skip(f"the other user imports txmq from {SOURCE}, which other users cannot reach")
    root = tempfile.mkdtemp(prefix="txmq-nobody-", dir="/tmp")
    os.chmod(root, 0o755)
    try:
        yield relocate_python(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def as_nobody(python: str, what: str, path, obj):
    """Run a task's side (``reader.read(partition)`` of each partition, or
    ``writer.write(batches)`` of each task's batches) as user nobody on
    the pickled ``obj``, as a Spark executor of another user would.
    Returns ``("ok", results, the directory's error there)`` or
    ``("error", class name, message)``."""
    proc = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", python, "-c", _TASK],
                          input=pickle.dumps((what, str(path), obj)), capture_output=True, cwd="/", timeout=120,
                          env={"PYTHONPATH": SOURCE, "HOME": "/tmp", "PATH": os.environ.get("PATH", "/usr/bin")})
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-4000:]
    return pickle.loads(proc.stdout)


def _mixed_topic(broker) -> None:
    """Topic ``orders``: plain messages with keys and headers, a committed,
    an aborted and an open transaction, then more plain messages."""
    broker.create_topic("orders", 3)
    p = broker.producer("orders")
    for part in range(3):
        p.send_batch([b"plain-%d-%d" % (part, i) for i in range(45)], partition=part,
                     keys=[b"k%d" % i for i in range(45)], headers=[{"i": b"%d" % i} for i in range(45)])
    committed, aborted = broker.new_transaction(), broker.new_transaction()
    for part in range(3):
        p.send_batch([b"C-%d" % i for i in range(5)], partition=part, txn=committed)
        p.send_batch([b"A-%d" % i for i in range(5)], partition=part, txn=aborted)
    committed.commit()
    aborted.abort()
    still_open = broker.new_transaction(timeout=600)
    p.send_batch([b"O-%d" % i for i in range(3)], partition=1, txn=still_open)
    for part in range(3):
        p.send_batch([b"after-%d-%d" % (part, i) for i in range(6)], partition=part)


def _rows(batch_lists) -> list:
    return [[row for b in batches for row in b.to_pylist()] for batches in batch_lists]


def _private_owner(tmp_path, **kwargs):
    data = tmp_path / "data"
    broker = txmq.Broker(data, fsync="never", **kwargs)
    os.chmod(data, 0o700)
    return broker


def test_flight_json_says_where_the_service_listens(tmp_path):
    broker = _private_owner(tmp_path)
    try:
        target, why = published_target(broker.path)
        assert target is None and "flight.json does not exist" in why
        service = serve_flight(broker, "127.0.0.1", 0)
        published = json.loads((tmp_path / "data" / "flight.json").read_text())
        assert published == {"v": 1, "pid": os.getpid(), "locations": [service.location],
                             "token_sha256": hashlib.sha256(service.token.encode()).hexdigest()}
        target, why = published_target(broker.path)
        assert why is None and target.location == service.location and target.token == service.token
        everywhere = serve_flight(broker, "0.0.0.0", 0)           # a wildcard bind: this host's name first
        assert everywhere.locations == [f"grpc://{socket.getfqdn()}:{everywhere.port}", everywhere.location]
        assert json.loads((tmp_path / "data" / "flight.json").read_text())["locations"] == everywhere.locations
        everywhere.stop()                                          # its own file: removed
        assert not (tmp_path / "data" / "flight.json").exists()
        assert published_target(broker.path)[0] is None
        again = serve_flight(broker, "127.0.0.1", 0)
        kept = (tmp_path / "data" / "flight.json").read_text()
        service.stop()                                             # not its file any more: kept
        assert (tmp_path / "data" / "flight.json").read_text() == kept
        assert published_target(broker.path)[0].location == again.location
    finally:
        broker.close()
    # The owner is gone (a crash leaves the file): not taken.
    (tmp_path / "data" / "flight.json").write_text(kept)
    target, why = published_target(broker.path)
    assert target is None and "gone" in why and "no process owns" in why
    # A service with a token of its own: not found through flight.token.
    with txmq.Broker(tmp_path / "data", fsync="never") as b:
        serve_flight(b, "127.0.0.1", 0, token="t" * 40)
        target, why = published_target(b.path)
        assert target is None and "token of its own" in why


def test_a_task_that_cannot_open_the_directory_reads_through_flight(unprivileged_python, tmp_path):
    broker = _private_owner(tmp_path)
    try:
        _mixed_topic(broker)
        service = serve_flight(broker, "127.0.0.1", 0)
        for options in ({"subscribe": "orders", "includeHeaders": "true", "maxOffsetsPerPartition": "20"},
                        {"subscribe": "orders", "isolation": "read_uncommitted"}):
            opts, backend = read_options(dict(options, path=broker.path), streaming=False)
            reader = TxmqReader(opts, backend)
            parts = reader.partitions()                           # planned here, as in the driver
            assert all(p.fallback.target.location == service.location for p in parts)
            local = _rows([list(reader.read(p)) for p in parts])   # this process can open it
            status, remote, error_there = as_nobody(unprivileged_python, "read", broker.path, (reader, parts))
            assert (status, error_there) == ("ok", "PermissionError")   # the task could not open it ...
            assert _rows(remote) == local                             # ... and read the same rows through Flight
            assert sum(map(len, local)) > 100
        # A streaming micro-batch's ranges carry it too.
        opts, backend = read_options({"path": broker.path, "subscribe": "orders"}, streaming=True)
        stream = TxmqStreamReader(opts, backend)
        start = stream.initialOffset()
        parts = stream.partitions(start, stream.latestOffset(start, stream.getDefaultReadLimit()))
        status, remote, _ = as_nobody(unprivileged_python, "read", broker.path, (stream, parts))
        assert status == "ok" and _rows(remote) == _rows([list(stream.read(p)) for p in parts])
        # Without a service: a clear error in the task, saying what to do.
        service.stop()
        opts, backend = read_options({"path": broker.path, "subscribe": "orders"}, streaming=False)
        reader = TxmqReader(opts, backend)
        status, name, message = as_nobody(unprivileged_python, "read", broker.path, (reader, reader.partitions()))
        assert (status, name) == ("error", "DataDirUnreadableError")
        assert "Permission denied, as user nobody" in message and "flight.json does not exist" in message
        assert "txmq serve DIR --flight" in message and "option('flight'" in message
        # Turned off: the same error, saying so.
        serve_flight(broker, "127.0.0.1", 0)
        opts, backend = read_options({"path": broker.path, "subscribe": "orders", "flight.fallback": "false"}, False)
        reader = TxmqReader(opts, backend)
        status, name, message = as_nobody(unprivileged_python, "read", broker.path, (reader, reader.partitions()))
        assert (status, name) == ("error", "DataDirUnreadableError") and "flight.fallback is false" in message
    finally:
        broker.close()


def test_a_task_that_cannot_open_the_directory_stages_through_flight(unprivileged_python, tmp_path):
    from pyspark.sql.types import StringType, StructField, StructType

    broker = _private_owner(tmp_path)
    try:
        broker.create_topic("out", 2)
        serve_flight(broker, "127.0.0.1", 0)
        consumer = broker.subscribe("out", "check", initial_position="earliest")
        schema = StructType([StructField("key", StringType()), StructField("value", StringType())])
        writer = batch_writer({"path": broker.path, "topic": "out"}, schema, False)
        tasks = [[pa.record_batch({"key": [str(i % 7) for i in range(lo, lo + 250)],
                                   "value": [str(i) for i in range(lo, lo + 250)]}) for lo in range(t, t + 1000, 250)]
                 for t in (0, 1000, 2000)]
        status, messages, error_there = as_nobody(unprivileged_python, "write", broker.path, (writer, tasks))
        assert (status, error_there) == ("ok", "PermissionError")
        assert [m.messages for m in messages] == [1000, 1000, 1000]
        writer.commit(messages)                       # the driver's commit, as always
        writer.commit(messages)                       # asked again: once
        got = list(drain(consumer))
        assert sorted(int(m.value) for m in got) == list(range(3000))
        assert len({m.txn_id for m in got}) == 1
        assert {m.key for m in got if m.partition == 0} & {m.key for m in got if m.partition == 1} == set()
        assert os.listdir(os.path.join(broker.path, "staging")) == []
        # A streaming write's tasks carry the same fallback.
        assert stream_writer({"path": broker.path, "topic": "out"}, schema, False).fallback == writer.fallback
    finally:
        broker.close()


def test_fallback_options_are_checked(tmp_path):
    from pyspark.sql.types import StringType, StructField, StructType

    with txmq.Broker(tmp_path / "data", fsync="never") as b:
        b.create_topic("t", 1)
        with pytest.raises(InvalidArgumentError, match="flight.fallback"):
            read_options({"path": b.path, "subscribe": "t", "flight.fallback": "maybe"}, False)
        with pytest.raises(InvalidArgumentError, match="flight.fallback.*only with path"):
            read_options({"flight": "grpc://127.0.0.1:1", "flight.token": "x" * 40, "subscribe": "t",
                          "flight.fallback": "true"}, False)
        with pytest.raises(InvalidArgumentError, match="flight.fallback"):
            batch_writer({"path": b.path, "topic": "t", "flight.fallback": "no"},
                         StructType([StructField("value", StringType())]), False)
        # Where the directory opens, the task never looks at the fallback.
        assert task_target(b.path, Fallback(None, "none")) is None
        with pytest.raises(DataDirUnreadableError, match="not a directory here"):
            task_target(str(tmp_path / "elsewhere"), Fallback(None, "not a directory here"))
