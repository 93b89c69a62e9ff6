"""Transactional producers: Kafka's transactional.id on the embedded API
(docs/FORMAT.md, "Idempotent producers"; docs/GUARANTEES.md G9).

A transactional id maps to (producer id, epoch) in the log of its home
coordinator. Opening the id again bumps the epoch durably, aborts the older
instance's open transaction and fences it: every later call of the older
instance raises :class:`~txmq.errors.ProducerFencedError`.
"""

from __future__ import annotations

import threading
import time

from txmq.errors import (ConcurrentTransactionsError, InvalidArgumentError, InvalidTxnStateError,
                         PartitionNotFoundError, ProducerFencedError, TransactionError)
from txmq.message import MessageId
from txmq.client.producer import Producer
from txmq.client.transaction import meta_of
from txmq.transactions.records import TxnState

# How long opening a transactional id waits for the previous instance's
# transaction to finish a commit or abort already decided.
FENCE_WAIT = 10.0


class TransactionalProducer:
    """One instance of a transactional id. Create it with
    :meth:`txmq.Broker.transactional_producer`.

    >>> tp = broker.transactional_producer("etl-1")        # doctest: +SKIP
    >>> with tp.begin() as txn:
    ...     tp.producer("out").send(b"v", txn=txn)
    ...     tp.send_offsets_to_transaction(txn, consumer, {0: 42})

    One transaction is open at a time. Thread-safe.
    """

    def __init__(self, broker, transactional_id: str, producer_id: int, epoch: int, coordinator,
                 timeout: float):
        self._broker = broker
        self.transactional_id = transactional_id
        self.producer_id = producer_id
        self.epoch = epoch
        self.timeout = timeout
        self.fenced = False
        self.closed = False
        self._coordinator = coordinator
        self._lock = threading.Lock()
        self._current = None          # the last Transaction begun
        self._producers: dict = {}

    def fenced_error(self) -> ProducerFencedError:
        return ProducerFencedError(self.transactional_id, self.epoch,
                                   "a newer instance of the transactional id was opened")

    def _check(self) -> None:
        self._broker._check_open()
        if self.fenced:
            raise self.fenced_error()
        if self.closed:
            raise TransactionError(None, f"transactional producer {self.transactional_id!r} is closed")

    def begin(self, timeout: float | None = None):
        """Begin this producer's next transaction (``timeout`` seconds,
        default the producer's). Raises
        :class:`~txmq.errors.InvalidTxnStateError` while the previous one is
        still open, :class:`~txmq.errors.ProducerFencedError` once fenced."""
        with self._lock:
            self._check()
            cur = self._current
            if cur is not None and cur.state is TxnState.OPEN:
                raise InvalidTxnStateError(cur.id, "OPEN", "begin another transaction of "
                                           f"{self.transactional_id!r} (one at a time)")
            self._current = self._broker._begin(self._coordinator, self.timeout if timeout is None else timeout,
                                                owner=self)
            return self._current

    def producer(self, topic: str) -> Producer:
        """A producer for ``topic`` with this instance's producer id and
        epoch; it sends only with ``txn=`` one of this producer's
        transactions."""
        self._check()
        t = self._broker._topic(topic)
        p = self._producers.get(topic)
        if p is None or p.closed or p._topic is not t:
            p = self._producers[topic] = Producer(self._broker, t, self.producer_id,
                                                  self.epoch, owner=self)
        return p

    def send_offsets_to_transaction(self, txn, subscription, offsets: dict) -> None:
        """Commit a subscription's position inside ``txn`` (Kafka's
        consumer-group offsets in a transaction): for each ``{partition:
        offset}``, every message below ``offset`` (the next one to consume)
        is acknowledged cumulatively when ``txn`` commits, and not at all if
        it aborts. ``subscription`` is a :class:`~txmq.Consumer` or a
        ``(topic, subscription name)`` pair of an exclusive or failover
        subscription. Positions only move forward: an offset at or below the
        current position changes nothing."""
        self._check()
        meta = meta_of(txn, self._broker)
        if meta.owner is not self:
            raise InvalidArgumentError("txn", txn, f"a transaction of {self.transactional_id!r}")
        sub = _subscription_of(self._broker, subscription)
        if not isinstance(offsets, dict):
            raise InvalidArgumentError("offsets", offsets, "a dict {partition: offset}")
        for partition, offset in offsets.items():
            if type(partition) is not int or type(offset) is not int or offset < 0:
                raise InvalidArgumentError("offsets", {partition: offset},
                                           "int partitions and int offsets >= 0")
        for partition, offset in sorted(offsets.items()):
            if offset <= sub.mark_delete(_lane_index(sub, partition)):
                continue
            sub.pending_acks.ack_cumulative_txn(meta, MessageId(sub.topic.name, partition, offset - 1))

    def _fence(self) -> None:
        """A newer instance is being opened: refuse everything from now on,
        abort the open transaction, and wait until a commit or abort that
        was already decided has been applied everywhere (as Kafka's
        InitProducerId does), so the new instance starts from a settled
        state. Raises :class:`ConcurrentTransactionsError` when that takes
        longer than ``FENCE_WAIT`` seconds."""
        with self._lock:
            self.fenced = True
            cur = self._current
        if cur is None:
            return
        if cur.state is TxnState.OPEN:
            try:
                cur._coordinator.end(cur._meta, False, reason="fenced")
            except TransactionError:
                pass               # it ended meanwhile (a commit that came first stands)
        deadline = time.monotonic() + FENCE_WAIT
        while cur.state in (TxnState.COMMITTING, TxnState.ABORTING):
            if time.monotonic() > deadline or self._broker.closed:
                raise ConcurrentTransactionsError(cur.id, self.transactional_id)
            time.sleep(0.001)

    def close(self) -> None:
        """Abort the open transaction, if any; the producer may not be used
        again. Closing a fenced instance does nothing."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            cur = self._current
        if not self.fenced and cur is not None and cur.state is TxnState.OPEN and not self._broker.closed:
            try:
                cur.abort()
            except (ProducerFencedError, TransactionError):
                pass               # fenced or ended meanwhile: nothing of it is left to end
        self._broker._transactional_closed(self)

    def __enter__(self) -> "TransactionalProducer":
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        state = "fenced" if self.fenced else "closed" if self.closed else "open"
        return (f"TransactionalProducer({self.transactional_id!r}, producer_id={self.producer_id}, "
                f"epoch={self.epoch}, {state})")


def _subscription_of(broker, subscription):
    sub = getattr(subscription, "_sub", None)
    if sub is not None:
        return sub
    if isinstance(subscription, tuple) and len(subscription) == 2:
        return broker._subscription(*subscription)
    raise InvalidArgumentError("subscription", subscription, "a Consumer or a (topic, subscription) pair")


def _lane_index(sub, partition: int) -> int:
    if not 0 <= partition < len(sub.lanes):
        raise PartitionNotFoundError(sub.topic.name, partition)
    return partition
