"""Crashes with real Kafka clients against `txmq serve` in a subprocess:

- exactly-once consume-transform-produce (confluent-kafka,
  ``send_offsets_to_transaction``) by a group of two worker processes, one
  SIGKILLed mid-stream and replaced under its transactional id, the other
  stalled inside a transaction and fenced by its replacement: the output,
  read read_committed, holds every input exactly once;
- the server SIGKILLed and restarted while an idempotent producer
  (acks=all) and a transactional producer run and a read_committed
  consumer reads: nothing acknowledged is lost, the idempotent producer's
  retries add no duplicate, and no aborted or unfinished transaction's data
  is ever delivered.

`txmq serve` runs with its default fsync="commit": an acknowledged produce
is in the page cache, which survives the server's SIGKILL (docs/KAFKA.md,
docs/GUARANTEES.md G4).
"""

import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import killer
from kafka_support import wait_until

confluent_kafka = pytest.importorskip("confluent_kafka")
from confluent_kafka import KafkaException, TopicPartition  # noqa: E402

WORKER = killer.worker("kafka_eos_worker.py")
FENCED_EXIT = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


class Served:
    """`txmq serve DIR --kafka 127.0.0.1:PORT` in a subprocess that can be
    SIGKILLed and started again on the same directory and port."""

    def __init__(self, path, partitions: int = 1):
        self.path, self.port, self.partitions = str(path), _free_port(), partitions
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.proc = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "txmq.cli", "serve", self.path, "--kafka", self.bootstrap,
             "--partitions", str(self.partitions), "--no-progress"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert wait_until(lambda: _listening(self.port) or self.proc.poll() is not None, 30)
        assert self.proc.poll() is None, f"txmq serve exited with {self.proc.returncode}"

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def served(tmp_path):
    s = Served(tmp_path / "data", partitions=2)
    s.start()
    yield s
    s.stop()


def read_all(bootstrap: str, topic: str, partitions: int, quiet_s: float = 2.0, limit_s: float = 60.0) -> list:
    """Every message a read_committed reader gets from ``topic``, until
    nothing new comes for ``quiet_s``."""
    c = confluent_kafka.Consumer({"bootstrap.servers": bootstrap, "group.id": "checker",
                                  "isolation.level": "read_committed", "enable.auto.commit": False})
    c.assign([TopicPartition(topic, p, confluent_kafka.OFFSET_BEGINNING) for p in range(partitions)])
    out, last, deadline = [], time.monotonic(), time.monotonic() + limit_s
    try:
        while time.monotonic() - last < quiet_s and time.monotonic() < deadline:
            for m in c.consume(1000, 0.2):
                if m.error() is None:
                    out.append(m)
                    last = time.monotonic()
    finally:
        c.close()
    return out


# -- exactly-once consume-transform-produce ----------------------------------------------

class Worker:
    """A kafka_eos_worker.py process and the lines it printed."""

    def __init__(self, served, tid: str, folder):
        self.tid = tid
        self.proc = subprocess.Popen([sys.executable, WORKER, served.bootstrap, tid, "eos", "in", "out",
                                      str(folder)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.split())

    def saw(self, word: str) -> int:
        return sum(1 for words in list(self.lines) if words and words[0] == word)

    def finish(self, timeout: float = 60.0) -> int:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(5)
        return self.proc.returncode

    def diagnostics(self) -> str:
        return f"{self.tid}: rc={self.proc.returncode} lines={self.lines[-5:]} stderr={self.proc.stderr.read()[-2000:]}"


def test_exactly_once_group_with_a_killed_and_a_fenced_member(served, tmp_path):
    inputs = [b"%05d" % i for i in range(3000)]
    p = confluent_kafka.Producer({"bootstrap.servers": served.bootstrap, "enable.idempotence": True})
    for i, v in enumerate(inputs):
        p.produce("in", key=b"k%d" % i, value=v, partition=i % 2)
    assert p.flush(30) == 0
    folder = tmp_path / "ctl"
    folder.mkdir()
    workers = []
    try:
        a, b = Worker(served, "eos-a", folder), Worker(served, "eos-b", folder)
        workers += [a, b]
        assert wait_until(lambda: a.saw("committed") >= 2 and b.saw("committed") >= 5, 60), \
            (a.diagnostics(), b.diagnostics())
        # B dies mid-stream; a new process takes its transactional id.
        b.proc.send_signal(signal.SIGKILL)
        assert (a.saw("committed") + b.saw("committed")) * 20 < len(inputs) // 2     # most input still to do
        assert b.finish() == -signal.SIGKILL
        b2 = Worker(served, "eos-b", folder)
        workers.append(b2)
        # A stalls inside a transaction; its replacement fences it.
        (folder / "hold-eos-a").touch()
        assert wait_until(lambda: a.saw("holding") == 1, 60), a.diagnostics()
        a2 = Worker(served, "eos-a", folder)
        workers.append(a2)
        assert wait_until(lambda: a2.saw("ready") == 1, 60), a2.diagnostics()
        (folder / "hold-eos-a").unlink()
        assert a.finish() == FENCED_EXIT, a.diagnostics()
        assert a.saw("fenced") == 1 and a.saw("committed") >= 2

        def done() -> bool:
            return {m.value() for m in read_all(served.bootstrap, "out", 2, quiet_s=0.5)} >= \
                {b"out:" + v for v in inputs}
        assert wait_until(done, 120, step=1.0), [w.diagnostics() for w in workers]
        (folder / "stop").touch()
        for w in (a2, b2):
            assert w.finish() == 0, w.diagnostics()
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()
    out = read_all(served.bootstrap, "out", 2)
    counts = collections.Counter(m.value() for m in out)
    assert counts == collections.Counter(b"out:" + v for v in inputs)     # every input exactly once
    assert all(m.key() == b"k" + str(int(m.value()[4:])).encode() for m in out)


# -- the server killed under load -----------------------------------------------------------

class TxnLoad(threading.Thread):
    """A transactional producer: transaction j writes ``t<j>-<i>`` (commit)
    or, every third one, ``a<j>-<i>`` and aborts. Outcomes: ``committed``
    (commit returned), ``aborted`` (deliberately or after an error),
    ``unknown`` (the commit's outcome was lost with the server)."""

    PER_TXN = 10

    def __init__(self, bootstrap: str, stop: threading.Event):
        super().__init__(daemon=True)
        self.bootstrap, self.stop = bootstrap, stop
        self.committed, self.aborted, self.unknown = [], [], []
        self.errors: list = []

    def _producer(self):
        p = confluent_kafka.Producer({"bootstrap.servers": self.bootstrap, "transactional.id": "crash-txn",
                                      "transaction.timeout.ms": 20000, "message.timeout.ms": 20000})
        p.init_transactions(60)
        return p

    def run(self) -> None:
        p, j = None, 0
        while not self.stop.is_set():
            try:
                if p is None:
                    p = self._producer()
                abort = j % 3 == 2
                p.begin_transaction()
                for i in range(self.PER_TXN):
                    p.produce("txn", value=b"%s%05d-%02d" % (b"a" if abort else b"t", j, i))
                if abort:
                    p.abort_transaction(60)
                    self.aborted.append(j)
                else:
                    p.commit_transaction(60)
                    self.committed.append(j)
            except KafkaException as e:
                err = e.args[0]
                self.errors.append(err.name())
                (self.unknown if not abort else self.aborted).append(j)
                try:
                    if err.txn_requires_abort():
                        p.abort_transaction(60)
                    else:
                        p = None               # fatal or unknown: a new instance fences this one
                except KafkaException:
                    p = None
            j += 1
            time.sleep(0.01)


class Reader(threading.Thread):
    """A read_committed consumer that reads throughout, across the crash."""

    def __init__(self, bootstrap: str, stop: threading.Event):
        super().__init__(daemon=True)
        self.stop = stop
        self.seen: list = []
        self.c = confluent_kafka.Consumer({"bootstrap.servers": bootstrap, "group.id": "live",
                                           "isolation.level": "read_committed", "enable.auto.commit": False})
        self.c.assign([TopicPartition("txn", 0, confluent_kafka.OFFSET_BEGINNING),
                       TopicPartition("idem", 0, confluent_kafka.OFFSET_BEGINNING)])

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                for m in self.c.consume(500, 0.2):
                    if m.error() is None:
                        self.seen.append((m.topic(), m.value()))
        finally:
            self.c.close()


@pytest.mark.parametrize("kills", [2, pytest.param(20, marks=pytest.mark.slow)])
def test_server_killed_and_restarted_under_load(tmp_path, kills):
    served = Served(tmp_path / "data", partitions=1)
    served.start()
    stop = threading.Event()
    acked, failed = [], []

    def delivered(err, msg):
        (failed if err is not None else acked).append(msg.value())

    idem = confluent_kafka.Producer({"bootstrap.servers": served.bootstrap, "enable.idempotence": True,
                                     "acks": "all", "message.timeout.ms": 60000, "linger.ms": 2})
    txns, reader = TxnLoad(served.bootstrap, stop), Reader(served.bootstrap, stop)
    try:
        for topic in ("idem", "txn"):           # created before the load, so the reader finds them
            idem.produce(topic, value=b"first", on_delivery=delivered)
        assert idem.flush(30) == 0
        txns.start()
        reader.start()
        sent, killed = 0, 0

        def produce(n):
            nonlocal sent
            for _ in range(n):
                idem.produce("idem", value=b"i%06d" % sent, on_delivery=delivered)
                sent += 1
            idem.poll(0)

        while killed < kills:
            deadline = time.monotonic() + 30
            floor = len(acked) + 500
            while (len(acked) < floor or len(txns.committed) < 3 * (killed + 1)) and time.monotonic() < deadline:
                produce(50)
                time.sleep(0.005)
            produce(200)                        # in flight when the server dies
            served.kill()
            killed += 1
            time.sleep(0.3)
            served.start()
        for _ in range(10):
            produce(50)
            time.sleep(0.01)
        assert idem.flush(90) == 0
        assert wait_until(lambda: len(txns.committed) >= 4 * kills, 60), (txns.committed, txns.errors)
        stop.set()
        txns.join(120)
        reader.join(30)
        final = read_all(served.bootstrap, "idem", 1) + read_all(served.bootstrap, "txn", 1)
    finally:
        stop.set()
        served.stop()
    values = [m.value() for m in final]
    counts = collections.Counter(values)
    # Idempotent producer: nothing acknowledged lost, nothing twice.
    assert not failed
    assert set(acked) <= set(values)
    assert all(n == 1 for v, n in counts.items() if v.startswith(b"i")), \
        [v for v, n in counts.items() if n > 1][:5]
    # Transactions: committed ones whole and once, aborted ones never, unknown ones all or nothing.
    by_txn = collections.defaultdict(list)
    for v in values:
        if v[:1] in (b"t", b"a"):
            by_txn[int(v[1:6])].append(v)
    assert not any(v.startswith(b"a") for v in values)
    for j in txns.committed:
        assert sorted(by_txn[j]) == [b"t%05d-%02d" % (j, i) for i in range(TxnLoad.PER_TXN)], j
    for j in txns.aborted:
        assert j not in by_txn, j
    for j in txns.unknown:
        assert len(by_txn.get(j, [])) in (0, TxnLoad.PER_TXN), by_txn[j]
    # The live read_committed reader never got anything that is not committed.
    committed_values = set(values)
    assert not [v for _, v in reader.seen if v not in committed_values]
    assert len(txns.committed) >= 4 * kills and len(acked) > 500 * kills
