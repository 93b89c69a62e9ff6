"""The Spark stage of ``txmq demo``: a Spark job reads the window
aggregation's committed output, computes each product's totals over all
its windows, and writes them back into txmq with the ``txmq`` sink — one
transaction, exactly once — where the demo checks them against the same
totals recomputed from the log.

The job runs in its own process (``python -m txmq.demo.spark DIR``):
Spark starts a JVM and Python workers, and none of that should outlive
the stage or share the demo's process. That process prints one ``RESULT
<json>`` line: ``{"count", "rows", "written"}`` or ``{"error"}``. A
machine without Java or pyspark skips the stage (``--no-spark``, or
reported as not installed); nothing here fails the demo because Spark
cannot start — only a wrong result fails it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import txmq
from txmq.demo.windows import OUTPUT as WINDOWS

INSTALL = 'pip install "txmq[spark]"'
TIMEOUT_S = 300.0
SHOW_ROWS = 5


OUTPUT = "shop.product-totals"      # what the Spark job writes: one message per product


def snippet(data_dir: str, topic: str) -> str:
    return (f'spark.read.format("txmq").option("path", {os.path.abspath(data_dir)!r})'
            f'.option("subscribe", {topic!r}).load()').replace("'", '"')


def missing() -> list:
    """The modules the Spark step needs that are not installed."""
    return [m for m in ("pyspark", "pyspark_txmq") if importlib.util.find_spec(m) is None]


def run(data_dir: str) -> dict:
    """Run the Spark job on ``data_dir`` (no process may own it) in a child
    process: ``{"count", "rows", "written"}``, or ``{"error"}`` when Spark
    could not run it. Creates :data:`OUTPUT` first; what an earlier run
    wrote there is deleted with it."""
    with txmq.Broker(data_dir, fsync="commit") as broker:
        if OUTPUT in broker.topics():
            broker.delete_topic(OUTPUT)
        broker.create_topic(OUTPUT, 1)
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    here = os.path.dirname(os.path.dirname(os.path.abspath(txmq.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([here] + [p for p in [env.get("PYTHONPATH")] if p])
    try:
        r = subprocess.run([sys.executable, "-m", "txmq.demo.spark", os.path.abspath(data_dir)],
                           capture_output=True, env=env, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"Spark did not finish in {TIMEOUT_S:.0f} s"}
    for line in reversed(r.stdout.decode(errors="replace").splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = r.stderr.decode(errors="replace").strip().splitlines()[-3:]
    return {"error": f"the Spark process exited with status {r.returncode}: " + " / ".join(tail)}


def expected_totals(window_messages) -> dict:
    """``{product: (total, orders, windows)}`` recomputed from the window
    aggregation's output messages: what the Spark job must write."""
    out: dict = {}
    for m in window_messages:
        r = json.loads(m.value)
        total, orders, windows = out.get(m.key, (0, 0, 0))
        out[m.key] = (total + r["total"], orders + r["count"], windows + 1)
    return out


def written_totals(messages) -> dict:
    """``{product: [(total, orders, windows), ...]}`` of the messages the
    Spark job wrote (a product written twice shows two entries)."""
    out: dict = {}
    for m in messages:
        r = json.loads(m.value)
        out.setdefault(m.key, []).append((r["total"], r["orders"], r["windows"]))
    return out


def _main(data_dir: str) -> None:
    try:
        from pyspark.sql import SparkSession, functions as F, types as T
        spark = (SparkSession.builder.master("local[2]").appName("txmq-demo")
                 .config("spark.ui.enabled", "false").getOrCreate())
        try:
            spark.sparkContext.setLogLevel("ERROR")
            windows = (spark.read.format("txmq").option("path", data_dir).option("subscribe", WINDOWS).load()
                       .select("key", F.from_json(F.col("value").cast("string"),
                                                  "start long, total long, count long").alias("w")))
            out = (windows.groupBy("key")
                   .agg(F.sum("w.total").alias("total"), F.sum("w.count").alias("orders"),
                        F.count(F.lit(1)).alias("windows"))
                   .select("key", F.to_json(F.struct("total", "orders", "windows"))
                           .cast(T.BinaryType()).alias("value"))
                   .cache())                 # written, then shown: one scan of the topic
            out.write.format("txmq").option("path", data_dir).option("topic", OUTPUT).mode("append").save()
            totals = [(bytes(r["key"] or b"").decode(errors="replace"), bytes(r["value"]).decode())
                      for r in out.orderBy("key").collect()]
            result = {"count": sum(json.loads(v)["windows"] for _, v in totals), "written": len(totals),
                      "rows": [{"key": k, "value": v} for k, v in totals[:SHOW_ROWS]]}
        finally:
            spark.stop()
    except Exception as e:          # reported, never raised: Spark is optional
        result = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1])
