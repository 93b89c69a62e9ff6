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

Given only ``path``, a job still reaches executors that cannot open the
directory (another host, or a user without rights to it): the driver,
which reads the directory, takes the owner's running Flight service from
``<data>/flight.json`` and ``<data>/flight.token``
(:func:`txmq.flight.client.published_target`) into a :class:`Fallback`
that travels with the tasks; a task whose executor cannot open the
directory itself (:func:`directory_error`) reads its range or stages its
attempt through that service instead (:func:`task_target`), with the same
rows and the same one commit. ``flight.fallback=false`` turns it off.
"""

from __future__ import annotations

import os
import pwd
import socket
from dataclasses import dataclass

from txmq.errors import DataDirUnreadableError, InvalidArgumentError
from txmq.flight.client import FlightTarget, published_target
from txmq.requester.read_plan import option_bool

FLIGHT = "flight"
TOKEN = "flight.token"
TOKEN_FILE = "flight.tokenFile"
TLS_ROOTS = "flight.tlsRootCerts"
FALLBACK = "flight.fallback"
FLIGHT_OPTIONS = (FLIGHT, TOKEN, TOKEN_FILE, TLS_ROOTS, FALLBACK)

__all__ = ["FLIGHT_OPTIONS", "flight_target", "without_flight_options", "Fallback", "fallback",
           "directory_error", "task_target"]


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
        option_bool(options, FALLBACK, True)           # checked when Spark plans, like every option
        return None
    if _get(options, FALLBACK) is not None:
        raise InvalidArgumentError(FALLBACK, _get(options, FALLBACK),
                                   f"only with path (with {FLIGHT} every task goes through the Flight service)")
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


@dataclass(frozen=True)
class Fallback:
    """What a task given ``path`` does when its executor cannot open the
    directory: go through ``target`` (the owner's Flight service, as the
    driver found it), or, when ``target`` is None, fail saying ``why_not``.
    Plain data, pickled into the tasks (the token with it)."""

    target: FlightTarget | None
    why_not: str | None = None


def fallback(options, path: str) -> Fallback:
    """The :class:`Fallback` of a job given ``path``, found where Spark
    plans it (the driver reads the directory): the Flight service its
    owner publishes, unless ``flight.fallback`` is false."""
    if not option_bool(options, FALLBACK, True):
        return Fallback(None, f"{FALLBACK} is false")
    return Fallback(*published_target(path))


def directory_error(path: str) -> OSError | None:
    """The error opening the directory ``path`` itself raises in this
    process (``PermissionError``: no right to list or enter it;
    ``FileNotFoundError``: it is not there, e.g. on another host), or None
    when it opens. Other errors (a file, a folder that is not a data
    directory) are left to the read or write to raise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except (PermissionError, FileNotFoundError) as e:
        return e
    except OSError:
        return None
    try:
        os.stat(os.path.join(path, "topics"))               # entering it needs the search right
    except PermissionError as e:
        return e
    except OSError:
        pass
    finally:
        os.close(fd)
    return None


def _user() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return f"uid {os.geteuid()}"


def task_target(path: str, fb: Fallback | None) -> FlightTarget | None:
    """In a task: None when this executor can open ``path`` (use it, as
    always), else the Flight target to go through instead. Raises
    :class:`DataDirUnreadableError` when the directory cannot be opened
    here and there is no fallback, saying why and what to do."""
    error = directory_error(path)
    if error is None:
        return None
    if fb is not None and fb.target is not None:
        return fb.target
    why = fb.why_not if fb is not None else "no Flight service was looked for"
    cause = f"{error.strerror or error}, as user {_user()} on host {socket.gethostname()}"
    raise DataDirUnreadableError(
        path, cause, f"this executor cannot read the path, and the tasks have no Flight service to go through "
        f"instead ({why}). Start the directory's owner with its Flight service (txmq serve DIR --flight "
        f"HOST:PORT, or txmq.flight.serve_flight) and the tasks use it by themselves, or give "
        f"option('{FLIGHT}', 'grpc://HOST:PORT') with {TOKEN} or {TOKEN_FILE} instead of path "
        f"(docs/SPARK_CLUSTER.md)")
