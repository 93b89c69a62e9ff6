"""``txmq.control``: the owner's control socket, ``<data>/control.sock``
(docs/API.md). The public names of two modules
(docs/ARCHITECTURE.md); nothing else lives here:

- :func:`request` (:mod:`txmq.requester.control_client`): run one request
  through the owner, or, when no process owns the directory, here;
- :class:`ControlServer` and the protocol (:mod:`txmq.broker.control_socket`).
"""

from txmq.broker.control_socket import MAX_REQUEST_BYTES, SOCKET_NAME, UNIX_PATH_MAX, ControlServer
from txmq.requester.control_client import request

__all__ = ["ControlServer", "MAX_REQUEST_BYTES", "SOCKET_NAME", "UNIX_PATH_MAX", "request"]
