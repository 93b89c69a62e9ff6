"""Typed errors of txmq. Every error carries the value that was wrong.

All errors derive from :class:`TxmqError`, so ``except txmq.errors.TxmqError``
catches anything the broker raises on purpose.
"""

from __future__ import annotations


class TxmqError(Exception):
    """Base class of every error txmq raises."""


class CorruptLogError(TxmqError):
    """A file failed its checks (magic, length, CRC) at a position.

    Attributes: ``path``, ``position`` (byte offset in the file), ``reason``.
    """

    def __init__(self, path, position: int, reason: str):
        self.path = str(path)
        self.position = int(position)
        self.reason = reason
        super().__init__(f"{self.path} at byte {self.position}: {reason}")


class DataDirLockedError(TxmqError):
    """Another process holds the data directory open for writing."""

    def __init__(self, path, holder: str | None = None):
        self.path = str(path)
        self.holder = holder
        who = f" (held by {holder})" if holder else ""
        super().__init__(f"data directory {self.path} is locked by another writer{who}")


class DataDirError(TxmqError, ValueError):
    """A path that is not, and cannot become, a txmq data directory (a
    file, a folder of other things, a path of the wrong type), or a folder
    inside one that is not what txmq keeps there.

    Attributes: ``path`` (as given), ``reason``.
    """

    def __init__(self, path, reason: str):
        self.path = path
        self.reason = reason
        shown = path if isinstance(path, str) and path else repr(path)
        super().__init__(f"data directory {shown}: {reason}")


class BrokerClosedError(TxmqError):
    """An operation was attempted on a closed broker, producer or consumer."""


class InvalidTopicNameError(TxmqError, ValueError):
    def __init__(self, name, reason: str):
        self.name = name
        super().__init__(f"invalid topic name {name!r}: {reason}")


class InvalidSubscriptionNameError(TxmqError, ValueError):
    def __init__(self, name, reason: str):
        self.name = name
        super().__init__(f"invalid subscription name {name!r}: {reason}")


class TopicExistsError(TxmqError):
    def __init__(self, name: str):
        self.name = name
        super().__init__(f"topic {name!r} already exists")


class TopicNotFoundError(TxmqError, KeyError):
    def __init__(self, name: str):
        self.name = name
        super().__init__(f"topic {name!r} does not exist")

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0]


class PartitionNotFoundError(TxmqError, IndexError):
    def __init__(self, topic: str, partition):
        self.topic = topic
        self.partition = partition
        super().__init__(f"topic {topic!r} has no partition {partition!r}")


class SubscriptionNotFoundError(TxmqError, KeyError):
    def __init__(self, topic: str, subscription: str):
        self.topic = topic
        self.subscription = subscription
        super().__init__(f"topic {topic!r} has no subscription {subscription!r}")

    def __str__(self) -> str:
        return self.args[0]


class SubscriptionBusyError(TxmqError):
    """An exclusive subscription already has a consumer."""

    def __init__(self, topic: str, subscription: str):
        self.topic = topic
        self.subscription = subscription
        super().__init__(
            f"subscription {subscription!r} on {topic!r} is exclusive and already has a consumer"
        )


class SubscriptionTypeError(TxmqError, ValueError):
    """A consumer asked a subscription for another type (or operation) than it has."""

    def __init__(self, subscription: str, have: str, wanted: str):
        self.subscription = subscription
        self.have = have
        self.wanted = wanted
        super().__init__(f"subscription {subscription!r} is {have}, not {wanted}")


class MessageTooLargeError(TxmqError, ValueError):
    def __init__(self, size: int, limit: int):
        self.size = size
        self.limit = limit
        super().__init__(f"message of {size} bytes is over the limit of {limit} bytes")


class InvalidMessageError(TxmqError, TypeError):
    """A value, key, header or event time of the wrong type or range."""

    def __init__(self, what: str, value):
        self.what = what
        self.value = value
        super().__init__(f"invalid {what}: {value!r}"[:500])


class NotAcknowledgeableError(TxmqError, ValueError):
    """An ack named a message this consumer cannot acknowledge."""

    def __init__(self, message_id, reason: str):
        self.message_id = message_id
        super().__init__(f"cannot acknowledge {message_id}: {reason}")


class InvalidArgumentError(TxmqError, ValueError):
    """An argument outside the values a call accepts."""

    def __init__(self, name: str, value, allowed: str):
        self.name = name
        self.value = value
        super().__init__(f"invalid {name} {value!r}: expected {allowed}")


class IsolationLevelMismatchError(TxmqError, ValueError):
    """A consumer asked a subscription for another isolation level than it has."""

    def __init__(self, subscription: str, have: str, wanted: str):
        self.subscription = subscription
        self.have = have
        self.wanted = wanted
        super().__init__(
            f"subscription {subscription!r} reads {have}; a consumer asked for {wanted}")


class OutOfOrderDeliveryError(TxmqError, ValueError):
    """``allow_out_of_order_delivery`` asked where it does not apply: with
    an exclusive or failover type (they deliver in offset order), with
    ``read_uncommitted`` (never held back by an open transaction), or
    another value than the existing subscription was created with
    (``have``: its value; None when it is the request alone that is
    refused). ``wanted`` is what the consumer asked for."""

    def __init__(self, subscription: str, reason: str, have: bool | None = None, wanted=None):
        self.subscription = subscription
        self.reason = reason
        self.have = have
        self.wanted = wanted
        super().__init__(f"subscription {subscription!r}: {reason}")


class TopicBusyError(TxmqError):
    """A topic still has consumers attached, or a prepared transaction
    writes or acknowledges on it (``prepared``: their ids), and was not
    deleted."""

    def __init__(self, name: str, consumers: int, prepared=()):
        self.name = name
        self.consumers = consumers
        self.prepared = list(prepared)
        if self.prepared:
            ids = ", ".join(str(t) for t in self.prepared)
            super().__init__(f"topic {name!r} is in prepared transaction(s) {ids}: commit or abort them first "
                             f"(commit_prepared / abort_prepared; force=True does not end them)")
        else:
            super().__init__(f"topic {name!r} has {consumers} consumer(s) attached; close them or pass force=True")


class TransactionError(TxmqError):
    """Base of the transaction errors; ``txn_id`` is the TxnID concerned."""

    def __init__(self, txn_id, message: str):
        self.txn_id = txn_id
        super().__init__(message)


class TransactionNotFoundError(TransactionError, KeyError):
    """No coordinator knows the transaction (never begun, or ended and purged)."""

    def __init__(self, txn_id):
        super().__init__(txn_id, f"transaction {txn_id} is not known to its coordinator")

    def __str__(self) -> str:
        return self.args[0]


class InvalidTxnStateError(TransactionError):
    """An operation needs the transaction in another state.

    ``state`` is where it is, ``wanted`` the state or transition asked for."""

    def __init__(self, txn_id, state: str, wanted: str):
        self.state = state
        self.wanted = wanted
        super().__init__(txn_id, f"transaction {txn_id} is {state}; cannot {wanted}")


class TransactionConflictError(TransactionError):
    """An ack collides with a transaction's pending ack or with an
    acknowledgement already made; nothing was changed.

    ``txn_id`` is the transaction acking (None for a plain ack of a message
    an open transaction holds), ``message_id`` the message, ``other`` the
    TxnID holding it (None when it was acknowledged outside a transaction)."""

    def __init__(self, txn_id, message_id, reason: str, other=None):
        self.message_id = message_id
        self.other = other
        self.reason = reason
        who = f"transaction {txn_id}: ack" if txn_id is not None else "plain ack"
        super().__init__(txn_id, f"{who} of {message_id} conflicts: {reason}"
                                 + (f" ({other})" if other is not None else ""))


class TransactionTimeoutError(TransactionError):
    """The transaction passed its timeout and was aborted by its coordinator."""

    def __init__(self, txn_id, timeout: float):
        self.timeout = timeout
        super().__init__(txn_id, f"transaction {txn_id} timed out after {timeout:g} s and was aborted")


class InvalidTxnTimeoutError(TransactionError, ValueError):
    """A transaction timeout outside (0, transaction_timeout_max]. ``txn_id``
    is None: the transaction was not created."""

    def __init__(self, timeout, maximum: float, txn_id=None):
        self.timeout = timeout
        self.maximum = maximum
        super().__init__(txn_id, f"invalid transaction timeout {timeout!r}: expected seconds in "
                                 f"(0, {maximum:g}] (transaction_timeout_max)")


class ConcurrentTransactionsError(TransactionError):
    """A transactional id was opened again while its previous instance's
    transaction ``txn_id`` was still completing (its commit or abort
    being applied) for longer than the broker waits; retry the opening
    (Kafka's CONCURRENT_TRANSACTIONS)."""

    def __init__(self, txn_id, transactional_id: str):
        self.transactional_id = transactional_id
        super().__init__(txn_id, f"transaction {txn_id} of {transactional_id!r} is still completing; "
                                 "open the transactional id again later")


class ProducerFencedError(TxmqError):
    """A newer instance of the same named producer or transactional id was
    opened (or a newer epoch of the producer id wrote to the partition): this
    instance may not send, acknowledge, commit or abort any more, and nothing
    it tries changes anything.

    ``producer`` is the name, transactional id or producer id; ``epoch`` the
    fenced instance's epoch."""

    def __init__(self, producer, epoch: int, reason: str = "a newer instance took over"):
        self.producer = producer
        self.epoch = epoch
        self.reason = reason
        super().__init__(f"producer {producer!r} (epoch {epoch}) is fenced: {reason}")


class OutOfOrderSequenceError(TxmqError, ValueError):
    """A batch's sequence number is not the next one its producer id owes
    this partition (a gap, or a new epoch that does not start at 0); nothing
    was appended.

    ``topic``, ``partition``, ``producer_id``, ``sequence`` (the batch's) and
    ``expected`` (the next sequence the partition takes from this producer
    id and epoch: 0 for a new epoch)."""

    def __init__(self, topic: str, partition: int, producer_id: int, sequence: int, expected: int,
                 what: str = "out of order"):
        self.topic = topic
        self.partition = partition
        self.producer_id = producer_id
        self.sequence = sequence
        self.expected = expected
        super().__init__(f"{topic}/{partition}: sequence {sequence} of producer {producer_id} is "
                         f"{what} (expected {expected})")


class DuplicateSequenceError(OutOfOrderSequenceError):
    """The sequence was appended already, but not as one of the last 5
    batches the partition remembers per producer (older, or a batch of
    another size at that sequence), so no offsets can be returned; nothing
    was appended."""

    def __init__(self, topic: str, partition: int, producer_id: int, sequence: int, expected: int):
        super().__init__(topic, partition, producer_id, sequence, expected,
                         "already appended, and not as one of the last 5 batches")


class InvalidHalfStateError(TxmqError):
    """A half message cannot take this step: it is unknown, or already
    ended the other way (a commit after a rollback, say).

    ``half_id`` is the half message, ``state`` where it is, ``wanted`` the
    step asked for."""

    def __init__(self, half_id, state: str, wanted: str):
        self.half_id = half_id
        self.state = state
        self.wanted = wanted
        super().__init__(f"half message {half_id} is {state}; cannot {wanted}")


class StagingError(TxmqError):
    """Staged batches cannot be ingested: an attempt is missing, was not
    closed, or holds a file that does not belong there (``txmq.ingest``)."""


class DataDirUnreadableError(TxmqError):
    """A process (a Spark task) cannot open a data directory it was given:
    no rights to it, or it is not on this host, and no Flight service of
    its owner to go through instead.

    Attributes: ``path``, ``cause`` (the error opening it raised),
    ``hint`` (what to do).
    """

    def __init__(self, path, cause: str, hint: str):
        self.path = str(path)
        self.cause = cause
        self.hint = hint
        super().__init__(f"data directory {self.path} cannot be opened here ({cause}): {hint}")


class DataLossError(TxmqError):
    """Offsets a read was planned for, or a reader reached, are gone, and
    the reader asked to be told (``failOnDataLoss`` of the Spark source,
    ``fail_on_data_loss=True`` of a consumer or a read-only read):
    retention deleted them, the log is shorter than when the read was
    planned, or they lay in bytes that failed their checks and were
    quarantined (docs/FORMAT.md, "Quarantine").

    Attributes: ``topic``, ``partition``, ``wanted`` (the first lost
    offset, or the planned one), ``have`` (where the log goes on), and for
    quarantined bytes ``path`` and ``position`` (the segment and the byte
    where they start; None otherwise).
    """

    def __init__(self, topic: str, partition: int, wanted: int, have: int, what: str, *, path=None,
                 position: int | None = None, hint: str = "set option failOnDataLoss=false to read what is left"):
        self.topic, self.partition, self.wanted, self.have = topic, partition, wanted, have
        self.path = None if path is None else str(path)
        self.position = position
        where = f" in {self.path} at byte {position}" if self.path is not None else ""
        super().__init__(f"{topic}/{partition}: {what}{where} (planned offset {wanted}, the log has {have}); "
                         f"{hint}")


class StorageFullError(TxmqError, OSError):
    """The file system holding the data directory is full (ENOSPC, EDQUOT):
    the write was not made and nothing of it is visible; what was
    acknowledged before is kept, reads go on, and writing resumes by
    itself once space is freed.

    Attributes: ``path`` (the file being written), ``needed`` (bytes the
    write wanted, or -1 when unknown).
    """

    def __init__(self, path, needed: int = -1, errno_: int = 28):
        self.path = str(path)
        self.needed = needed
        OSError.__init__(self, errno_, f"no space left for {self.path}"
                         + (f" ({needed} bytes wanted)" if needed >= 0 else ""))

    def __str__(self) -> str:
        return self.args[1]


class RequestInterruptedError(TxmqError):
    """The process owning a data directory went away during a request that
    is not safe to ask again (an ingest without a sink key): whether it
    took effect is unknown. Commit with ``sink=`` to make it idempotent."""

    def __init__(self, path, op):
        self.path = str(path)
        self.op = op
        super().__init__(f"the owner of {self.path} went away during {op!r}: its outcome is unknown "
                         f"(pass sink=(key, batch id) to make the request safe to repeat)")


class KafkaProtocolError(TxmqError, ValueError):
    """Bytes received over the Kafka protocol do not decode: a truncated or
    malformed request, or a record batch that fails its checks (magic,
    length, CRC-32C, record count). ``what`` names the part, ``position``
    is the byte offset in it where decoding stopped."""

    def __init__(self, what: str, position: int, reason: str):
        self.what = what
        self.position = int(position)
        self.reason = reason
        super().__init__(f"kafka {what} at byte {self.position}: {reason}")


class KafkaUsersFileError(TxmqError, ValueError):
    """The users file of the Kafka server (SASL credentials and topic ACLs,
    docs/KAFKA.md) cannot be read or does not follow its format; ``path``
    is the file, ``reason`` what is wrong."""

    def __init__(self, path, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"users file {self.path}: {reason}")
