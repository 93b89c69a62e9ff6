"""The half producer (RocketMQ's ``TransactionMQProducer``): sends a half
message, runs the application's local transaction and ends the message by
its answer. The half messages themselves (the half log, the state table,
commits and check-back) are kept by :mod:`txmq.storage.half_messages`.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from txmq import crashpoints
from txmq._batch import BatchSpec, Message
from txmq.errors import BrokerClosedError, InvalidArgumentError
from txmq.message import MessageId
from txmq.storage.half_messages import HALF_TOPIC, HalfStore, LocalTransactionState, as_local_state, group_hash

log = logging.getLogger("txmq.half")

_new = tuple.__new__               # a NamedTuple without its Python-level __new__ (the hot path)


class HalfSendResult(NamedTuple):
    """What :meth:`HalfProducer.send_in_transaction` returns: the local
    transaction's ``state``, the message's ``half_id``, and its
    ``message_id`` in the real topic when it was committed (else None)."""
    state: LocalTransactionState
    half_id: int
    message_id: MessageId | None


class HalfProducer:
    """Sends half messages to one topic for one producer group (RocketMQ's
    ``TransactionMQProducer``). Thread-safe.

    ``checker(message) -> LocalTransactionState`` answers the broker's
    check-back for any half message of the group that is still PREPARED
    after the check immunity; the broker asks one live producer of the
    group, at random. A producer without a checker sends but is not asked.
    """

    def __init__(self, broker, store: HalfStore, topic, group: str, checker, producer_id: int):
        self._broker = broker
        self._store = store
        self._topic = topic
        self.group = group
        self.checker = checker
        self.producer_id = producer_id
        self.group_hash = group_hash(group)
        self.closed = False
        store.register_group(producer_id, topic.name, group)
        if checker is not None:
            store.add_checker(self.group_hash, self)

    @property
    def topic(self) -> str:
        return self._topic.name

    def _check_open(self) -> None:
        if self.closed:
            raise BrokerClosedError(f"half producer of {self._topic.name!r} is closed")
        self._broker._check_open()

    def send_in_transaction(self, value, local_txn, arg=None, key=None, headers=None, event_time=None,
                            check_immunity: float | None = None) -> HalfSendResult:
        """Store ``value`` as a half message (invisible to every
        subscription), run ``local_txn(message, arg)``, and act on its
        :class:`LocalTransactionState`: COMMIT appends the message to the
        topic (once), ROLLBACK drops it, UNKNOWN (or an exception, which is
        logged) leaves it PREPARED for check-back.

        ``message.txn_id`` is the half id (RocketMQ's transaction id), which
        :meth:`end_transaction` takes. ``check_immunity`` (seconds)
        overrides the broker's ``half_check_immunity`` for this message.
        Returns :class:`HalfSendResult`."""
        self._check_open()
        if key is not None and type(key) is not bytes:
            key = key.encode("utf-8") if isinstance(key, str) else key
        immunity_ms = -1
        if check_immunity is not None:
            if not isinstance(check_immunity, (int, float)) or isinstance(check_immunity, bool) \
                    or not 0 <= check_immunity < 2**31 / 1000:
                raise InvalidArgumentError("check_immunity", check_immunity, "None or seconds >= 0")
            immunity_ms = int(check_immunity * 1000)
        spec = BatchSpec([value], None if key is None else [key], [headers] if headers else None,
                         None if event_time is None else [event_time])
        store = self._store
        index = store.log.append(spec, 0, None, self.producer_id, 0, -1, store.fsync != "never")
        if crashpoints.ARMED:
            crashpoints.reached("half.stored")
        # (a later append's time if another thread appended since: the
        # record's store time only decides when checks begin)
        size, publish_ms = spec.encoded_size(), store.log.last_publish_time
        if immunity_ms >= 0:
            store.record_new(index, size, publish_ms // 1000, self.group_hash, immunity_ms)
        message = Message(value, key, list(headers.items()) if isinstance(headers, dict) else headers,
                          _new(MessageId, (HALF_TOPIC, 0, index)),
                          publish_ms if event_time is None else event_time, publish_ms, 0, index)
        try:
            state = local_txn(message, arg)
            if state.__class__ is not LocalTransactionState:
                state = as_local_state(state)
        except Exception:
            log.exception("local transaction of half message %d raised: left for check-back", index)
            state = LocalTransactionState.UNKNOWN
        if crashpoints.ARMED:
            crashpoints.reached("half.local_done")
        if state is LocalTransactionState.COMMIT and immunity_ms < 0:
            mid = store.commit_new(index, size, publish_ms // 1000, self.group_hash, spec, key, self._topic.name,
                                   self.producer_id)
        else:
            mid = store.end(index, state, new=(size, publish_ms // 1000, self.group_hash), spec=spec, key=key,
                            topic=self._topic.name, producer_id=self.producer_id)
        return _new(HalfSendResult, (state, index, mid))

    def end_transaction(self, half_id: int, state: LocalTransactionState):
        """End half message ``half_id`` later (an application that decides
        after :meth:`send_in_transaction` returned UNKNOWN): COMMIT appends
        it (returns its MessageId; None if it was committed before),
        ROLLBACK drops it, UNKNOWN does nothing. Ending it the other way
        than it already ended raises :class:`InvalidHalfStateError`."""
        self._check_open()
        if not isinstance(state, LocalTransactionState):
            raise InvalidArgumentError("state", state, "a LocalTransactionState")
        if type(half_id) is not int:
            raise InvalidArgumentError("half_id", half_id, "an int half id")
        return self._store.end(half_id, state)

    def close(self) -> None:
        """Stop answering checks (other producers of the group still do)."""
        if not self.closed:
            self.closed = True
            self._store.remove_checker(self.group_hash, self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
