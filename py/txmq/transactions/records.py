"""Transaction identities and the per-transaction record shared by the
coordinator (which owns it) and the partitions and subscriptions that check
it under their own locks (docs/API.md, "Transaction").

A :class:`TxnID` is 128 bits: the coordinator id in the top 16, a sequence
that only grows in the other 112. On disk it is two little-endian u64 words
``(hi, lo)`` (``hi`` = coordinator << 48 | sequence >> 64). Sequences start
at 1: the all-zero id means "no transaction" in a batch header.
"""

from __future__ import annotations

import enum
import re
import threading
import time
from typing import NamedTuple

from txmq._txn import txn_parts, txn_words
from txmq.errors import BrokerClosedError, InvalidArgumentError, InvalidTxnStateError, TransactionTimeoutError


class TxnID(NamedTuple):
    """A transaction id: ``(coordinator, sequence)``, printed ``(tc,seq)``."""

    coordinator: int
    sequence: int

    def __str__(self) -> str:
        return f"({self.coordinator},{self.sequence})"

    @property
    def words(self) -> tuple:
        """The (hi, lo) u64 words stored in batch headers and logs."""
        return txn_words(self.coordinator, self.sequence)

    def __int__(self) -> int:
        hi, lo = self.words
        return (hi << 64) | lo

    @classmethod
    def from_words(cls, hi: int, lo: int) -> "TxnID":
        return cls(*txn_parts(hi, lo))

    @classmethod
    def parse(cls, value) -> "TxnID":
        """A TxnID from a TxnID, a (tc, seq) pair, or its text ``"(tc,seq)"``."""
        if isinstance(value, TxnID):
            return value
        if isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) for v in value):
            return cls(*value)
        if isinstance(value, str):
            m = re.fullmatch(r"\s*\(?\s*(\d+)\s*,\s*(\d+)\s*\)?\s*", value)
            if m:
                return cls(int(m.group(1)), int(m.group(2)))
        raise InvalidArgumentError("txn_id", value, "a TxnID, a (coordinator, sequence) pair or '(tc,seq)'")


class TxnState(str, enum.Enum):
    OPEN = "OPEN"
    PREPARED = "PREPARED"
    COMMITTING = "COMMITTING"
    COMMITTED = "COMMITTED"
    ABORTING = "ABORTING"
    ABORTED = "ABORTED"

    def __str__(self) -> str:
        return self.value


class TxnMeta:
    """A coordinator's record of one transaction.

    ``state`` changes only under ``lock``. Partitions and subscriptions call
    :meth:`check_open` under their own lock before they change anything for
    the transaction; ending takes each participant's lock once after leaving
    OPEN, so every operation either completed before the end began or is
    refused.
    """

    __slots__ = ("id", "words", "state", "timeout", "start_ms", "deadline", "partitions",
                 "subscriptions", "lock", "reason", "decided", "owner", "record", "prepared_ms", "xid",
                 "logged", "logged_subs")

    def __init__(self, txn_id: TxnID, timeout: float, start_ms: int, deadline: float):
        self.id = txn_id
        self.words = txn_id.words
        self.state = TxnState.OPEN
        self.timeout = timeout
        self.start_ms = start_ms
        self.deadline = deadline
        self.partitions: dict = {}        # (topic, index) -> Partition
        self.subscriptions: dict = {}     # (topic, name) -> Subscription
        self.lock = threading.Lock()
        self.reason = None                # why it was aborted by the broker, if it was
        self.decided = None               # True / False once COMMITTING / ABORTING is logged
        self.owner = None                 # the TransactionalProducer that began it, if one did
        self.record = None                # its decision record once a commit or a prepare logged one (bytes)
        self.prepared_ms = None           # when it was prepared (epoch ms), if it was
        self.xid = None                   # the global id given at prepare ("" when none)
        self.logged = False               # its BEGIN is in its coordinator log, or deferred to go out before
                                          # any later frame (or a snapshot names it)
        self.logged_subs = set()          # the subscription keys the log names for it (ADD_SUBSCRIPTION)

    def check_open(self, doing: str = "use it") -> None:
        if self.state is not TxnState.OPEN:
            raise self.not_open(doing)

    def check_owner(self) -> None:
        """Refuse any use once a newer instance of the transactional id that
        began this transaction was opened."""
        if self.owner is not None and self.owner.fenced:
            raise self.owner.fenced_error()

    def not_open(self, doing: str):
        if self.reason == "fenced":
            return self.owner.fenced_error()
        if self.reason == "closed":
            return BrokerClosedError(f"transaction {self.id} was aborted when its broker closed; cannot {doing}")
        if self.reason == "timeout":
            return TransactionTimeoutError(self.id, self.timeout)
        return InvalidTxnStateError(self.id, self.state.value, doing)

    def __repr__(self) -> str:
        return f"TxnMeta({self.id}, {self.state.value})"


def txn_info(meta) -> dict:
    """What ``Broker.transactions()`` and ``transaction_info`` show of a
    live transaction."""
    info = {
        "id": str(meta.id),
        "state": meta.state.value,
        "age_s": round(time.monotonic() - (meta.deadline - meta.timeout), 3),
        "timeout_s": meta.timeout,
        "started_ms": meta.start_ms,
        "partitions": sorted(f"{t}/{p}" for t, p in meta.partitions),
        "subscriptions": sorted(f"{t}/{s}" for t, s in meta.subscriptions),
    }
    if meta.prepared_ms is not None:
        info["xid"] = meta.xid
        info["prepared_ms"] = meta.prepared_ms
    return info
