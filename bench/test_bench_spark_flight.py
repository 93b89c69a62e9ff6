"""Spark full scan + aggregate through the owner's Arrow Flight service on
loopback against the local path (the executors opening the data directory
read-only), same data, same query, same session.

The data and query are test_bench_spark.py's (scan_data.py: 5,000,000
messages of a 16-byte key and a 100-byte value in one partition;
``count(*), sum(length(value)), max(offset), bit_xor(xxhash64(key))``,
answers compared). Both sides cut the partition into 5 ranges of
1,000,000 offsets. The owner is ``txmq serve DIR --flight 127.0.0.1:0`` in
a process of its own; on this 2-core machine it competes with Spark's two
task slots, as an owner sharing a host with executors would. Rounds
alternate (A A B B). Goal: Flight >= 0.7x the local path.
"""

from __future__ import annotations

import os

import pytest

import conftest
from scan_data import MESSAGES, QUERY, TOPIC, VALUE_BYTES, build_scan_topic
from test_bench_flight import flight_owner
from test_bench_producers import alternate
from test_bench_spark import spark  # noqa: F401  (the module's Spark session fixture)

ROUNDS, WARMUP = 6, 2
GROUP = "spark_scan_flight"
conftest.add_comparison(GROUP, conftest.Comparison(
    "Spark agg over 5M x (16 B key, 100 B value): through Flight (loopback) vs the local path",
    "flight", "local", 0.7, ">=", note="goal >= 0.7x the local path"))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    data = tmp_path_factory.mktemp("spark_scan_flight") / "data"
    build_scan_topic(data)
    os.sync()
    with flight_owner(data) as (location, token):
        yield str(data), location, token


def test_spark_scan_flight_vs_local(measure, benchmark, results, spark, served):  # noqa: F811
    data, location, token = served
    local = spark.read.format("txmq").option("path", data).option("subscribe", TOPIC).load()
    remote = (spark.read.format("txmq").option("flight", location).option("flight.token", token)
              .option("subscribe", TOPIC).load())
    benchmark.extra_info["spark_partitions"] = {"local": local.rdd.getNumPartitions(),
                                                "flight": remote.rdd.getNumPartitions()}
    answers = {}

    def scan(side, df):
        def run():
            answers[side] = df.selectExpr(*QUERY).collect()[0]
        return side, run

    alternate(measure, benchmark, results, GROUP, scan("local", local), scan("flight", remote),
              ops_per_round=MESSAGES, unit="msg", rounds=ROUNDS, warmup=WARMUP)
    assert answers["flight"] == answers["local"]
    assert answers["flight"].n == MESSAGES and answers["flight"].value_bytes == MESSAGES * VALUE_BYTES
