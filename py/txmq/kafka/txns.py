"""Kafka producer ids and transactions on txmq's producer table and
transactional producers.

- InitProducerId without a transactional id hands out a fresh producer id
  from the data directory's persistent counter (epoch 0); a client that
  names its current id and epoch (KIP-360, after an error) gets the epoch
  bumped. Its batches then go through each partition's producer table.
- InitProducerId with a transactional id opens
  :meth:`txmq.Broker.transactional_producer`: the id's epoch is bumped
  durably, the previous instance's open transaction is aborted and that
  instance fenced (PRODUCER_FENCED from then on), exactly as for the
  Python API — the two share the same ids.
- AddPartitionsToTxn / AddOffsetsToTxn begin the instance's txmq
  transaction if none is open; Produce of transactional batches appends in
  it; TxnOffsetCommit acknowledges the group's subscription cumulatively
  in it (``send_offsets_to_transaction``), so the offsets and the outputs
  commit or abort together; EndTxn commits or aborts it.
"""

from __future__ import annotations

import logging
import threading

from txmq.errors import (ConcurrentTransactionsError, InvalidArgumentError, InvalidTxnStateError,
                         InvalidTxnTimeoutError, PartitionNotFoundError, ProducerFencedError,
                         SubscriptionTypeError, TopicNotFoundError, TransactionError, TransactionTimeoutError,
                         InvalidTopicNameError)
from txmq.kafka.data import ProduceRefused
from txmq.kafka.protocol import Error
from txmq.transactions.records import TxnState

log = logging.getLogger("txmq.kafka")

EPOCH_MAX = 32767


class Session:
    """One live instance of a transactional id."""

    __slots__ = ("tp", "txn", "partitions", "groups")

    def __init__(self, tp):
        self.tp = tp
        self.txn = None                   # the txmq Transaction, while one is open
        self.partitions: set = set()
        self.groups: set = set()

    @property
    def open(self) -> bool:
        return self.txn is not None and self.txn.state is TxnState.OPEN


class Transactions:
    """The transactional ids served (thread-safe: handlers run in the pool)."""

    def __init__(self, server):
        self.server = server
        self.broker = server.broker
        self.sessions: dict = {}          # transactional id -> Session
        self.lock = threading.Lock()

    # -- InitProducerId -------------------------------------------------------------------

    async def init_producer_id(self, conn, version: int, body: dict) -> dict:
        return await self.server.blocking(self._init, conn, body)

    def _init(self, conn, body: dict) -> dict:
        answer = {"throttle_time_ms": 0, "error_code": Error.NONE, "producer_id": -1, "producer_epoch": -1}
        tid = body["transactional_id"]
        if tid is None:
            pid, epoch = body.get("producer_id", -1), body.get("producer_epoch", -1)
            if pid >= 0 and 0 <= epoch < EPOCH_MAX:
                return dict(answer, producer_id=pid, producer_epoch=epoch + 1)
            return dict(answer, producer_id=self.broker.allocate_producer_id(), producer_epoch=0)
        code = self.server.handlers.transactional_id_allowed(conn, tid)
        if code != Error.NONE:
            return dict(answer, error_code=code)
        timeout = body["transaction_timeout_ms"] / 1000.0
        with self.lock:
            old = self.sessions.get(tid)
            if old is not None and body.get("producer_id", -1) >= 0 and (
                    body["producer_id"] != old.tp.producer_id or body["producer_epoch"] != old.tp.epoch):
                return dict(answer, error_code=Error.PRODUCER_FENCED)
            try:
                tp = self.broker.transactional_producer(tid, timeout=timeout)
            except InvalidTxnTimeoutError:
                return dict(answer, error_code=Error.INVALID_TRANSACTION_TIMEOUT)
            except ConcurrentTransactionsError:
                return dict(answer, error_code=Error.CONCURRENT_TRANSACTIONS)
            except InvalidArgumentError:
                return dict(answer, error_code=Error.INVALID_REQUEST)
            self.sessions[tid] = Session(tp)
        return dict(answer, producer_id=tp.producer_id, producer_epoch=tp.epoch)

    def _session(self, tid, pid: int, epoch: int) -> Session:
        """The live session of ``tid`` for (pid, epoch), or ProduceRefused."""
        s = self.sessions.get(tid) if tid is not None else None
        if s is None or s.tp.closed:
            raise ProduceRefused(Error.INVALID_PRODUCER_ID_MAPPING, f"transactional id {tid!r} is not initialised")
        if s.tp.fenced:
            raise ProduceRefused(Error.PRODUCER_FENCED, f"transactional id {tid!r} was opened again")
        if pid != s.tp.producer_id:
            raise ProduceRefused(Error.INVALID_PRODUCER_ID_MAPPING,
                                 f"producer id {pid} is not {tid!r}'s ({s.tp.producer_id})")
        if epoch != s.tp.epoch:
            raise ProduceRefused(Error.PRODUCER_FENCED if epoch < s.tp.epoch else Error.INVALID_PRODUCER_EPOCH,
                                 f"epoch {epoch}, {tid!r} is at {s.tp.epoch}")
        return s

    def _begin(self, s: Session) -> None:
        if not s.open:
            if s.txn is not None and s.txn.state is TxnState.ABORTED and s.partitions:
                # The broker aborted it (timeout): the client must abort too.
                raise ProduceRefused(Error.INVALID_PRODUCER_EPOCH, "the transaction timed out and was aborted")
            s.txn = s.tp.begin()
            s.partitions, s.groups = set(), set()

    def producer_for(self, tid, pid: int, epoch: int, topic: str, index: int):
        """(Producer, Transaction) for a transactional batch of Produce."""
        with self.lock:
            s = self._session(tid, pid, epoch)
            if not s.open or (topic, index) not in s.partitions:
                raise ProduceRefused(Error.INVALID_TXN_STATE,
                                     f"{topic}/{index} was not added to {tid!r}'s transaction")
            return s.tp.producer(topic), s.txn

    # -- AddPartitionsToTxn / AddOffsetsToTxn -------------------------------------------------

    async def add_partitions(self, conn, version: int, body: dict) -> dict:
        return await self.server.blocking(self._add_partitions, conn, body)

    def _add_partitions(self, conn, body: dict) -> dict:
        code = Error.NONE
        with self.lock:
            try:
                s = self._session(body["v3_and_below_transactional_id"], body["v3_and_below_producer_id"],
                                  body["v3_and_below_producer_epoch"])
            except ProduceRefused as e:
                code = e.code
            results = []
            for t in body["v3_and_below_topics"]:
                name = t["name"]
                tcode = code
                if tcode == Error.NONE:
                    tcode = self.server.handlers.topic_ready(name, conn, op="write", create=False)
                parts = []
                for index in t["partitions"]:
                    pcode = tcode
                    if pcode == Error.NONE:
                        try:
                            self.broker._partition(name, index)
                        except (TopicNotFoundError, PartitionNotFoundError, InvalidTopicNameError):
                            pcode = Error.UNKNOWN_TOPIC_OR_PARTITION
                    parts.append((index, pcode))
                results.append((name, parts))
            if code == Error.NONE and all(c == Error.NONE for _, ps in results for _, c in ps):
                try:
                    self._begin(s)
                except ProduceRefused as e:
                    results = [(n, [(i, e.code) for i, _ in ps]) for n, ps in results]
                else:
                    s.partitions.update((n, i) for n, ps in results for i, _ in ps)
        return {"throttle_time_ms": 0, "results_by_topic_v3_and_below": [
            {"name": n, "results_by_partition": [{"partition_index": i, "partition_error_code": c}
                                                 for i, c in ps]} for n, ps in results]}

    async def add_offsets(self, conn, version: int, body: dict) -> dict:
        return await self.server.blocking(self._add_offsets, conn, body)

    def _add_offsets(self, conn, body: dict) -> dict:
        code = self.server.handlers.group_allowed(conn, body["group_id"])
        if code == Error.NONE:
            with self.lock:
                try:
                    s = self._session(body["transactional_id"], body["producer_id"], body["producer_epoch"])
                    self._begin(s)
                    s.groups.add(body["group_id"])
                except ProduceRefused as e:
                    code = e.code
        return {"throttle_time_ms": 0, "error_code": code}

    # -- TxnOffsetCommit ----------------------------------------------------------------------

    async def txn_offset_commit(self, conn, version: int, body: dict) -> dict:
        gid = body["group_id"]
        code = Error.NONE
        if body.get("generation_id", -1) >= 0:
            code = self.server.handlers.groups.check_member(gid, body["generation_id"], body["member_id"])
        return await self.server.blocking(self._txn_offset_commit, conn, body, code)

    def _txn_offset_commit(self, conn, body: dict, code: int) -> dict:
        gid = body["group_id"]
        out = []
        with self.lock:
            s = None
            if code == Error.NONE:
                try:
                    s = self._session(body["transactional_id"], body["producer_id"], body["producer_epoch"])
                    if not s.open or gid not in s.groups:
                        code = Error.INVALID_TXN_STATE
                except ProduceRefused as e:
                    code = e.code
            for t in body["topics"]:
                name = t["name"]
                parts = []
                tcode = code
                if tcode == Error.NONE and not self.server.handlers.may(conn, name, "read"):
                    tcode = Error.TOPIC_AUTHORIZATION_FAILED
                for p in t["partitions"]:
                    pcode = tcode
                    if pcode == Error.NONE:
                        pcode = self._ack_in_txn(s, name, gid, p["partition_index"], p["committed_offset"])
                    parts.append({"partition_index": p["partition_index"], "error_code": pcode})
                out.append({"name": name, "partitions": parts})
        return {"throttle_time_ms": 0, "topics": out}

    def _ack_in_txn(self, s: Session, topic: str, group_id: str, index: int, offset: int) -> int:
        try:
            sub = self.server.handlers.groups.subscription(topic, group_id)
            s.tp.send_offsets_to_transaction(s.txn, (topic, group_id), {index: offset})
        except (TopicNotFoundError, PartitionNotFoundError, InvalidTopicNameError):
            return Error.UNKNOWN_TOPIC_OR_PARTITION
        except ProducerFencedError:
            return Error.PRODUCER_FENCED
        except (TransactionTimeoutError, InvalidTxnStateError):
            return Error.INVALID_TXN_STATE
        except TransactionError as e:
            log.info("txmq.kafka: offsets of group %s on %s/%d in %s: %s", group_id, topic, index,
                     s.tp.transactional_id, e)
            return Error.CONCURRENT_TRANSACTIONS
        except (InvalidArgumentError, SubscriptionTypeError):
            # (a group named like a shared subscription of the Python API,
            # an out-of-order one say: it takes no cumulative ack)
            return Error.INVALID_GROUP_ID
        del sub
        return Error.NONE

    # -- EndTxn -------------------------------------------------------------------------------

    async def end_txn(self, conn, version: int, body: dict) -> dict:
        answer = await self.server.blocking(self._end, body)
        self.server.handlers.data.data_arrived()
        return answer

    def _end(self, body: dict) -> dict:
        code = Error.NONE
        with self.lock:
            try:
                s = self._session(body["transactional_id"], body["producer_id"], body["producer_epoch"])
            except ProduceRefused as e:
                return {"throttle_time_ms": 0, "error_code": e.code}
            txn = s.txn
        if txn is None:
            return {"throttle_time_ms": 0, "error_code": Error.NONE}
        try:
            if body["committed"]:
                if txn.state is TxnState.COMMITTED:
                    pass                               # a retried EndTxn
                else:
                    txn.commit()
            elif txn.state not in (TxnState.ABORTED,):
                txn.abort()
        except ProducerFencedError:
            code = Error.PRODUCER_FENCED
        except TransactionTimeoutError:
            code = Error.INVALID_PRODUCER_EPOCH        # Kafka bumps the epoch of a timed-out transaction
        except InvalidTxnStateError:
            code = Error.INVALID_TXN_STATE
        except ConcurrentTransactionsError:
            code = Error.CONCURRENT_TRANSACTIONS
        with self.lock:
            if s.txn is txn and code == Error.NONE:
                s.txn = None
                s.partitions, s.groups = set(), set()
        return {"throttle_time_ms": 0, "error_code": code}

    def close(self) -> None:
        """Forget the sessions; the broker's transactional producers stay
        until a client opens the id again (their open transactions time
        out or are aborted then)."""
        with self.lock:
            self.sessions.clear()
