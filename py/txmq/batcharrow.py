"""pyarrow arrays over one on-disk batch (docs/FORMAT.md: its sections are
laid out as Arrow's binary arrays are), for every reader that hands
batches to Arrow: ``receive_batch``, the read-only reader, staged ingest."""

from __future__ import annotations

import numpy as np


def batch_arrays(bufs: dict, first_event_time: int):
    """``(keys, values, event_times)`` of one batch, from
    ``Segment.arrow_buffers``: the key and value arrays are views of the
    mapping (no copy; keys may be null), the event times int64 milliseconds
    in a numpy array."""
    import pyarrow as pa

    n = bufs["count"]
    validity = None if bufs["validity"] is None else pa.py_buffer(bufs["validity"])
    keys = pa.Array.from_buffers(pa.binary(), n, [validity, pa.py_buffer(bufs["key_offsets"]),
                                                  pa.py_buffer(bufs["keys"])])
    values = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(bufs["value_offsets"]),
                                                    pa.py_buffer(bufs["values"])], null_count=0)
    times = first_event_time + np.frombuffer(bufs["event_deltas"], "<i4").astype(np.int64)
    return keys, values, times


def int64_array(type_, values):
    """An Arrow array of a 64-bit type (int64, a timestamp) over the memory
    of an int64 numpy array, without nulls: no conversion, where
    ``pa.array(values, pa.timestamp(...))`` costs some 10 us per 1,000
    values."""
    import pyarrow as pa

    values = np.ascontiguousarray(values, np.int64)
    return pa.Array.from_buffers(type_, len(values), [None, pa.py_buffer(values)], null_count=0)
