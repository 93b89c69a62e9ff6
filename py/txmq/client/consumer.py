"""Consumers: receive from a subscription and acknowledge."""

from __future__ import annotations

import datetime

from txmq.errors import BrokerClosedError, InvalidArgumentError
from txmq.message import Message, MessageId
from txmq.options import int_option, seconds_option
from txmq._accumulator import PendingMessageId
from txmq._ackset import received_or
from txmq._txn import bind_consumer_ack, consumer_ack
from txmq.client.transaction import Transaction, meta_of
from txmq.dispatch import lane_invariant
from txmq.dispatch.arrow_delivery import delivered_run
from txmq.transactions.records import TxnState

bind_consumer_ack(Transaction, TxnState.OPEN, lane_invariant)


def _ids(messages) -> list:
    if isinstance(messages, (Message, MessageId)):
        messages = [messages]
    if type(messages) is list:
        try:  # the common case, a list from receive_many
            return [m.message_id for m in messages]
        except AttributeError:
            pass
    return _checked_ids(messages)


def _checked_ids(messages) -> list:
    if isinstance(messages, (str, bytes, dict)) or not hasattr(messages, "__iter__"):
        raise InvalidArgumentError("messages", messages, "a Message, a MessageId or a list of them")
    out = []
    for m in messages:
        if isinstance(m, Message):
            out.append(m.message_id)
        elif isinstance(m, MessageId):
            out.append(m)
        elif isinstance(m, tuple) and len(m) == 3:
            out.append(MessageId(*m))
        elif isinstance(m, PendingMessageId):
            out.append(MessageId(*m.result()))
        else:
            raise InvalidArgumentError("message", m, "a Message, a MessageId or a list of them")
    return out


class Consumer:
    """One consumer attached to a subscription. Thread-safe.

    Create it with :meth:`txmq.Broker.subscribe`.
    """

    def __init__(self, broker, subscription, name: str | None = None, fail_on_data_loss: bool = False):
        self._broker = broker
        self._sub = subscription
        self.name = name
        # Offsets lost to quarantined bytes: passed over (False) or
        # DataLossError until skip_data_loss() (True).
        self.fail_on_data_loss = bool(fail_on_data_loss)
        self.closed = False
        self.rr = 0
        self.id = subscription.attach(self)

    @property
    def topic(self) -> str:
        return self._sub.topic.name

    @property
    def subscription(self) -> str:
        return self._sub.name

    def _check_open(self):
        if self.closed:
            raise BrokerClosedError(f"consumer of {self._sub.name!r} is closed")

    def receive(self, timeout: float | None = None) -> Message | None:
        """The next message, waiting up to ``timeout`` seconds (None: until
        one arrives); None on timeout."""
        ms = self.receive_many(1, timeout)
        return ms[0] if ms else None

    def receive_many(self, max_messages: int, timeout: float | None = None) -> list:
        """Up to ``max_messages`` messages, as soon as at least one is there
        (waiting up to ``timeout``); [] on timeout."""
        self._check_open()
        if not isinstance(max_messages, int) or isinstance(max_messages, bool) or max_messages < 1:
            raise InvalidArgumentError("max_messages", max_messages, "an int >= 1")
        if timeout is not None and not (type(timeout) in _SECONDS and 0.0 <= timeout < _INF):
            timeout = _timeout(timeout)
        return self._sub.receive(self, max_messages, timeout)

    def receive_batch(self, max_messages: int = 1 << 30, timeout: float | None = None):
        """A run of messages from one stored batch as a ``pyarrow.RecordBatch``
        (columns key, value, offset, event_time, publish_time; schema
        metadata topic and partition) whose key and value columns are views
        of the log with no copy. Acknowledge it with :meth:`ack` (the whole
        batch) or per offset. None on timeout."""
        self._check_open()
        if not isinstance(max_messages, int) or isinstance(max_messages, bool) or max_messages < 1:
            raise InvalidArgumentError("max_messages", max_messages, "an int >= 1")
        if timeout is not None and not (type(timeout) in _SECONDS and 0.0 <= timeout < _INF):
            timeout = _timeout(timeout)
        return self._sub.receive_batch(self, max_messages, timeout)

    ack = consumer_ack     # (compiled: ack(m, txn=) in one call; the rest is _ack's)

    def _ack(self, messages, txn=None) -> None:
        """:meth:`ack` (``txmq._txn.consumer_ack``, its docstring): every
        ack but the compiled one of a received Message in a transaction
        (which it hands here only to raise: a closed consumer, a bad
        ``txn``)."""
        self._check_open()
        if hasattr(messages, "schema") and hasattr(messages, "num_rows"):
            run = delivered_run(messages)
            if run is not None and run[0] == self.topic:      # (as received: no column to read)
                _, partition, first, end = run
                if txn is not None:
                    self._sub.pending_acks.ack_range_txn(meta_of(txn, self._broker), partition, range(first, end))
                else:
                    self._sub.ack_range(partition, first, end)
                return
            md = messages.schema.metadata or {}
            if messages.num_rows == 0:
                return
            partition = int(md[b"partition"])
            offsets = messages.column("offset").to_numpy()
            first, last = int(offsets[0]), int(offsets[-1])
            # (one run of consecutive offsets: a fresh delivery, acked as a range)
            dense = last - first + 1 == len(offsets) and (len(offsets) < 2 or bool((offsets[1:] > offsets[:-1]).all()))
            if txn is not None:
                self._sub.pending_acks.ack_range_txn(meta_of(txn, self._broker), partition,
                                                     range(first, last + 1) if dense else sorted(offsets.tolist()))
                return
            if dense:
                self._sub.ack_range(partition, first, last + 1)
            else:  # redelivered messages are scattered
                self._sub.ack([MessageId(self.topic, partition, int(o)) for o in offsets])
            return
        if txn is not None:
            self._sub.pending_acks.ack_txn(meta_of(txn, self._broker), received_or(messages, _ids))
            return
        self._sub.ack(received_or(messages, _ids))

    def ack_cumulative(self, message, txn=None) -> None:
        """Acknowledge ``message`` and everything before it on its partition
        (exclusive and failover subscriptions only); with ``txn``, pending
        in that transaction (conflicts with any other transaction's pending
        ack at or below it). Without ``txn`` it conflicts with any open
        transaction's pending ack at or below it
        (:class:`~txmq.errors.TransactionConflictError`, nothing changed)."""
        self._check_open()
        ids = _ids(message)
        if len(ids) != 1:
            raise InvalidArgumentError("message", message, "one Message or MessageId")
        if txn is not None:
            self._sub.pending_acks.ack_cumulative_txn(meta_of(txn, self._broker), ids[0])
            return
        self._sub.ack_cumulative(ids[0])

    def nack(self, messages) -> None:
        """Ask for redelivery after the subscription's ``nack_delay``; the
        message comes back with ``redelivery_count`` + 1."""
        self._check_open()
        self._sub.nack(_ids(messages))

    def release(self, messages) -> None:
        """Hand back messages this consumer received but did not process
        (not a failure): they are delivered again at once, in offset order,
        with their ``redelivery_count`` unchanged."""
        self._check_open()
        self._sub.nack(_ids(messages), count=False)

    def seek(self, target=None, *, timestamp=None, partition: int | None = None) -> None:
        """Move the subscription's cursor (for every consumer of it).

        ``target``: an offset (int, on ``partition`` or every partition), a
        :class:`MessageId` (its partition), ``"earliest"``, ``"latest"`` or a
        ``datetime``; or ``timestamp=`` milliseconds: the first message
        published at or after it. Acks above the new position are forgotten.
        """
        self._check_open()
        partition = int_option("partition", partition, 0, len(self._sub.lanes) - 1, optional=True)
        if timestamp is not None or isinstance(target, datetime.datetime):
            if isinstance(target, datetime.datetime):
                timestamp = int(target.timestamp() * 1000)
            if type(timestamp) is not int:
                raise InvalidArgumentError("timestamp", timestamp, "int milliseconds")
            return self._sub.seek(partition, ("time", timestamp))
        if isinstance(target, MessageId):
            return self._sub.seek(target.partition, target.offset)
        if target in ("earliest", "latest"):
            return self._sub.seek(partition, target)
        if isinstance(target, int) and not isinstance(target, bool) and target >= 0:
            return self._sub.seek(partition, target)
        raise InvalidArgumentError("seek target", target,
                                   "an offset >= 0, a MessageId, 'earliest', 'latest' or a datetime")

    def skip_data_loss(self, partition: int | None = None) -> int:
        """Acknowledge the offsets of the subscription lost to bytes that
        failed their checks (quarantined: docs/FORMAT.md), on ``partition``
        or on every partition, so its cursor moves past them. Until then
        they count in the backlog, and a consumer with
        ``fail_on_data_loss=True`` gets :class:`txmq.errors.DataLossError`
        on reaching them. Returns how many offsets were acknowledged."""
        self._check_open()
        return self._sub.skip_lost(partition)

    def close(self) -> None:
        """Detach; unacknowledged messages go to the subscription's other consumers."""
        if not self.closed:
            self.closed = True
            self._sub.detach(self)
            with self._sub.cond:
                self._sub.cond.notify_all()

    def unsubscribe(self) -> None:
        """Close and delete the subscription (its cursor is gone)."""
        self._broker._unsubscribe(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"Consumer({self.topic!r}, {self.subscription!r}, id={self.id})"


_SECONDS = (int, float)
_INF = float("inf")


def _timeout(timeout):
    """A receive's ``timeout``: None (wait until a message comes) or finite
    seconds >= 0; ``nan`` would never time out and never wait, spinning."""
    return seconds_option("timeout", timeout, optional=True)
