"""The owner's Arrow Flight service (``txmq.flight.serve_flight``,
``txmq serve --flight``) with a raw pyarrow Flight client and with
txmq's own client (:mod:`txmq.flight.client`):

- a planned read has one endpoint per range, its ends fixed at planning;
  DoGet streams exactly the committed messages (aborted and open
  transactions never appear), read_uncommitted every data message;
- DoPut stages an attempt, the commit action ingests a job's listed
  attempts as one transaction once per sink key, abort discards;
- bad input gets Flight's error codes and writes nothing: a wrong or
  missing token (UNAUTHENTICATED), a ticket for a partition or topic that
  does not exist and a plan whose segments retention deleted (NOT_FOUND),
  a malformed ticket and a DoPut whose schema is not the sink's
  (INVALID_ARGUMENT);
- the token file, TLS, stopping (by itself and with the broker), and the
  command line with --flight alone and beside --kafka.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.flight as flight
import pytest

import txmq
import txmq.readonly
from txmq.errors import DataLossError, InvalidArgumentError, PartitionNotFoundError, TopicNotFoundError
from txmq.flight import serve_flight, wire
from txmq.flight.client import FlightConnection, FlightTarget

T0 = 1_700_000_000_000


def bearer(token: str, timeout: float | None = None) -> flight.FlightCallOptions:
    return flight.FlightCallOptions(headers=[(b"authorization", b"Bearer " + token.encode())], timeout=timeout)


def read_command(**options) -> flight.FlightDescriptor:
    return flight.FlightDescriptor.for_command(json.dumps({"v": 1, "read": options}).encode())


def fetch(client, ticket: bytes, token: str) -> pa.Table:
    return client.do_get(flight.Ticket(ticket), bearer(token)).read_all()


def action(client, name: str, body: dict, token: str) -> dict:
    results = list(client.do_action(flight.Action(name, json.dumps(dict(body, v=1)).encode()), bearer(token)))
    assert len(results) == 1
    return json.loads(results[0].body.to_pybytes())


def stage(client, token: str, job: str, attempt: str, topic: str, batch: pa.RecordBatch) -> dict:
    cmd = json.dumps({"v": 1, "stage": {"job": job, "attempt": attempt, "topic": topic}}).encode()
    writer, reader = client.do_put(flight.FlightDescriptor.for_command(cmd), batch.schema, bearer(token))
    try:
        writer.write_batch(batch)
        writer.done_writing()
        answer = reader.read()
    finally:
        writer.close()               # raises the server's error, if it answered one
    return json.loads(answer.to_pybytes())


@pytest.fixture
def served(tmp_path):
    """A broker holding a workload, served over Flight on a free port:
    topic ``orders`` (3 partitions) with committed, aborted and still open
    transactions, and what read_committed may show."""
    broker = txmq.Broker(tmp_path / "data", fsync="never")
    broker.create_topic("orders", 3)
    broker.create_topic("empty", 1)
    p = broker.producer("orders")
    visible, everything = [], []

    def send(values, partition, txn=None, shown=True):
        mids = p.send_batch(values, keys=[b"k" + v for v in values], partition=partition, txn=txn,
                            event_times=[T0 + i for i in range(len(values))])
        for m, v in zip(mids, values):
            everything.append((m.partition, m.offset, v))
            if shown:
                visible.append((m.partition, m.offset, v))

    for part in range(3):
        send([b"plain-%d-%d" % (part, i) for i in range(200)], part)
    committed, aborted = broker.new_transaction(), broker.new_transaction()
    for part in range(3):
        send([b"C-%d-%d" % (part, i) for i in range(30)], part, committed)
        send([b"A-%d-%d" % (part, i) for i in range(20)], part, aborted, shown=False)
    committed.commit()
    aborted.abort()
    still_open = broker.new_transaction(timeout=600)
    send([b"O-1-%d" % i for i in range(5)], 1, still_open, shown=False)
    send([b"after-1-%d" % i for i in range(7)], 1, shown=False)        # behind the open one
    send([b"after-0-%d" % i for i in range(7)], 0)
    service = serve_flight(broker, port=0)
    client = flight.FlightClient(service.location)
    try:
        yield type("Served", (), dict(broker=broker, service=service, client=client, token=service.token,
                                      path=str(tmp_path / "data"), visible=visible, everything=everything,
                                      still_open=still_open))
    finally:
        client.close()
        broker.close()
    assert service.stopped


def rows(table: pa.Table) -> list:
    return list(zip(table.column("partition").to_pylist(), table.column("offset").to_pylist(),
                    table.column("value").to_pylist()))


def test_a_planned_read_returns_exactly_the_committed_messages(served):
    info = served.client.get_flight_info(read_command(subscribe="orders", maxOffsetsPerPartition="100"),
                                         bearer(served.token))
    assert info.schema == txmq.readonly.arrow_schema(False, "us")
    tickets = [wire.Ticket.decode(e.ticket.ticket) for e in info.endpoints]
    # one endpoint per range of at most 100 offsets; ends fixed at the LSO
    assert all(t.end - t.start <= 100 for t in tickets)
    ends = {p: max(t.end for t in tickets if t.partition == p) for p in range(3)}
    assert ends == {p: served.broker.last_stable_offset("orders", p) for p in range(3)}
    assert all(e.locations == [] for e in info.endpoints)          # read them from this server
    # Written after planning: the planned ranges do not grow.
    served.broker.producer("orders").send_batch([b"late"] * 5, partition=2)
    got = []
    for e in info.endpoints:
        table = fetch(served.client, e.ticket.ticket, served.token)
        assert table.schema == info.schema
        got += rows(table)
    assert sorted(got) == sorted(served.visible)
    assert len(got) == len(set(got))
    # the columns are the local reader's, value for value
    ro = txmq.readonly.open(served.path)
    local = pa.Table.from_batches(list(ro.read_arrow("orders", 0, 0, ends[0], timestamp_unit="us")))
    remote = pa.concat_tables([fetch(served.client, e.ticket.ticket, served.token) for e in info.endpoints
                               if wire.Ticket.decode(e.ticket.ticket).partition == 0]).combine_chunks()
    assert remote.equals(local.combine_chunks())


def test_an_out_of_order_read_skips_what_was_open_at_planning(served):
    """allowOutOfOrderDelivery=true through the service: the plan reaches
    the log end, its tickets carry the (maxReadPosition, log end) they were
    planned at, and a DoGet after the open transaction committed still
    skips it (what every task of the plan reads is fixed at planning)."""
    conn = FlightConnection(FlightTarget(served.service.location, served.token))
    tickets = conn.plan({"subscribe": "orders", "allowOutOfOrderDelivery": "true"})
    assert {t.partition: t.end for t in tickets} == {p: served.broker.high_watermark("orders", p) for p in range(3)}
    assert all(t.out_of_order and t.as_of[1] == t.end for t in tickets)
    assert wire.Ticket.decode(tickets[1].encode()) == tickets[1]
    served.still_open.commit()
    got = [r for t in tickets for batch in conn.read(t) for r in rows(pa.Table.from_batches([batch]))]
    after_1 = [e for e in served.everything if e[2].startswith(b"after-1-")]
    assert sorted(got) == sorted(served.visible + after_1)


def test_read_uncommitted_and_headers_through_txmq_client(served):
    conn = FlightConnection(FlightTarget(served.service.location, served.token))
    tickets = conn.plan({"subscribe": "orders", "isolation": "read_uncommitted", "includeHeaders": "true"})
    assert len(tickets) == 3 and all(t.isolation == "read_uncommitted" and t.include_headers for t in tickets)
    batches = [b for t in tickets for b in conn.read(t)]
    assert batches[0].schema == txmq.readonly.arrow_schema(True, "us")
    got = [r for b in batches for r in rows(pa.Table.from_batches([b]))]
    assert sorted(got) == sorted(served.everything)        # every data message, no marker
    assert conn.plan({"subscribe": "empty"}) == []
    # streaming offsets: initial (earliest / latest) and current (log start, latest)
    assert conn.offsets({"subscribe": "orders", "startingOffsets": "earliest"}, "initial") == \
        {"orders/0": 0, "orders/1": 0, "orders/2": 0}
    current = conn.offsets({"subscribe": "orders"}, "current")
    assert current == {f"orders/{p}": (0, served.broker.last_stable_offset("orders", p)) for p in range(3)}
    assert conn.offsets({"subscribe": "orders"}, "initial") == {k: v[1] for k, v in current.items()}
    served.still_open.commit()
    assert conn.offsets({"subscribe": "orders"}, "current")["orders/1"] == \
        (0, served.broker.high_watermark("orders", 1))
    conn.close()


def test_write_attempts_commit_once_per_job_and_abort_discards(served):
    c, token, b = served.client, served.token, served.broker
    b.create_topic("out", 2)
    batch = pa.record_batch({"key": pa.array([b"a", b"b", None]), "value": pa.array(["1", "2", "3"]),
                             "partition": pa.array([1, 1, 0], pa.int32())})
    assert stage(c, token, "job-1", "t0-a0", "out", batch) == {"attempt": "t0-a0", "messages": 3}
    assert stage(c, token, "job-1", "t0-a1", "out", batch) == {"attempt": "t0-a1", "messages": 3}   # a retry
    assert b.high_watermark("out", 0) == b.high_watermark("out", 1) == 0      # nothing visible yet
    sink = ["txmq.job/job-1", 0]
    assert action(c, "commit", {"job": "job-1", "attempts": ["t0-a1"], "sink": sink}, token) == \
        {"messages": 3, "skipped": False}
    assert action(c, "commit", {"job": "job-1", "attempts": ["t0-a1"], "sink": sink}, token) == \
        {"messages": 0, "skipped": True}                 # asked again: committed once
    assert action(c, "last_batch", {"sink": "txmq.job/job-1"}, token) == {"batch_id": 0}
    got = sorted((m.partition, m.offset, m.value) for p in (0, 1)
                 for m in txmq.readonly.open(served.path).read("out", p, 0))
    assert got == [(0, 0, b"3"), (1, 0, b"1"), (1, 1, b"2")]
    # one transaction: a commit marker after each partition's messages
    assert (b.high_watermark("out", 0), b.high_watermark("out", 1)) == (2, 3)
    # an aborted job leaves nothing, and its late attempts are refused
    stage(c, token, "job-2", "t0-a0", "out", batch)
    assert action(c, "abort", {"job": "job-2", "tombstone": True}, token) == {}
    with pytest.raises(flight.FlightServerError, match="StagingError"):
        stage(c, token, "job-2", "t1-a0", "out", batch)
    assert os.listdir(os.path.join(served.path, "staging")) == ["job-2.aborted"]
    assert (b.high_watermark("out", 0), b.high_watermark("out", 1)) == (2, 3)
    assert action(c, "topic", {"topic": "out"}, token) == {"partitions": 2}


def test_wrong_or_missing_token_is_refused_and_writes_nothing(served):
    c = served.client
    wrong = "x" * len(served.token)
    for options in (bearer(wrong), flight.FlightCallOptions(),
                    flight.FlightCallOptions(headers=[(b"authorization", served.token.encode())])):
        with pytest.raises(flight.FlightUnauthenticatedError, match="Bearer"):
            c.get_flight_info(read_command(subscribe="orders"), options)
        with pytest.raises(flight.FlightUnauthenticatedError):
            list(c.list_actions(options))
        ticket = wire.Ticket("orders", 0, 0, 10).encode()
        with pytest.raises(flight.FlightUnauthenticatedError):
            c.do_get(flight.Ticket(ticket), options).read_all()
    served.broker.create_topic("out", 1)
    with pytest.raises(flight.FlightUnauthenticatedError):
        stage(c, wrong, "job", "a", "out", pa.record_batch({"value": pa.array([b"v"])}))
    with pytest.raises(flight.FlightUnauthenticatedError):
        action(c, "commit", {"job": "job", "attempts": ["a"], "sink": None}, wrong)
    assert not os.path.exists(os.path.join(served.path, "staging", "job"))
    assert served.broker.high_watermark("out", 0) == 0
    # txmq's client keeps pyarrow's Flight error (UNAUTHENTICATED)
    with pytest.raises(flight.FlightUnauthenticatedError):
        FlightConnection(FlightTarget(served.service.location, wrong)).plan({"subscribe": "orders"})


def test_tickets_for_what_is_not_there_are_not_found(served):
    c, token = served.client, served.token
    for ticket, name in ((wire.Ticket("orders", 3, 0, 10), "PartitionNotFoundError"),
                         (wire.Ticket("nope", 0, 0, 10), "TopicNotFoundError"),
                         # past what the log holds: a plan this log never made
                         (wire.Ticket("orders", 0, 0, 10_000), "DataLossError")):
        with pytest.raises(pa.ArrowKeyError, match=name):           # gRPC NOT_FOUND
            fetch(c, ticket.encode(), token)
    with pytest.raises(pa.ArrowKeyError, match="TopicNotFoundError"):
        c.get_flight_info(read_command(subscribe="nope"), bearer(token))
    with pytest.raises(pa.ArrowKeyError, match="PartitionNotFoundError"):
        c.get_flight_info(read_command(assign='{"orders": [9]}'), bearer(token))
    # malformed requests: INVALID_ARGUMENT, naming what is wrong
    for raw, match in ((b"not json", "ticket"), (b'{"v": 2}', "ticket version"),
                       (json.dumps({"v": 1, "topic": "orders", "partition": 0, "start": 5, "end": 1, "strict": True,
                                    "isolation": "read_committed", "includeHeaders": False,
                                    "failOnDataLoss": True}).encode(), "start <= end"),
                       (wire.Ticket("orders", 0, 0, 1, isolation="dirty").encode(), "isolation")):
        with pytest.raises(pa.ArrowInvalid, match=match):
            fetch(c, raw, token)
    with pytest.raises(pa.ArrowInvalid, match="isolation 'serializable'"):
        c.get_flight_info(read_command(subscribe="orders", isolation="serializable"), bearer(token))
    with pytest.raises(pa.ArrowInvalid, match="path"):
        c.get_flight_info(read_command(subscribe="orders", path="/elsewhere"), bearer(token))
    with pytest.raises(pa.ArrowInvalid, match="action 'drop'"):
        action(c, "drop", {}, token)
    # txmq's client raises the txmq errors again
    conn = FlightConnection(FlightTarget(served.service.location, token))
    with pytest.raises(PartitionNotFoundError, match="no partition 3"):
        list(conn.read(wire.Ticket("orders", 3, 0, 10)))
    with pytest.raises(TopicNotFoundError, match="'nope'"):
        conn.plan({"subscribe": "nope"})
    with pytest.raises(InvalidArgumentError, match="startingOffsets"):
        conn.plan({"subscribe": "orders", "startingOffsets": "{bad"})


def test_a_plan_whose_segments_retention_deleted_is_not_found(tmp_path):
    with txmq.Broker(tmp_path / "d", fsync="never", segment_bytes_max=4096, retention_check_interval=3600) as b:
        b.create_topic("t", 1, retention_bytes=0)
        p = b.producer("t")
        for i in range(60):
            p.send(b"v%03d" % i + bytes(200))
        service = serve_flight(b, port=0)
        conn = FlightConnection(FlightTarget(service.location, service.token))
        plan = conn.plan({"subscribe": "t", "maxOffsetsPerPartition": "10"})
        strict = conn.plan({"subscribe": "t", "startingOffsets": '{"t": {"0": 0}}'})
        lenient = conn.plan({"subscribe": "t", "failOnDataLoss": "false"})
        assert [(t.start, t.end) for t in plan] == [(i, i + 10) for i in range(0, 60, 10)]
        assert b.enforce_retention() > 0
        log_start = b._partition("t", 0).start_offset
        assert 10 < log_start < 60
        client = flight.FlightClient(service.location)
        with pytest.raises(pa.ArrowKeyError, match="DataLossError: t/0: retention deleted offsets"):
            fetch(client, plan[1].encode(), service.token)
        # the first range began at "earliest" (not strict): what retention left of it, nothing
        assert fetch(client, plan[0].encode(), service.token).num_rows == 0
        with pytest.raises(DataLossError, match="failOnDataLoss=false"):
            list(conn.read(strict[0]))
        # failOnDataLoss=false reads what is left
        got = [r for b_ in conn.read(lenient[0]) for r in rows(pa.Table.from_batches([b_]))]
        assert [r[1] for r in got] == list(range(log_start, 60))
        client.close()


def test_do_put_with_a_schema_not_the_sinks_is_refused_and_writes_nothing(served):
    c, token, b = served.client, served.token, served.broker
    b.create_topic("out", 1)
    bad = [pa.record_batch({"key": pa.array([b"k"])}),                                  # no value
           pa.record_batch({"value": pa.array([1, 2])}),                                 # not bytes
           pa.record_batch({"value": pa.array([b"v"]), "partition": pa.array([0], pa.int64())}),
           pa.record_batch({"value": pa.array([b"v"]), "headers": pa.array([["h"]])})]
    for i, batch in enumerate(bad):
        with pytest.raises(pa.ArrowInvalid, match="InvalidArgumentError: invalid (columns|value column|"
                                                  "partition column|headers column)"):
            stage(c, token, "job", f"a{i}", "out", batch)
    with pytest.raises(pa.ArrowKeyError, match="TopicNotFoundError"):
        stage(c, token, "job", "a9", "nope", pa.record_batch({"value": pa.array([b"v"])}))
    with pytest.raises(pa.ArrowInvalid, match="attempt"):
        stage(c, token, "job", "../escape", "out", pa.record_batch({"value": pa.array([b"v"])}))
    with pytest.raises(pa.ArrowInvalid, match="InvalidTopicNameError"):      # no path is made of it
        stage(c, token, "job", "a10", "../../../etc", pa.record_batch({"value": pa.array([b"v"])}))
    # a value that breaks the sink's rules mid-stream: the attempt is dropped
    with pytest.raises(pa.ArrowInvalid, match="null values"):
        stage(c, token, "job", "nulls", "out", pa.record_batch({"value": pa.array([b"v", None])}))
    staging = os.path.join(served.path, "staging")
    assert not os.path.exists(staging) or os.listdir(staging) == []
    with pytest.raises(flight.FlightServerError, match="StagingError"):
        action(c, "commit", {"job": "job", "attempts": ["a1"], "sink": None}, token)
    assert b.high_watermark("out", 0) == 0


def _self_signed(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    return str(cert), str(key)


def test_tls(tmp_path):
    cert, key = _self_signed(tmp_path)
    with txmq.Broker(tmp_path / "d", fsync="never") as b:
        b.create_topic("t", 1)
        b.producer("t").send_batch([b"secret-%d" % i for i in range(10)])
        service = serve_flight(b, "127.0.0.1", 0, tls=(cert, key))
        assert service.location.startswith("grpc+tls://127.0.0.1:")
        with open(cert, "rb") as f:
            roots = f.read()
        conn = FlightConnection(FlightTarget(service.location, service.token, roots))
        got = [v for t in conn.plan({"subscribe": "t"}) for bt in conn.read(t) for v in bt.column("value").to_pylist()]
        assert got == [b"secret-%d" % i for i in range(10)]
        # a client that does not trust the certificate, or speaks plain gRPC, gets nothing
        untrusting = flight.FlightClient(service.location)
        with pytest.raises(flight.FlightUnavailableError):
            untrusting.get_flight_info(read_command(subscribe="t"), bearer(service.token, 5))
        plain = flight.FlightClient(service.location.replace("grpc+tls", "grpc"))
        with pytest.raises(flight.FlightUnavailableError):
            plain.get_flight_info(read_command(subscribe="t"), bearer(service.token, 5))
        for c in (untrusting, plain):
            c.close()
        conn.close()
    with pytest.raises(OSError, match="TLS certificate and key"):
        with txmq.Broker(tmp_path / "d2", fsync="never") as b:
            serve_flight(b, port=0, tls=(key, cert))                # swapped: not a usable pair


def test_token_file_lifecycle_and_stop(tmp_path):
    data = tmp_path / "d"
    with txmq.Broker(data, fsync="never") as b:
        b.create_topic("t", 1)
        s1 = serve_flight(b, port=0)
        token_file = data / "flight.token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert token_file.read_text().strip() == s1.token and len(s1.token) >= 40
        assert s1.host == "127.0.0.1"
        s1.stop()
        assert s1.stopped
        with pytest.raises(flight.FlightUnavailableError):
            flight.FlightClient(s1.location).get_flight_info(read_command(subscribe="t"), bearer(s1.token, 3))
        # a restart keeps the token (running queries go on); others may not read it
        os.chmod(token_file, 0o644)
        s2 = serve_flight(b, port=0)
        assert s2.token == s1.token and stat.S_IMODE(token_file.stat().st_mode) == 0o600
        # a token of the caller's own, and a second service beside the first
        s3 = serve_flight(b, port=0, token="t" * 32)
        assert FlightConnection(FlightTarget(s3.location, "t" * 32)).plan({"subscribe": "t"}) == []
        with pytest.raises(InvalidArgumentError, match="token"):
            serve_flight(b, port=0, token="short")
        with pytest.raises(OSError, match="cannot listen"):
            serve_flight(b, port=s2.port)
        with pytest.raises(InvalidArgumentError, match="port"):
            serve_flight(b, port=70000)
        assert len(b._services) == 2
    assert s2.stopped and s3.stopped                     # closing the broker stopped them
    with pytest.raises(txmq.errors.BrokerClosedError):
        serve_flight(b, port=0)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _serve(data, *args):
    return subprocess.Popen([sys.executable, "-m", "txmq.cli", "serve", str(data), *args],
                            stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))


def _wait_for_token(data, proc, timeout=30.0) -> str:
    deadline = time.monotonic() + timeout
    while not (data / "flight.token").exists():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "txmq serve wrote no token"
        time.sleep(0.05)
    return (data / "flight.token").read_text().strip()


def _plan_when_up(location, token, options, timeout=30.0):
    """Plan once the server listens (the token file is written before it
    binds; a plan, unlike a commit, is not retried by the client)."""
    conn = FlightConnection(FlightTarget(location, token), retry_s=timeout)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return conn, conn.plan(options)
        except flight.FlightUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.mark.parametrize("with_kafka", [False, True])
def test_cli_serve_flight(tmp_path, with_kafka):
    data = tmp_path / "d"
    with txmq.Broker(data, fsync="never") as b:
        b.create_topic("t", 2)
        b.producer("t").send_batch([b"m%d" % i for i in range(10)], partition=1)
    fport, kport = _free_port(), _free_port()
    args = ["--flight", f"127.0.0.1:{fport}"] + (["--kafka", f"127.0.0.1:{kport}"] if with_kafka else [])
    proc = _serve(data, *args)
    try:
        token = _wait_for_token(data, proc)
        conn, tickets = _plan_when_up(f"grpc://127.0.0.1:{fport}", token, {"subscribe": "t"})
        assert [v for t in tickets for bt in conn.read(t) for v in bt.column("value").to_pylist()] == \
            [b"m%d" % i for i in range(10)]
        conn.stage("cli-job", "a0", "t", iter([pa.record_batch({"value": pa.array([b"w"]),
                                                                "partition": pa.array([0], pa.int32())})]))
        assert conn.commit("cli-job", ["a0"], ("txmq.job/cli-job", 0))["messages"] == 1
        assert txmq.readonly.writer_pid(str(data)) == proc.pid
        kafka_listening = True
        try:
            socket.create_connection(("127.0.0.1", kport), timeout=1).close()
        except OSError:
            kafka_listening = False
        assert kafka_listening == with_kafka
        conn.close()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "Arrow Flight on grpc://127.0.0.1:%d" % fport in err and "stopped" in err
    assert ("Kafka's protocol" in err) == with_kafka
    assert [m.value for m in txmq.readonly.open(data).read("t", 0, 0)] == [b"w"]


def test_cli_serve_flight_errors(tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        proc = _serve(tmp_path / "d", "--flight", f"127.0.0.1:{busy.getsockname()[1]}")
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 5 and "cannot listen" in err
    finally:
        busy.close()
    proc = _serve(tmp_path / "d", "--flight", "nowhere")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "--flight 'nowhere': expected HOST:PORT" in err
    proc = _serve(tmp_path / "d", "--flight", "127.0.0.1:0", "--flight-tls-cert", "/no/such.pem")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "go together" in err


def test_a_topic_deleted_and_created_again_is_served_anew(served):
    b, conn = served.broker, FlightConnection(FlightTarget(served.service.location, served.token))
    b.create_topic("again", 1)
    b.producer("again").send_batch([b"old-%d" % i for i in range(5)])
    assert [v for t in conn.plan({"subscribe": "again"}) for bt in conn.read(t)
            for v in bt.column("value").to_pylist()] == [b"old-%d" % i for i in range(5)]
    b.delete_topic("again")
    with pytest.raises(TopicNotFoundError):
        conn.plan({"subscribe": "again"})
    b.create_topic("again", 1)
    b.producer("again").send_batch([b"new-%d" % i for i in range(3)])
    assert [v for t in conn.plan({"subscribe": "again"}) for bt in conn.read(t)
            for v in bt.column("value").to_pylist()] == [b"new-%d" % i for i in range(3)]
    actions = {a.type for a in served.client.list_actions(bearer(served.token))}
    assert actions == set(wire.ACTIONS)
