"""The client side of txmq's Flight service: what the Spark source and
sink run in the driver and in executors (docs/SPARK_CLUSTER.md).

A :class:`FlightTarget` (location, token, TLS roots) is plain data, so it
travels in Spark's pickled readers and writers; :func:`connect` gives the
:class:`FlightConnection` of a target, one per process (a Spark Python
worker runs many tasks; the gRPC channel is opened once).

Errors the server answers with a txmq error's name are raised again as
that :mod:`txmq.errors` class (``TopicNotFoundError``, ``DataLossError``,
``InvalidArgumentError``, ...), the Flight error as its cause; others
(UNAUTHENTICATED, UNAVAILABLE) stay pyarrow's Flight errors. A job's
last steps, which take effect once however often they are sent (a commit
with a sink key, an abort, ``last_batch``), are sent again while the
server is unavailable (an owner restarting), up to ``retry_s``; reads and
plans fail at once, and Spark retries the task or the query fails.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.flight as flight

from txmq import errors
from txmq.errors import InvalidArgumentError, TxmqError
from txmq.flight import wire
from txmq.requester.read_only_directory import writer_pid

__all__ = ["FlightTarget", "FlightConnection", "connect", "raise_txmq_error", "published_target"]

ACTION_TIMEOUT_S = 120.0
RETRY_S = 120.0
_RETRY_PAUSE_S = 0.5
_SCHEMES = ("grpc", "grpc+tcp", "grpc+tls")
_CLASS = re.compile(r"^(\w+): ")
_TAIL = re.compile(r"\. (Detail: |gRPC client debug context: ).*", re.S)


@dataclass(frozen=True)
class FlightTarget:
    """Where a txmq Flight service is and how to prove who we are:
    ``location`` ``grpc://host:port`` (or ``grpc+tls://``), ``token`` the
    owner's bearer token, ``tls_roots`` PEM bytes of the certificates to
    trust (None: the system's)."""

    location: str
    token: str
    tls_roots: bytes | None = None

    def __post_init__(self):
        scheme, sep, rest = self.location.partition("://")
        if not sep or scheme not in _SCHEMES or not re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[^:/\[\]]+):\d{1,5}", rest):
            raise InvalidArgumentError("flight", self.location, "grpc://HOST:PORT or grpc+tls://HOST:PORT")
        wire.check_token(self.token, "flight token")

    def __repr__(self) -> str:          # never show the token
        return f"FlightTarget({self.location!r})"


def published_target(data_dir) -> tuple:
    """``(FlightTarget, None)`` of the Flight service serving ``data_dir``
    now, from its ``flight.json`` and ``flight.token`` (read here: the
    caller can open the directory), or ``(None, why not)``. The file is
    taken only while the process that wrote it still owns the directory
    (a service that died leaves it behind), and the token only when its
    digest is the one the service checks (a service given a token of its
    own, ``serve_flight(token=...)``, cannot be found this way). The first
    published location is used."""
    where = wire.address_path(data_dir)
    try:
        published = wire.read_published(data_dir)
    except (OSError, InvalidArgumentError) as e:
        return None, f"{where} cannot be read ({e})"
    if published is None:
        return None, f"no Flight service serves it ({where} does not exist)"
    owner = writer_pid(data_dir)
    if owner is None or owner not in (0, published["pid"]):
        return None, (f"the Flight service in {where} (pid {published['pid']}) is gone: "
                      + ("no process owns the directory" if owner is None else f"pid {owner} owns it now"))
    try:
        with open(wire.token_path(data_dir)) as f:
            token = f.read().strip()
    except OSError as e:
        return None, f"the Flight token {wire.token_path(data_dir)} cannot be read here ({e.strerror or e})"
    if wire.token_digest(token) != published["token_sha256"]:
        return None, (f"the Flight service in {where} checks a token of its own, not "
                      f"{wire.token_path(data_dir)}: give option('flight', ...) with its token")
    try:
        return FlightTarget(published["locations"][0], token), None
    except InvalidArgumentError as e:
        return None, f"{where}: {e}"


def raise_txmq_error(e: Exception):
    """Raise the txmq error a Flight error names (see the module
    docstring), else ``e`` itself."""
    message = _TAIL.sub("", str(e)).strip()
    if message.startswith("'") and message.endswith("'"):
        message = message[1:-1]               # a KeyError's repr
    m = _CLASS.match(message)
    cls = getattr(errors, m.group(1), None) if m else None
    if not (isinstance(cls, type) and issubclass(cls, TxmqError)):
        raise e
    err = TxmqError.__new__(cls)
    TxmqError.__init__(err, message[m.end():])
    raise err from e


class FlightConnection:
    """One gRPC channel to a txmq Flight service and the calls the Spark
    source and sink make on it (thread-safe)."""

    def __init__(self, target: FlightTarget, *, retry_s: float = RETRY_S):
        self.target = target
        self.retry_s = retry_s
        kwargs = {"tls_root_certs": target.tls_roots} if target.tls_roots else {}
        self.client = flight.FlightClient(target.location, **kwargs)
        headers = [(wire.AUTH_HEADER.encode(), (wire.BEARER + target.token).encode())]
        self._stream_options = flight.FlightCallOptions(headers=headers)
        self._action_options = flight.FlightCallOptions(headers=headers, timeout=ACTION_TIMEOUT_S)

    # -- reads -------------------------------------------------------------------------

    def plan(self, options: dict) -> list:
        """The tickets (:class:`wire.Ticket`) of a batch read with the Spark
        source's ``options`` (no ``path``): one per planned range."""
        descriptor = flight.FlightDescriptor.for_command(wire.encode({"read": dict(options)}))
        info = self._call(lambda: self.client.get_flight_info(descriptor, self._action_options), retry=False)
        return [wire.Ticket.decode(e.ticket.ticket) for e in info.endpoints]

    def offsets(self, options: dict, at: str) -> dict:
        """A streaming read's offsets (``at`` "initial" or "current", see
        :data:`txmq.flight.wire.ACTIONS`)."""
        got = self.action("offsets", {"read": dict(options), "at": at})["offsets"]
        return got if at == "initial" else {k: tuple(v) for k, v in got.items()}

    def read(self, ticket: wire.Ticket):
        """The record batches of one planned range, as the server streams
        them."""
        try:
            reader = self.client.do_get(flight.Ticket(ticket.encode()), self._stream_options)
            while True:
                try:
                    chunk = reader.read_chunk()
                except StopIteration:
                    return
                if chunk.data is not None:
                    yield chunk.data
        except (flight.FlightError, pa.ArrowException) as e:
            raise_txmq_error(e)

    # -- writes ------------------------------------------------------------------------

    def stage(self, job: str, attempt: str, topic: str, batches) -> dict:
        """Stage one write attempt: every batch of ``batches`` (an iterator
        of RecordBatches with the sink's columns), then the attempt is
        complete on the owner. Returns ``{"attempt", "messages"}``."""
        batches = iter(batches)
        first = next(batches, None)
        schema = first.schema if first is not None else pa.schema([("value", pa.binary())])
        descriptor = flight.FlightDescriptor.for_command(
            wire.encode({"stage": {"job": job, "attempt": attempt, "topic": topic}}))
        try:
            writer, reader = self.client.do_put(descriptor, schema, self._stream_options)
            try:
                if first is not None:
                    writer.write_batch(first)
                    for batch in batches:
                        writer.write_batch(batch)
                writer.done_writing()
                answer = reader.read()
            finally:
                writer.close()          # raises the error the server answered, if any
        except (flight.FlightError, pa.ArrowException) as e:
            raise_txmq_error(e)
        if answer is None:
            raise errors.StagingError(f"the Flight service staged {job}/{attempt} without an answer")
        return json.loads(answer.to_pybytes())

    def commit(self, job: str, attempts, sink=None) -> dict:
        """Ingest the listed attempts as one transaction (retried while the
        server is unavailable only with a ``sink`` key, which makes it
        happen once)."""
        return self.action("commit", {"job": job, "attempts": list(attempts),
                                      "sink": None if sink is None else list(sink)}, retry=sink is not None)

    def abort(self, job: str, tombstone: bool = True) -> None:
        self.action("abort", {"job": job, "tombstone": tombstone}, retry=True)

    def last_batch(self, sink: str) -> int:
        return self.action("last_batch", {"sink": sink}, retry=True)["batch_id"]

    def topic_partitions(self, topic: str) -> int:
        return self.action("topic", {"topic": topic})["partitions"]

    # -- plumbing ----------------------------------------------------------------------

    def action(self, name: str, body: dict, *, retry: bool = False) -> dict:
        """One DoAction: its single result's JSON."""
        def run():
            results = list(self.client.do_action(flight.Action(name, wire.encode(body)), self._action_options))
            if len(results) != 1:
                raise errors.TxmqError(f"flight action {name!r} answered {len(results)} results, not 1")
            return json.loads(results[0].body.to_pybytes())
        return self._call(run, retry=retry)

    def _call(self, fn, *, retry: bool):
        deadline = time.monotonic() + self.retry_s
        while True:
            try:
                return fn()
            except flight.FlightUnavailableError:
                if not retry or time.monotonic() > deadline:
                    raise
                time.sleep(_RETRY_PAUSE_S)
            except (flight.FlightError, pa.ArrowException) as e:
                raise_txmq_error(e)

    def close(self) -> None:
        self.client.close()


_connections: dict = {}
_lock = threading.Lock()


def connect(target: FlightTarget) -> FlightConnection:
    """The connection of this process to ``target`` (made on first use; a
    forked child makes its own)."""
    key = (os.getpid(), target)
    with _lock:
        conn = _connections.get(key)
        if conn is None:
            conn = _connections[key] = FlightConnection(target)
        return conn
