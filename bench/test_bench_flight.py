"""``DoGet`` of one partition with a raw pyarrow Flight client against
reading the same record batches with ``txmq.readonly`` in the reader's own
process.

The data is the Spark scan's (scan_data.py: 5,000,000 messages of a
16-byte key and a 100-byte value in one partition, on-disk batches of
10,000). The owner is ``txmq serve DIR --flight 127.0.0.1:0`` in a process
of its own, as a cluster's would be; the client asks for the one ticket of
the whole partition (read_committed) and reads every batch. The local side
reads the same range with ``ReadOnlyDirectory.read_arrow`` (timestamps in
microseconds, as Flight sends them).

A local batch is a view of the mapped segment: building it touches no
message byte, so "reading" it costs next to nothing while DoGet must move
every byte through a socket. The comparison with a goal therefore makes
both sides use what they read, the same way: a CRC-32C (hardware) over
every batch's key and value bytes. The untouched comparison is reported
for information. Goal: DoGet >= 0.5x the local read.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import numpy as np
import pyarrow.flight as flight
import pytest

import conftest
import txmq.readonly
from scan_data import MESSAGES, TOPIC, build_scan_topic
from test_bench_producers import alternate
from txmq._log import crc32c_of
from txmq.flight import wire

ROUNDS, WARMUP = 10, 2
GROUP = "flight_doget"
GROUP_UNTOUCHED = "flight_doget_untouched"
conftest.add_comparison(GROUP, conftest.Comparison(
    "DoGet of 1 partition (5M x 116 B), raw pyarrow client vs txmq.readonly, bytes used (CRC-32C)",
    "doget", "readonly", 0.5, ">=", note="goal >= 0.5x the local read of the same batches"))
conftest.add_comparison(GROUP_UNTOUCHED, conftest.Comparison(
    "DoGet of 1 partition vs txmq.readonly, batches only (local views touch no byte)",
    "doget", "readonly", None, ">=", note="for information: a local batch is a view of the mapping"))


@contextlib.contextmanager
def flight_owner(path):
    """``txmq serve PATH --flight 127.0.0.1:0`` in its own process: yields
    (location, token) and stops it after."""
    proc = subprocess.Popen([sys.executable, "-m", "txmq.cli", "serve", str(path), "--flight", "127.0.0.1:0"],
                            stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    try:
        line = proc.stderr.readline()
        assert "Arrow Flight on grpc://" in line, line + proc.stderr.read()
        location = line.split(" on ", 1)[1].split()[0]
        with open(os.path.join(path, wire.TOKEN_FILE)) as f:
            token = f.read().strip()
        yield location, token
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    data = tmp_path_factory.mktemp("flight_doget") / "data"
    build_scan_topic(data)
    os.sync()
    with flight_owner(data) as (location, token):
        yield str(data), location, token


def _crc(batch) -> None:
    for col in (0, 1):                       # key, value
        crc32c_of(np.frombuffer(batch.column(col).buffers()[2], np.uint8))


def _sides(served, touch: bool):
    data, location, token = served
    client = flight.FlightClient(location)
    options = flight.FlightCallOptions(headers=[(b"authorization", b"Bearer " + token.encode())])
    ticket = flight.Ticket(wire.Ticket(TOPIC, 0, 0, MESSAGES).encode())
    ro = txmq.readonly.open(data)

    def doget():
        n = 0
        for chunk in client.do_get(ticket, options):
            n += chunk.data.num_rows
            if touch:
                _crc(chunk.data)
        assert n == MESSAGES

    def local():
        n = 0
        for batch in ro.read_arrow(TOPIC, 0, 0, MESSAGES, timestamp_unit="us"):
            n += batch.num_rows
            if touch:
                _crc(batch)
        assert n == MESSAGES

    return ("readonly", local), ("doget", doget)


def test_doget_vs_readonly(measure, benchmark, results, served):
    alternate(measure, benchmark, results, GROUP, *_sides(served, True), ops_per_round=MESSAGES, unit="msg",
              rounds=ROUNDS, warmup=WARMUP)


def test_doget_vs_readonly_untouched(measure, benchmark, results, served):
    alternate(measure, benchmark, results, GROUP_UNTOUCHED, *_sides(served, False), ops_per_round=MESSAGES,
              unit="msg", rounds=ROUNDS, warmup=WARMUP)
