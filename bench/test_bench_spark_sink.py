"""Spark's batch sink: ``df.write.format("txmq")`` against a sink that
discards the same Arrow batches, same cached DataFrame, same session.

The txmq side stages each task's batches in the on-disk layout and commits
the job as one transaction through the owner (a broker held open in this
process, reached through its control socket, as a Spark job meets a
running application). The discard side is a Python data source whose
tasks iterate the batches and drop them: what Spark itself costs to hand
Arrow batches to a Python writer. Goal: txmq >= 0.7x the discard sink.

2,000,000 rows of a 16-byte key and a 100-byte value, 2 partitions,
cached before timing; rounds alternate (A A B B ...), as in
test_bench_producers.
"""

from __future__ import annotations

import os
import sys

import pytest
from pyspark import cloudpickle
from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, WriterCommitMessage

import conftest
import txmq
from test_bench_producers import alternate

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from spark_fixtures import build_session  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # workers import neither bench/ nor tests/

ROWS = 2_000_000
GROUP = "spark_sink"
COMPARISON = conftest.Comparison("Spark batch write 2M x (16B key, 100B value): txmq vs a discarding sink",
                                 "txmq", "discard", 0.7, ">=",
                                 note="goal >= 70% of a sink that discards the Arrow batches")
conftest.add_comparison(GROUP, COMPARISON)


class _Discarded(WriterCommitMessage):
    pass


class _DiscardWriter(DataSourceArrowWriter):
    def write(self, iterator):
        rows = 0
        for batch in iterator:
            rows += batch.num_rows
        return _Discarded()


class DiscardSource(DataSource):
    """``format("discard")``: every batch is read and dropped."""

    @classmethod
    def name(cls):
        return "discard"

    def writer(self, schema, overwrite):
        return _DiscardWriter()


@pytest.fixture(scope="module")
def spark():
    session = build_session("txmq-bench-sink")
    session.sparkContext.setLogLevel("ERROR")
    session.dataSource.register(DiscardSource)
    yield session
    session.stop()


def test_spark_sink(spark, measure, benchmark, results, tmp_path):
    path = str(tmp_path / "data")
    broker = txmq.Broker(path, fsync="never")
    try:
        broker.create_topic("out", 2)
        df = (spark.range(0, ROWS, numPartitions=2)
              .selectExpr("unhex(lpad(hex(id), 32, '0')) as key",
                          "unhex(concat(lpad(hex(id), 32, '0'), repeat('ab', 84))) as value").cache())
        assert df.count() == ROWS

        def to_txmq():
            df.write.format("txmq").option("path", path).option("topic", "out").mode("append").save()

        def to_discard():
            df.write.format("discard").mode("append").save()

        _, writes = alternate(measure, benchmark, results, GROUP, ("discard", to_discard), ("txmq", to_txmq),
                              ops_per_round=ROWS, unit="row", rounds=4, warmup=2)
        # every write's rows, and each write's COMMIT marker in both partitions
        assert sum(broker.high_watermark("out", p) for p in range(2)) == writes * (ROWS + 2)
    finally:
        broker.close()
