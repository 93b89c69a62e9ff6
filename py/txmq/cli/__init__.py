"""The ``txmq`` command line (docs/CLI.md).

One module per concern: ``app`` (arguments, dispatch, exit codes),
``opening`` (the one way commands open a data directory), ``admin``
(topics, subscriptions, transactions, stats), ``produce``, ``consume``,
``check`` (read-only verification of a directory's files), ``bench``,
``output`` (tables, JSON, progress) and ``demo``.
"""

from txmq.cli.app import main
from txmq.cli.demo import demo

__all__ = ["demo", "main"]
