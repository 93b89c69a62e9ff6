"""``txmq serve DIR --kafka HOST:PORT``: hold a data directory as its owner
and serve it over Kafka's protocol until SIGINT or SIGTERM.

``--flight HOST:PORT`` serves it over Arrow Flight as well (to Spark
executors that cannot open the directory, docs/SPARK_CLUSTER.md), or
alone when ``--kafka`` is not given.

The owner also answers the control socket (staged ingest from Spark and
other writers), and other processes read the directory read-only beside
it, as with any owner.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from txmq.cli import exits, opening
from txmq.errors import KafkaUsersFileError
from txmq.flight import serve_flight
from txmq.kafka import serve_kafka
from txmq.kafka.auth import Users

DEFAULT_KAFKA = "127.0.0.1:9092"
DEFAULT_FLIGHT = "127.0.0.1:8815"


def parse_address(text: str, option: str = "--kafka", example: str = DEFAULT_KAFKA) -> tuple:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6; ``:PORT`` binds 127.0.0.1)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise exits.CliError(f"{option} {text!r}: expected HOST:PORT, e.g. {example}")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


def serve(args) -> int:
    # Every argument is checked before the directory is opened.
    flight_address = getattr(args, "flight", None)
    kafka_address = args.kafka or (None if flight_address else DEFAULT_KAFKA)
    kafka = parse_address(kafka_address) if kafka_address is not None else None
    flight = parse_address(flight_address, "--flight", DEFAULT_FLIGHT) if flight_address is not None else None
    tls = _flight_tls(args)
    if args.users is not None:
        try:
            Users.load(args.users)            # a bad file is refused before the directory is opened
        except KafkaUsersFileError as e:
            raise exits.CliError(str(e)) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    broker = opening.open_for_writing(args.dir, args.progress, create=True)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        services = []
        if kafka is not None:
            services.append(_start_kafka(broker, *kafka, args))
        if flight is not None:
            services.append(_start_flight(broker, *flight, tls))
        while not stop.wait(0.5):
            pass
        for service in reversed(services):
            service.stop()
        print("txmq: stopped", file=sys.stderr)
        return exits.OK
    finally:
        broker.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _start_kafka(broker, host: str, port: int, args):
    """Serve ``broker`` over Kafka's protocol; exit 5 when the address
    cannot be bound."""
    try:
        server = serve_kafka(broker, host, port, advertised_host=args.advertised_host,
                             auto_create_topics=not args.no_auto_create,
                             default_partitions=args.partitions, users_file=args.users)
    except OSError as e:
        raise exits.CliError(f"cannot listen on {host}:{port}: {e.strerror or e}", exits.REFUSED) from None
    auth = f", SASL with {len(server.users.users)} users" if server.users is not None else ""
    print(f"txmq: serving {broker.path} over Kafka's protocol on {host}:{server.port} "
          f"(fsync={broker.fsync}{auth}); Ctrl-C stops", file=sys.stderr, flush=True)
    return server


def _flight_tls(args):
    cert, key = getattr(args, "flight_tls_cert", None), getattr(args, "flight_tls_key", None)
    if (cert is None) != (key is None):
        raise exits.CliError("--flight-tls-cert and --flight-tls-key go together")
    return None if cert is None else (cert, key)


def _start_flight(broker, host: str, port: int, tls):
    """Serve ``broker`` over Arrow Flight; exit 5 when the address cannot
    be bound (or the TLS pair is not usable), 2 when the certificate or
    key cannot be read."""
    try:
        service = serve_flight(broker, host, port, tls=tls)
    except OSError as e:
        if tls is not None and e.filename is not None:
            raise exits.CliError(f"--flight-tls: cannot read {e.filename}: {e.strerror}") from None
        raise exits.CliError(e.strerror or str(e), exits.REFUSED) from None
    print(f"txmq: serving {broker.path} over Arrow Flight on {service.location} (bearer token in "
          f"{os.path.join(broker.path, 'flight.token')}); Ctrl-C stops", file=sys.stderr, flush=True)
    return service
