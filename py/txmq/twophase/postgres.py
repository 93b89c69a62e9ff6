"""One atomic commit of a txmq transaction and a PostgreSQL transaction
(docs/TWOPHASE.md has the protocol as a sequence diagram).

Both sides are prepared first — txmq's with :meth:`txmq.Transaction.prepare`,
PostgreSQL's with ``PREPARE TRANSACTION`` — and then one decision is
recorded in exactly one place: the commit of the prepared txmq transaction
(:meth:`txmq.Broker.commit_prepared`), a synced record in its coordinator's
log. PostgreSQL's ``COMMIT PREPARED`` follows the decision; it is never
the decision. The global id names the pair in both:
``<name>:<coordinator>:<sequence>`` (the txmq transaction id), the
PostgreSQL gid and the prepared transaction's ``xid`` alike.

Steps of :meth:`TwoPhaseTransaction.commit`, with the crash point each
crash test kills at (``TXMQ_CRASH_AT``)::

    twophase.before_prepare     nothing prepared
    1. txn.prepare(xid=gid)                 txmq: PREPARED, durable
    twophase.between_prepares
    2. PREPARE TRANSACTION gid              PostgreSQL: prepared, durable
    twophase.prepared
    3. broker.commit_prepared(txn.id)       the decision (txmq's log, synced)
    twophase.decided
    4. COMMIT PREPARED gid                  PostgreSQL: committed
    twophase.between_commits
    5. broker.forget_prepared(txn.id)       the outcome is no longer needed

:meth:`PostgresTwoPhase.recover` resolves every pair a crash of either side
left in doubt, from what the two hold:

=================================  ==================================  ====================================
txmq says of the transaction       PostgreSQL holds gid prepared       PostgreSQL does not
=================================  ==================================  ====================================
PREPARED (no decision)             decide abort: abort_prepared, then  abort_prepared (PostgreSQL never
                                   ROLLBACK PREPARED                   prepared it, or rolled it back)
COMMITTED (decided)                COMMIT PREPARED                     nothing (done; the outcome forgotten)
ABORTED, or unknown                ROLLBACK PREPARED                   nothing
=================================  ==================================  ====================================

PostgreSQL commits only after txmq's commit is durable, so "PostgreSQL
committed" always has "txmq committed" behind it; and txmq keeps the
outcome of an ended prepared transaction until step 5 forgets it, so a
PostgreSQL side still prepared learns which way its pair went.
"""

from __future__ import annotations

import logging
import re
import threading
from contextlib import contextmanager

import psycopg

from txmq import TxnID, TxnState, crashpoints
from txmq.errors import InvalidArgumentError

__all__ = ["PostgresTwoPhase", "TwoPhaseTransaction"]

log = logging.getLogger("txmq.twophase")

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}")


class TwoPhaseTransaction:
    """One pair: :attr:`txn`, a txmq transaction (pass it as ``txn=`` to
    sends and acks), and :attr:`conn`, a psycopg connection inside a
    PostgreSQL transaction (run the statements on it). :meth:`commit`
    commits both or neither; :meth:`abort` aborts both. Use it once."""

    def __init__(self, owner: "PostgresTwoPhase", txn, conn, gid: str):
        self._owner = owner
        self.txn = txn
        self.conn = conn
        self.gid = gid
        self._done = False

    def commit(self) -> None:
        """Commit both transactions atomically. On return the decision is
        durable and txmq's side is visible; PostgreSQL's side is committed
        too, unless ``COMMIT PREPARED`` failed (PostgreSQL went away after
        the decision): then its rows appear when :meth:`PostgresTwoPhase.recover`
        completes it, and this call logs a warning and returns, since the
        pair did commit.

        Raises (and leaves nothing committed on either side) when a step
        before the decision fails: txmq's prepare (its transaction aborted:
        timed out, a conflict, a full disk), or PostgreSQL's ``PREPARE
        TRANSACTION`` (a constraint, a serialization failure, the server
        gone). When the decision itself fails, the pair is left to
        :meth:`PostgresTwoPhase.recover` and the error is raised."""
        self._take()
        owner, broker, conn, txn = self._owner, self._owner.broker, self.conn, self.txn
        try:
            crashpoints.reached("twophase.before_prepare")
            try:
                txn.prepare(xid=self.gid)
            except BaseException:
                owner._rollback(conn)
                raise
            crashpoints.reached("twophase.between_prepares")
            try:
                conn.tpc_prepare()
            except BaseException:
                # PostgreSQL aborted its side: no decision was made, so abort ours.
                broker.abort_prepared(txn.id)
                broker.forget_prepared(txn.id)
                owner._rollback(conn)
                raise
            crashpoints.reached("twophase.prepared")
            try:
                broker.commit_prepared(txn.id)          # the decision
            except BaseException:
                owner._discard(conn)                    # (recover() ends both sides)
                raise
            crashpoints.reached("twophase.decided")
            try:
                conn.tpc_commit()
            except psycopg.Error as e:
                log.warning("txmq: pair %s committed; PostgreSQL's COMMIT PREPARED failed (%s): "
                            "PostgresTwoPhase.recover() completes it", self.gid, e)
                owner._discard(conn)
                return
            crashpoints.reached("twophase.between_commits")
            broker.forget_prepared(txn.id)
            owner._release(conn)
        finally:
            owner._ended(self.gid)

    def abort(self) -> None:
        """Abort both transactions (before :meth:`commit`)."""
        self._take()
        try:
            try:
                self.txn.abort()
            finally:
                self._owner._rollback(self.conn)
        finally:
            self._owner._ended(self.gid)

    def _take(self) -> None:
        if self._done:
            raise InvalidArgumentError("TwoPhaseTransaction", self.gid, "one not committed or aborted yet")
        self._done = True


class PostgresTwoPhase:
    """Atomic commits of txmq transactions of ``broker`` together with
    PostgreSQL transactions on the database ``conninfo`` names (psycopg
    3; the server needs ``max_prepared_transactions`` > 0).

    ``name`` (letters, digits, ``_.-``; at most 100) starts every global
    id this object makes: give each data directory (and each application
    sharing one database) its own, since :meth:`recover` resolves exactly
    the gids that start with it. ``connect`` (a callable returning a
    psycopg connection) replaces ``psycopg.connect(conninfo)``.

    Thread-safe; each pair has a connection of its own, reused from a
    small pool once the pair ended."""

    def __init__(self, broker, conninfo: str | None = None, *, name: str, connect=None, pool_max: int = 8):
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidArgumentError("name", name, "1 to 100 letters, digits, '_', '.' or '-'")
        if connect is None:
            if not isinstance(conninfo, str):
                raise InvalidArgumentError("conninfo", conninfo, "a PostgreSQL connection string (or pass connect=)")
            connect = _connector(conninfo)
        self.broker = broker
        self.name = name
        self._connect = connect
        self._pool: list = []
        self._pool_max = pool_max
        self._lock = threading.Lock()
        self._in_flight: set = set()          # gids of pairs begun here and not ended

    # -- pairs ---------------------------------------------------------------------

    def begin(self, timeout: float = 60.0) -> TwoPhaseTransaction:
        """A new pair: a txmq transaction (``timeout`` seconds, as
        :meth:`txmq.Broker.new_transaction`) and a PostgreSQL transaction
        begun for two-phase commit under the pair's global id."""
        txn = self.broker.new_transaction(timeout)
        gid = self.gid_of(txn.id)
        try:
            conn = self._acquire()
            conn.tpc_begin(gid)
        except BaseException:
            txn.abort()
            raise
        with self._lock:
            self._in_flight.add(gid)
        return TwoPhaseTransaction(self, txn, conn, gid)

    @contextmanager
    def transaction(self, timeout: float = 60.0):
        """``with two_phase.transaction() as pair:`` commits both on normal
        exit and aborts both on an exception."""
        pair = self.begin(timeout)
        try:
            yield pair
        except BaseException:
            if not pair._done:
                pair.abort()
            raise
        if not pair._done:
            pair.commit()

    def gid_of(self, txn_id) -> str:
        """The global id of the pair whose txmq transaction is ``txn_id``."""
        txn_id = TxnID.parse(txn_id)
        return f"{self.name}:{txn_id.coordinator}:{txn_id.sequence}"

    def txn_id_of(self, gid: str):
        """The txmq transaction id a global id of this object names, or
        None when ``gid`` is not one of its."""
        m = re.fullmatch(re.escape(self.name) + r":(\d+):(\d+)", gid)
        return None if m is None else TxnID(int(m.group(1)), int(m.group(2)))

    # -- recovery ------------------------------------------------------------------

    def recover(self) -> dict:
        """Resolve every pair of this ``name`` that a crash (of the
        application, txmq's process or PostgreSQL) left in doubt, by the
        table of the module docstring; pairs still in flight in this
        object are left alone. Returns ``{"committed": n, "aborted": n}``:
        the pairs completed each way.

        Idempotent: run it at start, and again after an error. When
        PostgreSQL cannot be reached it raises psycopg's error having
        changed nothing (it asks PostgreSQL first); a prepared txmq
        transaction then keeps holding its readers back until a later
        call can ask."""
        done = {"committed": 0, "aborted": 0}
        conn = self._acquire()
        try:
            pg = {x.gtrid for x in conn.tpc_recover() if x.format_id is None}
            with self._lock:
                busy = set(self._in_flight)
            for gid in sorted(pg - busy):
                txn_id = self.txn_id_of(gid)
                if txn_id is None:
                    continue
                outcome = self.broker.prepared_outcome(txn_id)
                if outcome is TxnState.PREPARED:
                    self.broker.abort_prepared(txn_id)        # no decision was made: decide abort
                    outcome = TxnState.ABORTED
                if outcome is TxnState.COMMITTED:
                    conn.tpc_commit(gid)
                    done["committed"] += 1
                else:
                    conn.tpc_rollback(gid)
                    done["aborted"] += 1
                self._forget(txn_id)
            for t in self.broker.prepared_transactions():
                gid = t["xid"]
                if self.txn_id_of(gid) is None or gid in pg or gid in busy:
                    continue
                # Prepared in txmq alone: PostgreSQL never prepared its side
                # (or rolled it back), so no decision can have been made.
                self.broker.abort_prepared(t["id"])
                self._forget(t["id"])
                done["aborted"] += 1
        except BaseException:
            self._discard(conn)
            raise
        self._release(conn)
        return done

    def _forget(self, txn_id) -> None:
        self.broker.forget_prepared(txn_id)

    # -- connections -----------------------------------------------------------------

    def _acquire(self):
        with self._lock:
            if self._pool:
                return self._pool.pop()
        return self._connect()

    def _release(self, conn) -> None:
        """Back to the pool, if it is usable and the pool has room."""
        if conn.closed or conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            self._discard(conn)
            return
        with self._lock:
            if len(self._pool) < self._pool_max:
                self._pool.append(conn)
                return
        conn.close()

    def _discard(self, conn) -> None:
        try:
            conn.close()
        except psycopg.Error:
            pass

    def _rollback(self, conn) -> None:
        """End PostgreSQL's side of a pair that did not prepare there."""
        try:
            conn.tpc_rollback()
        except psycopg.Error as e:
            log.warning("txmq: rolling back PostgreSQL's side failed (%s); the server rolls it back when "
                        "the connection closes", e)
            self._discard(conn)
            return
        self._release(conn)

    def _ended(self, gid: str) -> None:
        with self._lock:
            self._in_flight.discard(gid)

    def close(self) -> None:
        """Close the pooled connections."""
        with self._lock:
            pool, self._pool = self._pool, []
        for conn in pool:
            self._discard(conn)

    def __enter__(self) -> "PostgresTwoPhase":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _connector(conninfo: str):
    def connect():
        return psycopg.connect(conninfo)
    return connect
