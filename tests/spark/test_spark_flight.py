"""Spark reading and writing txmq through the owner's Arrow Flight service
(``option("flight", "grpc://host:port")``, no ``path``): the same rows,
offsets and guarantees as the local path (tests/test_spark_read.py,
tests/test_spark_write.py), in the shared local Spark session.

The broker and its Flight service run in this process; Spark's Python
workers reach them over loopback. tests/test_spark_cluster.py runs the
same through a standalone cluster whose worker cannot open the directory.
"""

from __future__ import annotations

import os
import sys

import pytest
from pyspark import cloudpickle

import txmq
import txmq.readonly
from txmq.flight import serve_flight
from killer import drain
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
        query.awaitTermination(180)
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
