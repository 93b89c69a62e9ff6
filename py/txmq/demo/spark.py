"""The Spark step of ``txmq demo``: how to read a topic of the demo's data
directory with Spark, and, when ``pyspark`` and the ``pyspark_txmq`` data
source are installed, doing it.

The read runs in its own process (``python -m txmq.demo.spark DIR
TOPIC``): Spark starts a JVM and Python workers, and none of that should
outlive the step or share the demo's process. That process prints one
``RESULT <json>`` line: ``{"count", "rows": [...]}`` or ``{"error"}``.
Nothing here can fail the demo because Spark is missing or cannot start.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import txmq

INSTALL = 'pip install "txmq[spark]"'
TIMEOUT_S = 300.0
SHOW_ROWS = 5


def snippet(data_dir: str, topic: str) -> str:
    return (f'spark.read.format("txmq").option("path", {os.path.abspath(data_dir)!r})'
            f'.option("subscribe", {topic!r}).load()').replace("'", '"')


def missing() -> list:
    """The modules the Spark step needs that are not installed."""
    return [m for m in ("pyspark", "pyspark_txmq") if importlib.util.find_spec(m) is None]


def read(data_dir: str, topic: str) -> dict:
    """Read ``topic`` with Spark in a child process: ``{"count", "rows"}``,
    or ``{"error"}`` when Spark could not do it."""
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    here = os.path.dirname(os.path.dirname(os.path.abspath(txmq.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([here] + [p for p in [env.get("PYTHONPATH")] if p])
    try:
        r = subprocess.run([sys.executable, "-m", "txmq.demo.spark", os.path.abspath(data_dir), topic],
                           capture_output=True, env=env, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"Spark did not finish in {TIMEOUT_S:.0f} s"}
    for line in reversed(r.stdout.decode(errors="replace").splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = r.stderr.decode(errors="replace").strip().splitlines()[-3:]
    return {"error": f"the Spark process exited with status {r.returncode}: " + " / ".join(tail)}


def _main(data_dir: str, topic: str) -> None:
    try:
        from pyspark.sql import SparkSession
        spark = (SparkSession.builder.master("local[2]").appName("txmq-demo")
                 .config("spark.ui.enabled", "false").getOrCreate())
        try:
            spark.sparkContext.setLogLevel("ERROR")
            df = spark.read.format("txmq").option("path", data_dir).option("subscribe", topic).load()
            rows = [{"key": (r["key"] or b"").decode(errors="replace"),
                     "value": (r["value"] or b"").decode(errors="replace"),
                     "partition": r["partition"], "offset": r["offset"]}
                    for r in df.select("key", "value", "partition", "offset").limit(SHOW_ROWS).collect()]
            result = {"count": df.count(), "rows": rows}
        finally:
            spark.stop()
    except Exception as e:          # reported, never raised: Spark is optional
        result = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
