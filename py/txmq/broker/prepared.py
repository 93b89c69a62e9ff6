"""Prepared transactions through the broker (docs/API.md, "Prepared
transactions"): list them, end them, keep and forget their outcomes."""

from __future__ import annotations

import time

from txmq.errors import InvalidTxnStateError, TransactionNotFoundError
from txmq.transactions.records import TxnID, TxnState, txn_info



class PreparedTransactions:
    """The Broker's calls on prepared transactions (a mixin: the coordinators
    are the Broker's)."""

    def prepared_transactions(self) -> list:
        """Every PREPARED transaction (:meth:`Transaction.prepare`), oldest
        first, as dicts: ``id``, ``xid``, ``prepared_ms`` (epoch) and
        ``age_s`` (seconds since it was prepared), ``partitions``,
        ``subscriptions``, and ``holds_back``: the partitions whose
        read_committed readers it holds back (it is the oldest open
        transaction there)."""
        self._check_open()
        metas = [m for tc in self._coordinators for m in list(tc.txns.values())
                 if m.state is TxnState.PREPARED and m.prepared_ms is not None]
        now = time.time_ns() // 1_000_000
        out = []
        for m in sorted(metas, key=lambda m: (m.prepared_ms, m.id)):
            info = txn_info(m)
            info["age_s"] = round(max(0, now - m.prepared_ms) / 1000.0, 3)
            info["holds_back"] = sorted(f"{t}/{i}" for (t, i), p in m.partitions.items()
                                        if (p.blocked_by() or (None,))[0] == m.id)
            out.append(info)
        return out

    def _prepared(self, txn_id, commit: bool):
        """The live meta of prepared ``txn_id`` to commit or abort, or None
        when it has already ended that way (its outcome kept)."""
        self._check_open()
        txn_id = TxnID.parse(txn_id)
        tc = self._coordinators[txn_id.coordinator] if txn_id.coordinator < len(self._coordinators) else None
        meta = None if tc is None else tc.txns.get(txn_id)
        if meta is not None and meta.state is TxnState.PREPARED and meta.prepared_ms is not None:
            return meta
        outcome = None if tc is None else tc.prepared_outcome(txn_id)
        if outcome is (TxnState.COMMITTED if commit else TxnState.ABORTED):
            return None
        doing = "commit_prepared" if commit else "abort_prepared"
        if meta is not None:
            raise InvalidTxnStateError(txn_id, meta.state.value, doing)
        if outcome is not None:
            raise InvalidTxnStateError(txn_id, outcome.value, doing)
        raise TransactionNotFoundError(txn_id)

    def commit_prepared(self, txn_id) -> None:
        """Commit the PREPARED transaction ``txn_id`` (a TxnID, a
        (coordinator, sequence) pair or ``"(tc,seq)"``), from any process
        that owns the directory: its messages become visible and its acks
        apply, as :meth:`Transaction.commit`; on return the commit is
        durable. Committing one that already committed does nothing;
        :class:`InvalidTxnStateError` if it aborted or is not prepared,
        :class:`TransactionNotFoundError` if it is not known."""
        meta = self._prepared(txn_id, True)
        if meta is not None:
            tc = self._coordinator_of(meta)
            tc.end(meta, True)
            tc.write_deferred()        # (an operator's end: tools reading the directory see it at once)

    def abort_prepared(self, txn_id) -> None:
        """Abort the PREPARED transaction ``txn_id``: its messages are
        dropped and its acked messages delivered again; on return the abort
        is durable. Aborting one that already aborted does nothing;
        :class:`InvalidTxnStateError` if it committed or is not prepared,
        :class:`TransactionNotFoundError` if it is not known."""
        meta = self._prepared(txn_id, False)
        if meta is not None:
            tc = self._coordinator_of(meta)
            tc.end(meta, False)
            tc.write_deferred()

    def prepared_outcome(self, txn_id):
        """``TxnState.PREPARED`` while ``txn_id`` is prepared, then
        ``COMMITTED`` or ``ABORTED`` once decided (durable: applied at once,
        or by recovery) until :meth:`forget_prepared`; None for a
        transaction that was never prepared, or whose outcome was
        forgotten. Another party's recovery asks this
        (:mod:`txmq.twophase`)."""
        self._check_open()
        txn_id = TxnID.parse(txn_id)
        if txn_id.coordinator >= len(self._coordinators):
            return None
        return self._coordinators[txn_id.coordinator].prepared_outcome(txn_id)

    def forget_prepared(self, txn_id) -> bool:
        """Stop keeping the outcome of the ended prepared transaction
        ``txn_id``; False when none is kept (a crash right after may keep
        it until it is forgotten again).
        :class:`InvalidTxnStateError` while it is still prepared. Outcomes
        nobody forgets are dropped oldest first past 10,000 per
        coordinator."""
        self._check_open()
        txn_id = TxnID.parse(txn_id)
        if txn_id.coordinator >= len(self._coordinators):
            return False
        return self._coordinators[txn_id.coordinator].forget_prepared(txn_id)
