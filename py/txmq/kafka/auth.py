"""SASL authentication (PLAIN and SCRAM-SHA-256) and per-user topic ACLs
for the Kafka server, from a users file.

The users file is JSON (docs/KAFKA.md, "Authentication and ACLs")::

    {"users": {
        "alice": {"password": "alice-secret",
                  "topics": {"orders": ["read", "write"], "logs.*": ["read"]}},
        "bob":   {"scram_sha_256": {"salt": "<base64>", "iterations": 4096,
                                    "stored_key": "<base64>", "server_key": "<base64>"},
                  "topics": {"*": ["describe"]}},
        "ops":   {"password": "...", "superuser": true}}}

A user with ``password`` may authenticate with PLAIN or SCRAM-SHA-256 (the
server derives SCRAM credentials from it when it loads the file); one with
``scram_sha_256`` credentials (see :func:`scram_credentials`) only with
SCRAM-SHA-256. ``topics`` maps a topic name, or a prefix ending in ``*``
(``*`` alone: every topic), to operations: ``read`` (Fetch, ListOffsets,
offset commits and fetches of a group on the topic), ``write`` (Produce,
AddPartitionsToTxn, CreateTopics and DeleteTopics of the topic, creation on
first use), ``describe`` (Metadata, DescribeConfigs) or ``all``; ``read``
and ``write`` imply ``describe``, as in Kafka. The most specific pattern
that matches a topic decides (an exact name, then the longest prefix). A
``superuser`` may do everything. Groups and transactional ids are open to
every authenticated user.

SCRAM-SHA-256 is RFC 5802 / RFC 7677 as Kafka runs it: a client-first
message ``n,,n=<user>,r=<nonce>``, the server's ``r=<nonce+server nonce>,
s=<salt>,i=<iterations>``, the client's proof, the server's signature. An
unknown user gets a made-up salt and fails at the proof, so the exchange
does not tell which users exist.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os

from txmq.errors import KafkaUsersFileError

PLAIN = "PLAIN"
SCRAM_SHA_256 = "SCRAM-SHA-256"
MECHANISMS = (PLAIN, SCRAM_SHA_256)
OPERATIONS = ("read", "write", "describe")
SCRAM_ITERATIONS = 4096          # Kafka's default for SCRAM-SHA-256
SCRAM_MIN_ITERATIONS = 4096      # RFC 7677's minimum
NONCE_BYTES = 24


class AuthenticationFailed(Exception):
    """A SASL exchange failed; the message is what the client is told."""


def server_nonce() -> str:
    """The server's part of a SCRAM nonce (printable, no comma)."""
    return _b64(os.urandom(NONCE_BYTES))


def scram_credentials(password: str, salt: bytes | None = None, iterations: int = SCRAM_ITERATIONS) -> dict:
    """The ``scram_sha_256`` entry of a users file for ``password``: base64
    ``salt``, ``iterations``, ``stored_key`` and ``server_key`` (RFC 5802),
    so the file need not hold the password itself."""
    salt = os.urandom(16) if salt is None else salt
    salted = hashlib.pbkdf2_hmac("sha256", password.encode("utf-8"), salt, iterations)
    client_key = hmac.digest(salted, b"Client Key", "sha256")
    return {"salt": _b64(salt), "iterations": iterations,
            "stored_key": _b64(hashlib.sha256(client_key).digest()),
            "server_key": _b64(hmac.digest(salted, b"Server Key", "sha256"))}


class User:
    """One user of the file: credentials and topic ACLs."""

    __slots__ = ("name", "password", "scram", "superuser", "exact", "prefixes")

    def __init__(self, name: str, password, scram, superuser: bool, acls: dict):
        self.name = name
        self.password = password                    # bytes or None
        self.scram = scram                          # (salt, iterations, stored_key, server_key) or None
        self.superuser = superuser
        self.exact = {k: v for k, v in acls.items() if not k.endswith("*")}
        # Longest prefix first: the most specific pattern decides.
        self.prefixes = sorted(((k[:-1], v) for k, v in acls.items() if k.endswith("*")),
                               key=lambda kv: -len(kv[0]))

    def allowed(self, topic: str, operation: str) -> bool:
        if self.superuser:
            return True
        ops = self.exact.get(topic)
        if ops is None:
            ops = next((v for prefix, v in self.prefixes if topic.startswith(prefix)), ())
        return operation in ops


class Users:
    """The users file, loaded: ``Users.load(path)``."""

    def __init__(self, users: dict, path: str = "<users>"):
        self.path = path
        self.users = users                          # name -> User
        self._fake_salt_key = os.urandom(32)

    @classmethod
    def load(cls, path) -> "Users":
        """Read and check a users file; raises :class:`KafkaUsersFileError`."""
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except OSError as e:
            raise KafkaUsersFileError(path, e.strerror or str(e)) from None
        except (ValueError, UnicodeDecodeError) as e:
            raise KafkaUsersFileError(path, f"not JSON: {e}") from None
        return cls.from_dict(doc, path)

    @classmethod
    def from_dict(cls, doc, path: str = "<users>") -> "Users":
        """The same from an already parsed document."""
        if not isinstance(doc, dict) or not isinstance(doc.get("users"), dict) or set(doc) - {"users"}:
            raise KafkaUsersFileError(path, 'expected {"users": {NAME: {...}, ...}}')
        users = {}
        for name, entry in doc["users"].items():
            users[name] = _user(path, name, entry)
        return cls(users, path)

    def mechanisms(self) -> list:
        return list(MECHANISMS)

    def allowed(self, user: User | None, topic: str, operation: str) -> bool:
        """May ``user`` do ``operation`` (read / write / describe) on ``topic``?"""
        return user is not None and user.allowed(topic, operation)

    # -- PLAIN (RFC 4616) -------------------------------------------------------------------

    def plain(self, auth_bytes: bytes) -> User:
        """The user a PLAIN message ``authzid NUL authcid NUL passwd``
        authenticates, or :class:`AuthenticationFailed`."""
        parts = bytes(auth_bytes).split(b"\0")
        if len(parts) != 3:
            raise AuthenticationFailed("malformed PLAIN message")
        authzid, authcid, password = parts
        try:
            name = authcid.decode("utf-8")
        except UnicodeDecodeError:
            raise AuthenticationFailed("malformed PLAIN message") from None
        if authzid and authzid != authcid:
            raise AuthenticationFailed("authorization id differs from the user")
        user = self.users.get(name)
        # Compare even for an unknown user, so timing does not tell.
        expected = user.password if user is not None and user.password is not None else b"\0" * 32
        if not hmac.compare_digest(expected, password) or user is None or user.password is None:
            raise AuthenticationFailed(f"authentication failed for user {name!r} (PLAIN)")
        return user

    # -- SCRAM-SHA-256 ----------------------------------------------------------------------

    def scram(self) -> "ScramExchange":
        return ScramExchange(self)

    def _scram_of(self, name: str):
        user = self.users.get(name)
        if user is not None and user.scram is not None:
            return user, user.scram
        # An unknown user: a stable made-up salt, so two tries look alike.
        salt = hmac.digest(self._fake_salt_key, name.encode("utf-8"), "sha256")[:16]
        return None, (salt, SCRAM_ITERATIONS, os.urandom(32), os.urandom(32))


class ScramExchange:
    """The server side of one SCRAM-SHA-256 exchange: :meth:`step` takes
    each client message and returns the answer; after the second,
    :attr:`user` is the authenticated user."""

    def __init__(self, users: Users):
        self.users = users
        self.user = None
        self._state = "first"
        self._user = self._creds = self._name = None
        self._first_bare = self._server_first = self._nonce = None

    def step(self, message: bytes) -> bytes:
        try:
            text = bytes(message).decode("utf-8")
        except UnicodeDecodeError:
            raise AuthenticationFailed("SCRAM message is not UTF-8") from None
        if self._state == "first":
            return self._first(text)
        if self._state == "final":
            return self._final(text)
        raise AuthenticationFailed("SCRAM exchange already ended")

    def _first(self, text: str) -> bytes:
        # gs2-header: "n,," or "n,a=<authzid>," (no channel binding over plain TCP)
        if not text.startswith(("n,", "y,")):
            raise AuthenticationFailed("SCRAM: channel binding is not supported")
        try:
            _, authzid, bare = text.split(",", 2)
        except ValueError:
            raise AuthenticationFailed("malformed SCRAM client-first message") from None
        attrs = _attributes(bare)
        if "n" not in attrs or "r" not in attrs or not attrs["r"]:
            raise AuthenticationFailed("malformed SCRAM client-first message")
        name = _saslname(attrs["n"])
        if authzid and _saslname(authzid[2:] if authzid.startswith("a=") else authzid) != name:
            raise AuthenticationFailed("authorization id differs from the user")
        self._user, self._creds = self.users._scram_of(name)
        self._name = name
        salt, iterations = self._creds[0], self._creds[1]
        self._nonce = attrs["r"] + server_nonce()
        self._first_bare = bare
        self._server_first = f"r={self._nonce},s={_b64(salt)},i={iterations}"
        self._state = "final"
        return self._server_first.encode("utf-8")

    def _final(self, text: str) -> bytes:
        self._state = "done"
        without_proof, sep, proof_part = text.rpartition(",p=")
        if not sep:
            raise AuthenticationFailed("malformed SCRAM client-final message")
        attrs = _attributes(without_proof)
        if attrs.get("r") != self._nonce:
            raise AuthenticationFailed("SCRAM nonce mismatch")
        try:
            proof = base64.b64decode(proof_part, validate=True)
        except ValueError:
            raise AuthenticationFailed("malformed SCRAM proof") from None
        _, _, stored_key, server_key = self._creds
        auth_message = f"{self._first_bare},{self._server_first},{without_proof}".encode("utf-8")
        signature = hmac.digest(stored_key, auth_message, "sha256")
        if len(proof) != len(signature):
            raise AuthenticationFailed(f"authentication failed for user {self._name!r} (SCRAM-SHA-256)")
        client_key = bytes(a ^ b for a, b in zip(proof, signature))
        if not hmac.compare_digest(hashlib.sha256(client_key).digest(), stored_key) or self._user is None:
            raise AuthenticationFailed(f"authentication failed for user {self._name!r} (SCRAM-SHA-256)")
        self.user = self._user
        return f"v={_b64(hmac.digest(server_key, auth_message, 'sha256'))}".encode("utf-8")


# -- the file ------------------------------------------------------------------------------

def _user(path: str, name, entry) -> User:
    if not isinstance(name, str) or not name:
        raise KafkaUsersFileError(path, f"user name {name!r}: expected a non-empty string")
    if not isinstance(entry, dict):
        raise KafkaUsersFileError(path, f"user {name!r}: expected an object")
    unknown = set(entry) - {"password", "scram_sha_256", "topics", "superuser"}
    if unknown:
        raise KafkaUsersFileError(path, f"user {name!r}: unknown keys {sorted(unknown)}")
    password = entry.get("password")
    if password is not None and (not isinstance(password, str) or not password):
        raise KafkaUsersFileError(path, f"user {name!r}: password must be a non-empty string")
    scram = None
    if "scram_sha_256" in entry:
        scram = _scram_entry(path, name, entry["scram_sha_256"])
    elif password is not None:
        c = scram_credentials(password)
        scram = (base64.b64decode(c["salt"]), c["iterations"], base64.b64decode(c["stored_key"]),
                 base64.b64decode(c["server_key"]))
    if password is None and scram is None:
        raise KafkaUsersFileError(path, f"user {name!r}: needs a password or scram_sha_256 credentials")
    superuser = entry.get("superuser", False)
    if not isinstance(superuser, bool):
        raise KafkaUsersFileError(path, f"user {name!r}: superuser must be true or false")
    topics = entry.get("topics", {})
    if not isinstance(topics, dict):
        raise KafkaUsersFileError(path, f"user {name!r}: topics must map topic patterns to operations")
    acls = {}
    for pattern, ops in topics.items():
        if not isinstance(pattern, str) or not pattern or "*" in pattern[:-1]:
            raise KafkaUsersFileError(path, f"user {name!r}: topic pattern {pattern!r} (a name, or a prefix "
                                            f"ending in *)")
        if not isinstance(ops, list) or not all(isinstance(o, str) for o in ops):
            raise KafkaUsersFileError(path, f"user {name!r}: operations of {pattern!r} must be a list")
        granted = set()
        for op in ops:
            if op == "all":
                granted.update(OPERATIONS)
            elif op in OPERATIONS:
                granted.add(op)
            else:
                raise KafkaUsersFileError(path, f"user {name!r}: operation {op!r} on {pattern!r} "
                                                f"(read, write, describe or all)")
        if granted & {"read", "write"}:
            granted.add("describe")
        acls[pattern] = frozenset(granted)
    return User(name, None if password is None else password.encode("utf-8"), scram, superuser, acls)


def _scram_entry(path: str, name: str, c) -> tuple:
    try:
        salt, iterations = base64.b64decode(c["salt"], validate=True), c["iterations"]
        stored, server = base64.b64decode(c["stored_key"], validate=True), base64.b64decode(c["server_key"],
                                                                                           validate=True)
    except (TypeError, KeyError, ValueError) as e:
        raise KafkaUsersFileError(path, f"user {name!r}: scram_sha_256 needs base64 salt, stored_key and "
                                        f"server_key and an int iterations ({type(e).__name__}: {e})") from None
    if not isinstance(iterations, int) or iterations < SCRAM_MIN_ITERATIONS or len(stored) != 32 \
            or len(server) != 32 or not salt:
        raise KafkaUsersFileError(path, f"user {name!r}: scram_sha_256 needs iterations >= "
                                        f"{SCRAM_MIN_ITERATIONS} and 32-byte keys")
    return salt, iterations, stored, server


def _attributes(text: str) -> dict:
    out = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if sep and len(key) == 1:
            out.setdefault(key, value)
    return out


def _saslname(text: str) -> str:
    return text.replace("=2C", ",").replace("=3D", "=")


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")
