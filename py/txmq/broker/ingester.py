"""Staged ingest, the owner's side: the broker appends the
listed staged attempts of a job as one transaction, once per sink batch
id, and deletes the job's staging. The requester's side is
:mod:`txmq.requester.staged_ingest`; the staging directory,
:mod:`txmq.storage.staging`.

A commit may carry a ``sink`` key and a batch id (a streaming query's
persistent id and micro-batch): the last committed batch id of each sink is
recorded in the topic ``txmq.sinks`` in the same transaction, and a batch
id at or below it is not appended again, so a micro-batch replayed after a
crash commits once.
"""

from __future__ import annotations

import os
import shutil
import threading

from txmq import crashpoints
from txmq.errors import InvalidArgumentError, StagingError, TopicNotFoundError, TxmqError
from txmq.storage.staging import attempt_files, check_name, open_staged, staged_batches, staging_dir

SINKS_TOPIC = "txmq.sinks"


def check_sink(sink) -> tuple:
    """``sink`` as (non-empty str key, int batch id >= 0)."""
    try:
        key, batch_id = sink
    except (TypeError, ValueError):
        key = batch_id = None
    if not isinstance(key, str) or not key or type(batch_id) is not int or batch_id < 0:
        raise InvalidArgumentError("sink", sink, "(non-empty str key, int batch id >= 0)")
    return key, batch_id


class Ingester:
    """The owner's side of staged ingest (one per broker; requests run one
    at a time, so a sink's batch id is checked and recorded atomically)."""

    def __init__(self, broker):
        self.broker = broker
        self.lock = threading.Lock()
        self._sinks: dict | None = None      # sink key -> last committed batch id

    def _sink_progress(self) -> dict:
        """The last committed batch id of every sink, from ``txmq.sinks``."""
        if self._sinks is None:
            sinks = {}
            if SINKS_TOPIC in self.broker.topics():
                p = self.broker._topics[SINKS_TOPIC].partitions[0]
                offset, end = p.start_offset, p.max_read_position
                while offset < end:
                    got = p.read(offset, 10_000, end)
                    if not got:
                        break
                    for off, key, value, _, _, _, info in got:
                        if not p.never_delivered(info, True):
                            sinks[key.decode()] = max(sinks.get(key.decode(), -1), int(value))
                        offset = off + 1
            self._sinks = sinks
        return self._sinks

    def last_batch(self, sink: str) -> int:
        """The last batch id committed for ``sink`` (-1: none)."""
        if not isinstance(sink, str) or not sink:
            raise InvalidArgumentError("sink", sink, "a non-empty str")
        with self.lock:
            return self._sink_progress().get(sink, -1)

    def ingest(self, job: str, attempts, sink=None) -> dict:
        """Append the listed attempts of ``job`` as one transaction, then
        delete the job's staging directory. ``sink`` = (key, batch id):
        skipped (and the staging deleted) when that batch id was committed
        already; recorded in ``txmq.sinks`` in the same transaction
        otherwise. Returns ``{"messages", "skipped"}``."""
        broker = self.broker
        jdir = staging_dir(broker.path, job)
        if isinstance(attempts, (str, bytes)):
            raise InvalidArgumentError("attempts", attempts, "a list of attempt names")
        try:
            attempts = [check_name("attempt", a) for a in attempts]
        except TypeError:
            raise InvalidArgumentError("attempts", attempts, "a list of attempt names") from None
        if sink is not None:
            sink = check_sink(sink)
        with self.lock:
            if sink is not None:
                key, batch_id = sink
                if batch_id <= self._sink_progress().get(key, -1):
                    shutil.rmtree(jdir, ignore_errors=True)
                    return {"messages": 0, "skipped": True}
            files = [f for a in attempts for f in attempt_files(os.path.join(jdir, a))]
            for topic, part, path in files:
                if topic not in broker.topics():
                    raise TopicNotFoundError(topic)
                if part >= len(broker._topics[topic].partitions):
                    raise StagingError(f"{path}: partition {part} of {topic!r} does not exist")
            producers = {}
            messages = 0
            segments = []
            txn = None
            committed = False
            try:
                for topic, part, path in files:       # all checked before anything is appended
                    segments.append(open_staged(path))
                txn = broker.new_transaction(timeout=broker.transaction_timeout_max)
                for (topic, part, path), seg in zip(files, segments):
                    p = producers.get(topic) or producers.setdefault(topic, broker.producer(topic))
                    for values, keys, headers, event_times in staged_batches(seg):
                        p.send_batch(values, keys=keys, headers=headers, event_times=event_times,
                                     partition=part, txn=txn)
                        messages += len(values)
                if sink is not None:
                    if SINKS_TOPIC not in broker.topics():
                        broker.create_topic(SINKS_TOPIC, 1)
                    broker.producer(SINKS_TOPIC).send(str(batch_id).encode(), key=key.encode(), txn=txn)
                if crashpoints.ARMED:
                    crashpoints.reached("ingest.appended")
                txn.commit()
                committed = True
                if crashpoints.ARMED:
                    crashpoints.reached("ingest.committed")
            finally:
                if not committed and txn is not None:
                    try:
                        txn.abort()
                    except TxmqError:
                        pass           # decided already (a commit failing half way ends by retry)
                for seg in segments:
                    seg.close(False)
            if sink is not None:
                self._sinks[key] = batch_id
        shutil.rmtree(jdir, ignore_errors=True)
        return {"messages": messages, "skipped": False}

    def discard(self, job: str) -> None:
        """Delete every staged attempt of ``job``."""
        shutil.rmtree(staging_dir(self.broker.path, job), ignore_errors=True)
