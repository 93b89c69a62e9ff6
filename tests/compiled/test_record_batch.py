"""``Segment.record_batch``: a run of one stored batch as a pyarrow
RecordBatch built through Arrow's C data interface (``receive_batch``'s
path). Compared with the messages the segment decodes, over random batches
and runs; the key and value columns are views of the mapping, which stays
mapped while any column lives and is unmapped after the last one goes."""

from __future__ import annotations

import gc
import random

import pyarrow as pa
import pytest

from txmq._batch import BatchSpec
from txmq._segment import Segment
from txmq._arrow_batch import record_batch_schema


def new_segment(tmp_path, capacity=1 << 20):
    seg = Segment(tmp_path / "00000000000000000000.log", 0, capacity, True)
    assert seg.recover(0, 0) is None
    return seg


def schema():
    return record_batch_schema("t", 3)


def random_spec(rng: random.Random):
    n = rng.randrange(1, 60)
    values = [rng.randbytes(rng.choice((0, 1, 7, 100))) for _ in range(n)]
    kind = rng.choice(("none", "all", "some"))
    keys = None if kind == "none" else [
        (rng.randbytes(rng.randrange(0, 9)) if kind == "all" or rng.random() < 0.5 else None) for _ in range(n)]
    times = [rng.randrange(1_000_000, 1_000_000 + 2**30) for _ in range(n)] if rng.random() < 0.7 else None
    return values, keys, times


def test_runs_of_random_batches_match_the_decoded_messages(tmp_path):
    rng = random.Random(7)
    seg = new_segment(tmp_path)
    batches = []
    for _ in range(40):
        values, keys, times = random_spec(rng)
        pos = seg.size
        base = seg.append(BatchSpec(values, keys=keys, event_times=times), 0, 0, 0, -1, 0, -1,
                          1_700_000_000_000 + rng.randrange(1000))
        batches.append((pos, base, values, keys, times))
    for pos, base, sent_values, sent_keys, sent_times in batches:
        n = len(sent_values)
        info = seg.batch_at(pos)
        for _ in range(8):
            first = rng.randrange(n)
            count = rng.randrange(1, n - first + 1)
            rb = seg.record_batch(pos, first, count, "t", 3)
            rb.validate(full=True)
            assert rb.schema.equals(schema(), check_metadata=True) and rb.num_rows == count
            assert rb.column("offset").to_pylist() == list(range(base + first, base + first + count))
            run = slice(first, first + count)
            assert rb.column("value").to_pylist() == sent_values[run]
            assert rb.column("key").to_pylist() == ([None] * count if sent_keys is None else sent_keys[run])
            if sent_times is not None:
                assert rb.column("event_time").cast(pa.int64()).to_pylist() == sent_times[run]
            assert rb.column("publish_time").cast(pa.int64()).to_pylist() == [info.publish_time] * count
            # Against the old construction from the batch's views.
            bufs = seg.arrow_buffers(pos)
            keys = pa.Array.from_buffers(pa.binary(), bufs["count"], [
                None if bufs["validity"] is None else pa.py_buffer(bufs["validity"]),
                pa.py_buffer(bufs["key_offsets"]), pa.py_buffer(bufs["keys"])])
            values = pa.Array.from_buffers(pa.binary(), bufs["count"], [
                None, pa.py_buffer(bufs["value_offsets"]), pa.py_buffer(bufs["values"])])
            deltas = memoryview(bufs["event_deltas"]).cast("i").tolist()
            assert rb.column("key").to_pylist() == keys.slice(first, count).to_pylist()
            assert rb.column("value").to_pylist() == values.slice(first, count).to_pylist()
            assert rb.column("key").null_count == keys.slice(first, count).null_count
            assert rb.column("event_time").cast(pa.int64()).to_pylist() == [
                info.first_event_time + d for d in deltas[first:first + count]]
            del rb, keys, values, bufs
    gc.collect()
    seg.close()


def test_bad_runs_are_refused(tmp_path):
    seg = new_segment(tmp_path)
    seg.append(BatchSpec([b"a", b"b", b"c"]), 0, 0, 0, -1, 0, -1, 1)
    for first, n in ((0, 0), (-1, 2), (2, 2), (0, 4), (3, 1)):
        with pytest.raises(ValueError):
            seg.record_batch(0, first, n, "t", 3)
    assert seg.mapping.exports == 0         # (nothing was exported for them)
    seg.close()


def test_the_mapping_lives_as_long_as_a_column_and_no_longer(tmp_path):
    seg = new_segment(tmp_path)
    values = [b"x%d" % i for i in range(20)]
    keys = [b"k%d" % i if i % 3 else None for i in range(20)]
    seg.append(BatchSpec(list(values), keys=list(keys)), 0, 0, 0, -1, 0, -1, 5)
    rb = seg.record_batch(0, 2, 15, "t", 3)
    mapping = seg.mapping
    assert mapping.exports == 1
    # Zero copy: the value bytes lie inside the mapping.
    base = pa.py_buffer(mapping).address
    assert base <= rb.column("value").buffers()[2].address < base + mapping.size
    value_column = rb.column("value")
    del rb
    gc.collect()
    assert mapping.exports == 1             # a column still holds the batch's memory
    seg.close()
    assert not mapping.closed               # unmap deferred while Arrow holds views
    assert value_column.to_pylist() == values[2:17]
    del value_column
    gc.collect()
    assert mapping.exports == 0
    assert mapping.closed                   # the last view released: unmapped


def test_many_batches_release_everything(tmp_path):
    seg = new_segment(tmp_path)
    seg.append(BatchSpec([b"v%d" % i for i in range(1000)]), 0, 0, 0, -1, 0, -1, 5)
    for _ in range(20_000):
        rb = seg.record_batch(0, 10, 900, "t", 3)
        assert rb.num_rows == 900
    del rb
    assert seg.mapping.exports == 0
    seg.close()


def test_the_schema_is_built_once_per_partition():
    a = record_batch_schema("t", 3)
    assert record_batch_schema("t", 3) is a
    assert a.metadata == {b"topic": b"t", b"partition": b"3"}
    assert a.names == ["key", "value", "offset", "event_time", "publish_time"]
    assert [str(t) for t in a.types] == ["binary", "binary", "int64", "timestamp[ms]", "timestamp[ms]"]
    assert record_batch_schema("t", 4).metadata[b"partition"] == b"4"
