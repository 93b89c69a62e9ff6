"""What travels over txmq's Arrow Flight service: descriptors, tickets,
actions, the token (docs/FORMAT.md, "Arrow Flight").

Every command, ticket and action body is one UTF-8 JSON object carrying
``"v": 1``; every action answers with one result, a JSON object. The
record batches are Arrow IPC as Flight sends them.

=========================  ==================================================
``GetFlightInfo``,         descriptor command ``{"v": 1, "read": {options}}``:
``GetSchema``              a batch read, the options of the Spark source
                           (strings, as Spark hands them; no ``path``)
``DoGet``                  ticket ``{"v": 1, "topic", "partition", "start",
                           "end", "strict", "isolation", "includeHeaders",
                           "failOnDataLoss"}``: one planned range
``DoPut``                  descriptor command ``{"v": 1, "stage": {"job",
                           "attempt", "topic"}}``, batches with the sink's
                           columns; one ``PutResult`` whose metadata is
                           ``{"attempt", "messages"}``
``DoAction``               see :data:`ACTIONS`
=========================  ==================================================

Authentication: every call carries the header ``authorization: Bearer
<token>``; the owner keeps the token in ``<data>/flight.token`` (mode 0600).

Where a running service listens is published in ``<data>/flight.json``
(:func:`publish`), so that a Spark job given only the directory's path
finds it for executors that cannot open the directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from dataclasses import dataclass

from txmq.errors import InvalidArgumentError
from txmq.files import write_atomic

VERSION = 1
TOKEN_FILE = "flight.token"
ADDRESS_FILE = "flight.json"
TOKEN_BYTES = 32                       # random bytes, written as URL-safe base64 (43 characters)
AUTH_HEADER = "authorization"
BEARER = "Bearer "
DEFAULT_PORT = 8815                    # the port Arrow's own examples use
MAX_JSON_BYTES = 1 << 20

# Action type -> (body, result): what each DoAction takes and answers.
ACTIONS = {
    "offsets": ('{"v": 1, "read": {options}, "at": "initial" | "current"}',
                'initial: {"offsets": {"topic/partition": offset}}; '
                'current: {"offsets": {"topic/partition": [log start, latest]}}'),
    "topic": ('{"v": 1, "topic": name}', '{"partitions": n}'),
    "commit": ('{"v": 1, "job": job, "attempts": [attempt, ...], "sink": [key, batch id] | null}',
               '{"messages": n, "skipped": bool}'),
    "abort": ('{"v": 1, "job": job, "tombstone": bool}', '{}'),
    "last_batch": ('{"v": 1, "sink": key}', '{"batch_id": n}'),
}


def encode(obj: dict) -> bytes:
    """A command, ticket, body or result: versioned JSON."""
    return json.dumps(dict(obj, v=VERSION), separators=(",", ":")).encode()


def decode(what: str, raw) -> dict:
    """The JSON object of a command, ticket or action body, its version
    checked. Raises :class:`InvalidArgumentError` naming ``what``."""
    raw = bytes(raw)
    if len(raw) > MAX_JSON_BYTES:
        raise InvalidArgumentError(what, f"{len(raw)} bytes", f"at most {MAX_JSON_BYTES} bytes of JSON")
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise InvalidArgumentError(what, raw[:200], "a UTF-8 JSON object (docs/FORMAT.md, Arrow Flight)") from None
    if not isinstance(obj, dict):
        raise InvalidArgumentError(what, obj, "a JSON object")
    if obj.get("v") != VERSION:
        raise InvalidArgumentError(f"{what} version", obj.get("v"), str(VERSION))
    return obj


def field(obj: dict, what: str, name: str, kind, *, optional: bool = False):
    """``obj[name]`` checked to be of ``kind`` (bool is not an int here)."""
    if name not in obj or obj[name] is None:
        if optional:
            return None
        raise InvalidArgumentError(f"{what}.{name}", None, f"a {getattr(kind, '__name__', kind)}")
    value = obj[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidArgumentError(f"{what}.{name}", value, f"a {getattr(kind, '__name__', kind)}")
    return value


def read_options(obj: dict, what: str) -> dict:
    """The Spark source options of a read request: strings by name."""
    options = field(obj, what, "read", dict)
    for k, v in options.items():
        if not isinstance(v, (str, int, bool)):
            raise InvalidArgumentError(f"{what}.read.{k}", v, "a string (an option value)")
    return {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in options.items()}


@dataclass(frozen=True)
class Ticket:
    """One planned range and how to read it (a ``DoGet`` ticket)."""

    topic: str
    partition: int
    start: int
    end: int
    strict: bool = True
    isolation: str = "read_committed"
    include_headers: bool = False
    fail_on_data_loss: bool = True
    out_of_order: bool = False          # allowOutOfOrderDelivery, with ...
    as_of: tuple | None = None          # ... the (maxReadPosition, log end) it was planned at

    def encode(self) -> bytes:
        obj = {"topic": self.topic, "partition": self.partition, "start": self.start, "end": self.end,
               "strict": self.strict, "isolation": self.isolation, "includeHeaders": self.include_headers,
               "failOnDataLoss": self.fail_on_data_loss}
        if self.out_of_order:
            obj["allowOutOfOrderDelivery"] = True
            obj["asOf"] = list(self.as_of)
        return encode(obj)

    @classmethod
    def decode(cls, raw) -> "Ticket":
        obj = decode("ticket", raw)
        out_of_order = bool(field(obj, "ticket", "allowOutOfOrderDelivery", bool, optional=True))
        as_of = field(obj, "ticket", "asOf", list, optional=True)
        if out_of_order and (as_of is None or len(as_of) != 2 or not all(type(x) is int and x >= 0 for x in as_of)):
            raise InvalidArgumentError("ticket.asOf", as_of, "[maxReadPosition, log end] with allowOutOfOrderDelivery")
        t = cls(field(obj, "ticket", "topic", str), field(obj, "ticket", "partition", int),
                field(obj, "ticket", "start", int), field(obj, "ticket", "end", int),
                field(obj, "ticket", "strict", bool), field(obj, "ticket", "isolation", str),
                field(obj, "ticket", "includeHeaders", bool), field(obj, "ticket", "failOnDataLoss", bool),
                out_of_order, tuple(as_of) if out_of_order else None)
        if t.partition < 0 or t.start < 0 or t.end < t.start:
            raise InvalidArgumentError("ticket", obj, "partition >= 0 and 0 <= start <= end")
        return t

    @classmethod
    def of(cls, rng, opts) -> "Ticket":
        """The ticket of a planned range (a :class:`txmq.requester.read_plan.Split` or
        a Spark ``OffsetRange``) read with ``opts`` (ReadOptions)."""
        return cls(rng.topic, rng.partition, rng.start, rng.end, rng.strict, opts.isolation,
                   opts.include_headers, opts.fail_on_data_loss, opts.out_of_order,
                   getattr(rng, "as_of", None) if opts.out_of_order else None)


def token_path(data_dir) -> str:
    return os.path.join(os.fspath(data_dir), TOKEN_FILE)


def load_or_create_token(data_dir) -> str:
    """The token of ``<data>/flight.token``, written first (mode 0600, by
    an exclusive create) when the file does not exist. A token kept across
    restarts lets running Spark queries go on; delete the file to change
    it. A file readable by others is made 0600."""
    path = token_path(data_dir)
    if not os.path.exists(path):
        # Written whole under another name, then linked in: a reader never
        # sees a partial token, and a token already there is never replaced.
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(TOKEN_BYTES) + "\n")
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
        finally:
            os.unlink(tmp)
    if os.stat(path).st_mode & 0o077:
        os.chmod(path, 0o600)
    with open(path) as f:
        token = f.read().strip()
    return check_token(token, path)


def check_token(token, where: str = "token") -> str:
    """A token is 16 to 512 visible ASCII characters (a header value)."""
    if not isinstance(token, str) or not 16 <= len(token) <= 512 or not all(33 <= ord(c) < 127 for c in token):
        raise InvalidArgumentError(where, "<hidden>", "16 to 512 visible ASCII characters")
    return token


def token_digest(token: str) -> str:
    """The SHA-256 of a token, hex: what ``flight.json`` says of the token
    the service checks (never the token itself)."""
    return hashlib.sha256(token.encode()).hexdigest()


def address_path(data_dir) -> str:
    return os.path.join(os.fspath(data_dir), ADDRESS_FILE)


def publish(data_dir, locations: list, token: str) -> dict:
    """Write ``<data>/flight.json`` (docs/FORMAT.md): the locations a
    running service listens on, best first, the pid of the process serving
    it (the directory's owner) and the digest of its token. Replaced
    atomically: a reader sees the previous file or this one. Returns what
    was written, for :func:`unpublish`."""
    published = {"v": VERSION, "pid": os.getpid(), "locations": list(locations),
                 "token_sha256": token_digest(token)}
    write_atomic(address_path(data_dir), (json.dumps(published) + "\n").encode(),
                 tmp_suffix=f".{os.getpid()}.{secrets.token_hex(4)}.tmp")
    return published


def unpublish(data_dir, published: dict) -> None:
    """Remove ``<data>/flight.json`` if it still holds ``published`` (a
    service started later in the same directory keeps its own)."""
    path = address_path(data_dir)
    try:
        if read_published(data_dir) == published:
            os.unlink(path)
    except (OSError, InvalidArgumentError):
        pass


def read_published(data_dir) -> dict | None:
    """The contents of ``<data>/flight.json``, checked; None when there is
    none. Raises :class:`InvalidArgumentError` for a file that is not one,
    ``OSError`` when it cannot be read."""
    path = address_path(data_dir)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_JSON_BYTES + 1)
    except FileNotFoundError:
        return None
    obj = decode(path, raw)
    pid = field(obj, path, "pid", int)
    locations = field(obj, path, "locations", list)
    digest = field(obj, path, "token_sha256", str)
    if pid <= 0 or not locations or not all(isinstance(x, str) for x in locations):
        raise InvalidArgumentError(path, obj, "a pid > 0 and a non-empty list of locations")
    return {"v": VERSION, "pid": pid, "locations": locations, "token_sha256": digest}
