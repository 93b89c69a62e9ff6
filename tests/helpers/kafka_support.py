"""Shared pieces of the Kafka front-end tests: a broker served on a free
127.0.0.1 port that stops by itself, helpers that drive real clients, and
a raw client that writes Kafka frames by hand."""

import socket
import struct
import time
from types import SimpleNamespace

import pytest

import txmq
from txmq import _kafka
from txmq.kafka import schema, serve_kafka


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


class RawClient:
    """A socket speaking Kafka frames by hand, with txmq's codec."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.corr = 0

    def send_frame(self, payload: bytes) -> None:
        self.sock.sendall(struct.pack(">i", len(payload)) + payload)

    def frame(self, key: int, version: int, body: dict) -> bytes:
        w = _kafka.Writer()
        self.corr += 1
        for write, v in ((_kafka.write_i16, key), (_kafka.write_i16, version), (_kafka.write_i32, self.corr)):
            write(w, v)
        _kafka.write_i16(w, 3)
        head = w.getvalue() + b"raw"
        if schema.is_flexible(key, version):
            head += b"\x00"
        bw = _kafka.Writer()
        _kafka.write_struct(bw, body, schema.request(key, version))
        return head + bw.getvalue()

    def read_frame(self) -> bytes:
        size = struct.unpack(">i", self._exactly(4))[0]
        return self._exactly(size)

    def request(self, key: int, version: int, body: dict) -> dict:
        self.send_frame(self.frame(key, version, body))
        raw = self.read_frame()
        assert struct.unpack(">i", raw[:4])[0] == self.corr
        pos = 5 if key != 18 and schema.is_flexible(key, version) else 4
        return _kafka.read_struct(_kafka.Reader(raw, pos), schema.response(key, version))

    def _exactly(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("closed")
            out += chunk
        return out

    def closed_by_server(self, within: float = 5.0) -> bool:
        self.sock.settimeout(within)
        try:
            return self.sock.recv(1) == b""
        except (ConnectionResetError, BrokenPipeError):
            return True
        except socket.timeout:
            return False

    def close(self):
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
