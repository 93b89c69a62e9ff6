"""``txmq.readonly``: a data directory opened read-only, from any process,
whether another process holds it or not (docs/API.md). The public name of
:mod:`txmq.requester.read_only_directory`, which holds the view (and
:mod:`txmq.requester.arrow_scan`, its Arrow batches); nothing
else lives here (docs/ARCHITECTURE.md).

>>> import txmq.readonly
>>> ro = txmq.readonly.open("data")                # doctest: +SKIP
"""

from txmq.requester.arrow_scan import arrow_schema
from txmq.requester.read_only_directory import (GATHER_BELOW, MARKER_ABORT, TRANSACTIONAL, PartitionView,
                                                ReadOnlyDirectory, ReadView, open, read_readview, writer_pid)

__all__ = ["GATHER_BELOW", "MARKER_ABORT", "PartitionView", "ReadOnlyDirectory", "ReadView", "TRANSACTIONAL",
           "arrow_schema", "open", "read_readview", "writer_pid"]
