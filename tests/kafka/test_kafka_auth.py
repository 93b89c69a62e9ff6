"""SASL (PLAIN, SCRAM-SHA-256) and per-user topic ACLs of the Kafka server
(txmq.kafka.auth, docs/KAFKA.md): the users file and its errors, SCRAM
against RFC 7677's own example, and real clients — confluent-kafka and
kafka-python — let in, refused at authentication
(SASL_AUTHENTICATION_FAILED) and refused per topic
(TOPIC_AUTHORIZATION_FAILED)."""

import base64
import json
import socket
import struct
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

import txmq
from txmq.kafka import serve_kafka
from kafka_support import RawClient, listening, wait_until
from txmq.errors import KafkaUsersFileError
from txmq.kafka import auth
from txmq.kafka.protocol import Error

confluent_kafka = pytest.importorskip("confluent_kafka")
kafka_python = pytest.importorskip("kafka")

USERS = {"users": {
    "alice": {"password": "alice-pw", "topics": {"orders": ["read", "write"], "shared.*": ["all"]}},
    "reader": {"password": "reader-pw", "topics": {"orders": ["read"]}},
    "writer": {"scram_sha_256": auth.scram_credentials("writer-pw"), "topics": {"orders": ["write"]}},
    "ops": {"password": "ops-pw", "superuser": True},
}}


@pytest.fixture
def secured(tmp_path):
    users = tmp_path / "users.json"
    users.write_text(json.dumps(USERS))
    broker = txmq.Broker(tmp_path / "data", fsync="never", control_socket=False)
    broker.create_topic("orders")
    broker.create_topic("secret")
    server = serve_kafka(broker, "127.0.0.1", 0, users_file=users)
    yield SimpleNamespace(broker=broker, server=server, bootstrap=f"127.0.0.1:{server.port}", users=users)
    broker.close()


def confluent_conf(k, user, password, mechanism="PLAIN", **extra):
    conf = {"bootstrap.servers": k.bootstrap, "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanisms": mechanism, "sasl.username": user, "sasl.password": password}
    conf.update(extra)
    return conf


def confluent_produce(k, user, password, topic, mechanism="PLAIN"):
    """The delivery error code of one message (0: delivered)."""
    reports = []
    p = confluent_kafka.Producer(confluent_conf(k, user, password, mechanism, **{"message.timeout.ms": 10000}))
    p.produce(topic, value=b"from " + user.encode(), on_delivery=lambda err, msg: reports.append(err))
    p.flush(15)
    assert len(reports) == 1
    return 0 if reports[0] is None else reports[0].code()


def confluent_read(k, user, password, topic, mechanism="PLAIN"):
    """(values, error codes) a consumer of ``topic`` in a group gets."""
    c = confluent_kafka.Consumer(confluent_conf(k, user, password, mechanism, **{
        "group.id": f"g-{user}", "enable.auto.commit": False, "auto.offset.reset": "earliest"}))
    c.subscribe([topic])
    values, errors, deadline = [], [], time.monotonic() + 15
    try:
        while time.monotonic() < deadline and not (values or errors):
            m = c.poll(0.2)
            if m is None:
                continue
            (errors.append(m.error().code()) if m.error() else values.append(m.value()))
    finally:
        c.close()
    return values, errors


# -- the users file -------------------------------------------------------------------------

@pytest.mark.parametrize("doc, reason", [
    ({"people": {}}, "expected"),
    ({"users": {"a": {}}}, "password or scram"),
    ({"users": {"a": {"password": "p", "topics": {"t": ["delete"]}}}}, "operation 'delete'"),
    ({"users": {"a": {"password": "p", "topics": {"a*b": ["read"]}}}}, "topic pattern"),
    ({"users": {"a": {"password": "p", "superuser": "yes"}}}, "superuser"),
    ({"users": {"a": {"password": "p", "role": "x"}}}, "unknown keys"),
    ({"users": {"a": {"scram_sha_256": {"salt": "!!", "iterations": 4096}}}}, "scram_sha_256"),
    ({"users": {"a": {"scram_sha_256": dict(auth.scram_credentials("p"), iterations=10)}}}, "iterations"),
])
def test_users_file_errors(tmp_path, doc, reason):
    path = tmp_path / "users.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(KafkaUsersFileError, match=reason) as e:
        auth.Users.load(path)
    assert e.value.path == str(path)


def test_users_file_refused_by_serve_kafka_and_cli(tmp_path):
    bad = tmp_path / "users.json"
    bad.write_text("{not json")
    with txmq.Broker(tmp_path / "d", fsync="never", control_socket=False) as b:
        with pytest.raises(KafkaUsersFileError, match="not JSON"):
            serve_kafka(b, "127.0.0.1", 0, users_file=bad)
        assert b._services == []
    out = subprocess.run([sys.executable, "-m", "txmq.cli", "serve", str(tmp_path / "d2"), "--kafka", "127.0.0.1:0",
                          "--users", str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "not JSON" in out.stderr
    assert not (tmp_path / "d2").exists()


def test_acl_patterns_most_specific_wins():
    users = auth.Users.from_dict({"users": {"u": {"password": "p", "topics": {
        "*": ["describe"], "logs.*": ["read"], "logs.audit.*": ["write"], "logs.x": []}}}})
    u = users.users["u"]
    assert users.allowed(u, "anything", "describe") and not users.allowed(u, "anything", "read")
    assert users.allowed(u, "logs.a", "read") and not users.allowed(u, "logs.a", "write")
    assert users.allowed(u, "logs.audit.1", "write") and users.allowed(u, "logs.audit.1", "describe")
    assert not users.allowed(u, "logs.audit.1", "read")
    assert not users.allowed(u, "logs.x", "describe")          # an exact name beats every prefix
    assert not users.allowed(None, "anything", "describe")


def test_scram_sha_256_rfc7677_example(monkeypatch):
    # RFC 7677 section 3: user "user", password "pencil".
    salt = base64.b64decode("W22ZaJ0SNY7soEsUEjb6gQ==")
    users = auth.Users.from_dict({"users": {"user": {"scram_sha_256": auth.scram_credentials("pencil", salt, 4096)}}})
    monkeypatch.setattr(auth, "server_nonce", lambda: "%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0")
    x = users.scram()
    assert x.step(b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO") == \
        b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
    assert x.step(b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
                  b"p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=") == \
        b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="
    assert x.user.name == "user"
    bad = users.scram()
    bad.step(b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO")
    with pytest.raises(auth.AuthenticationFailed, match="authentication failed"):
        bad.step(b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
                 b"p=AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=")
    # An unknown user gets a salt all the same, and fails at the proof.
    ghost = users.scram()
    assert b",s=" in ghost.step(b"n,,n=ghost,r=abc")
    with pytest.raises(auth.AuthenticationFailed):
        ghost.step(b"c=biws,r=abc%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,p=AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=")


def test_plain_messages():
    users = auth.Users.from_dict(USERS)
    assert users.plain(b"\0alice\0alice-pw").name == "alice"
    assert users.plain(b"alice\0alice\0alice-pw").name == "alice"
    for bad in (b"\0alice\0wrong", b"\0nobody\0x", b"bob\0alice\0alice-pw", b"alice-pw", b"\0writer\0writer-pw"):
        with pytest.raises(auth.AuthenticationFailed):
            users.plain(bad)


# -- real clients ---------------------------------------------------------------------------

@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256"])
def test_confluent_kafka_allowed_and_refused_per_topic(secured, mechanism):
    k = secured
    assert confluent_produce(k, "alice", "alice-pw", "orders", mechanism) == 0
    assert confluent_produce(k, "alice", "alice-pw", "shared.x", mechanism) == 0         # created on first use
    assert confluent_produce(k, "alice", "alice-pw", "secret", mechanism) == \
        confluent_kafka.KafkaError.TOPIC_AUTHORIZATION_FAILED
    assert confluent_produce(k, "reader", "reader-pw", "orders", mechanism) == \
        confluent_kafka.KafkaError.TOPIC_AUTHORIZATION_FAILED
    values, errors = confluent_read(k, "reader", "reader-pw", "orders", mechanism)
    assert values == [b"from alice"] and not errors
    assert confluent_read(k, "alice", "alice-pw", "secret", mechanism)[1][:1] == \
        [confluent_kafka.KafkaError.TOPIC_AUTHORIZATION_FAILED]
    assert [m.value for m in k.broker.subscribe("secret", "s", initial_position="earliest")
            .receive_many(10, timeout=0.2)] == []
    assert "shared.x" in k.broker.topics()


def test_confluent_kafka_scram_only_user_and_write_only_acl(secured):
    k = secured
    assert confluent_produce(k, "writer", "writer-pw", "orders", "SCRAM-SHA-256") == 0
    values, errors = confluent_read(k, "writer", "writer-pw", "orders", "SCRAM-SHA-256")
    assert not values and errors[:1] == [confluent_kafka.KafkaError.TOPIC_AUTHORIZATION_FAILED]
    assert k.broker.high_watermark("orders", 0) == 1


@pytest.mark.parametrize("mechanism, user, password", [
    ("PLAIN", "alice", "wrong"), ("SCRAM-SHA-256", "alice", "wrong"), ("PLAIN", "nobody", "x"),
    ("SCRAM-SHA-256", "nobody", "x"), ("PLAIN", "writer", "writer-pw")])       # writer has no password for PLAIN
def test_confluent_kafka_bad_credentials(secured, caplog, mechanism, user, password):
    errors = []
    p = confluent_kafka.Producer(confluent_conf(secured, user, password, mechanism, **{
        "error_cb": errors.append, "message.timeout.ms": 3000}))
    p.produce("orders", value=b"never")
    p.flush(5)
    assert any(e.code() == confluent_kafka.KafkaError._AUTHENTICATION and "authentication failed" in e.str()
               for e in errors), [e.str() for e in errors]
    assert secured.broker.high_watermark("orders", 0) == 0
    assert any("authentication failed" in r.getMessage() and "connection closed" in r.getMessage()
               for r in caplog.records if r.name == "txmq.kafka")


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256"])
def test_kafka_python_allowed_refused_and_bad_password(secured, caplog, mechanism):
    k = secured
    conf = dict(bootstrap_servers=k.bootstrap, security_protocol="SASL_PLAINTEXT", sasl_mechanism=mechanism)
    p = kafka_python.KafkaProducer(sasl_plain_username="alice", sasl_plain_password="alice-pw", **conf)
    p.send("orders", b"kafka-python").get(10)
    with pytest.raises(kafka_python.errors.TopicAuthorizationFailedError):
        p.send("secret", b"no").get(10)
    p.close()
    # kafka-python raises the refusal, or logs it and retries until its bootstrap timeout.
    with pytest.raises((kafka_python.errors.SaslAuthenticationFailedError,
                        kafka_python.errors.KafkaTimeoutError)) as refused:
        kafka_python.KafkaProducer(sasl_plain_username="alice", sasl_plain_password="wrong",
                                   bootstrap_timeout_ms=2000, **conf)
    said = [str(refused.value)] + [r.getMessage() for r in caplog.records if r.name.startswith("kafka")]
    assert any("SaslAuthenticationFailedError" in m and "authentication failed for user 'alice'" in m
               for m in said), said
    c = kafka_python.KafkaConsumer(sasl_plain_username="reader", sasl_plain_password="reader-pw",
                                   auto_offset_reset="earliest", consumer_timeout_ms=3000, **conf)
    assert c.topics() == {"orders"}                          # only what the user may describe
    c.assign([kafka_python.TopicPartition("orders", 0)])
    assert [m.value for m in c] == [b"kafka-python"]
    c.close()


def test_requests_before_authentication_close_the_connection(secured, caplog):
    with RawClient(secured.server.port) as rc:
        assert rc.request(18, 3, {})["error_code"] == 0                   # ApiVersions is allowed
        assert rc.request(17, 1, {"mechanism": "GSSAPI"}) == {
            "error_code": Error.UNSUPPORTED_SASL_MECHANISM, "mechanisms": ["PLAIN", "SCRAM-SHA-256"]}
        rc.send_frame(rc.frame(3, 9, {"topics": None}))                  # Metadata: not yet
        assert rc.closed_by_server()
    assert any("before authenticating" in r.getMessage() for r in caplog.records)
    with RawClient(secured.server.port) as rc:                          # SaslAuthenticate needs a handshake
        assert rc.request(36, 2, {"auth_bytes": b"\0alice\0alice-pw"})["error_code"] == Error.ILLEGAL_SASL_STATE
        assert rc.closed_by_server()
    with RawClient(secured.server.port) as rc:                          # the whole exchange by hand
        assert rc.request(17, 1, {"mechanism": "PLAIN"})["error_code"] == 0
        assert rc.request(36, 2, {"auth_bytes": b"\0ops\0ops-pw"})["error_code"] == 0
        names = {t["name"] for t in rc.request(3, 9, {"topics": None})["topics"]}
        assert {"orders", "secret"} <= names                            # a superuser sees everything


def test_no_users_file_refuses_sasl(tmp_path):
    with txmq.Broker(tmp_path / "d", fsync="never", control_socket=False) as b:
        s = serve_kafka(b, "127.0.0.1", 0)
        with RawClient(s.port) as rc:
            assert rc.request(17, 1, {"mechanism": "PLAIN"}) == {
                "error_code": Error.UNSUPPORTED_SASL_MECHANISM, "mechanisms": []}


def test_cli_serve_with_users(tmp_path):
    users = tmp_path / "users.json"
    users.write_text(json.dumps(USERS))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "txmq.cli", "serve", str(tmp_path / "d"), "--kafka",
                             f"127.0.0.1:{port}", "--users", str(users)], stderr=subprocess.PIPE, text=True)
    try:
        k = SimpleNamespace(bootstrap=f"127.0.0.1:{port}")
        assert wait_until(lambda: listening(port), 30)
        assert confluent_produce(k, "ops", "ops-pw", "made-by-ops", "SCRAM-SHA-256") == 0
        assert confluent_produce(k, "reader", "reader-pw", "made-by-ops") == \
            confluent_kafka.KafkaError.TOPIC_AUTHORIZATION_FAILED
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "SASL with 4 users" in err
