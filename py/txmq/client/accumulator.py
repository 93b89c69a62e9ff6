"""Batching of one-message sends inside a transaction (docs/API.md,
"Sends inside a transaction are batched").

``send(value, txn=txn)`` does not append a batch per message: the message
joins the open batch of its (producer, transaction, partition), a
``txmq._accumulator.SendAccumulator``, which is appended as one batch when
it reaches ``batch_bytes``, when it is ``linger_ms`` old (the broker's
timer), when the message's offset is asked for, when the producer flushes,
sends outside the accumulator to that partition or closes, and at the
latest when the transaction commits, before anything of the commit is
logged. An abort drops what was never appended.

A batching producer (``broker.producer(topic, batching=True)``) keeps an
accumulator without a transaction per partition for its sends outside
transactions, appended by the same rules but for the commit: by size, by
the timer, when an offset is asked for, on its flush, before its other
sends to that partition, when it closes, and when the broker closes. An
accumulator is known to the timer only while it holds messages (from the
send that starts a batch until a flush leaves it empty), so a producer
flushed and dropped without ``close()`` is not kept alive, and a hundred
thousand open transactions that each sent once cost the timer nothing.

A failed append is kept in its accumulator: every later send into it, its
flush, and the ids of its messages raise it, and nothing is appended from
it again (for a batching producer, what the log keeps of its sends stays a
prefix of them).

:class:`SendBatching` is the broker's side: the settings, the open
accumulators the timer looks at, and the one flush every path uses.
"""

from __future__ import annotations

import logging
import threading
import time

from txmq._accumulator import SendAccumulator
from txmq.errors import BrokerClosedError
from txmq.transactions.records import TxnState

log = logging.getLogger("txmq.accumulator")


class SendBatching:
    """The accumulators of one broker. ``linger_ms`` 0 turns batching off
    (every send is appended when it is made)."""

    def __init__(self, linger_ms: float, batch_bytes: int):
        self.linger_ms = linger_ms
        self.linger_s = linger_ms / 1000.0
        self.batch_bytes = batch_bytes
        self.live: set = set()       # accumulators holding messages: the timer's
        self._live_lock = threading.Lock()   # a batching producer's accumulator joining or leaving live
        self.timer = None            # the broker's linger timer (Scheduler.on_demand): armed when
                                     # an accumulator joins live, asleep once live is empty

    @property
    def enabled(self) -> bool:
        return self.linger_ms > 0

    def open(self, producer, partition, txn) -> SendAccumulator:
        """A new accumulator of ``producer`` for ``txn`` (None: its sends
        outside transactions) on ``partition``, known to ``txn`` (flushed by
        its commit) and to the timer."""
        meta = None if txn is None else txn._meta
        if meta is not None and meta.partitions.get((partition.topic, partition.index)) is not partition:
            # Now, not at the append: the transaction lists its partitions
            # from its first send on (Broker.transactions).
            producer._broker._coordinator_of(meta).register_partition(meta, partition)
        # Never more than half a segment: a batch must fit one.
        limit = max(1, min(self.batch_bytes, partition.segment_bytes_max // 2))
        acc = SendAccumulator(partition, meta, producer, threading.Lock(), self.flush, limit,
                              partition.max_message_bytes)
        if txn is not None:
            txn._accumulators.append(acc)      # (the commit appends what it holds)
        acc.on_start = self._started           # known to the timer while it holds messages
        return acc

    def _started(self, acc: SendAccumulator) -> None:
        """A send started a batch in ``acc``. (flush_due forgets an empty
        one under the same lock, after checking it holds nothing: a batch
        started meanwhile is added again here, after.)"""
        with self._live_lock:
            self.live.add(acc)
        if self.timer is not None:
            self.timer.arm()

    def flush(self, acc: SendAccumulator) -> None:
        """Append the open batch of ``acc`` (registering its partition with
        the transaction first). A failure is kept: every later send into
        ``acc``, every id of its messages not yet appended, and the commit
        raise it."""
        with acc.lock:
            if acc.error is not None:
                raise acc.error              # (nothing is appended after a failed batch)
            spec = acc.take()
            if spec is None:
                return
            p, meta, producer = acc.partition, acc.meta, acc.producer
            try:
                if meta is not None and meta.partitions.get((p.topic, p.index)) is not p:
                    producer._broker._coordinator_of(meta).register_partition(meta, p)
                base = p.append(spec, 0, meta, producer.producer_id, producer.epoch, -1, None, producer._fence)
            except BrokerClosedError as e:
                acc.failed(_named(producer, e))
                raise acc.error from None
            except BaseException as e:
                acc.failed(e)
                raise
            acc.flushed(base)

    def flush_due(self) -> bool:
        """The broker's timer: append every batch open for ``linger_ms``,
        and forget the accumulators whose transaction ended. True while
        some accumulator is still open (the timer runs again)."""
        if not self.live:
            return False
        now = time.monotonic()
        for acc in list(self.live):
            if acc.error is not None or (acc.meta is not None and acc.meta.state is not TxnState.OPEN):
                self.live.discard(acc)
            elif not acc.pending:
                # Empty (its batch appended): forgotten until a send starts
                # the next, so open transactions that sent once and wait
                # cost the timer nothing.
                with self._live_lock:
                    if not acc.pending:
                        self.live.discard(acc)
            elif acc.count and now - acc.first_at >= self.linger_s:
                try:
                    self.flush(acc)
                except Exception as e:      # kept in acc: its sends and the commit raise it
                    log.debug("txmq: linger flush of %r failed: %s", acc, e)
        return bool(self.live)

    def flush_all(self) -> None:
        """Append every open batch of a transaction still open and of a
        batching producer (the broker closing); failures are kept as for
        the timer's flushes."""
        for acc in list(self.live):
            if acc.count and (acc.meta is None or acc.meta.state is TxnState.OPEN):
                try:
                    self.flush(acc)
                except Exception as e:
                    log.debug("txmq: flush of %r at close failed: %s", acc, e)
        self.live.clear()

    def finish(self, txn) -> BaseException | None:
        """Before ``txn`` commits: append every batch it has open; the first
        error any of them raised (the commit then aborts), or None. A batch
        for a partition deleted since (its topic is gone) has nowhere to
        go and nothing to commit, as data appended there before the delete
        would be gone with it: it is dropped, and its ids raise."""
        accs, txn._accumulators = txn._accumulators, []
        first = None
        for acc in accs:
            self.live.discard(acc)
            try:
                self.flush(acc)
            except BaseException as e:
                if acc.producer._broker._participant_exists(acc.partition):
                    if first is None:
                        first = e
        return first

    def drop(self, txn) -> None:
        """``txn`` aborts: what it never appended is dropped."""
        accs, txn._accumulators = txn._accumulators, []
        for acc in accs:
            self.live.discard(acc)


def _named(producer, error: BrokerClosedError) -> BaseException:
    """What closed under a flush: the producer, the broker, or the topic
    (deleted), by name when the producer can tell."""
    try:
        producer._check_open()
    except Exception as e:
        return e
    return error
