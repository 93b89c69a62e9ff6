"""Arrow record batches of a partition for the read-only reader's
``read_arrow`` (the Spark source and the Flight service), in the columns of
Spark's Kafka source: views of the mapped segments where a stored batch is
large enough, small ones gathered together."""

from __future__ import annotations

import numpy as np

from txmq.batcharrow import batch_arrays, int64_array


def arrow_schema(include_headers: bool = False, timestamp_unit: str = "ms"):
    """The columns of :meth:`ReadOnlyDirectory.read_arrow`, Spark's Kafka
    source's: key binary, value binary, topic string, partition int32,
    offset int64, timestamp (UTC), timestampType int32 (0: CreateTime, the
    event time), and with ``include_headers`` headers list<struct<key
    string, value binary>> (null for a message without headers)."""
    import pyarrow as pa

    fields = [("key", pa.binary()), ("value", pa.binary()), ("topic", pa.string()),
              ("partition", pa.int32()), ("offset", pa.int64()),
              ("timestamp", pa.timestamp(timestamp_unit, tz="UTC")), ("timestampType", pa.int32())]
    if include_headers:
        fields.append(("headers", pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))))
    return pa.schema(fields)


def arrow_batches(view, start: int, limit: int, committed: bool, max_rows: int,
                  include_headers: bool, unit: str, gather_below: int, lost_cb=None, open_txns=None):
    """Record batches of ``view`` (a read_only_directory.PartitionView)
    from ``start`` to ``limit``, of at most ``max_rows`` rows. A batch of
    ``gather_below`` rows or more is yielded on its own, its key and value
    columns views of the mapping (Arrow's binary layout has one offsets
    array per column, so a column over the mapping cannot span two
    batches; a range that starts or ends inside one is a slice). Runs of
    smaller batches (a topic fed by single sends) are copied together into
    batches of up to ``max_rows`` rows: building a view costs some 40 us a
    batch, and a consumer such as Spark pays a fixed cost per record batch
    too. A batch is all one transaction, so filtering never splits one."""
    import pyarrow as pa

    schema = arrow_schema(include_headers, unit)
    scale = 1000 if unit == "us" else 1
    gathered = _Gathered()

    def record_batch(keys, values, offsets, times, headers):
        n = len(offsets)
        columns = [keys, values, pa.repeat(view.topic, n), pa.array(np.full(n, view.partition, np.int32)),
                   int64_array(pa.int64(), offsets), int64_array(schema.field("timestamp").type, times * scale),
                   pa.array(np.zeros(n, np.int32))]
        if include_headers:
            # A message without headers has an empty list, never NULL (Kafka's source).
            columns.append(pa.array([[{"key": k, "value": v} for k, v in h] if h else [] for h in headers],
                                    schema.field("headers").type))
        return pa.RecordBatch.from_arrays(columns, schema=schema)

    def flush():
        keys, values, offsets, times, headers = gathered.take()
        return record_batch(pa.array(keys, pa.binary()), pa.array(values, pa.binary()),
                            np.asarray(offsets, np.int64), np.asarray(times, np.int64), headers)

    for seg, pos, info in view.batches(start, limit, lost_cb):
        if view.skipped(info, committed, open_txns):
            continue
        i0 = max(start, info.base_offset) - info.base_offset
        i1 = min(info.count, limit - info.base_offset)
        if i1 - i0 < gather_below:
            for offset, key, value, headers, event_time in seg.messages(pos, info.base_offset + i0, i1 - i0):
                gathered.add(offset, key, value, headers, event_time)
                if len(gathered) >= max_rows:
                    yield flush()
            continue
        if gathered:
            yield flush()
        keys, values, times = batch_arrays(seg.arrow_buffers(pos), info.first_event_time)
        for a in range(i0, i1, max_rows):
            n = min(i1 - a, max_rows)
            headers = [m[3] for m in seg.messages(pos, info.base_offset + a, n)] if include_headers else None
            yield record_batch(keys.slice(a, n), values.slice(a, n),
                               np.arange(info.base_offset + a, info.base_offset + a + n, dtype=np.int64),
                               times[a:a + n], headers)
    if gathered:
        yield flush()


class _Gathered:
    """Columns of small batches, copied together."""

    def __init__(self):
        self._empty()

    def _empty(self):
        self.keys, self.values, self.offsets, self.times, self.headers = [], [], [], [], []

    def add(self, offset, key, value, headers, event_time):
        self.offsets.append(offset)
        self.keys.append(key)
        self.values.append(value)
        self.headers.append(headers)
        self.times.append(event_time)

    def take(self):
        """(keys, values, offsets, times, headers), leaving it empty."""
        out = self.keys, self.values, self.offsets, self.times, self.headers
        self._empty()
        return out

    def __len__(self):
        return len(self.offsets)
