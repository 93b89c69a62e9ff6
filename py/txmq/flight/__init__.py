"""Arrow Flight for txmq: the owner serves its data directory to Spark
executors (and any Flight client) that cannot open it themselves
(docs/SPARK_CLUSTER.md).

- :mod:`txmq.flight.wire`: descriptors, tickets, actions, the token file;
- :mod:`txmq.flight.server`: :class:`FlightService`, started by
  :func:`serve_flight`;
- :mod:`txmq.flight.client`: :class:`FlightTarget` and the connection the
  Spark source and sink use.
"""

from txmq.flight.client import FlightTarget, connect
from txmq.flight.server import FlightService, serve_flight

__all__ = ["serve_flight", "FlightService", "FlightTarget", "connect"]
