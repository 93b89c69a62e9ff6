"""``txmq.readonly``: a data directory opened read-only, from any process,
whether another process holds it or not (docs/API.md). The public name of
:mod:`txmq.requester.read_only_directory`, which holds the view; nothing
else lives here (docs/ARCHITECTURE.md).

>>> import txmq.readonly
>>> ro = txmq.readonly.open("data")                # doctest: +SKIP
"""

from txmq.requester.read_only_directory import (GATHER_BELOW, MARKER_ABORT, TRANSACTIONAL, PartitionView,
                                                ReadOnlyDirectory, ReadView, arrow_schema, open, read_readview,
                                                writer_pid)

__all__ = ["GATHER_BELOW", "MARKER_ABORT", "PartitionView", "ReadOnlyDirectory", "ReadView", "TRANSACTIONAL",
           "arrow_schema", "open", "read_readview", "writer_pid"]
