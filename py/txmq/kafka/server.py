"""The Kafka protocol server: asyncio (uvloop where installed) in a thread
of its own, in front of one :class:`txmq.Broker`.

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
import concurrent.futures
import logging
import os
import threading
import time

from txmq.errors import InvalidArgumentError, KafkaProtocolError
from txmq.kafka import protocol
from txmq.kafka.protocol import Error

log = logging.getLogger("txmq.kafka")

DEFAULT_PORT = 9092
MAX_REQUEST_BYTES = 100 * 1024 * 1024      # Kafka's socket.request.max.bytes
IDLE_TIMEOUT = 600.0                       # Kafka's connections.max.idle.ms
BLOCKING_THREADS = 4


class KafkaServer:
    """Serves a broker over Kafka's protocol until :meth:`stop` (or the
    broker's ``close()``). Create it with :meth:`txmq.Broker.serve_kafka`.

    ``port`` 0 takes a free port; :attr:`port` tells which. ``host`` is
    bound as given (127.0.0.1 by default); ``advertised_host`` is the host
    clients are told to connect to (default: ``host``, or 127.0.0.1 for a
    wildcard bind). ``auto_create_topics`` creates a topic a client
    produces to or asks metadata for (Kafka's default) with
    ``default_partitions`` partitions.
    """

    def __init__(self, broker, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *,
                 advertised_host: str | None = None, auto_create_topics: bool = True,
                 default_partitions: int = 1, max_request_bytes: int = MAX_REQUEST_BYTES,
                 idle_timeout: float = IDLE_TIMEOUT):
        from txmq.kafka.handlers import Handlers
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
                    asyncio.start_server(self._connection, self.host, self.port, reuse_address=True,
                                         limit=64 * 1024))
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
        self.broker._kafka_server_stopped(self)

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

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        self.stats["connections"] += 1
        peer = writer.get_extra_info("peername")
        conn = Connection(peer)
        try:
            await self._serve(conn, reader, writer)
        except asyncio.CancelledError:
            pass
        except (ConnectionError, asyncio.IncompleteReadError):
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
            writer.close()
            try:
                await writer.wait_closed()
            except Exception:
                pass

    async def _serve(self, conn, reader, writer) -> None:
        while True:
            try:
                head = await asyncio.wait_for(reader.readexactly(protocol.SIZE_BYTES), self.idle_timeout)
            except asyncio.TimeoutError:
                log.info("txmq.kafka: %s: idle for %.0f s, connection closed", _peer(conn.peer),
                         self.idle_timeout)
                return
            except asyncio.IncompleteReadError as e:
                if e.partial:
                    log.warning("txmq.kafka: %s: connection closed inside a size prefix", _peer(conn.peer))
                return
            size = int.from_bytes(head, "big", signed=True)
            if size < protocol.HEADER_MIN_BYTES or size > self.max_request_bytes:
                self.stats["errors"] += 1
                log.warning("txmq.kafka: %s: request of %d bytes (limit %d), connection closed",
                            _peer(conn.peer), size, self.max_request_bytes)
                return
            frame = await asyncio.wait_for(reader.readexactly(size), self.idle_timeout)
            req = protocol.decode_request(frame)
            conn.client_id = req.client_id
            self.stats["requests"] += 1
            if req.body is None:
                out = protocol.unsupported_response(req)
                log.info("txmq.kafka: %s: api key %d version %d not served: UNSUPPORTED_VERSION",
                         _peer(conn.peer), req.api_key, req.api_version)
            else:
                body = await self.handlers.handle(conn, req)
                if body is None:                   # Produce with acks=0: no answer
                    continue
                out = protocol.encode_response(req.api_key, req.api_version, req.correlation_id, body)
            writer.write(out)
            await writer.drain()


class Connection:
    """What the server knows of one client connection."""

    __slots__ = ("peer", "client_id", "opened", "user")

    def __init__(self, peer):
        self.peer = peer
        self.client_id = None
        self.opened = time.monotonic()
        self.user = None


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
