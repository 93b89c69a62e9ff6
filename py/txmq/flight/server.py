"""The owner's Arrow Flight service: Spark executors (and any Flight
client) that cannot open the data directory read and write it over the
network with every guarantee of the local path (docs/SPARK_CLUSTER.md,
docs/GUARANTEES.md).

Started by :func:`txmq.flight.serve_flight`. What each call does (the
bytes are in :mod:`txmq.flight.wire` and docs/FORMAT.md):

- ``GetFlightInfo`` plans a batch read exactly as the local Spark source
  plans it (:func:`txmq.requester.read_plan.plan`): every range's end is fixed now
  (the last stable offset under ``read_committed``, the log end
  otherwise); one endpoint per range, its ticket the range. Endpoints name
  no location: read them from this server.
- ``DoGet`` checks the range against the partition as it is (retention,
  a shorter log) and streams its committed record batches, built by
  :func:`txmq.requester.read_plan.read_split` over the owner's segments mapped
  read-only: key and value columns are views of the mapping, sent without
  re-encoding.
- ``DoPut`` stages one write attempt
  (:class:`txmq.requester.staged_ingest.StagedWriter`) under ``<data>/staging/<job>/<attempt>/``; the ``commit`` action
  ingests a job's listed attempts as one transaction, once per sink key
  and batch id (:meth:`txmq.Broker.ingest_staged`), as the control socket
  does for local writers; ``abort`` discards a job.

Every call must carry ``authorization: Bearer <token>`` (else
UNAUTHENTICATED). txmq errors become Flight's codes: a topic, partition
or planned offsets that are not there NOT_FOUND (``ArrowKeyError`` in
pyarrow), a bad request INVALID_ARGUMENT (``ArrowInvalid``), other txmq
errors FAILED (``FlightServerError``); the message starts with the txmq
error's class name so that :mod:`txmq.flight.client` raises it again.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import json
import logging
import socket
import threading

import pyarrow as pa
import pyarrow.flight as flight

from txmq.errors import (BrokerClosedError, DataLossError, InvalidArgumentError, PartitionNotFoundError,
                         TopicNotFoundError, TxmqError)
from txmq.flight import wire
from txmq.requester import arrow_scan, read_only_directory, staged_ingest
from txmq.requester.read_plan import (ReadOptions, current_offsets, initial_offsets, parse_read_options, plan,
                                      read_split)
from txmq.storage.staging import topic_partitions

log = logging.getLogger("txmq.flight")

STOP_WAIT_S = 10.0           # how long stop() waits for calls in flight before leaving them
NOT_FOUND = (TopicNotFoundError, PartitionNotFoundError, DataLossError)


def flight_error(e: TxmqError) -> Exception:
    """The Flight error a txmq error is answered with (module docstring)."""
    message = f"{type(e).__name__}: {e}"
    if isinstance(e, NOT_FOUND):
        return pa.ArrowKeyError(message)
    if isinstance(e, ValueError):
        return pa.ArrowInvalid(message)
    if isinstance(e, BrokerClosedError):
        return flight.FlightUnavailableError(message)
    return flight.FlightServerError(message)


@contextlib.contextmanager
def _answering():
    """Turn txmq errors into Flight errors; log anything unexpected."""
    try:
        yield
    except TxmqError as e:
        raise flight_error(e) from None
    except (flight.FlightError, pa.ArrowException):
        raise
    except Exception as e:                     # noqa: BLE001 - answered, not lost
        log.exception("flight call failed")
        raise flight.FlightInternalError(f"{type(e).__name__}: {e}") from None


class _BearerAuth(flight.ServerMiddlewareFactory):
    """Rejects a call without ``authorization: Bearer <token>``."""

    def __init__(self, token: str):
        super().__init__()
        self._expected = (wire.BEARER + token).encode()

    def start_call(self, info, headers):
        values = headers.get(wire.AUTH_HEADER) or []
        given = values[0] if len(values) == 1 else ""
        if isinstance(given, str):
            given = given.encode("utf-8", "replace")
        if not hmac.compare_digest(given, self._expected):
            raise flight.FlightUnauthenticatedError(
                "txmq: missing or wrong 'authorization: Bearer <token>' header "
                f"(the token is in the data directory's {wire.TOKEN_FILE})")
        return None


class _Directory:
    """The owner's directory read as every reader reads it
    (:mod:`txmq.requester.read_only_directory`); views are built one at a time (a view caches
    mappings), batches are read from them concurrently."""

    def __init__(self, path: str):
        self._ro = read_only_directory.open(path)
        self._lock = threading.Lock()

    def view(self, topic: str, partition: int):
        with self._lock:
            return self._ro.view(topic, partition)

    def topics(self) -> list:
        return self._ro.topics()

    def partitions(self, topic: str) -> list:
        return self._ro.partitions(topic)

    def close(self) -> None:
        with self._lock:
            self._ro.close()


def _location(host: str, port: int, tls: bool) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"{'grpc+tls' if tls else 'grpc'}://{shown}:{port}"


class FlightService(flight.FlightServerBase):
    """A running Flight service of one broker (module docstring). Listens
    from construction; :meth:`stop` (or the broker's ``close()``) ends it.

    ``port`` is the bound port (pass 0 for a free one), ``location`` the
    URI clients connect to, ``locations`` every URI it is published under
    in ``<data>/flight.json`` (this host's name first for a wildcard
    bind, then ``location``), ``token`` the bearer token. The file is
    written when the service listens and removed when it stops.
    """

    def __init__(self, broker, host: str = "127.0.0.1", port: int = wire.DEFAULT_PORT, *, tls=None,
                 token: str | None = None):
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise InvalidArgumentError("port", port, "an int from 0 to 65535")
        if not isinstance(host, str) or not host:
            raise InvalidArgumentError("host", host, "a host name or address to bind")
        certificates = None
        if tls is not None:
            if not (isinstance(tls, (tuple, list)) and len(tls) == 2):
                raise InvalidArgumentError("tls", tls, "(certificate PEM path, private key PEM path)")
            with open(tls[0], "rb") as f:
                cert = f.read()
            with open(tls[1], "rb") as f:
                key = f.read()
            certificates = [(cert, key)]
        self.token = wire.check_token(token) if token is not None else wire.load_or_create_token(broker.path)
        self.broker = broker
        self.host = host
        self.tls = tls is not None
        self._dir = _Directory(broker.path)
        self._stopped = False
        self._stop_lock = threading.Lock()
        try:
            super().__init__(_location(host, port, self.tls), tls_certificates=certificates,
                             middleware={"auth": _BearerAuth(self.token)})
        except pa.ArrowException as e:
            self._dir.close()
            # gRPC says no more than this; its own log line on stderr has the cause.
            why = "the port is in use, or the host is not an address of this machine"
            if certificates:
                why += ", or the TLS certificate and key are not a matching PEM pair"
            raise OSError(errno.EADDRNOTAVAIL, f"cannot listen on {host}:{port} for Arrow Flight ({why}): {e}") \
                from None
        wildcard = host in ("0.0.0.0", "::", "")
        self.location = _location("127.0.0.1" if wildcard else host, self.port, self.tls)
        # Where it listens, for Spark jobs given only the path (docs/FORMAT.md,
        # flight.json): a wildcard bind is reached by this host's name first.
        self.locations = ([_location(socket.getfqdn(), self.port, self.tls)] if wildcard else []) + [self.location]
        try:
            self._published = wire.publish(broker.path, self.locations, self.token)
        except BaseException:
            self.shutdown()
            self._dir.close()
            raise

    # -- reads -------------------------------------------------------------------------

    def _read_options(self, obj: dict, what: str, streaming: bool) -> ReadOptions:
        return parse_read_options(wire.read_options(obj, what), streaming, path=self.broker.path)

    def _check_running(self) -> None:
        if self._stopped or self.broker.closed:
            raise BrokerClosedError(f"the Flight service of {self.broker.path} is stopping")

    def get_flight_info(self, context, descriptor):
        with _answering():
            self._check_running()
            opts = self._command_read(descriptor)
            endpoints = [flight.FlightEndpoint(wire.Ticket.of(s, opts).encode(), [])
                         for s in plan(opts, self._dir)]
            return flight.FlightInfo(arrow_scan.arrow_schema(opts.include_headers, "us"), descriptor, endpoints,
                                     -1, -1)

    def get_schema(self, context, descriptor):
        with _answering():
            opts = self._command_read(descriptor)
            return flight.SchemaResult(arrow_scan.arrow_schema(opts.include_headers, "us"))

    def _command_read(self, descriptor) -> ReadOptions:
        if descriptor.descriptor_type != flight.DescriptorType.CMD:
            raise InvalidArgumentError("descriptor", descriptor.path, 'a command {"v": 1, "read": {options}}')
        return self._read_options(wire.decode("command", descriptor.command), "command", False)

    def do_get(self, context, ticket):
        with _answering():
            self._check_running()
            t = wire.Ticket.decode(ticket.ticket)
            opts = ReadOptions(path=self.broker.path, isolation=t.isolation, include_headers=t.include_headers,
                               fail_on_data_loss=t.fail_on_data_loss, out_of_order=t.out_of_order)
            if t.isolation not in ("read_committed", "read_uncommitted"):
                raise InvalidArgumentError("ticket.isolation", t.isolation, "read_committed | read_uncommitted")
            batches = read_split(opts, t, self._dir)      # checks the range before the first batch
            return flight.GeneratorStream(arrow_scan.arrow_schema(t.include_headers, "us"), self._stream(batches))

    def _stream(self, batches):
        with _answering():
            for batch in batches:
                if self._stopped:
                    raise BrokerClosedError("the Flight service stopped during the read")
                yield batch

    # -- writes ------------------------------------------------------------------------

    def do_put(self, context, descriptor, reader, writer):
        with _answering():
            self._check_running()
            if descriptor.descriptor_type != flight.DescriptorType.CMD:
                raise InvalidArgumentError("descriptor", descriptor.path, 'a command {"v": 1, "stage": {...}}')
            stage = wire.field(wire.decode("command", descriptor.command), "command", "stage", dict)
            job = wire.field(stage, "stage", "job", str)
            attempt = wire.field(stage, "stage", "attempt", str)
            topic = wire.field(stage, "stage", "topic", str)
            topic_partitions(self.broker.path, topic)      # TopicNotFoundError before anything
            staged_ingest.check_sink_schema(reader.schema)        # the sink's columns, before anything
            staged = staged_ingest.StagedWriter(self.broker.path, job, attempt, topic)
            try:
                while True:
                    try:
                        chunk = reader.read_chunk()
                    except StopIteration:
                        break
                    if chunk.data is not None:
                        staged.write_arrow(chunk.data)
                    if self._stopped:
                        raise BrokerClosedError("the Flight service stopped during the write")
                result = staged.close()
            except BaseException:
                staged.abort()
                raise
            writer.write(pa.py_buffer(json.dumps(result).encode()))

    # -- actions -----------------------------------------------------------------------

    def list_actions(self, context):
        return [(name, f"body {body} -> {result}") for name, (body, result) in wire.ACTIONS.items()]

    def do_action(self, context, action):
        with _answering():
            self._check_running()
            handler = getattr(self, "_action_" + action.type, None) if action.type in wire.ACTIONS else None
            if handler is None:
                raise InvalidArgumentError("action", action.type, " | ".join(wire.ACTIONS))
            body = wire.decode(f"{action.type} body", action.body.to_pybytes() if action.body else b"")
            return [json.dumps(handler(body, action.type)).encode()]

    def _action_offsets(self, body: dict, what: str) -> dict:
        opts = self._read_options(body, what, True)
        at = wire.field(body, what, "at", str)
        if at == "initial":
            return {"offsets": initial_offsets(opts, self._dir)}
        if at == "current":
            return {"offsets": {k: list(v) for k, v in current_offsets(opts, self._dir).items()}}
        raise InvalidArgumentError(f"{what}.at", at, "initial | current")

    def _action_topic(self, body: dict, what: str) -> dict:
        return {"partitions": topic_partitions(self.broker.path, wire.field(body, what, "topic", str))}

    def _action_commit(self, body: dict, what: str) -> dict:
        job = wire.field(body, what, "job", str)
        attempts = wire.field(body, what, "attempts", list)
        sink = wire.field(body, what, "sink", list, optional=True)
        if not all(isinstance(a, str) for a in attempts):
            raise InvalidArgumentError(f"{what}.attempts", attempts, "a list of attempt names")
        if sink is not None and (len(sink) != 2 or not isinstance(sink[0], str) or type(sink[1]) is not int):
            raise InvalidArgumentError(f"{what}.sink", sink, "[key, batch id] or null")
        return self.broker.ingest_staged(job, attempts, sink)

    def _action_abort(self, body: dict, what: str) -> dict:
        staged_ingest.abort(self.broker.path, wire.field(body, what, "job", str),
                     tombstone=wire.field(body, what, "tombstone", bool))
        return {}

    def _action_last_batch(self, body: dict, what: str) -> dict:
        return {"batch_id": self.broker.sink_batch_id(wire.field(body, what, "sink", str))}

    # -- lifecycle ---------------------------------------------------------------------

    def stop(self, timeout: float = STOP_WAIT_S) -> None:
        """Stop listening and end the calls in flight (reads and writes end
        at their next batch); waits up to ``timeout`` seconds for them."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        wire.unpublish(self.broker.path, self._published)       # no new job finds it
        done = threading.Thread(target=self.shutdown, name="txmq-flight-stop", daemon=True)
        done.start()
        done.join(timeout)
        if done.is_alive():
            log.warning("flight: calls still running %.0f s after stop; left to end on their own", timeout)
        self._dir.close()
        self.broker.detach(self)

    @property
    def stopped(self) -> bool:
        return self._stopped

    def __repr__(self) -> str:
        return f"FlightService({self.location!r}, {self.broker.path!r})"


def serve_flight(broker, host: str = "127.0.0.1", port: int = wire.DEFAULT_PORT, *, tls=None,
                 token: str | None = None) -> FlightService:
    """Serve ``broker`` (an open :class:`txmq.Broker`) over Arrow Flight
    (docs/SPARK_CLUSTER.md) for Spark executors and other clients that
    cannot open the data directory: planned reads (``GetFlightInfo`` /
    ``DoGet``), staged writes (``DoPut``) and their commit as one
    transaction. Returns the running :class:`FlightService` (``.port``,
    ``.location``, ``.token``; ``port=0`` takes a free port), attached to
    the broker: ``service.stop()`` stops it, ``broker.close()`` stops every
    attached service first.

    Binds ``host`` (127.0.0.1 unless told otherwise). ``tls`` =
    (certificate PEM path, private key PEM path) serves ``grpc+tls``. Every
    call must carry ``authorization: Bearer <token>``: ``token``, or by
    default the one in ``<data>/flight.token`` (created, mode 0600, when
    missing). Raises ``OSError`` when the address cannot be bound or the
    certificate not read, :class:`~txmq.errors.BrokerClosedError` if the
    broker is closed."""
    broker._check_open()
    service = FlightService(broker, host, port, tls=tls, token=token)
    try:
        broker.attach(service)
    except BaseException:
        service.stop()
        raise
    return service
