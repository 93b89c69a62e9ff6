"""The Kafka protocol server: asyncio (uvloop where installed) in a thread
of its own, in front of one :class:`txmq.Broker`. Each connection's bytes
are cut into request frames by :class:`Framer`, which receives a large
request straight into a buffer of its own.

Each connection reads one request at a time and answers it before reading
the next, as a Kafka broker does (a client pipelines; the answers keep its
order). Work that blocks (appends, syncs, transaction ends) runs in a small
thread pool, so one slow disk write never stalls the other connections;
group coordination runs on the event loop.

Abuse never costs more than the connection it came on: a frame over
``max_request_bytes`` or one that does not decode is logged (one line)
and the connection closed; a connection silent for ``idle_timeout``
seconds is closed; an API key or version not served is answered with
UNSUPPORTED_VERSION. A handler's unexpected exception is logged in one
line and closes that connection; acknowledged data is never touched.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import os
import threading
import time

from txmq.errors import InvalidArgumentError, KafkaProtocolError
from txmq.kafka import protocol
from txmq.kafka.auth import Users
from txmq.kafka.handlers import Handlers
from txmq.kafka.protocol import Error

log = logging.getLogger("txmq.kafka")

DEFAULT_PORT = 9092
MAX_REQUEST_BYTES = 100 * 1024 * 1024      # Kafka's socket.request.max.bytes
IDLE_TIMEOUT = 600.0                       # Kafka's connections.max.idle.ms
BLOCKING_THREADS = 4
FAILED_AUTHENTICATION_DELAY = 0.1          # s, Kafka's connection.failed.authentication.delay.ms


class KafkaServer:
    """Serves a broker over Kafka's protocol until :meth:`stop` (or the
    broker's ``close()``). Create it with :func:`txmq.kafka.serve_kafka`.

    ``port`` 0 takes a free port; :attr:`port` tells which. ``host`` is
    bound as given (127.0.0.1 by default); ``advertised_host`` is the host
    clients are told to connect to (default: ``host``, or 127.0.0.1 for a
    wildcard bind). ``auto_create_topics`` creates a topic a client
    produces to or asks metadata for (Kafka's default) with
    ``default_partitions`` partitions. ``users_file`` turns on SASL
    (PLAIN, SCRAM-SHA-256) and per-user topic ACLs (:mod:`txmq.kafka.auth`):
    a connection must then authenticate before any request but ApiVersions.
    """

    def __init__(self, broker, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *,
                 advertised_host: str | None = None, auto_create_topics: bool = True,
                 default_partitions: int = 1, max_request_bytes: int = MAX_REQUEST_BYTES,
                 idle_timeout: float = IDLE_TIMEOUT, users_file=None):
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise InvalidArgumentError("port", port, "an int from 0 to 65535")
        if not isinstance(max_request_bytes, int) or max_request_bytes < 1024:
            raise InvalidArgumentError("max_request_bytes", max_request_bytes, "an int >= 1024")
        if not isinstance(default_partitions, int) or not 1 <= default_partitions <= 10_000:
            raise InvalidArgumentError("default_partitions", default_partitions, "an int from 1 to 10000")
        self.broker = broker
        self.host = host
        self.port = port
        self.advertised_host = advertised_host or (host if host not in ("", "0.0.0.0", "::") else "127.0.0.1")
        self.auto_create_topics = auto_create_topics
        self.default_partitions = default_partitions
        self.max_request_bytes = max_request_bytes
        self.idle_timeout = idle_timeout
        self.users = None if users_file is None else Users.load(users_file)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(BLOCKING_THREADS, thread_name_prefix="txmq-kafka")
        self._server = None
        self._thread = None
        self._connections: set = set()
        self._stopped = False
        self._stop_lock = threading.Lock()
        self.handlers = Handlers(self)
        self.stats = {"connections": 0, "requests": 0, "errors": 0}

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> "KafkaServer":
        """Bind and serve in a background thread; returns once listening
        (raises ``OSError`` when the address cannot be bound)."""
        ready = threading.Event()
        failure = []

        def run():
            loop = _new_loop()
            asyncio.set_event_loop(loop)
            self.loop = loop
            try:
                self._server = loop.run_until_complete(
                    loop.create_server(lambda: Framer(self), self.host, self.port, reuse_address=True))
            except BaseException as e:
                failure.append(e)
                ready.set()
                loop.close()
                return
            self.port = self._server.sockets[0].getsockname()[1]
            self.handlers.start()
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self._shutdown())
                loop.close()

        self._thread = threading.Thread(target=run, name=f"txmq-kafka-{self.port}", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._pool.shutdown(wait=False)
            raise failure[0]
        log.info("txmq: serving %s over Kafka's protocol on %s:%d", self.broker.path, self.host, self.port)
        return self

    async def _shutdown(self) -> None:
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        self.handlers.stop()
        await self._server.wait_closed()

    def stop(self) -> None:
        """Stop listening, close every connection, wait for requests in
        progress to end. Idempotent; the broker stays open."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        if self.loop is not None and self._thread is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
        self._pool.shutdown(wait=True)
        self.broker.detach(self)

    close = stop

    @property
    def stopped(self) -> bool:
        return self._stopped

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def __repr__(self) -> str:
        return f"KafkaServer({self.host}:{self.port}, {'stopped' if self._stopped else 'serving'})"

    # -- work ----------------------------------------------------------------------------------

    async def blocking(self, fn, *args):
        """Run ``fn(*args)`` in the server's thread pool."""
        return await self.loop.run_in_executor(self._pool, fn, *args)

    async def _connection(self, framer: "Framer") -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        self.stats["connections"] += 1
        peer = framer.transport.get_extra_info("peername")
        conn = Connection(peer)
        try:
            await self._serve(conn, framer)
        except asyncio.CancelledError:
            pass
        except ConnectionError:
            pass                                    # the client went away: nothing to say
        except KafkaProtocolError as e:
            self.stats["errors"] += 1
            log.warning("txmq.kafka: %s: malformed request, connection closed: %s", _peer(peer), e)
        except Exception as e:                     # one line per connection problem
            self.stats["errors"] += 1
            log.warning("txmq.kafka: %s: %s: %s; connection closed", _peer(peer), type(e).__name__, e,
                        exc_info=log.isEnabledFor(logging.DEBUG))
        finally:
            self._connections.discard(task)
            self.handlers.connection_closed(conn)
            framer.transport.close()

    async def _serve(self, conn, framer: "Framer") -> None:
        while True:
            try:
                frame = await asyncio.wait_for(framer.next_frame(), self.idle_timeout)
            except asyncio.TimeoutError:
                log.info("txmq.kafka: %s: idle for %.0f s, connection closed", _peer(conn.peer),
                         self.idle_timeout)
                return
            if frame is None:
                if framer.refused_size is not None:
                    self.stats["errors"] += 1
                    log.warning("txmq.kafka: %s: request of %d bytes (limit %d), connection closed",
                                _peer(conn.peer), framer.refused_size, self.max_request_bytes)
                elif framer.partial_prefix:
                    log.warning("txmq.kafka: %s: connection closed inside a size prefix", _peer(conn.peer))
                return
            req = protocol.decode_request(frame)
            conn.client_id = req.client_id
            self.stats["requests"] += 1
            if self.users is not None and conn.user is None and req.api_key not in protocol.BEFORE_AUTHENTICATION:
                self.stats["errors"] += 1
                log.warning("txmq.kafka: %s: api key %d before authenticating (SASL is required), "
                            "connection closed", _peer(conn.peer), req.api_key)
                return
            if req.body is None:
                out = protocol.unsupported_response(req)
                log.info("txmq.kafka: %s: api key %d version %d not served: UNSUPPORTED_VERSION",
                         _peer(conn.peer), req.api_key, req.api_version)
            else:
                body = await self.handlers.handle(conn, req)
                if body is None:                   # Produce with acks=0: no answer
                    continue
                out = protocol.encode_response(req.api_key, req.api_version, req.correlation_id, body)
            await framer.write(out)
            if conn.close_after:                   # a failed authentication: answered, then closed
                log.warning("txmq.kafka: %s: %s; connection closed", _peer(conn.peer), conn.close_after)
                # As Kafka's connection.failed.authentication.delay.ms: the client reads the
                # answer before the close, and password guessing slows down.
                await asyncio.sleep(FAILED_AUTHENTICATION_DELAY)
                return


class Framer(asyncio.BufferedProtocol):
    """One connection's bytes as request frames, read with no copy in
    between: the event loop receives straight into the buffers given here.

    A frame is ``size i32`` and ``size`` bytes. Prefixes and small frames
    land in a staging buffer of ``STAGING_BYTES`` (several small requests
    per receive); a frame that does not fit gets a buffer of its own, and
    the rest of it is received into that buffer directly, so a 1 MB
    Produce reaches the decoder as received. A size outside
    ``HEADER_MIN_BYTES .. max_request_bytes`` stops reading: the
    connection's task reports it and closes the connection. Reading pauses
    while ``QUEUED_FRAMES_MAX`` frames wait (the task answers them in
    order), and :meth:`write` waits while the transport's buffer is full.
    """

    STAGING_BYTES = 64 * 1024
    QUEUED_FRAMES_MAX = 16

    def __init__(self, server: KafkaServer):
        self.server = server
        self.transport = None
        self.refused_size = None          # a size prefix out of bounds
        self.partial_prefix = False       # the client closed inside a size prefix
        self._staging = bytearray(self.STAGING_BYTES)
        self._staged = 0                  # bytes held in _staging
        self._big = None                  # a frame too large for staging, being received
        self._big_pos = 0
        self._frames = collections.deque()
        self._waiter = None
        self._closed = False
        self._reading_paused = False
        self._writing_paused = False
        self._drain_waiter = None

    # -- asyncio.BufferedProtocol ---------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.loop.create_task(self.server._connection(self))

    def get_buffer(self, sizehint: int):
        if self._big is not None:
            return memoryview(self._big)[self._big_pos:]
        return memoryview(self._staging)[self._staged:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._big is not None:
            self._big_pos += nbytes
            if self._big_pos == len(self._big):
                frame, self._big = self._big, None
                self._deliver(frame)
            return
        self._staged += nbytes
        self._split()

    def eof_received(self):
        return False                      # close the transport

    def connection_lost(self, exc) -> None:
        self._closed = True
        self.partial_prefix = self._big is None and 0 < self._staged < protocol.SIZE_BYTES
        self._wake()
        waiter, self._drain_waiter = self._drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionResetError("connection lost"))

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        waiter, self._drain_waiter = self._drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- frames -----------------------------------------------------------------------------------

    def _split(self) -> None:
        buf, pos, end = self._staging, 0, self._staged
        while end - pos >= protocol.SIZE_BYTES:
            size = int.from_bytes(buf[pos:pos + protocol.SIZE_BYTES], "big", signed=True)
            if size < protocol.HEADER_MIN_BYTES or size > self.server.max_request_bytes:
                self.refused_size = size
                self.transport.pause_reading()
                self._wake()
                return
            start = pos + protocol.SIZE_BYTES
            if end - start >= size:
                self._deliver(bytes(memoryview(buf)[start:start + size]))
                pos = start + size
                continue
            if protocol.SIZE_BYTES + size > len(buf):
                big = bytearray(size)
                big[:end - start] = buf[start:end]
                self._big, self._big_pos = big, end - start
                pos = end
            break
        if pos:
            buf[:end - pos] = buf[pos:end]
            self._staged = end - pos

    def _deliver(self, frame) -> None:
        self._frames.append(frame)
        if len(self._frames) >= self.QUEUED_FRAMES_MAX and not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next_frame(self):
        """The next request frame (bytes or bytearray, without its size
        prefix), or None once the connection is closed or refused."""
        while not self._frames:
            if self._closed or self.refused_size is not None:
                return None
            self._waiter = self.server.loop.create_future()
            await self._waiter
        frame = self._frames.popleft()
        if self._reading_paused and len(self._frames) < self.QUEUED_FRAMES_MAX // 2:
            self._reading_paused = False
            self.transport.resume_reading()
        return frame

    async def write(self, data: bytes) -> None:
        """Send one response, waiting while the transport's buffer is full."""
        if self._closed:
            raise ConnectionResetError("connection lost")
        self.transport.write(data)
        if self._writing_paused:
            self._drain_waiter = self.server.loop.create_future()
            await self._drain_waiter


class Connection:
    """What the server knows of one client connection."""

    __slots__ = ("peer", "client_id", "opened", "user", "sasl", "close_after")

    def __init__(self, peer):
        self.peer = peer
        self.client_id = None
        self.opened = time.monotonic()
        self.user = None                  # the authenticated txmq.kafka.auth.User
        self.sasl = None                  # the mechanism chosen by SaslHandshake, then its exchange
        self.close_after = None           # why to close once the current answer is sent

    @property
    def where(self) -> str:
        """The peer as ``host:port``, for log lines."""
        return _peer(self.peer)


def _peer(peer) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer)


def _new_loop() -> asyncio.AbstractEventLoop:
    if os.environ.get("TXMQ_KAFKA_NO_UVLOOP") != "1":
        try:
            import uvloop
            return uvloop.new_event_loop()
        except ImportError:
            pass
    return asyncio.new_event_loop()


__all__ = ["KafkaServer", "Error", "DEFAULT_PORT"]


def serve_kafka(broker, host: str = "127.0.0.1", port: int = DEFAULT_PORT, **options) -> KafkaServer:
    """Serve ``broker`` (an open :class:`txmq.Broker`) over Kafka's wire
    protocol (docs/KAFKA.md) in a background thread; returns the running
    :class:`KafkaServer` (``.port`` is the bound port: pass ``port=0`` for a
    free one). ``server.stop()`` stops it; ``broker.close()`` stops every
    server first. ``options``: ``advertised_host``, ``auto_create_topics``
    (default True), ``default_partitions`` (1), ``max_request_bytes``
    (100 MiB), ``idle_timeout`` (600 s), ``users_file`` (None: no
    authentication; a path: SASL PLAIN / SCRAM-SHA-256 and topic ACLs from
    that JSON file, docs/KAFKA.md). Raises ``OSError`` when the address
    cannot be bound, :class:`~txmq.errors.KafkaUsersFileError` for a bad
    users file, :class:`~txmq.errors.BrokerClosedError` if the broker is
    closed."""
    server = KafkaServer(broker, host, port, **options)
    broker.attach(server)
    try:
        return server.start()
    except BaseException:
        broker.detach(server)
        raise
