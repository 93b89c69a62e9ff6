"""The options that send the ``txmq`` source and sink through the owner's
Arrow Flight service instead of the data directory (docs/SPARK_CLUSTER.md):

- ``flight``: ``grpc://HOST:PORT`` or ``grpc+tls://HOST:PORT``, the
  address ``txmq serve DIR --flight HOST:PORT`` (or
  ``txmq.flight.serve_flight``) listens on. ``path`` is then not given: the
  server reads and writes its own directory;
- ``flight.token``: the owner's bearer token, or ``flight.tokenFile``: a
  file holding it (the owner's ``<data>/flight.token``, or a copy), read
  where Spark plans the query;
- ``flight.tlsRootCerts``: with ``grpc+tls``, a PEM file of the
  certificates to trust (default: the system's), read where Spark plans.

What is read on the driver travels to the executors inside the pickled
reader or writer (Spark's task serialization), so executors need neither
the token file nor the certificates.
"""

from __future__ import annotations

from txmq.errors import InvalidArgumentError
from txmq.flight.client import FlightTarget

FLIGHT = "flight"
TOKEN = "flight.token"
TOKEN_FILE = "flight.tokenFile"
TLS_ROOTS = "flight.tlsRootCerts"
FLIGHT_OPTIONS = (FLIGHT, TOKEN, TOKEN_FILE, TLS_ROOTS)

__all__ = ["FLIGHT_OPTIONS", "flight_target", "without_flight_options"]


def _get(options, name):
    value = options.get(name)
    return None if value is None else str(value)


def flight_target(options):
    """The :class:`txmq.flight.client.FlightTarget` the options name, or
    None when there is no ``flight`` option (the local path). Raises
    :class:`InvalidArgumentError` naming the option at fault."""
    location = _get(options, FLIGHT)
    extra = [n for n in (TOKEN, TOKEN_FILE, TLS_ROOTS) if _get(options, n) is not None]
    if location is None:
        if extra:
            raise InvalidArgumentError(extra[0], "<given>", f"only with the {FLIGHT} option")
        return None
    if _get(options, "path") is not None:
        raise InvalidArgumentError("path", _get(options, "path"),
                                   f"no path with {FLIGHT}: the Flight server reads its own data directory")
    token, token_file = _get(options, TOKEN), _get(options, TOKEN_FILE)
    if (token is None) == (token_file is None):
        raise InvalidArgumentError(TOKEN, "<given>" if token else None,
                                   f"exactly one of {TOKEN} and {TOKEN_FILE} with {FLIGHT}")
    if token_file is not None:
        try:
            with open(token_file) as f:
                token = f.read().strip()
        except OSError as e:
            raise InvalidArgumentError(TOKEN_FILE, token_file, f"a readable file holding the token ({e.strerror})") \
                from None
    roots = None
    roots_file = _get(options, TLS_ROOTS)
    if roots_file is not None:
        if not location.startswith("grpc+tls://"):
            raise InvalidArgumentError(TLS_ROOTS, roots_file, f"only with a grpc+tls:// {FLIGHT} location")
        try:
            with open(roots_file, "rb") as f:
                roots = f.read()
        except OSError as e:
            raise InvalidArgumentError(TLS_ROOTS, roots_file, f"a readable PEM file ({e.strerror})") from None
    return FlightTarget(location.strip(), token, roots)


def without_flight_options(options) -> dict:
    """The options as a plain dict, without the Flight ones: what the
    Flight server is sent."""
    flight = {n.lower() for n in FLIGHT_OPTIONS}
    return {str(k): str(v) for k, v in options.items() if str(k).lower() not in flight and v is not None}
