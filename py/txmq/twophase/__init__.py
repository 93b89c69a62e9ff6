"""Atomic commits of a txmq transaction together with a transaction of
another system, over txmq's prepared transactions
(:meth:`txmq.Transaction.prepare`; docs/TWOPHASE.md).

:class:`PostgresTwoPhase` does it with PostgreSQL's ``PREPARE
TRANSACTION`` (psycopg 3: ``pip install "txmq[postgres]"``)."""

from txmq.twophase.postgres import PostgresTwoPhase, TwoPhaseTransaction

__all__ = ["PostgresTwoPhase", "TwoPhaseTransaction"]
