"""Arrow Flight for txmq: the owner serves its data directory to Spark
executors (and any Flight client) that cannot open it themselves
(docs/SPARK_CLUSTER.md).

- :mod:`txmq.flight.wire`: descriptors, tickets, actions, the token file;
- :mod:`txmq.flight.server`: :class:`FlightService`, started by
  :meth:`txmq.Broker.serve_flight`;
- :mod:`txmq.flight.client`: :class:`FlightTarget` and the connection the
  Spark source and sink use.

Importing this package does not import ``pyarrow.flight``; its modules do.
"""

from __future__ import annotations

__all__ = ["FlightService", "FlightTarget", "connect"]


def __getattr__(name):
    if name == "FlightService":
        from txmq.flight.server import FlightService
        return FlightService
    if name in ("FlightTarget", "connect"):
        from txmq.flight import client
        return getattr(client, name)
    raise AttributeError(name)
