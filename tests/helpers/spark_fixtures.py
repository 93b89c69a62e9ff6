"""One local SparkSession for the whole test session (starting one takes
~7-10 s here). A test module that needs it imports the fixture:

    from spark_fixtures import spark  # noqa: F401  (a pytest fixture)

pyspark is imported at module level on purpose: without it the tests that
need Spark fail at collection, they are never skipped.
"""

import os
import sys

import pyspark  # noqa: F401  (a missing pyspark is a failure, not a skip)
import pytest
from pyspark.sql import SparkSession


def build_session(app_name: str = "txmq-tests") -> SparkSession:
    # Spark's Python workers must run this interpreter: it is the one with
    # txmq (and pyspark_txmq, found by Spark on its path) installed.
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    return (SparkSession.builder.master("local[2,4]").appName(app_name)
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.default.parallelism", "2")
            .config("spark.sql.execution.arrow.pyspark.enabled", "true")
            .config("spark.sql.session.timeZone", "UTC")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.streaming.forceDeleteTempCheckpointLocation", "true")
            .getOrCreate())


@pytest.fixture(scope="session")
def spark():
    session = build_session()
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
