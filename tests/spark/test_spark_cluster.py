"""Spark on a real standalone cluster whose executors cannot open the data
directory, so that every task reads and writes through the owner's Arrow
Flight service (docs/SPARK_CLUSTER.md, "Reproducing the cluster test").

The module starts, from the pyspark package's own ``spark-class``, a
master and one worker bound to 127.0.0.1. The worker (and so every
executor) runs as an unprivileged user that this module creates with
``useradd`` and deletes at the end; the data directory is mode 0700 and
owned by root, and ``txmq serve DIR --flight`` (root) owns it. The
interpreter is hard-linked to a directory that user can reach (a Python
under ``/root`` is not), and the drivers run as root with it too, since a
Python data source's tasks run the driver's interpreter path.

- A batch read returns exactly the committed messages (aborted and open
  transactions never appear); the executors run as the other user and
  cannot read the directory.
- A streaming query (Flight in, Flight out, a checkpoint) whose driver is
  SIGKILLed mid-stream and restarted from the checkpoint writes every
  input message's output exactly once.
- A batch write whose executor is SIGKILLed mid-task (a batch already
  sent) commits every row exactly once, in one transaction.
- Given only ``path`` (no Flight option), a batch read returns the same
  rows and a batch write commits every row once: the driver (root) plans
  and commits locally, the tasks find the owner's Flight service in
  ``flight.json`` and go through it; with ``flight.fallback=false`` the
  tasks fail saying the path is unreadable there.

Marked slow (about two minutes here); it needs root (else skipped with the
reason), Java, and loopback ports. Everything it starts is stopped by it.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pyspark
import pytest

import txmq
import txmq.readonly
from unprivileged import others_can_enter, relocate_python

import killer

pytestmark = pytest.mark.slow

USER = "txmq-spark-test"
DRIVER = killer.worker("spark_cluster_driver.py")
SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(txmq.__file__)))      # the py/ folder with txmq
START_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """A standalone master and worker run as ``user``."""

    def __init__(self, root: str, python: str, user: str):
        self.root, self.python, self.user = root, python, user
        self.pw = pwd.getpwnam(user)
        rel = os.path.relpath(os.path.dirname(os.path.abspath(pyspark.__file__)), sys.prefix)
        self.spark_home = os.path.join(root, "python", rel)
        self.port, self.ui_port, self.worker_ui_port = _free_port(), _free_port(), _free_port()
        self.master_url = f"spark://127.0.0.1:{self.port}"
        self.procs = []
        for name in ("home", "work", "logs"):
            os.makedirs(os.path.join(root, name))
            os.chown(os.path.join(root, name), self.pw.pw_uid, self.pw.pw_gid)
        self.markers = os.path.join(root, "markers")
        os.makedirs(self.markers)
        os.chmod(self.markers, 0o1777)

    def _start(self, name: str, *args):
        env = dict(os.environ, HOME=os.path.join(self.root, "home"), SPARK_HOME=self.spark_home,
                   SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=self.python, SPARK_NO_DAEMONIZE="1")
        env.pop("PYTHONPATH", None)
        log = open(os.path.join(self.root, "logs", name + ".log"), "wb")
        proc = subprocess.Popen(["setpriv", f"--reuid={self.pw.pw_uid}", f"--regid={self.pw.pw_gid}",
                                 "--clear-groups", os.path.join(self.spark_home, "bin", "spark-class"), *args],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=os.path.join(self.root, "home"),
                                start_new_session=True)
        log.close()
        self.procs.append(proc)
        return proc

    def start(self) -> None:
        self.master = self._start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                                  "--port", str(self.port), "--webui-port", str(self.ui_port))
        self.worker = self._start("worker", "org.apache.spark.deploy.worker.Worker", self.master_url,
                                  "--host", "127.0.0.1", "--cores", "2", "--memory", "2g",
                                  "--work-dir", os.path.join(self.root, "work"),
                                  "--webui-port", str(self.worker_ui_port))
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            for proc in self.procs:
                assert proc.poll() is None, self.logs()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=2) as r:
                    if json.load(r).get("aliveworkers", 0) >= 1:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError("the worker did not register with the master in time\n" + self.logs())

    def logs(self) -> str:
        out = []
        for name in ("master", "worker"):
            try:
                with open(os.path.join(self.root, "logs", name + ".log"), errors="replace") as f:
                    out.append(f"--- {name}\n" + f.read()[-3000:])
            except OSError:
                pass
        return "\n".join(out)

    def executors(self) -> list:
        """Pids of the executor JVMs the worker runs now (its children)."""
        pids = []
        for tid in os.listdir(f"/proc/{self.worker.pid}/task"):
            try:
                with open(f"/proc/{self.worker.pid}/task/{tid}/children") as f:
                    pids += [int(p) for p in f.read().split()]
            except OSError:
                continue
        out = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"CoarseGrainedExecutorBackend" in f.read():
                        out.append(pid)
            except OSError:
                continue
        return out

    def stop(self) -> None:
        for proc in reversed(self.procs):           # the worker first: it stops its executors
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        pytest.skip("the cluster test runs its Spark worker as an unprivileged user it creates with useradd "
                    "(and serves a directory that user cannot read): run it as root, e.g. in CI's container")
    for tool in ("useradd", "userdel", "setpriv", "java"):
        if shutil.which(tool) is None:
            pytest.skip(f"the cluster test needs {tool}")
    if not others_can_enter(SOURCE):
        pytest.skip(f"the executors import txmq from {SOURCE}, which other users cannot reach")
    created = False
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin",
                        USER], check=True)
        created = True
    root = tempfile.mkdtemp(prefix="txmq-cluster-", dir="/tmp")
    os.chmod(root, 0o755)
    c = None
    try:
        c = Cluster(root, relocate_python(root), USER)
        c.start()
        yield c
    finally:
        if c is not None:
            c.stop()
        shutil.rmtree(root, ignore_errors=True)
        if created:
            subprocess.run(["userdel", USER], check=False)


class Serving:
    """``txmq serve DATA --flight`` (as root) on a free port."""

    def __init__(self, data):
        self.port = _free_port()
        self.location = f"grpc://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "txmq.cli", "serve", str(data), "--flight",
                                      f"127.0.0.1:{self.port}"], stderr=subprocess.PIPE, text=True,
                                     env=dict(os.environ, PYTHONPATH=SOURCE))
        line = self.proc.stderr.readline()
        assert "Arrow Flight on " + self.location in line, line + self.proc.stderr.read()
        with open(os.path.join(data, "flight.token")) as f:
            self.token = f.read().strip()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        _, err = self.proc.communicate(timeout=60)
        assert self.proc.returncode == 0, err


def driver(cluster, mode: str, data: str, location: str, token: str, **extra):
    """Start a driver (as root, in its own process group: SIGKILL of the
    group kills its JVM too)."""
    args = dict(master=cluster.master_url, python=cluster.python, pythonpath=SOURCE, flight=location,
                token=token, data=data, **extra)
    env = dict(os.environ, PYSPARK_PYTHON=cluster.python, PYSPARK_DRIVER_PYTHON=cluster.python, PYTHONPATH=SOURCE)
    return subprocess.Popen([cluster.python, DRIVER, mode, json.dumps(args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def finish(proc, timeout: float = 600) -> str:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError("driver timed out\n" + err[-4000:])
    assert proc.returncode == 0, err[-4000:]
    return out


def line_after(out: str, prefix: str) -> str:
    for line in out.splitlines():
        if line.startswith(prefix):
            return line[len(prefix):]
    raise AssertionError(f"no {prefix!r} line in\n{out[-3000:]}")


def test_batch_read_through_flight_is_committed_only(cluster, tmp_path):
    data = tmp_path / "data"
    want = []
    with txmq.Broker(data, fsync="never") as b:
        b.create_topic("orders", 3)
        p = b.producer("orders")
        for part in range(3):
            mids = p.send_batch([b"plain-%d-%d" % (part, i) for i in range(120)], partition=part)
            want += [(m.partition, m.offset, "plain-%d-%d" % (part, i)) for i, m in enumerate(mids)]
        committed, aborted = b.new_transaction(), b.new_transaction()
        for part in range(3):
            mids = p.send_batch([b"C-%d-%d" % (part, i) for i in range(10)], partition=part, txn=committed)
            want += [(m.partition, m.offset, "C-%d-%d" % (part, i)) for i, m in enumerate(mids)]
            p.send_batch([b"A-%d" % i for i in range(10)], partition=part, txn=aborted)
        committed.commit()
        aborted.abort()
    os.chmod(data, 0o700)
    # The owner serves it with a transaction left open on partition 2:
    # it and what follows it there never appear.
    port = _free_port()
    script = ("import sys, time, txmq\n"
              "from txmq.flight import serve_flight\n"
              "b = txmq.Broker(sys.argv[1], fsync='never')\n"
              "p = b.producer('orders')\n"
              "t = b.new_transaction(timeout=600)\n"
              "p.send_batch([b'OPEN'] * 4, partition=2, txn=t)\n"
              "p.send_batch([b'after-open'] * 3, partition=2)\n"
              "late = p.send_batch([b'late-0-%d' % i for i in range(5)], partition=0)\n"
              "s = serve_flight(b, '127.0.0.1', int(sys.argv[2]))\n"
              "print('READY', [m.offset for m in late], flush=True)\n"
              "sys.stdin.read()\n"
              "b.close()\n")
    owner = subprocess.Popen([sys.executable, "-c", script, str(data), str(port)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=SOURCE))
    try:
        ready, late = owner.stdout.readline().split(" ", 1)
        assert ready == "READY"
        want += [(0, off, "late-0-%d" % i) for i, off in enumerate(json.loads(late))]
        token = (data / "flight.token").read_text().strip()
        out = finish(driver(cluster, "read", str(data), f"grpc://127.0.0.1:{port}", token))
    finally:
        owner.stdin.close()
        assert owner.wait(60) == 0
    got = sorted(tuple(r) for r in json.loads(line_after(out, "ROWS ")))
    assert got == sorted(want)
    assert json.loads(line_after(out, "EXECUTOR ")) == [USER, False]     # tasks ran as the other user
    # Given only path, the tasks went through the owner's Flight service by themselves.
    assert sorted(tuple(r) for r in json.loads(line_after(out, "PATH_ROWS "))) == sorted(want)
    failed = line_after(out, "LOCAL_FAILED ")                             # without the fallback they cannot
    assert "DataDirUnreadableError" in failed and f"Permission denied, as user {USER}" in failed, failed
    assert "flight.fallback is false" in failed, failed


def test_streaming_read_restarted_after_the_driver_is_killed(cluster, tmp_path):
    data = tmp_path / "data"
    n = 6000
    with txmq.Broker(data, fsync="never") as b:
        b.create_topic("in", 3)
        b.create_topic("out", 3)
        p = b.producer("in")
        for i in range(0, n, 200):
            with b.transaction() as txn:
                p.send_batch([b"m%d" % j for j in range(i, i + 200)], keys=[b"k%d" % (j % 13) for j in range(i, i + 200)],
                             txn=txn)
        t = b.new_transaction()
        p.send_batch([b"aborted"] * 50, txn=t)            # never copied
        t.abort()
    os.chmod(data, 0o700)
    with Serving(data) as owner:
        location, token = owner.location, owner.token
        ckpt = str(tmp_path / "ckpt")
        ro = txmq.readonly.open(data)

        def written() -> int:
            return sum(len(list(ro.read("out", part, 0))) for part in range(3))

        first = driver(cluster, "stream", str(data), location, token, checkpoint=ckpt, per_trigger=400)
        deadline = time.monotonic() + 300
        while written() == 0:
            assert first.poll() is None, first.stderr.read()[-4000:]
            assert time.monotonic() < deadline, "no micro-batch was written"
            time.sleep(0.2)
        os.killpg(first.pid, signal.SIGKILL)              # the driver and its JVM, mid-stream
        first.wait(30)
        at_kill = written()
        assert 0 < at_kill < n, at_kill
        out = finish(driver(cluster, "stream", str(data), location, token, checkpoint=ckpt, per_trigger=400,
                            drain=True))
        assert "DRAINED" in out
        got = [(m.key, m.value) for part in range(3) for m in ro.read("out", part, 0)]
    assert len(got) == len(set(got)), "a message written twice"
    assert sorted(got) == sorted((b"k%d" % (j % 13), b"m%d!" % j) for j in range(n))


def test_batch_write_with_an_executor_killed_mid_task_commits_once(cluster, tmp_path):
    data = tmp_path / "data"
    rows = 40_000
    with txmq.Broker(data, fsync="never") as b:
        b.create_topic("out", 2)
    os.chmod(data, 0o700)
    marker = os.path.join(cluster.markers, f"write-{os.getpid()}-{time.monotonic_ns()}")
    with Serving(data) as owner:
        proc = driver(cluster, "write", str(data), owner.location, owner.token, rows=rows, marker=marker)
        deadline = time.monotonic() + 300
        while not os.path.exists(marker):
            assert proc.poll() is None, proc.stderr.read()[-4000:]
            assert time.monotonic() < deadline, "the first attempt never sent its first batch"
            time.sleep(0.1)
        executors = cluster.executors()
        assert len(executors) == 1, executors
        os.kill(executors[0], signal.SIGKILL)             # mid-task: a batch of task 0 already sent
        out = finish(proc)
        assert "WRITTEN" in out
    ro = txmq.readonly.open(data)
    got = [m for part in range(2) for m in ro.read("out", part, 0)]
    assert sorted(int(m.value) for m in got) == list(range(rows))         # each row once
    assert len({m.txn_id for m in got}) == 1                               # in one transaction
    assert os.listdir(data / "staging") == []


def test_batch_write_given_only_path_goes_through_flight(cluster, tmp_path):
    data = tmp_path / "data"
    rows = 20_000
    with txmq.Broker(data, fsync="never") as b:
        b.create_topic("out", 2)
    os.chmod(data, 0o700)
    with Serving(data) as owner:
        out = finish(driver(cluster, "write_path", str(data), owner.location, owner.token, rows=rows))
        assert "WRITTEN" in out
    ro = txmq.readonly.open(data)
    got = [m for part in range(2) for m in ro.read("out", part, 0)]
    assert sorted(int(m.value) for m in got) == list(range(rows))         # each row once
    assert len({m.txn_id for m in got}) == 1                               # in one transaction
    assert os.listdir(data / "staging") == []
    assert not (data / "flight.json").exists()                             # the stopped owner unpublished it
