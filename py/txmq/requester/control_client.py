"""The requester's side of the owner's control socket (the
protocol in :mod:`txmq.broker.control_socket`): :func:`request` asks the
process that owns a data directory, or — when no process owns it — takes
the lock, does the work itself with a :class:`~txmq.broker.broker.Broker`
of its own and lets the lock go.
"""

from __future__ import annotations

import json
import os
import socket
import time

from txmq import errors
from txmq.broker.broker import Broker
from txmq.broker.control_socket import SOCKET_NAME, address_of, read_line, run_handlers
from txmq.errors import DataDirLockedError, RequestInterruptedError, TxmqError


def _ask(path: str, req: dict, timeout: float) -> dict:
    address, fd = address_of(path)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(address)
            s.sendall(json.dumps(req).encode() + b"\n")
            line = read_line(s)
    finally:
        if fd >= 0:
            os.close(fd)
    if not line:
        raise ConnectionResetError("the owner closed the control connection without an answer")
    return json.loads(line)


def _raise(answer: dict):
    cls = getattr(errors, answer.get("error", ""), None)
    if not (isinstance(cls, type) and issubclass(cls, TxmqError)):
        cls = TxmqError
    e = TxmqError.__new__(cls)
    TxmqError.__init__(e, answer.get("message", "control request failed"))
    for k, v in (answer.get("attrs") or {}).items():
        setattr(e, k, v)              # path and position of a CorruptLogError, say
    raise e


def request(data_dir, req: dict, *, timeout: float = 120.0) -> dict:
    """Run one control request on ``data_dir``: through its owner's control
    socket, or, when no process owns the directory, in this process with
    the directory opened (and closed again) here. If the owner dies during
    the request, an idempotent one (every op but an ``ingest`` without a
    sink) is asked again the same way; an ingest without a sink raises
    :class:`RequestInterruptedError` (its outcome is unknown)."""
    data_dir = os.path.abspath(os.fspath(data_dir))
    path = os.path.join(data_dir, SOCKET_NAME)
    deadline = time.monotonic() + timeout
    while True:
        try:
            answer = _ask(path, req, max(deadline - time.monotonic(), 1.0))
        except (FileNotFoundError, ConnectionRefusedError):
            answer = None                 # no owner listening (or one that died)
        except (ConnectionResetError, BrokenPipeError):
            # The owner went away during the request. Asking again (another
            # owner, or this process) is safe only for a request that
            # happens once however often it is asked.
            if req.get("op") == "ingest" and req.get("sink") is None:
                raise RequestInterruptedError(data_dir, req.get("op")) from None
            answer = None
        if answer is not None:
            if not answer.get("ok"):
                _raise(answer)
            return answer
        try:
            with Broker(data_dir, control_socket=False) as broker:
                return run_handlers(broker._control_handlers(), req)
        except DataDirLockedError:
            # An owner is starting (socket not bound yet) or stopping.
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
