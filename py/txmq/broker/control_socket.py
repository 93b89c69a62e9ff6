"""The owner's control socket (docs/ARCHITECTURE.md): ``<data>/control.sock``.

The process that holds a data directory listens on a Unix stream socket in
it (mode 0600) for local requests; other processes write through it. A
request is one JSON object on one line, the answer another:

    {"op": "ping"}                                  -> {"ok": true, "pid": ...}
    {"op": "ingest", "job": J, "attempts": [...],
     "sink": null | [key, batch_id]}                -> {"ok": true, "messages": n, "skipped": bool}
    {"op": "last_batch", "sink": key}               -> {"ok": true, "batch_id": n}
    {"op": "discard", "job": J}                     -> {"ok": true}

A failure answers ``{"ok": false, "error": "<txmq.errors class>",
"message": ..., "attrs": {...}}`` and the requester raises that error, with
its attributes (a CorruptLogError's path and position, say).

This module is the owner's side (:class:`ControlServer`) and the wire
protocol both sides speak; the requester's side is
:func:`txmq.requester.control_client.request`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading

from txmq.errors import InvalidArgumentError, TxmqError

log = logging.getLogger("txmq.control")

SOCKET_NAME = "control.sock"
MAX_REQUEST_BYTES = 1 << 20
UNIX_PATH_MAX = 107


def address_of(path: str):
    """A name to bind or connect ``path`` by: the path itself, or, when it
    is longer than a Unix socket address may be, the same file reached
    through ``/proc/self/fd`` of its directory. Returns (address, fd to
    close or -1)."""
    if len(path.encode()) <= UNIX_PATH_MAX:
        return path, -1
    fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
    return f"/proc/self/fd/{fd}/{os.path.basename(path)}", fd


class ControlServer:
    """Serves one broker's control socket on a thread of its own; each
    connection gets a thread (requests are short, and ingest requests are
    serialised by the broker's Ingester)."""

    def __init__(self, broker, handlers: dict):
        self.broker = broker
        self.handlers = handlers
        self.path = os.path.join(broker.path, SOCKET_NAME)
        try:
            os.unlink(self.path)          # left by a process that died holding the directory
        except FileNotFoundError:
            pass
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address, fd = address_of(self.path)
        old = os.umask(0o177)             # created 0600: only this user may ask
        try:
            self.sock.bind(address)
        finally:
            os.umask(old)
            if fd >= 0:
                os.close(fd)
        self.sock.listen(64)
        self.sock.settimeout(1.0)         # (close wakes it sooner)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="txmq-control", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), name="txmq-control-conn", daemon=True).start()

    def _handle(self, conn) -> None:
        with conn:
            try:
                answer = run_handlers(self.handlers, json.loads(read_line(conn)))
            except TxmqError as e:
                attrs = {k: v for k, v in vars(e).items() if isinstance(v, (str, int, float, bool, type(None)))}
                answer = {"ok": False, "error": type(e).__name__, "message": str(e), "attrs": attrs}
            except Exception as e:       # noqa: BLE001 - answered, not lost: the requester raises it
                log.exception("control request failed")
                answer = {"ok": False, "error": "TxmqError", "message": f"{type(e).__name__}: {e}"}
            try:
                conn.sendall(json.dumps(answer).encode() + b"\n")
            except OSError:
                pass                     # the requester went away

    def close(self) -> None:
        self._stop.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)      # wakes the accept() at once (Linux)
        except OSError:
            pass
        self.sock.close()
        self._thread.join(timeout=5)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def run_handlers(handlers: dict, req) -> dict:
    """The answer of the handler of ``req``'s op (the owner's and a
    requester's own, when no process owns the directory)."""
    handler = handlers.get(req.get("op")) if isinstance(req, dict) else None
    if handler is None:
        raise InvalidArgumentError("op", req.get("op") if isinstance(req, dict) else req,
                                   " | ".join(sorted(handlers)))
    return {"ok": True, **(handler(req) or {})}


def read_line(conn) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        buf += chunk
        if len(buf) > MAX_REQUEST_BYTES:
            raise InvalidArgumentError("request", f"{len(buf)} bytes", f"at most {MAX_REQUEST_BYTES} bytes")
    return buf
