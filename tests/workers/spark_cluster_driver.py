"""A Spark driver for tests/spark/test_spark_cluster.py: connects to the
standalone master it is given and reads or writes txmq through the owner's
Flight service only (the executors cannot open the data directory).

    python spark_cluster_driver.py MODE '{json arguments}'

Modes (each prints the lines the test waits for):

- ``read``: a batch read of topic ``orders`` through Flight; prints
  ``ROWS <json [[partition, offset, value latin-1], ...]>``, then
  ``EXECUTOR <json [user, can read the data directory]>``, then the same
  read given only ``path`` (which the executors cannot open: they go
  through the owner's Flight service by themselves) as ``PATH_ROWS``, then
  the same with ``flight.fallback=false``: ``LOCAL_FAILED <message>``.
- ``stream``: a streaming query ``in`` -> ``out`` (value + "!") through
  Flight both ways, with a checkpoint; prints ``STARTED``; with
  ``"drain": true`` runs until the input is consumed, stops and prints
  ``DRAINED``, else runs until killed.
- ``write``: a batch write of ``rows`` values into topic ``out`` through
  Flight; the first attempt of task 0 touches ``marker`` after its first
  batch and then waits to be killed with its executor; prints ``WRITTEN``.
- ``write_path``: a batch write of ``rows`` values into topic ``out``
  given only ``path``; prints ``WRITTEN``.
"""

from __future__ import annotations

import json
import os
import sys
import time

from pyspark.sql import SparkSession


def session(args) -> SparkSession:
    python = args["python"]
    return (SparkSession.builder.master(args["master"]).appName("txmq-cluster-" + args["mode"])
            .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.pyspark.python", python).config("spark.pyspark.driver.python", python)
            .config("spark.executorEnv.PYTHONPATH", args["pythonpath"])
            .config("spark.executor.memory", "1g").config("spark.cores.max", "2")
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.sql.session.timeZone", "UTC")
            .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
            .getOrCreate())


def flight(reader, args):
    return reader.format("txmq").option("flight", args["flight"]).option("flight.token", args["token"])


def read(spark, args) -> None:
    df = flight(spark.read, args).option("subscribe", "orders").option("maxOffsetsPerPartition", "50").load()
    rows = [[r.partition, r.offset, bytes(r.value).decode("latin-1")]
            for r in df.select("partition", "offset", "value").collect()]
    print("ROWS " + json.dumps(rows), flush=True)
    data = args["data"]
    seen = spark.sparkContext.parallelize([0], 1).map(
        lambda _: (__import__("getpass").getuser(), os.access(data, os.R_OK))).collect()[0]
    print("EXECUTOR " + json.dumps(seen), flush=True)
    # Given only path: the driver reads the directory and plans; the tasks,
    # which cannot open it, go through the owner's Flight service by themselves.
    df = spark.read.format("txmq").option("path", data).option("subscribe", "orders") \
        .option("maxOffsetsPerPartition", "50").load()
    rows = [[r.partition, r.offset, bytes(r.value).decode("latin-1")]
            for r in df.select("partition", "offset", "value").collect()]
    print("PATH_ROWS " + json.dumps(rows), flush=True)
    try:
        spark.read.format("txmq").option("path", data).option("subscribe", "orders") \
            .option("flight.fallback", "false").load().collect()
        print("LOCAL_READ_WORKED", flush=True)
    except Exception as e:                 # noqa: BLE001 - the expected failure, printed for the test
        print("LOCAL_FAILED " + " ".join(str(e).split())[:2000], flush=True)


def stream(spark, args) -> None:
    src = (flight(spark.readStream, args).option("subscribe", "in").option("startingOffsets", "earliest")
           .option("maxOffsetsPerTrigger", str(args["per_trigger"])).load())
    out = src.selectExpr("key", "concat(cast(value as string), '!') as value")
    q = (flight(out.writeStream, args).option("topic", "out").option("checkpointLocation", args["checkpoint"])
         .trigger(processingTime="300 milliseconds").start())
    print("STARTED", flush=True)
    if args.get("drain"):
        q.processAllAvailable()
        q.stop()
        print("DRAINED", flush=True)
    else:
        q.awaitTermination()


def write(spark, args) -> None:
    marker = args["marker"]

    def slow_first_attempt(batches):
        from pyspark import TaskContext
        ctx = TaskContext.get()
        for i, batch in enumerate(batches):
            yield batch
            if ctx.partitionId() == 0 and ctx.attemptNumber() == 0 and i == 0:
                with open(marker, "w") as f:          # a batch is on its way: kill the executor now
                    f.write(str(os.getpid()))
                time.sleep(600)

    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "500")
    df = (spark.range(0, args["rows"], numPartitions=4)
          .selectExpr("cast(id % 11 as string) as key", "cast(id as string) as value")
          .mapInArrow(slow_first_attempt, "key string, value string"))
    flight(df.write, args).option("topic", "out").mode("append").save()
    print("WRITTEN", flush=True)


def write_path(spark, args) -> None:
    df = (spark.range(0, args["rows"], numPartitions=4)
          .selectExpr("cast(id % 11 as string) as key", "cast(id as string) as value"))
    df.write.format("txmq").option("path", args["data"]).option("topic", "out").mode("append").save()
    print("WRITTEN", flush=True)


def main() -> None:
    mode, args = sys.argv[1], json.loads(sys.argv[2])
    args["mode"] = mode
    spark = session(args)
    spark.sparkContext.setLogLevel("ERROR")
    {"read": read, "stream": stream, "write": write, "write_path": write_path}[mode](spark, args)
    spark.stop()


if __name__ == "__main__":
    main()
