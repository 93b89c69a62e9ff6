"""``txmq.ingest``: staged ingest, other processes appending to a data
directory as one atomic step (docs/API.md). The public names
of three modules (docs/ARCHITECTURE.md); nothing else lives here:

- :mod:`txmq.requester.staged_ingest`: the requester's side,
  :class:`StagedWriter` and :func:`commit`, :func:`last_batch`,
  :func:`abort`;
- :mod:`txmq.broker.ingester`: the owner's side, :class:`Ingester`;
- :mod:`txmq.storage.staging`: the staging directory and
  :func:`clean_staging`.
"""

from txmq.broker.ingester import SINKS_TOPIC, Ingester
from txmq.requester.staged_ingest import StagedWriter, abort, check_sink_schema, commit, last_batch
from txmq.storage.staging import (ABORTED, COMPLETE, STAGED_AGE_S, STAGED_SEGMENT_BYTES, STAGING, TOMBSTONE_AGE_S,
                                  clean_staging, staging_dir, topic_partitions)

__all__ = ["ABORTED", "COMPLETE", "Ingester", "SINKS_TOPIC", "STAGED_AGE_S", "STAGED_SEGMENT_BYTES", "STAGING",
           "StagedWriter", "TOMBSTONE_AGE_S", "abort", "check_sink_schema", "clean_staging", "commit", "last_batch", "staging_dir",
           "topic_partitions"]
