"""The transaction handle of the embedded API (docs/API.md)."""

from __future__ import annotations

import time
from concurrent.futures import Future

from txmq.errors import InvalidArgumentError
from txmq.transactions.records import TxnID, TxnState

XID_BYTES_MAX = 0xFFFF      # a prepared transaction's global id, stored as a u16-length string


class Transaction:
    """An open transaction. Create it with :meth:`txmq.Broker.new_transaction`
    or ``with broker.transaction() as txn:`` (commit on normal exit, abort on
    an exception).

    Pass it as ``txn=`` to :meth:`Producer.send`, :meth:`Producer.send_batch`,
    :meth:`Consumer.ack` and :meth:`Consumer.ack_cumulative`. Its messages and
    acks take effect together at :meth:`commit`, or not at all.
    """

    __slots__ = ("_broker", "_coordinator", "_meta", "_accumulators")

    def __init__(self, broker, coordinator, meta):
        self._broker = broker
        self._coordinator = coordinator
        self._meta = meta
        self._accumulators: list = []    # the batches of its one-message sends (client/accumulator.py)

    @property
    def id(self) -> TxnID:
        """The TxnID: ``.coordinator`` and ``.sequence``, printed ``(tc,seq)``."""
        return self._meta.id

    @property
    def state(self) -> TxnState:
        """OPEN, COMMITTING, COMMITTED, ABORTING or ABORTED (a transaction
        still open when its broker closed reads ABORTED: the next open's
        recovery aborts it)."""
        return self._meta.state

    @property
    def timeout(self) -> float:
        """Seconds after :meth:`Broker.new_transaction` at which the
        coordinator aborts it if it is still open."""
        return self._meta.timeout

    def commit(self) -> None:
        """Make every message and ack of the transaction take effect. On
        return they are visible to readers and survive a crash, and, under
        ``fsync="commit"`` / ``"always"``, a power loss (one flush, shared
        with concurrent commits: docs/GUARANTEES.md).

        A PREPARED transaction (:meth:`prepare`) is committed as
        :meth:`Broker.commit_prepared` commits it.

        Raises :class:`~txmq.errors.TransactionTimeoutError` if the
        transaction timed out, :class:`~txmq.errors.InvalidTxnStateError` if
        it is not open (or prepared), :class:`~txmq.errors.ProducerFencedError` if it
        belongs to a transactional producer a newer instance replaced.

        First the batches of its one-message sends still accumulating are
        appended (its acks need no write: the decision record names them):
        an error doing so (a partition deleted meanwhile, a full disk)
        aborts the transaction and is raised here."""
        if self._broker._closed:
            self._broker._check_open()
        meta = self._meta
        if meta.owner is not None:
            meta.check_owner()
        self._before_decision(False)
        self._coordinator.end(meta, True)

    def prepare(self, xid: str | None = None) -> None:
        """Make the transaction PREPARED: durable (under ``fsync="commit"``
        / ``"always"``, also across a power loss) with its messages and
        acks held as they are while it is open, until :meth:`commit` or
        :meth:`abort` — or, from any later process that owns the
        directory, :meth:`Broker.commit_prepared` /
        :meth:`Broker.abort_prepared` with its :attr:`id` — ends it
        (docs/API.md, "Prepared transactions"). It survives a crash and
        reopening; no transaction timeout aborts it (only the broker's
        ``prepared_timeout``, off by default); leaving a ``with`` block
        leaves it prepared. Until it ends, read_committed readers wait
        behind it as behind an open transaction
        (:meth:`Broker.prepared_transactions` shows which).

        ``xid``: a global id of the caller's (at most 65535 UTF-8 bytes),
        kept with it and shown by :meth:`Broker.prepared_transactions`.

        Raises what :meth:`commit` raises; as there, the batches still
        accumulating are appended and the acks framed first, and an error
        before the transaction is durably prepared aborts it."""
        if self._broker._closed:
            self._broker._check_open()
        if xid is None:
            xid = ""
        try:
            ok = type(xid) is str and len(xid.encode("utf-8")) <= XID_BYTES_MAX
        except UnicodeEncodeError:
            ok = False
        if not ok:
            raise InvalidArgumentError("xid", xid, "None or a str of at most 65535 UTF-8 bytes")
        meta = self._meta
        if meta.owner is not None:
            meta.check_owner()
        self._before_decision(True)
        self._coordinator.prepare(meta, xid)

    def _before_decision(self, frame_acks: bool) -> None:
        """What a commit or a prepare does before its decision is built:
        append the batches still accumulating (so the decision record
        names them); a prepare (``frame_acks``) also frames the acks in
        the pending-ack logs (a commit's decision record names them as
        ranges, so they need no frame). A failure aborts the transaction
        and is raised."""
        meta = self._meta
        if meta.state is not TxnState.OPEN:
            return                       # (the coordinator's end says why it cannot commit)
        error = self._broker._batching.finish(self) if self._accumulators else None
        if error is None and frame_acks and meta.subscriptions:
            try:
                for acks in list(meta.subscriptions.values()):
                    acks.write_txn(meta.id)
            except BaseException as e:
                error = e
        if error is not None:
            self._coordinator.end(meta, False)
            raise error

    def flush(self) -> None:
        """Append the batches of this transaction's one-message sends that
        are still accumulating (what :meth:`commit` does first), and write
        its acks to the pending-ack logs and its partitions and subscriptions
        to its coordinator's log, now: a read_uncommitted reader, a
        read-only view in another process (``txmq.readonly``) and a crash
        then see them. Raises what an append raised; the transaction stays
        open."""
        meta = self._meta
        if meta.owner is not None:
            meta.check_owner()
        meta.check_open("flush")
        for acc in list(self._accumulators):
            self._broker._batching.flush(acc)
        self._coordinator.log_participants(meta)     # (inspection then names them)
        for acks in list(meta.subscriptions.values()):
            acks.write_txn(meta.id)

    def commit_async(self) -> Future:
        """Start the commit and return a ``concurrent.futures.Future`` at
        once, so one thread can pipeline commits (docs/API.md,
        "Transaction"): the commit's decision is written now, and the
        coordinator's flusher thread syncs it together with every decision
        written since, then makes the messages visible and applies the acks,
        then resolves the future (result None). Its messages and acks take
        effect only then; after a power loss, a commit whose future was
        resolved is kept, and one whose future was not may be kept or
        aborted, whole either way.

        Every error comes through the future (``future.result()`` raises
        it): those :meth:`commit` raises, and an I/O error of the sync. The
        future cannot be cancelled.

        As in :meth:`commit`, the batches of its one-message sends still
        accumulating are appended first (an error doing so aborts the
        transaction, through the future)."""
        future = Future()
        future.set_running_or_notify_cancel()
        try:
            self._broker._check_open()
            self._meta.check_owner()
            self._before_decision(False)
            self._coordinator.end(self._meta, True, future=future)
        except BaseException as e:
            future.set_exception(e)
        return future

    def abort(self) -> None:
        """Discard the transaction's messages; its acked messages become
        deliverable again (redelivery count + 1).

        Aborting a transaction already aborted does nothing: a second
        abort, or one after the broker aborted it (timeout, force-abort,
        ``broker.close()``). Aborting a committed (or committing) one raises
        :class:`~txmq.errors.InvalidTxnStateError`; a fenced transactional
        producer's transaction raises
        :class:`~txmq.errors.ProducerFencedError` (it was aborted when the
        newer instance opened)."""
        meta = self._meta
        meta.check_owner()
        if meta.state in (TxnState.OPEN, TxnState.PREPARED):
            self._broker._check_open()
        if self._accumulators:
            self._broker._batching.drop(self)
        self._coordinator.end(meta, False)

    def __enter__(self) -> "Transaction":
        return self

    def __exit__(self, exc_type, exc, tb):
        if self._meta.state is TxnState.PREPARED:
            return False        # ended only by an explicit commit or abort
        if exc_type is None:
            self.commit()
        elif self._meta.state is TxnState.OPEN and not self._broker.closed and not (
                self._meta.owner is not None and self._meta.owner.fenced):
            self.abort()
        return False

    def __repr__(self) -> str:
        age = time.monotonic() - (self._meta.deadline - self._meta.timeout)
        return f"Transaction({self.id}, {self.state.value}, age={age:.1f}s)"


def meta_of(txn, broker):
    """The coordinator's record of ``txn`` (the ``txn=`` of a send or an
    ack through ``broker``): it must be a :class:`Transaction` of that
    broker, and not one of a fenced transactional producer."""
    if type(txn) is not Transaction or txn._broker is not broker:
        raise InvalidArgumentError("txn", txn, "None or a Transaction of this broker")
    meta = txn._meta
    if meta.owner is not None:
        meta.check_owner()
    return meta
