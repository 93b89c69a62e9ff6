"""The ``txmq`` PySpark data source (docs/SPARK.md).

Spark (4.0 and later) imports every top-level module named ``pyspark_*`` on
its Python path and registers the ``DefaultSource`` it finds under that
class's ``name()``, so no ``spark.dataSource.register`` call is needed::

    df = (spark.read.format("txmq").option("path", data_dir)
          .option("subscribe", "orders,payments").load())

The columns and options are those of Spark's own Kafka source, so a job
moves from Kafka to txmq by changing the format name (see docs/API.md,
"PySpark data source"). Reading lives in :mod:`pyspark_txmq.source`,
writing in :mod:`pyspark_txmq.sink`; with ``option("flight",
"grpc://host:port")`` both go through the owner's Arrow Flight service
(:mod:`pyspark_txmq.remote`, docs/SPARK_CLUSTER.md), for executors that
cannot open the data directory.
"""

from __future__ import annotations

from pyspark.sql.datasource import DataSource
from pyspark.sql.types import (ArrayType, BinaryType, IntegerType, LongType, StringType, StructField, StructType,
                               TimestampType)

from txmq.errors import InvalidArgumentError

__all__ = ["DefaultSource", "kafka_schema"]


def kafka_schema(include_headers: bool = False) -> StructType:
    """Spark's Kafka source's columns: key, value, topic, partition, offset,
    timestamp, timestampType, and ``headers`` with ``includeHeaders``."""
    fields = [StructField("key", BinaryType()), StructField("value", BinaryType()),
              StructField("topic", StringType()), StructField("partition", IntegerType()),
              StructField("offset", LongType()), StructField("timestamp", TimestampType()),
              StructField("timestampType", IntegerType())]
    if include_headers:
        fields.append(StructField("headers", ArrayType(StructType([StructField("key", StringType()),
                                                                   StructField("value", BinaryType())]))))
    return StructType(fields)


def _check_schema(schema: StructType, include_headers: bool) -> None:
    """The reader yields exactly the Kafka columns: a user-given schema
    (``spark.read.schema(...)``) must be that one."""
    expected = kafka_schema(include_headers)
    if schema.simpleString() != expected.simpleString():
        raise InvalidArgumentError("schema", schema.simpleString(), expected.simpleString()
                                   + " (the columns of Spark's Kafka source; headers with includeHeaders=true)")


class DefaultSource(DataSource):
    """``format("txmq")``: read (batch and streaming) and write a data
    directory. Everything it holds is its options, so it pickles."""

    @classmethod
    def name(cls) -> str:
        return "txmq"

    def schema(self) -> StructType:
        from pyspark_txmq.source import option_bool

        return kafka_schema(option_bool(self.options, "includeHeaders", False))

    def reader(self, schema: StructType):
        from pyspark_txmq.source import TxmqReader, read_options

        opts, backend = read_options(self.options, streaming=False)
        _check_schema(schema, opts.include_headers)
        return TxmqReader(opts, backend)

    def streamReader(self, schema: StructType):
        from pyspark_txmq.source import TxmqStreamReader, read_options

        opts, backend = read_options(self.options, streaming=True)
        _check_schema(schema, opts.include_headers)
        return TxmqStreamReader(opts, backend)

    def writer(self, schema: StructType, overwrite: bool):
        from pyspark_txmq.sink import batch_writer

        return batch_writer(self.options, schema, overwrite)

    def streamWriter(self, schema: StructType, overwrite: bool):
        from pyspark_txmq.sink import stream_writer

        return stream_writer(self.options, schema, overwrite)
