"""Reading txmq topics with Spark: the ``txmq`` data source
(``pyspark_txmq``, docs/SPARK.md), found by Spark with no register call.

- A batch read returns exactly the committed messages (G2) with their
  offsets, keys, values, headers and timestamps: aborted transactions,
  a transaction still open in a Broker of this process, the messages
  after it in its partition, and markers never appear; read_uncommitted
  returns every data message and no marker (G3).
- While a writer process (tests/workers/readonly_writer.py) keeps committing and
  aborting, each Spark read is a committed prefix of every partition.
- startingOffsets / endingOffsets JSON, splitting into offset ranges, and
  option errors that name the option and its value.
- Streaming: maxOffsetsPerTrigger (ReadMaxRows) with Trigger.AvailableNow,
  and a stream over a live writer.

One SparkSession serves the whole test session (tests/helpers/spark_fixtures.py).
"""

import json
import pickle
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

import txmq
import txmq.readonly as readonly
from pyspark_txmq import DefaultSource
from pyspark_txmq.source import OffsetRange, admit, parse_read_options, split
from killer import worker
from spark_fixtures import spark  # noqa: F401  (pytest fixture)
from txmq.errors import InvalidArgumentError
from txmq.requester import read_plan

WRITER = worker("readonly_writer.py")
T0 = 1_700_000_000_000         # event times of the workload, ms


def rows_of(df, headers=False):
    """Collected rows as comparable tuples:
    (topic, partition, offset, key, value, timestamp µs, timestampType[, headers])."""
    cols = ["topic", "partition", "offset", "key", "value", "unix_micros(timestamp) AS ts", "timestampType"]
    if headers:
        cols.append("headers")
    out = []
    for r in df.selectExpr(*cols).collect():
        row = (r.topic, r.partition, r.offset, bytes(r.key) if r.key is not None else None, bytes(r.value),
               r.ts, r.timestampType)
        if headers:
            row += (None if r.headers is None else tuple((h.key, bytes(h.value)) for h in r.headers),)
        out.append(row)
    return sorted(out)


def load(spark, path, **options):
    reader = spark.read.format("txmq").option("path", str(path))
    for k, v in options.items():
        reader = reader.option(k, v)
    return reader.load()


class Workload:
    """Sends through a Broker and remembers, per message, its row and
    whether read_committed may show it."""

    def __init__(self, broker):
        self.broker = broker
        self.sent = []                 # (row, visible_to_read_committed)

    def send(self, producer, topic, values, partition, keys=None, headers=None, txn=None, t=0):
        n = len(values)
        times = [T0 + t + i for i in range(n)]
        mids = producer.send_batch(values, keys=keys, headers=headers, event_times=times, partition=partition,
                                   txn=txn)
        for i, mid in enumerate(mids):
            h = ()
            if headers is not None and headers[i]:
                h = tuple((k, bytes(v)) for k, v in (headers[i].items() if isinstance(headers[i], dict)
                                                    else headers[i]))
            self.sent.append([(topic, mid.partition, mid.offset, None if keys is None else keys[i], values[i],
                               times[i] * 1000, 0, h), txn])
        return mids


def test_batch_read_returns_exactly_the_committed_messages(spark, tmp_path):
    data = tmp_path / "data"
    with txmq.Broker(data, fsync="never") as broker:
        broker.create_topic("orders", 3)
        broker.create_topic("pay", 1)
        orders, pay = broker.producer("orders"), broker.producer("pay")
        w = Workload(broker)
        for p in range(3):
            w.send(orders, "orders", [b"plain-%d-%d" % (p, i) for i in range(20)], p,
                   keys=[b"k%d" % i for i in range(20)], t=p * 100)
        w.send(pay, "pay", [b"pay-%d" % i for i in range(7)], 0,
               headers=[{"src": b"web", "n": b"%d" % i} for i in range(7)], t=500)
        committed = broker.new_transaction()
        aborted = broker.new_transaction()
        for p in range(3):
            w.send(orders, "orders", [b"C-%d-%d" % (p, i) for i in range(5)], p, keys=[b"c%d" % i for i in range(5)],
                   headers=[[("txn", b"c"), ("i", b"%d" % i)] for i in range(5)], txn=committed, t=1000)
            if p != 1:
                w.send(orders, "orders", [b"A-%d-%d" % (p, i) for i in range(4)], p, txn=aborted, t=2000)
        w.send(pay, "pay", [b"pay-C"], 0, txn=committed, t=1500)
        committed.commit()
        aborted.abort()
        # A transaction left open on partition 1: it and everything after it
        # there stay invisible to read_committed; the other partitions go on.
        still_open = broker.new_transaction(timeout=600)
        w.send(orders, "orders", [b"O-1-%d" % i for i in range(3)], 1, txn=still_open, t=3000)
        for p in range(3):
            w.send(orders, "orders", [b"after-%d-%d" % (p, i) for i in range(6)], p,
                   keys=[None, b"x", None, b"y", b"z", None], t=4000 + p)
        later = broker.new_transaction()
        w.send(orders, "orders", [b"L-0-%d" % i for i in range(2)], 0, txn=later, t=5000)
        later.commit()
        open_first = min(r[2] for r, txn in w.sent if txn is still_open)

        def visible(row, txn):
            if txn is aborted or txn is still_open:
                return False
            return not (row[0] == "orders" and row[1] == 1 and row[2] >= open_first)

        want = sorted(r for r, txn in w.sent if visible(r, txn))
        got = rows_of(load(spark, data, subscribe="orders,pay", includeHeaders="true"), headers=True)
        assert got == want
        # Without includeHeaders there is no headers column (Kafka's default).
        df = load(spark, data, subscribe="orders")
        assert df.columns == ["key", "value", "topic", "partition", "offset", "timestamp", "timestampType"]
        assert rows_of(df) == [r[:7] for r in want if r[0] == "orders"]

        # read_uncommitted: every data message up to the log end, no marker.
        got = rows_of(load(spark, data, subscribe="orders,pay", isolation="read_uncommitted",
                           includeHeaders="true"), headers=True)
        assert got == sorted(r for r, _ in w.sent)

        still_open.commit()
        # The commit moved partition 1's maxReadPosition past the open data
        # and what followed it.
        got = rows_of(load(spark, data, subscribe="orders", **{"kafka.isolation.level": "read_committed"}))
        assert got == sorted(r[:7] for r, txn in w.sent if r[0] == "orders" and txn is not aborted)


def out_of_order_workload(broker) -> tuple:
    """Topic ``t`` (2 partitions): plain, committed and aborted data, and on
    partition 1 a transaction left open with committed data after it.
    Returns (the open transaction, the rows every out-of-order read shows
    now, the open transaction's rows)."""
    broker.create_topic("t", 2)
    prod = broker.producer("t")
    w = Workload(broker)
    for p in range(2):
        w.send(prod, "t", [b"plain-%d-%d" % (p, i) for i in range(5)], p, t=p)
    held = broker.new_transaction(timeout=600)
    bad = broker.new_transaction()
    w.send(prod, "t", [b"open-%d" % i for i in range(3)], 1, txn=held, t=10)
    w.send(prod, "t", [b"bad-%d" % i for i in range(2)], 1, txn=bad, t=20)
    with broker.transaction() as txn:
        for p in range(2):
            w.send(prod, "t", [b"C-%d-%d" % (p, i) for i in range(4)], p, txn=txn, t=30 + p)
    bad.abort()
    w.send(prod, "t", [b"after-%d" % i for i in range(3000)], 1, t=40)
    now = sorted(r[:7] for r, txn in w.sent if txn is None or txn.state.value == "COMMITTED")
    held_rows = sorted(r[:7] for r, txn in w.sent if txn is held)
    return held, now, held_rows


def test_batch_read_out_of_order_reads_committed_data_past_open_transactions(spark, tmp_path):
    """allowOutOfOrderDelivery=true: every committed and plain row up to
    the log end, past the open transaction on partition 1, never the open
    or aborted ones; read_committed alone stops at maxReadPosition."""
    data = tmp_path / "data"
    with txmq.Broker(data, fsync="never", linger_ms=0) as broker:
        held, now, held_rows = out_of_order_workload(broker)
        got = rows_of(load(spark, data, subscribe="t", allowOutOfOrderDelivery="true", maxOffsetsPerPartition="500"))
        assert got == now
        classic = rows_of(load(spark, data, subscribe="t"))
        assert len(classic) < len(now) and not {r[4] for r in classic if r[1] == 1} & {b"after-0", b"C-1-0"}
        held.commit()
        got = rows_of(load(spark, data, subscribe="t", allowOutOfOrderDelivery="true"))
        assert got == sorted(now + held_rows)


def test_an_out_of_order_plan_reads_alike_whenever_its_tasks_run(tmp_path):
    """The tasks of a planned out-of-order read skip the transactions open
    when it was planned, even once they have committed: a task run late,
    or again, returns the rows the plan saw."""
    data = tmp_path / "data"
    with txmq.Broker(data, fsync="never", linger_ms=0) as broker:
        held, now, held_rows = out_of_order_workload(broker)
        opts = parse_read_options({"path": str(data), "subscribe": "t", "allowOutOfOrderDelivery": "true",
                                   "maxOffsetsPerPartition": "700"}, streaming=False)
        with readonly.open(data) as ro:
            splits = read_plan.plan(opts, ro)
        assert {s.as_of for s in splits if s.partition == 1} == {(5, broker.high_watermark("t", 1))}
        assert max(s.end for s in splits if s.partition == 1) == broker.high_watermark("t", 1)

        def rows():
            out = []
            for s in splits:
                for rb in read_plan.read_split(opts, s):
                    out += [(s.topic, s.partition, o, v) for o, v in zip(rb.column("offset").to_pylist(),
                                                                         rb.column("value").to_pylist())]
            return sorted(out)

        before = rows()
        assert before == sorted((r[0], r[1], r[2], r[4]) for r in now)
        held.commit()
        assert rows() == before
        assert pickle.loads(pickle.dumps(splits)) == splits


def test_offsets_json_and_splitting_into_ranges(spark, tmp_path):
    data = tmp_path / "data"
    with txmq.Broker(data, fsync="never") as broker:
        broker.create_topic("t", 2)
        producer = broker.producer("t")
        producer.send_batch([b"a%d" % i for i in range(1000)], partition=0)
        for _ in range(5):     # 5 transactions of 99 messages + a marker each: 500 offsets
            with broker.transaction() as txn:
                producer.send_batch([b"b%d" % i for i in range(99)], partition=1, txn=txn)
    # No writer holds the directory now: the reader uses the closed readview.
    df = load(spark, data, subscribe="t", startingOffsets=json.dumps({"t": {"0": 100, "1": -2}}),
              endingOffsets=json.dumps({"t": {"0": 900, "1": -1}}), maxOffsetsPerPartition="100")
    assert df.rdd.getNumPartitions() == 8 + 5
    got = [(r.partition, r.offset) for r in df.select("partition", "offset").collect()]
    assert sorted(got) == [(0, o) for o in range(100, 900)] + [(1, o) for o in range(500) if o % 100 != 99]
    assert len(got) == len(set(got))

    # Partitions left out of the JSON take the default (earliest / latest).
    df = load(spark, data, subscribe="t", startingOffsets='{"t": {"1": 300}}', endingOffsets='{"t": {"0": 10}}')
    assert df.rdd.getNumPartitions() == 2
    got = sorted((r.partition, r.offset) for r in df.select("partition", "offset").collect())
    assert got == [(0, o) for o in range(10)] + [(1, o) for o in range(300, 500) if o % 100 != 99]

    # minPartitions (Kafka's) splits further; assign picks partitions.
    df = load(spark, data, assign='{"t": [1]}', minPartitions="4")
    assert df.rdd.getNumPartitions() == 4
    assert df.count() == 495


def test_plans_are_picklable_and_ranges_cover_offsets_once():
    opts = parse_read_options({"path": "/x", "subscribe": "t"}, streaming=False)
    ranges = [OffsetRange("t", 0, 7, 1007), OffsetRange("t", 1, 0, 10, False)]
    pieces = split(ranges, 300, None)
    assert [(r.start, r.end) for r in pieces if r.partition == 0] == [(7, 257), (257, 507), (507, 757), (757, 1007)]
    assert [(r.start, r.end, r.strict) for r in pieces if r.partition == 1] == [(0, 10, False)]
    assert len(split(ranges, 10**9, 5)) >= 5
    import pickle
    assert pickle.loads(pickle.dumps(pieces)) == pieces
    assert pickle.loads(pickle.dumps(opts)) == opts


def test_admission_shares_max_rows_in_proportion():
    start = {"t/0": 0, "t/1": 100, "t/2": 50}
    latest = {"t/0": 300, "t/1": 200, "t/2": 50}
    end = admit(start, latest, 100)
    assert sum(end[k] - start[k] for k in start) == 100
    assert end == {"t/0": 75, "t/1": 125, "t/2": 50}
    assert admit(start, latest, 10_000) == latest
    assert admit(start, latest, 1) == {"t/0": 1, "t/1": 100, "t/2": 50}


BAD_OPTIONS = [
    ({"subscribe": "t"}, False, "path"),
    ({"path": "/d"}, False, "subscribe"),
    ({"path": "/d", "subscribe": "t", "assign": '{"t":[0]}'}, False, "subscribe"),
    ({"path": "/d", "subscribe": " , "}, False, "subscribe"),
    ({"path": "/d", "subscribe": "t", "isolation": "serializable"}, False, "isolation 'serializable'"),
    ({"path": "/d", "subscribe": "t", "isolation": "read_committed", "kafka.isolation.level": "read_uncommitted"},
     False, "isolation"),
    ({"path": "/d", "subscribe": "t", "startingOffsets": "latest"}, False, "startingOffsets 'latest'"),
    ({"path": "/d", "subscribe": "t", "endingOffsets": "earliest"}, False, "endingOffsets 'earliest'"),
    ({"path": "/d", "subscribe": "t", "startingOffsets": "{nope"}, False, "startingOffsets '{nope'"),
    ({"path": "/d", "subscribe": "t", "startingOffsets": '{"t": {"0": -1}}'}, False, "startingOffsets"),
    ({"path": "/d", "subscribe": "t", "endingOffsets": '{"t": {"0": -2}}'}, False, "endingOffsets"),
    ({"path": "/d", "subscribe": "t", "startingOffsets": '{"u": {"0": 1}}'}, False, "not u/0"),
    ({"path": "/d", "subscribe": "t", "startingOffsets": '{"t": {"0": 9}}', "endingOffsets": '{"t": {"0": 3}}'},
     False, "endingOffsets"),
    ({"path": "/d", "subscribe": "t", "endingOffsets": "latest"}, True, "endingOffsets"),
    ({"path": "/d", "subscribe": "t", "maxOffsetsPerTrigger": "0"}, True, "maxOffsetsPerTrigger '0'"),
    ({"path": "/d", "subscribe": "t", "maxOffsetsPerPartition": "many"}, False, "maxOffsetsPerPartition 'many'"),
    ({"path": "/d", "subscribe": "t", "minPartitions": "-3"}, False, "minPartitions '-3'"),
    ({"path": "/d", "subscribe": "t", "includeHeaders": "yes"}, False, "includeHeaders 'yes'"),
    ({"path": "/d", "subscribe": "t", "failOnDataLoss": "maybe"}, False, "failOnDataLoss 'maybe'"),
    ({"path": "/d", "subscribePattern": "("}, False, "subscribePattern"),
    # every option the source does not know is refused by name (typos, Kafka-only options)
    ({"path": "/d", "subscribe": "t", "startingOffset": "earliest"}, False, "invalid option 'startingOffset'"),
    ({"path": "/d", "subscribe": "t", "kafka.bootstrap.servers": "h:9092"}, True,
     "invalid option 'kafka.bootstrap.servers'"),
    ({"path": "/d", "subscribe": "t", "groupIdPrefix": "g"}, True, "invalid option 'groupIdPrefix'"),
    ({"path": "/d", "subscribe": "t", "maxOffsetsPerTrigger": "5"}, False, "maxOffsetsPerTrigger '5'"),
    ({"path": "/d", "subscribe": "t", "endingTimestamp": "5"}, True, "endingTimestamp '5'"),
    ({"path": "/d", "subscribe": "t", "startingTimestamp": "soon"}, False, "startingTimestamp 'soon'"),
    ({"path": "/d", "subscribe": "t", "startingTimestamp": "-4"}, True, "startingTimestamp '-4'"),
    ({"path": "/d", "subscribe": "t", "startingOffsetsByTimestamp": '{"t": {"0": "x"}}'}, False,
     "startingOffsetsByTimestamp"),
    ({"path": "/d", "subscribe": "t", "endingOffsetsByTimestamp": '{"u": {"0": 5}}'}, False, "not u/0"),
    ({"path": "/d", "subscribe": "t", "startingOffsetsByTimestampStrategy": "closest"}, False,
     "startingOffsetsByTimestampStrategy 'closest'"),
    ({"path": "/d", "assign": '{"t": [-1]}'}, False, "assign"),
    ({"path": "/d", "subscribe": "t", "allowOutOfOrderDelivery": "sometimes"}, False,
     "allowOutOfOrderDelivery 'sometimes'"),
    ({"path": "/d", "subscribe": "t", "allowOutOfOrderDelivery": "true"}, True, "false in a streaming read"),
    ({"path": "/d", "subscribe": "t", "allowOutOfOrderDelivery": "true", "isolation": "read_uncommitted"}, False,
     "false with isolation read_uncommitted"),
]


@pytest.mark.parametrize("options, streaming, message", BAD_OPTIONS)
def test_bad_options_name_the_option_and_value(options, streaming, message):
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        parse_read_options(options, streaming)
    assert issubclass(InvalidArgumentError, ValueError)


def test_bad_options_and_topics_surface_through_spark(spark, tmp_path):
    data = tmp_path / "data"
    with txmq.Broker(data, fsync="never") as broker:
        broker.create_topic("t", 1)
    with pytest.raises(Exception, match="invalid isolation 'bogus'"):
        load(spark, data, subscribe="t", isolation="bogus").collect()
    with pytest.raises(Exception, match="TopicNotFoundError|nope"):
        load(spark, data, subscribe="nope").collect()
    with pytest.raises(Exception, match="not a txmq data directory"):
        load(spark, tmp_path / "nothing", subscribe="t").collect()
    # A user schema other than Kafka's columns is refused by name.
    with pytest.raises(Exception, match="invalid schema"):
        spark.read.format("txmq").schema("value binary").option("path", str(data)).option("subscribe", "t") \
            .load().collect()


def committed_names(status) -> set:
    try:
        return set(Path(status).read_text().split())
    except FileNotFoundError:
        return set()


def start_writer(data, status, seconds, seed):
    proc = subprocess.Popen([sys.executable, str(WRITER), str(data), str(status), str(seconds), str(seed)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def committed_rows(path, partition, end):
    with readonly.open(path) as ro:
        return [(m.offset, m.value) for m in ro.read("t", partition, 0, end)]


def check_committed_prefix(data, status, got_by_partition, before):
    """``got_by_partition``: {p: [(offset, value)]} read by Spark;
    ``before``: maxReadPosition of each partition before the read."""
    names = committed_names(status)
    with readonly.open(data) as ro:
        after = {p: ro.last_stable_offset("t", p) for p in range(3)}
    for p in range(3):
        got = got_by_partition.get(p, [])
        assert [o for o, _ in got] == sorted({o for o, _ in got})
        for _, v in got:
            kind = v.split(b"|")
            assert kind[0] in (b"P", b"C"), v                     # no aborted data, no marker
            if kind[0] == b"C":
                assert kind[1].decode() in names, v               # no open transaction's data
        full = committed_rows(data, p, after[p])
        assert got == full[:len(got)]                                  # a prefix of what is committed,
        assert len(got) >= sum(1 for o, _ in full if o < before[p])    # as long as the one before it


def read_while_writing(spark, tmp_path, reads, seconds, seed, split=None):
    data, status = tmp_path / "data", tmp_path / "status"
    writer = start_writer(data, status, seconds, seed)
    try:
        time.sleep(0.2)
        for i in range(reads):
            with readonly.open(data) as ro:
                before = {p: ro.last_stable_offset("t", p) for p in range(3)}
            options = {"subscribe": "t"} if split is None else {"subscribe": "t", "maxOffsetsPerPartition": split}
            rows = load(spark, data, **options).select("partition", "offset", "value").collect()
            got = {}
            for r in sorted(rows, key=lambda r: (r.partition, r.offset)):
                got.setdefault(r.partition, []).append((r.offset, bytes(r.value)))
            assert writer.poll() is None, "the writer stopped before the read ended"
            check_committed_prefix(data, status, got, before)
            assert sum(map(len, got.values())) > 0
    finally:
        writer.kill()
        writer.wait()


def test_concurrent_writer_each_read_is_a_committed_prefix(spark, tmp_path):
    read_while_writing(spark, tmp_path, reads=1, seconds=60, seed=5)


@pytest.mark.slow
def test_concurrent_writer_many_reads_split_into_ranges(spark, tmp_path):
    read_while_writing(spark, tmp_path, reads=3, seconds=300, seed=11, split="20000")


def stream_batches(spark, data, checkpoint, trigger, **options):
    """Run a streaming read into foreachBatch; return the rows of each
    micro-batch as [(partition, offset, value)]."""
    batches = []

    def collect(df, batch_id):
        batches.append((batch_id, sorted((r.partition, r.offset, bytes(r.value))
                                         for r in df.select("partition", "offset", "value").collect())))

    reader = spark.readStream.format("txmq").option("path", str(data))
    for k, v in options.items():
        reader = reader.option(k, v)
    query = reader.load().writeStream.foreachBatch(collect).option("checkpointLocation", str(checkpoint))
    query = query.trigger(**trigger).start()
    return query, batches


def test_streaming_available_now_with_max_offsets_per_trigger(spark, tmp_path):
    data = tmp_path / "data"
    with txmq.Broker(data, fsync="never") as broker:
        broker.create_topic("s", 2)
        producer = broker.producer("s")
        producer.send_batch([b"p0-%d" % i for i in range(230)], partition=0)
        producer.send_batch([b"p1-%d" % i for i in range(90)], partition=1)
        with broker.transaction() as txn:
            producer.send_batch([b"c-%d" % i for i in range(30)], partition=1, txn=txn)
        txn = broker.new_transaction()
        producer.send_batch([b"a-%d" % i for i in range(10)], partition=0, txn=txn)
        txn.abort()
        # Open: holds partition 0 back at its first offset (241), so the
        # stream ends there under read_committed.
        still_open = broker.new_transaction(timeout=600)
        producer.send_batch([b"o-%d" % i for i in range(5)], partition=0, txn=still_open)
        producer.send_batch([b"late-%d" % i for i in range(5)], partition=0)

        query, batches = stream_batches(spark, data, tmp_path / "ckpt", {"availableNow": True}, subscribe="s",
                                        startingOffsets="earliest", maxOffsetsPerTrigger="100")
        assert query.awaitTermination(120), "the availableNow stream did not end in 120 s"
        assert query.exception() is None
        rows = [r for _, b in batches for r in b]
        want = sorted([(0, i, b"p0-%d" % i) for i in range(230)] + [(1, i, b"p1-%d" % i) for i in range(90)]
                      + [(1, 90 + i, b"c-%d" % i) for i in range(30)])
        assert sorted(rows) == want                        # once each, committed only
        # 241 offsets on 0 (10 aborted, a marker), 121 on 1 (a marker): <= 100 per batch
        assert all(len(b) <= 100 for _, b in batches)
        assert len([b for _, b in batches if b]) >= 4

        still_open.commit()
        # The same query restarted from its checkpoint goes on where it ended.
        query, batches = stream_batches(spark, data, tmp_path / "ckpt", {"availableNow": True}, subscribe="s",
                                        maxOffsetsPerTrigger="100")
        query.awaitTermination(120)
        assert query.exception() is None
        rows = sorted(r for _, b in batches for r in b)
        assert rows == sorted([(0, 241 + i, b"o-%d" % i) for i in range(5)] + [(0, 246 + i, b"late-%d" % i)
                                                                               for i in range(5)])


def test_stream_reader_offsets_limits_and_available_now(tmp_path):
    data = tmp_path / "data"
    with txmq.Broker(data, fsync="never") as broker:
        broker.create_topic("s", 2)
        producer = broker.producer("s")
        producer.send_batch([b"x"] * 40, partition=0)
        producer.send_batch([b"y"] * 10, partition=1)
        source = DefaultSource({"path": str(data), "subscribe": "s", "maxOffsetsPerTrigger": "20"})
        reader = source.streamReader(source.schema())
        assert reader.initialOffset() == {"s/0": 40, "s/1": 10}          # Kafka's default: latest
        assert reader.getDefaultReadLimit() == ReadMaxRows(20)
        start = {"s/0": 0, "s/1": 0}
        assert reader.latestOffset(start, ReadMaxRows(20)) == {"s/0": 16, "s/1": 4}
        assert reader.latestOffset(start, ReadAllAvailable()) == {"s/0": 40, "s/1": 10}
        reader.prepareForTriggerAvailableNow()
        producer.send_batch([b"z"] * 5, partition=1)
        assert reader.latestOffset(start, ReadAllAvailable()) == {"s/0": 40, "s/1": 10}   # the target holds
        assert reader.reportLatestOffset() == {"s/0": 40, "s/1": 15}
        parts = reader.partitions({"s/0": 16, "s/1": 4}, {"s/0": 40, "s/1": 10})
        assert [(p.topic, p.partition, p.start, p.end) for p in parts] == [("s", 0, 16, 40), ("s", 1, 4, 10)]
        assert sum(b.num_rows for b in reader.read(parts[0])) == 24
        assert reader.partitions({"s/0": 40, "s/1": 10}, {"s/0": 40, "s/1": 10}) == []
        import pickle
        pickle.dumps(reader)


@pytest.mark.slow
def test_stream_over_a_live_writer_is_a_committed_prefix(spark, tmp_path):
    data, status = tmp_path / "data", tmp_path / "status"
    writer = start_writer(data, status, 120, 23)
    try:
        query, batches = stream_batches(spark, data, tmp_path / "ckpt", {"processingTime": "500 milliseconds"},
                                        subscribe="t", startingOffsets="earliest", maxOffsetsPerTrigger="5000")
        time.sleep(20)
        query.stop()
        assert query.exception() is None
        assert writer.poll() is None, "the writer stopped before the stream did"
        got = {}
        for _, b in batches:
            assert len(b) <= 5000
            for p, o, v in b:
                got.setdefault(p, []).append((o, v))
        # The micro-batches, in order, make one committed prefix per partition.
        check_committed_prefix(data, status, got, {p: 0 for p in range(3)})
        assert len([b for _, b in batches if b]) >= 3
    finally:
        writer.kill()
        writer.wait()


def _published(data, topic) -> list:
    """(partition, offset, publish_time) of every committed message."""
    with readonly.open(data) as d:
        return sorted((p, m.message_id.offset, m.publish_time) for p in d.partitions(topic)
                      for m in d.read(topic, p, 0))


def _times_workload(data) -> list:
    """Topic ``t`` of 2 partitions: 4 rounds of 5 messages per partition, a
    few ms apart, so each round has its own publish time."""
    with txmq.Broker(data, fsync="never") as broker:
        broker.create_topic("t", 2)
        producer = broker.producer("t")
        for r in range(4):
            for p in range(2):
                producer.send_batch([b"r%d-p%d-%d" % (r, p, i) for i in range(5)], partition=p)
            time.sleep(0.02)
    return _published(data, "t")


def test_timestamps_choose_offsets_from_the_time_index(spark, tmp_path):
    """startingTimestamp, startingOffsetsByTimestamp, endingTimestamp and
    endingOffsetsByTimestamp read from the first offset published at or
    after the time (Kafka's offsetsForTimes), and take precedence over
    startingOffsets / endingOffsets."""
    data = tmp_path / "data"
    published = _times_workload(data)
    at = {(p, off): t for p, off, t in published}
    t2 = at[(0, 10)]                 # round 2 of partition 0
    t3 = at[(1, 15)]                 # round 3 of partition 1

    def got(**options):
        return sorted((r.partition, r.offset) for r in load(spark, data, subscribe="t", **options).collect())

    def want(lo, hi=None, per_lo=None):
        return sorted((p, off) for p, off, t in published
                      if t >= (per_lo[p] if per_lo else lo) and (hi is None or t < hi))

    assert len(want(t2)) == 20                    # half of it: the filter is not trivial
    assert got(startingTimestamp=str(t2)) == want(t2)
    assert got(startingTimestamp=str(t2), startingOffsets='{"t": {"0": 0, "1": 0}}') == want(t2)
    assert got(endingTimestamp=str(t3)) == want(0, t3)
    assert got(startingTimestamp=str(t2), endingTimestamp=str(t3)) == want(t2, t3)
    per = {0: at[(0, 5)], 1: at[(1, 15)]}
    assert got(startingOffsetsByTimestamp=json.dumps({"t": {"0": per[0], "1": per[1]}})) == want(0, per_lo=per)
    assert got(endingOffsetsByTimestamp=json.dumps({"t": {"0": t2, "1": t3}})) == sorted(
        (p, off) for p, off, t in published if t < (t2 if p == 0 else t3))
    last = max(t for *_, t in published)
    # Past the last message: an end is the latest; a start fails, or with
    # startingOffsetsByTimestampStrategy=latest starts at the end.
    assert got(endingTimestamp=str(last + 10_000)) == want(0)
    assert got(startingTimestamp=str(last + 10_000), startingOffsetsByTimestampStrategy="latest") == []
    with pytest.raises(Exception, match=f"invalid startingTimestamp {last + 10_000}"):
        got(startingTimestamp=str(last + 10_000))
    with pytest.raises(Exception, match="startingOffsetsByTimestamp.*none for t/1"):
        got(startingOffsetsByTimestamp=json.dumps({"t": {"0": t2}}))


def test_streaming_starts_at_a_timestamp(spark, tmp_path):
    data = tmp_path / "data"
    published = _times_workload(data)
    t2 = {(p, off): t for p, off, t in published}[(1, 10)]
    q = (spark.readStream.format("txmq").option("path", str(data)).option("subscribe", "t")
         .option("startingTimestamp", str(t2)).load()
         .writeStream.format("memory").queryName("from_time").trigger(availableNow=True).start())
    q.awaitTermination(120)
    got = sorted((r.partition, r.offset) for r in spark.table("from_time").collect())
    assert got == sorted((p, off) for p, off, t in published if t >= t2)


def test_starting_offsets_past_the_end_fail_the_read(spark, tmp_path):
    """As Spark's Kafka source with failOnDataLoss: a start past a
    partition's log end is no offset at all."""
    data = tmp_path / "data"
    with txmq.Broker(data, fsync="never") as broker:
        broker.create_topic("t", 1)
        broker.producer("t").send_batch([b"v%d" % i for i in range(10)])
    past = '{"t": {"0": 50}}'
    with pytest.raises(Exception, match="DataLossError.*t/0: startingOffsets past the log end"):
        load(spark, data, subscribe="t", startingOffsets=past).collect()
    assert load(spark, data, subscribe="t", startingOffsets=past, failOnDataLoss="false").count() == 0
    assert load(spark, data, subscribe="t", startingOffsets='{"t": {"0": 10}}').count() == 0    # the end itself
    stream = (spark.readStream.format("txmq").option("path", str(data)).option("subscribe", "t")
              .option("startingOffsets", past).load()
              .writeStream.format("memory").queryName("past_end").trigger(availableNow=True).start())
    with pytest.raises(Exception, match="startingOffsets past the log end"):
        stream.awaitTermination(120)


def test_empty_headers_read_back_as_an_empty_array(spark, tmp_path):
    """Kafka's source gives every record a headers array: [] when it has
    none, never NULL."""
    data = tmp_path / "data"
    with txmq.Broker(data, fsync="never") as broker:
        broker.create_topic("t", 1)
        p = broker.producer("t")
        p.send_batch([b"a", b"b", b"c"], headers=[{}, None, {"h": b"1"}])
        p.send(b"d")
        p.send_batch([b"e%d" % i for i in range(200)])               # a batch read as a view
    rows = load(spark, data, subscribe="t", includeHeaders="true").orderBy("offset").collect()
    assert [r.headers for r in rows[:3]] == [[], [], [("h", b"1")]]
    assert all(r.headers == [] for r in rows[3:]) and len(rows) == 204
