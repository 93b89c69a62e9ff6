"""``txmq serve DIR --kafka HOST:PORT``: hold a data directory as its owner
and serve it over Kafka's protocol until SIGINT or SIGTERM.

The owner also answers the control socket (staged ingest from Spark and
other writers), and other processes read the directory read-only beside
it, as with any owner.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

from txmq.cli import exits, opening
from txmq.errors import KafkaUsersFileError
from txmq.kafka import serve_kafka
from txmq.kafka.auth import Users

DEFAULT_KAFKA = "127.0.0.1:9092"


def parse_address(text: str) -> tuple:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6; ``:PORT`` binds 127.0.0.1)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise exits.CliError(f"--kafka {text!r}: expected HOST:PORT, e.g. {DEFAULT_KAFKA}")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


def serve(args) -> int:
    host, port = parse_address(args.kafka)
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
        try:
            server = serve_kafka(broker, host, port, advertised_host=args.advertised_host,
                                 auto_create_topics=not args.no_auto_create,
                                 default_partitions=args.partitions, users_file=args.users)
        except OSError as e:
            raise exits.CliError(f"cannot listen on {host}:{port}: {e.strerror or e}", exits.REFUSED) from None
        auth = f", SASL with {len(server.users.users)} users" if server.users is not None else ""
        print(f"txmq: serving {broker.path} over Kafka's protocol on {host}:{server.port} "
              f"(fsync={broker.fsync}{auth}); Ctrl-C stops", file=sys.stderr, flush=True)
        while not stop.wait(0.5):
            pass
        server.stop()
        print("txmq: stopped", file=sys.stderr)
        return exits.OK
    finally:
        broker.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
