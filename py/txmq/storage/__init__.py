"""The storage layer: a partition's files and what they hold.

- ``layout``: the name of every file of a partition directory, and the
  fixed layouts of its side files (recovery point, snapshots, .txnindex);
- ``index``: a segment's offset and time indexes;
- ``loader``: the one walk over a partition's segments at open, in
  writer, read-only and check mode;
- ``log``: the segments, indexes, recovery point, durability and reads;
- ``txnbuffer``: open and aborted transactions and the .txnindex files;
- ``producer_state``: idempotent producers;
- ``retention``: which segments may be deleted;
- ``delivery``: what a read_committed or read_uncommitted reader may see
  at a position (subscriptions and the read-only view);
- ``partition``: the writer's :class:`~txmq.storage.partition.Partition`,
  a log with its transaction buffer and producer state under one lock;
- ``topic``: a topic's partitions and ``topic.json``;
- ``cursor``: a subscription's cursor log (mark-delete and acks);
- ``datadir``: the data directory, its marker file and its lock;
- ``half_messages``: the half-message store (half log, state table, redo
  log, check-back);
- ``staging``: the staging directory of staged ingest.

Nothing here imports the broker, dispatch, the clients or the requester;
from ``txmq.transactions`` only the ids and records (docs/ARCHITECTURE.md).
"""
