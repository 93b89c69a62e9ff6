"""Producers: append messages to a topic's partitions."""

from __future__ import annotations

import itertools
import random

import numpy as np

from txmq._log import BatchSpec
from txmq._partitioner import partition_for, partitions_for_arrow, partitions_for_list
from txmq.errors import (BrokerClosedError, InvalidArgumentError, InvalidMessageError, PartitionNotFoundError,
                         ProducerFencedError)
from txmq.message import MessageId, MessageIds


class Producer:
    """Sends to one topic. Thread-safe; cheap to create.

    Without a key, each ``send`` / ``send_batch`` goes to the next partition
    in turn; with a key, to the partition Kafka's default partitioner picks
    (murmur2), so keyed data lands where a Kafka client would put it.

    Every producer is idempotent (DESIGN.md §4): it has a producer id, an
    epoch, and per partition a sequence that each batch carries, so a batch
    sent again with its sequence (``sequence=``) is appended once and
    answers with its original ids. A named producer
    (``broker.producer(topic, name="svc-a")``) keeps its producer id across
    restarts and continues its sequences (:attr:`last_sequence`); opening
    the same name on the topic again fences this instance. A producer of a
    :class:`~txmq.TransactionalProducer` sends only in that producer's
    transactions.
    """

    __slots__ = ("_broker", "_topic", "_rr", "closed", "producer_id", "epoch", "name", "fenced", "_owner",
                 "_fence", "__weakref__")

    def __init__(self, broker, topic, producer_id: int, epoch: int = 0, name: str | None = None,
                 owner=None):
        self._broker = broker
        self._topic = topic
        self._rr = itertools.count(random.randrange(1 << 16))
        self.closed = False
        self.producer_id = producer_id
        self.epoch = epoch
        self.name = name
        self.fenced = False
        self._owner = owner                       # a TransactionalProducer, or None
        # Checked under the partition lock: the owner for a transactional
        # producer's producers, this instance for a named one.
        self._fence = owner if owner is not None else self if name is not None else None

    @property
    def topic(self) -> str:
        return self._topic.name

    def _partition(self, key, partition):
        parts = self._topic.partitions
        if partition is not None:
            if not isinstance(partition, int) or not 0 <= partition < len(parts):
                raise PartitionNotFoundError(self._topic.name, partition)
            return parts[partition]
        if key is not None and len(parts) > 1:
            return parts[partition_for(key, len(parts))]
        return parts[next(self._rr) % len(parts)]

    @property
    def last_sequence(self) -> dict:
        """``{partition: last sequence}`` this producer id appended to each
        partition of the topic (-1: none yet). A restarted named producer
        resends from here; its next sends continue after it."""
        return {p.index: p.last_sequence(self.producer_id) for p in self._topic.partitions}

    def fenced_error(self) -> ProducerFencedError:
        return ProducerFencedError(self.name, self.epoch, f"opened again on topic {self._topic.name!r}")

    def _check_open(self):
        if self.closed:
            raise BrokerClosedError(f"producer of {self._topic.name!r} is closed")
        self._broker._check_open()
        if self._fence is not None and self._fence.fenced:
            raise self._fence.fenced_error()

    def _append(self, p, spec, txn, sequence):
        if txn is None:
            if self._owner is not None:
                raise InvalidArgumentError("txn", None, f"a transaction of transactional producer "
                                                        f"{self._owner.transactional_id!r} (begin())")
            return p.append(spec, 0, None, self.producer_id, self.epoch, sequence, None, self._fence)
        meta = txn._checked_meta(self._broker)
        if self._owner is not None and meta.owner is not self._owner:
            raise InvalidArgumentError("txn", txn, f"a transaction of transactional producer "
                                                   f"{self._owner.transactional_id!r} (begin())")
        if meta.partitions.get((p.topic, p.index)) is not p:
            self._broker._coordinator_of(meta).register_partition(meta, p)
        return p.append(spec, 0, meta, self.producer_id, self.epoch, sequence, None, self._fence)

    def send(self, value, key=None, headers=None, event_time=None, partition=None, txn=None,
             sequence: int | None = None) -> MessageId:
        """Append one message; return its :class:`MessageId` once it is in the
        log (and durable, under ``fsync="always"``).

        ``value`` and ``key`` are bytes (a str key is UTF-8 encoded);
        ``headers`` a dict or a list of (str, bytes) pairs; ``event_time``
        int milliseconds (default: the publish time); ``partition``
        overrides the partitioner; ``txn`` makes the message part of that
        transaction (visible to READ_COMMITTED readers once it commits, and
        made durable by the commit rather than by this call). Raises
        :class:`~txmq.errors.TransactionTimeoutError` /
        :class:`~txmq.errors.InvalidTxnStateError` when ``txn`` is no longer
        open.

        ``sequence`` sends with an explicit sequence number (int32) for the
        target partition instead of the next one: resending a sequence that
        is among the partition's last 5 batches of this producer returns the
        original MessageId and appends nothing (retries after a timeout or a
        crash). Sequences are per partition, so on a topic of several
        partitions ``sequence`` needs ``partition=`` or ``key=`` (a resend
        must reach the same partition). A gap raises :class:`~txmq.errors.OutOfOrderSequenceError`,
        an older sequence :class:`~txmq.errors.DuplicateSequenceError`. A
        fenced instance raises :class:`~txmq.errors.ProducerFencedError`.
        """
        if self.closed or self._broker._closed or self._owner is not None:
            # (a fenced named producer is refused under the partition lock)
            self._check_open()
        if key is not None and type(key) is not bytes:
            key = _key_bytes(key)
        if event_time is not None and type(event_time) is not int:
            raise InvalidMessageError("event_time (expected int milliseconds)", event_time)
        if sequence is None:
            sequence = -1
        elif type(sequence) is not int or not 0 <= sequence < SEQUENCE_LIMIT:
            raise InvalidArgumentError("sequence", sequence, "an int from 0 to 2**31 - 1")
        spec = BatchSpec([value], None if key is None else [key], [headers] if headers else None,
                         None if event_time is None else [event_time])
        parts = self._topic.partitions
        if sequence >= 0 and partition is None and key is None and len(parts) > 1:
            raise _unrouted(sequence)
        if partition is not None or (key is not None and len(parts) > 1):
            p = self._partition(key, partition)
        else:
            p = parts[next(self._rr) % len(parts)]
        if txn is None and self._owner is None:
            return _new_id(MessageId, (self._topic.name, p.index,
                                       p.append(spec, 0, None, self.producer_id, self.epoch, sequence, None,
                                                self._fence)))
        return _new_id(MessageId, (self._topic.name, p.index, self._append(p, spec, txn, sequence)))

    def send_batch(self, values, keys=None, headers=None, event_times=None, partition=None,
                   txn=None, sequence: int | None = None) -> MessageIds:
        """Append many messages; return their ids in input order.

        ``values`` is a list of bytes or a pyarrow binary/string array (the
        array's bytes are copied once, straight into the log, with no
        per-message Python work). Messages bound for one partition form one
        batch; without keys the whole call goes to one partition. ``txn``
        makes every message part of that transaction.

        ``sequence`` is the batch's base sequence (the messages take
        ``sequence`` .. ``sequence + n - 1``), with the rules of
        :meth:`send`; on a topic of several partitions it needs
        ``partition=``.
        """
        self._check_open()
        if sequence is None:
            sequence = -1
        elif type(sequence) is not int or not 0 <= sequence < SEQUENCE_LIMIT:
            raise InvalidArgumentError("sequence", sequence, "an int from 0 to 2**31 - 1")
        if isinstance(values, tuple):
            values = list(values)
        if isinstance(keys, tuple):
            keys = list(keys)
        parts = self._topic.partitions
        n = len(values)
        if not n:
            raise InvalidMessageError("values (a batch needs at least one message)", values)
        if sequence >= 0 and partition is None and len(parts) > 1:
            raise _unrouted(sequence)
        if partition is not None or keys is None or len(parts) == 1:
            p = self._partition(None, partition)
            spec = BatchSpec(values, keys, headers, event_times)
            base = self._append(p, spec, txn, sequence)
            return MessageIds(self._topic.name, np.full(n, p.index, np.int32),
                              np.arange(base, base + n, dtype=np.int64))
        if len(keys) != n:
            raise InvalidMessageError(f"keys (expected {n} entries)", len(keys))
        if isinstance(keys, list):
            targets = partitions_for_list(keys, len(parts))
        else:
            targets = partitions_for_arrow(keys, len(parts))
        nulls = targets < 0
        if nulls.any():
            targets[nulls] = next(self._rr) % len(parts)
        offsets = np.empty(n, np.int64)
        for pi in np.unique(targets):
            idx = np.flatnonzero(targets == pi)
            spec = BatchSpec(_take(values, idx), _take(keys, idx),
                             None if headers is None else [headers[i] for i in idx],
                             None if event_times is None else np.asarray(event_times)[idx])
            base = self._append(parts[pi], spec, txn, -1)
            offsets[idx] = np.arange(base, base + len(idx), dtype=np.int64)
        return MessageIds(self._topic.name, targets, offsets)

    def append_spec(self, spec: BatchSpec, partition: int, txn=None, sequence: int = -1) -> int:
        """Append a prepared :class:`~txmq._log.BatchSpec` (for instance
        ``BatchSpec.from_columns``) to ``partition`` as one batch; return
        its base offset. The bulk path of front ends that decode messages
        themselves (the Kafka server); ``txn`` and ``sequence`` (-1: the
        next) as in :meth:`send_batch`."""
        self._check_open()
        if type(sequence) is not int or not -1 <= sequence < SEQUENCE_LIMIT:
            raise InvalidArgumentError("sequence", sequence, "-1 or an int from 0 to 2**31 - 1")
        return self._append(self._partition(None, partition), spec, txn, sequence)

    def flush(self) -> None:
        """Sends are written when they return; kept for Kafka-style code."""

    def close(self) -> None:
        self.closed = True
        if self.name is not None:
            self._broker._named_closed(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


SEQUENCE_LIMIT = 1 << 31
_new_id = tuple.__new__   # MessageId without its Python-level __new__: the send hot path


def _unrouted(sequence: int) -> InvalidArgumentError:
    return InvalidArgumentError("sequence", sequence, "a send with partition= (or, for send(), key=): "
                                "sequences are per partition, and round-robin would send a resend "
                                "to another one")


def _key_bytes(key) -> bytes:
    if isinstance(key, str):
        return key.encode()
    if isinstance(key, (bytearray, memoryview)):
        return bytes(key)
    raise InvalidMessageError("key (expected bytes, str or None)", key)


def _take(seq, idx):
    if isinstance(seq, list):
        return [seq[i] for i in idx]
    return seq.take(idx)
