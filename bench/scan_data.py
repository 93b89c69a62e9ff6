"""The Spark scan benchmarks' data: 5,000,000 messages (16-byte random
key, 100-byte random value) in one partition of topic ``scan``, written
with ``send_batch`` of 10,000 (so on-disk batches of 10,000). Shared by
test_bench_spark.py, test_bench_spark_flight.py and test_bench_flight.py."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

import txmq

TOPIC = "scan"
MESSAGES = 5_000_000
KEY_BYTES, VALUE_BYTES = 16, 100
SEND_BATCH = 10_000
QUERY = ["count(*) AS n", "sum(length(value)) AS value_bytes", "max(offset) AS last",
         "bit_xor(xxhash64(key)) AS keys"]


def build_scan_topic(path) -> None:
    """Write the messages into a new data directory at ``path``."""
    rng = np.random.default_rng(7)
    with txmq.Broker(path, fsync="never") as broker:
        broker.create_topic(TOPIC, 1)
        producer = broker.producer(TOPIC)
        offsets = pa.array(np.arange(0, (SEND_BATCH + 1) * KEY_BYTES, KEY_BYTES, dtype=np.int32))
        voffsets = pa.array(np.arange(0, (SEND_BATCH + 1) * VALUE_BYTES, VALUE_BYTES, dtype=np.int32))
        for _ in range(MESSAGES // SEND_BATCH):
            keys = pa.BinaryArray.from_buffers(pa.binary(), SEND_BATCH, [None, offsets.buffers()[1],
                                               pa.py_buffer(rng.bytes(SEND_BATCH * KEY_BYTES))])
            values = pa.BinaryArray.from_buffers(pa.binary(), SEND_BATCH, [None, voffsets.buffers()[1],
                                                 pa.py_buffer(rng.bytes(SEND_BATCH * VALUE_BYTES))])
            producer.send_batch(values, keys=keys, partition=0)
