"""Shared pieces of the Kafka front-end tests: a broker served on a free
127.0.0.1 port that stops by itself, and helpers that drive real clients."""

import socket
import time
from types import SimpleNamespace

import pytest

import txmq
from txmq.kafka import serve_kafka


@pytest.fixture
def kafka(tmp_path):
    broker = txmq.Broker(tmp_path / "data", fsync="never", control_socket=False)
    server = serve_kafka(broker, "127.0.0.1", 0)
    yield SimpleNamespace(broker=broker, server=server, bootstrap=f"127.0.0.1:{server.port}", path=tmp_path / "data")
    broker.close()
    assert server.stopped


def confluent_consume(bootstrap: str, topics, group: str, *, isolation="read_committed", want=None,
                      seconds=10.0, extra=None):
    """Messages a confluent-kafka consumer of ``group`` gets within
    ``seconds`` (or as soon as it has ``want``)."""
    from confluent_kafka import Consumer
    conf = {"bootstrap.servers": bootstrap, "group.id": group, "auto.offset.reset": "earliest",
            "isolation.level": isolation, "enable.auto.commit": False}
    conf.update(extra or {})
    c = Consumer(conf)
    c.subscribe(list(topics))
    got, deadline = [], time.monotonic() + seconds
    try:
        while time.monotonic() < deadline and (want is None or len(got) < want):
            m = c.poll(0.2)
            if m is None or m.error():
                continue
            got.append(m)
    finally:
        c.close()
    return got


def wait_until(cond, seconds=10.0, step=0.05):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()


def listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port``."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False
