"""A real PostgreSQL server for the tests of txmq.twophase, started by the
test session and stopped with it:

    from postgres_server import postgres  # noqa: F401  (a pytest fixture)

It runs the server binaries of the machine (Debian's ``postgresql``
package: ``initdb`` on the PATH or under /usr/lib/postgresql/<v>/bin;
``.ci/run`` installs the package where it is missing), in a fresh cluster
under a temporary folder, listening on 127.0.0.1 at a free port and on a
Unix socket there, with ``max_prepared_transactions`` set. PostgreSQL
refuses to run as root, so under root the cluster belongs to the
``postgres`` user (or ``nobody``). The server gets SIGTERM when this
process dies, so an interrupted run leaves no server behind. Without
server binaries the tests that need it are skipped, saying so.
"""

from __future__ import annotations

import ctypes
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

PR_SET_PDEATHSIG = 1
START_TIMEOUT = 60.0          # a bound on a cluster starting on a loaded 2-core machine, not a speed check


def server_bin() -> str | None:
    """The folder of ``initdb``, ``pg_ctl`` and ``postgres``, or None."""
    found = shutil.which("initdb")
    if found and os.path.exists(os.path.join(os.path.dirname(os.path.realpath(found)), "postgres")):
        return os.path.dirname(os.path.realpath(found))
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.path.exists(os.path.join(d, "initdb")):
            return d
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    """One cluster: :attr:`conninfo` reaches database ``txmq`` as user ``txmq``."""

    def __init__(self, *, fsync: bool = False):
        self.bin = server_bin()
        if self.bin is None:
            pytest.skip("no PostgreSQL server binaries (install Debian's postgresql; .ci/run does)")
        self.root = tempfile.mkdtemp(prefix="txmq-pg-")
        self.data = os.path.join(self.root, "data")
        self.port = _free_port()
        self.user = None
        if os.geteuid() == 0:
            for name in ("postgres", "nobody"):
                try:
                    self.user = pwd.getpwnam(name)
                    break
                except KeyError:
                    continue
            os.chmod(self.root, 0o755)
            os.chown(self.root, self.user.pw_uid, self.user.pw_gid)
        self._run([os.path.join(self.bin, "initdb"), "-D", self.data, "-U", "txmq", "-A", "trust", "--no-sync",
                   "-E", "UTF8"])
        settings = ["-c", "listen_addresses=127.0.0.1", "-c", f"port={self.port}",
                    "-c", f"unix_socket_directories={self.root}", "-c", "max_prepared_transactions=64",
                    "-c", "max_connections=100", "-c", f"fsync={'on' if fsync else 'off'}",
                    "-c", "logging_collector=off"]
        self.log = open(os.path.join(self.root, "server.log"), "wb")
        self.proc = subprocess.Popen([os.path.join(self.bin, "postgres"), "-D", self.data] + settings,
                                     stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=self._as_owner)
        self.conninfo = f"host=127.0.0.1 port={self.port} user=txmq dbname=txmq"
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"PostgreSQL exited: {self._log_tail()}")
            done = subprocess.run([os.path.join(self.bin, "psql"), "-h", "127.0.0.1", "-p", str(self.port),
                                   "-U", "txmq", "-d", "postgres", "-c", "CREATE DATABASE txmq"],
                                  capture_output=True)
            if done.returncode == 0:
                break
            assert time.monotonic() < deadline, f"PostgreSQL did not start: {self._log_tail()}"
            time.sleep(0.2)

    def _as_owner(self) -> None:
        """In the child: drop root for the cluster's owner, and die with us."""
        if self.user is not None:
            os.setgid(self.user.pw_gid)
            os.setuid(self.user.pw_uid)
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    def _run(self, argv) -> None:
        done = subprocess.run(argv, capture_output=True, preexec_fn=self._as_owner)
        if done.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed: {done.stderr.decode()[-2000:]}")

    def _log_tail(self) -> str:
        with open(os.path.join(self.root, "server.log"), "rb") as f:
            return f.read()[-2000:].decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)        # fast shutdown
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres():
    server = PostgresServer()
    yield server
    server.stop()
