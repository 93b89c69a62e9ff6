"""Exactly-once functions: a user function over input topics into an output
topic, one broker transaction per step, with event-time windows whose state
lives in a state topic written in the same transactions.

>>> from txmq.functions import Function, Tumbling          # doctest: +SKIP
>>> totals = Function(broker, "totals", ["clicks", "views"], "per-minute",
...                   lambda m: 1, window=Tumbling(60_000),
...                   max_out_of_orderness_ms=5_000)
>>> totals.run(idle_timeout=1.0)

Modules: :mod:`~txmq.functions.runner` (steps, retries, dead letters,
metrics), :mod:`~txmq.functions.windows` (windows, watermark, state
snapshot), :mod:`~txmq.functions.lanes` (who owns a lane's state, fencing,
restore).
"""

from txmq.functions.runner import Function, Record
from txmq.functions.windows import Sliding, Tumbling

__all__ = ["Function", "Record", "Sliding", "Tumbling"]
