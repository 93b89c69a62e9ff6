"""Producers: append messages to a topic's partitions."""

from __future__ import annotations

import itertools
import random
import sys
import threading

import numpy as np

from txmq._accumulator import bind_producer_send, producer_send
from txmq._batch import BatchSpec
from txmq._partitioner import partition_for, partitions_for_arrow, partitions_for_list
from txmq.errors import (BrokerClosedError, InvalidArgumentError, InvalidMessageError, PartitionNotFoundError,
                         ProducerFencedError, TopicNotFoundError)
from txmq.message import MessageId, MessageIds
from txmq.storage.topic import PartitionStub
from txmq.client.transaction import Transaction, meta_of
from txmq.transactions.records import TxnState

bind_producer_send(Transaction, TxnState.OPEN, MessageId)


class Producer:
    """Sends to one topic. Thread-safe; cheap to create.

    Without a key, each ``send`` / ``send_batch`` goes to the next partition
    in turn; with a key, to the partition Kafka's default partitioner picks
    (murmur2), so keyed data lands where a Kafka client would put it.

    Every producer is idempotent (docs/FORMAT.md, "Idempotent producers"): it has a producer id, an
    epoch, and per partition a sequence that each batch carries, so a batch
    sent again with its sequence (``sequence=``) is appended once and
    answers with its original ids. A named producer
    (``broker.producer(topic, name="svc-a")``) keeps its producer id across
    restarts and continues its sequences (:attr:`last_sequence`); opening
    the same name on the topic again fences this instance. A producer of a
    :class:`~txmq.TransactionalProducer` sends only in that producer's
    transactions.

    A batching producer (``broker.producer(topic, batching=True)``, Pulsar's
    ``enableBatching``, Kafka's ``linger.ms``) batches its one-message sends
    outside transactions too: ``send`` returns at once with a
    :class:`~txmq._accumulator.PendingMessageId`, and the message reaches the
    log with its batch (docs/API.md, "A batching producer").
    """

    __slots__ = ("_broker", "_topic", "_rr", "closed", "producer_id", "epoch", "name", "fenced", "_owner",
                 "_fence", "_batching", "_accs", "_plain", "_acc_lock", "_batched", "__weakref__")

    def __init__(self, broker, topic, producer_id: int, epoch: int = 0, name: str | None = None,
                 owner=None, batching: bool = False):
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
        self._batching = broker._batching      # the broker's send accumulators (client/accumulator.py)
        self._accs: dict = {}                  # partition -> its accumulator for a transaction there
        self._plain: dict = {}                 # partition -> its accumulator outside transactions (batching)
        self._acc_lock = threading.Lock()      # opening accumulators
        # Sends outside transactions accumulate too (never for the producer
        # of a transactional producer: it sends only inside them).
        self._batched = batching and owner is None and broker._batching.enabled

    @property
    def topic(self) -> str:
        return self._topic.name

    def _partition(self, key, partition):
        parts = self._topic.partitions
        if partition is not None:
            if type(partition) is not int or not 0 <= partition < len(parts):   # (bools are not partitions)
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
        if self._broker._topics.get(self._topic.name) is not self._topic:
            raise TopicNotFoundError(self._topic.name)     # deleted since this producer was made
        if self._fence is not None and self._fence.fenced:
            raise self._fence.fenced_error()

    def _flush_partition(self, p) -> None:
        """Append what this producer has pending on ``p`` (its batch for a
        transaction, its batch outside transactions) before anything else it
        sends there: its sends keep their order."""
        self._flush_txn_batch(p)
        self._flush_plain_batch(p)

    def _flush_txn_batch(self, p) -> None:
        acc = self._accs.get(p)
        # (pending: also a batch another thread is appending; an ended
        # transaction's leftovers were dropped with it, or raise through its ids)
        if acc is not None and acc.pending and acc.meta.state is TxnState.OPEN:
            try:
                self._batching.flush(acc)
            except Exception:
                pass              # kept in the accumulator: its transaction's commit raises it

    def _flush_plain_batch(self, p) -> None:
        acc = self._plain.get(p)
        if acc is not None and (acc.pending or acc.error is not None):
            # Raises what failed there: nothing this producer sends to ``p``
            # goes past a batch of its that the log refused.
            self._batching.flush(acc)

    def _open_accumulator(self, p, txn, meta):
        """This producer's accumulator for ``txn`` on ``p``: a batch it had
        open there for another transaction is appended first."""
        with self._acc_lock:
            old = self._accs.get(p)
            if old is not None:
                if old.meta is meta:
                    return old            # (another thread opened it meanwhile)
                self._flush_txn_batch(p)
            if not p._segments:
                raise p._closed_error()
            acc = self._accs[p] = self._batching.open(self, p, txn)
            return acc

    def _open_plain(self, p):
        """This batching producer's accumulator outside transactions on
        ``p``: one per partition, for the producer's life."""
        with self._acc_lock:
            acc = self._plain.get(p)
            if acc is None:
                if not p._segments:
                    raise p._closed_error()
                acc = self._plain[p] = self._batching.open(self, p, None)
            return acc

    def _append(self, p, spec, txn, sequence):
        if self._accs or self._plain:
            self._flush_partition(p)
        if txn is None:
            if self._owner is not None:
                raise InvalidArgumentError("txn", None, f"a transaction of transactional producer "
                                                        f"{self._owner.transactional_id!r} (begin())")
            return p.append(spec, 0, None, self.producer_id, self.epoch, sequence, None, self._fence)
        meta = meta_of(txn, self._broker)
        if self._owner is not None and meta.owner is not self._owner:
            raise InvalidArgumentError("txn", txn, f"a transaction of transactional producer "
                                                   f"{self._owner.transactional_id!r} (begin())")
        if meta.partitions.get((p.topic, p.index)) is not p:
            if type(p) is PartitionStub:
                self._topic.open_partition(p)    # a participant is an open partition (txmq.storage.topic)
            self._broker._coordinator_of(meta).register_partition(meta, p)
        return p.append(spec, 0, meta, self.producer_id, self.epoch, sequence, None, self._fence)

    send = producer_send     # (compiled: a batched send in one call; the rest is _send's)

    def _send(self, value, key=None, headers=None, event_time=None, partition=None, txn=None,
              sequence: int | None = None) -> MessageId:
        """:meth:`send` (``txmq._accumulator.producer_send``, its
        docstring): every send but the batched ones it takes itself."""
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
        parts = self._topic.partitions
        if sequence >= 0 and partition is None and key is None and len(parts) > 1:
            raise _unrouted(sequence)
        if partition is not None:          # (_partition, inline: every send)
            if type(partition) is not int or not 0 <= partition < len(parts):   # (bools are not partitions)
                raise PartitionNotFoundError(self._topic.name, partition)
            p = parts[partition]
        elif key is not None and len(parts) > 1:
            p = parts[partition_for(key, len(parts))]
        elif len(parts) == 1:
            p = parts[0]
        else:
            p = parts[next(self._rr) % len(parts)]
        if sequence < 0 and (self._batched if txn is None else self._batching.linger_ms):
            # Batched (client/accumulator.py): everything a send can refuse
            # by itself is refused here; the append comes with the batch.
            if txn is None:
                meta = None
                if self._accs:
                    self._flush_txn_batch(p)
            else:
                if type(txn) is not Transaction or txn._broker is not self._broker:
                    raise InvalidArgumentError("txn", txn, "None or a Transaction of this broker")
                meta = txn._meta
                if meta.owner is not self._owner:
                    if self._owner is not None:
                        raise InvalidArgumentError("txn", txn, f"a transaction of transactional producer "
                                                               f"{self._owner.transactional_id!r} (begin())")
                    meta.check_owner()
                if meta.state is not TxnState.OPEN:
                    raise meta.not_open("send")
            if self._fence is not None and self._fence.fenced:
                raise self._fence.fenced_error()
            if self._broker._topics.get(self._topic.name) is not self._topic:
                self._check_open()         # deleted since this producer was made
            if meta is None:
                acc = self._plain.get(p)
                if acc is None:
                    acc = self._open_plain(p)
            else:
                if self._plain:
                    self._flush_plain_batch(p)
                acc = self._accs.get(p)
                if acc is None or acc.meta is not meta:
                    acc = self._open_accumulator(p, txn, meta)
            return acc.send(value, key, headers, event_time)    # (appends a batch that is full)
        # (a batched send above checks the message in acc.add instead)
        spec = BatchSpec([value], None if key is None else [key], [headers] if headers else None,
                         None if event_time is None else [event_time])
        if self._plain:
            self._flush_partition(p)
        elif self._accs:              # (a plain send of a producer that also sends in transactions:
            acc = self._accs.get(p)   # one call only when a batch of its is pending there)
            if acc is not None and acc.pending:
                self._flush_txn_batch(p)
        try:
            if txn is None and self._owner is None:
                return _new_id(MessageId, (self._topic.name, p.index,
                                           p.append(spec, 0, None, self.producer_id, self.epoch, sequence, None,
                                                    self._fence)))
            return _new_id(MessageId, (self._topic.name, p.index, self._append(p, spec, txn, sequence)))
        except BrokerClosedError:
            self._check_open()    # name what closed: this producer, the broker, or the topic (deleted)
            raise

    def send_batch(self, values, keys=None, headers=None, event_times=None, partition=None,
                   txn=None, sequence: int | None = None) -> MessageIds:
        """Append many messages; return their ids in input order.

        ``values`` is a list of bytes or a pyarrow binary/string array (the
        array's bytes are copied once, straight into the log, with no
        per-message Python work), or any other iterable of bytes (read into
        a list first). ``keys`` (None, or one bytes, str or None per
        message), ``headers`` (None, or one dict / list of pairs / None per
        message) and ``event_times`` (None, or one int per message) are
        taken the same way. Messages bound for one partition form one
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
        if type(values) is not list:
            values = _column("values", values, arrow=True)
        if keys is not None and type(keys) is not list:
            keys = _column("keys", keys, arrow=True)
        if headers is not None and type(headers) is not list:
            headers = _column("headers", headers)
        if event_times is not None and type(event_times) is not list:
            event_times = _column("event_times", event_times, numpy=True)
        parts = self._topic.partitions
        n = len(values)
        if not n:
            raise InvalidMessageError("values (a batch needs at least one message)", values)
        if sequence >= 0 and partition is None and len(parts) > 1:
            raise _unrouted(sequence)
        try:
            if partition is not None or keys is None or len(parts) == 1:
                p = self._partition(None, partition)
                spec = BatchSpec(values, keys, headers, event_times)
                base = self._append(p, spec, txn, sequence)
                return MessageIds.run(self._topic.name, p.index, base, n)
            for what, column in (("keys", keys), ("headers", headers), ("event_times", event_times)):
                if column is not None and len(column) != n:     # (split by index below)
                    raise InvalidMessageError(f"{what} (expected {n} entries)", len(column))
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
        except BrokerClosedError:
            self._check_open()    # name what closed: this producer, the broker, or the topic (deleted)
            raise

    def append_spec(self, spec: BatchSpec, partition: int, txn=None, sequence: int = -1) -> int:
        """Append a prepared :class:`~txmq._batch.BatchSpec` (for instance
        ``BatchSpec.from_columns``) to ``partition`` as one batch; return
        its base offset. The bulk path of front ends that decode messages
        themselves (the Kafka server); ``txn`` and ``sequence`` (-1: the
        next) as in :meth:`send_batch`."""
        self._check_open()
        if type(spec) is not BatchSpec:
            raise InvalidArgumentError("spec", spec, "a BatchSpec")
        if type(sequence) is not int or not -1 <= sequence < SEQUENCE_LIMIT:
            raise InvalidArgumentError("sequence", sequence, "-1 or an int from 0 to 2**31 - 1")
        p = self._partition(None, partition)
        try:
            return self._append(p, spec, txn, sequence)
        except BrokerClosedError:
            self._check_open()    # name what closed: this producer, the broker, or the topic (deleted)
            raise

    def flush(self) -> None:
        """Append every batch of this producer's sends that is still
        accumulating: those inside transactions (docs/API.md, "Sends inside
        a transaction are batched") and, for a batching producer, those
        outside them ("A batching producer"); raise what an append raised.
        A plain producer's sends outside transactions are in the log when
        they return."""
        error = None
        accs = [a for a in self._accs.values() if a.meta.state is TxnState.OPEN] + list(self._plain.values())
        for acc in accs:
            try:
                self._batching.flush(acc)
            except BaseException as e:      # (the other batches are appended all the same)
                error = error or e
        if error is not None:
            raise error

    def close(self) -> None:
        """Close this producer; its accumulating batches are appended first
        (an append that fails is raised by its transaction's commit; a
        batching producer's sends outside transactions: by this call)."""
        error = None
        for p in list(self._accs):
            self._flush_txn_batch(p)
        for acc in list(self._plain.values()):
            try:
                self._batching.flush(acc)
            except BaseException as e:
                error = error or e
        self._accs.clear()
        self._plain.clear()
        self.closed = True
        if self.name is not None:
            self._broker._named_closed(self)
        if error is not None:
            raise error

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


def _column(what: str, seq, arrow: bool = False, numpy: bool = False):
    """One per-message argument of send_batch as a list (a pyarrow array,
    or a numpy array for ``event_times``, as it is); anything that is not
    an iterable of entries is refused by name."""
    pa = sys.modules.get("pyarrow")       # not imported: no argument is an Arrow array
    if arrow and pa is not None and isinstance(seq, (pa.Array, pa.ChunkedArray)):
        return seq
    if numpy and isinstance(seq, np.ndarray):
        return seq
    if not isinstance(seq, (str, bytes, bytearray, memoryview, dict)):
        try:
            return list(seq)
        except TypeError:
            pass
    raise InvalidMessageError(f"{what} (expected a list, or another iterable, with one entry per message)", seq)


def _take(seq, idx):
    if isinstance(seq, list):
        return [seq[i] for i in idx]
    return seq.take(idx)
