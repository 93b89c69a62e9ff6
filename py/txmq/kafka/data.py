"""Produce, Fetch and ListOffsets: Kafka's data path onto txmq partitions.

Kafka offsets are txmq offsets: a batch keeps its base offset, a marker
takes one offset, as in Kafka. Produce appends each record batch as one
txmq batch — plain, idempotent (the batch's producer id, epoch and base
sequence go through txmq's producer table: a retried batch answers with
its first offset and appends nothing) or in the transactional id's open
transaction. Fetch returns txmq batches re-encoded as record batch v2
(markers as control batches) from the fetch offset up to the high
watermark (read_uncommitted) or the last stable offset (read_committed),
with the aborted transactions of that range from the partition's
``.txnindex``; read_committed fetches also leave out the batches of aborted
transactions, so such data never reaches a client whatever it does with
the list.
"""

from __future__ import annotations

import asyncio
import logging
import time

from txmq._batch import FLAG
from txmq._segment import SegmentClosedError
from txmq.errors import (BrokerClosedError, ConcurrentTransactionsError, DuplicateSequenceError,
                         InvalidMessageError, InvalidTxnStateError, KafkaProtocolError, MessageTooLargeError,
                         OutOfOrderSequenceError, PartitionNotFoundError, ProducerFencedError,
                         TopicNotFoundError, TransactionTimeoutError, InvalidTopicNameError)
from txmq import _kafka, _kafka_records
from txmq.kafka import records
from txmq.kafka.protocol import Error
from txmq.client.producer import Producer

log = logging.getLogger("txmq.kafka")

READ_COMMITTED = 1
EARLIEST, LATEST = -2, -1
MARKER_COMMIT = FLAG["marker_commit"]
FETCH_BUFFER_BYTES = 4 * 1024 * 1024     # initial size of a partition's fetch buffer; it grows


class ProduceRefused(Exception):
    """A produce refused with a Kafka error code (raised inside the
    transactional path, answered per partition)."""

    def __init__(self, code: int, reason: str = ""):
        self.code = code
        super().__init__(reason or str(code))


def error_code(e: BaseException, transactional: bool = False) -> int:
    """The Kafka error code for a txmq error raised by an append."""
    if isinstance(e, ProduceRefused):
        return e.code
    if isinstance(e, (TopicNotFoundError, PartitionNotFoundError, InvalidTopicNameError)):
        return Error.UNKNOWN_TOPIC_OR_PARTITION
    if isinstance(e, MessageTooLargeError):
        return Error.MESSAGE_TOO_LARGE
    if isinstance(e, DuplicateSequenceError):
        return Error.DUPLICATE_SEQUENCE_NUMBER
    if isinstance(e, OutOfOrderSequenceError):
        return Error.OUT_OF_ORDER_SEQUENCE_NUMBER
    if isinstance(e, ProducerFencedError):
        return Error.PRODUCER_FENCED if transactional else Error.INVALID_PRODUCER_EPOCH
    if isinstance(e, (TransactionTimeoutError, InvalidTxnStateError)):
        return Error.INVALID_TXN_STATE
    if isinstance(e, ConcurrentTransactionsError):
        return Error.CONCURRENT_TRANSACTIONS
    if isinstance(e, (KafkaProtocolError, InvalidMessageError)):
        return Error.CORRUPT_MESSAGE
    return Error.UNKNOWN_SERVER_ERROR


class DataPath:
    """Produce / Fetch / ListOffsets for one server."""

    def __init__(self, server):
        self.server = server
        self.broker = server.broker
        self._plain: dict = {}            # topic -> the Producer of non-idempotent Kafka batches
        self._idempotent: dict = {}       # (topic, producer id, epoch) -> Producer
        self._listening: dict = {}        # partition -> listener, to wake waiting fetches
        self._waiters = 0
        self._event: asyncio.Event | None = None

    def start(self) -> None:
        self._event = asyncio.Event()

    def stop(self) -> None:
        for p, cb in list(self._listening.items()):
            p.remove_listener(cb)
        self._listening.clear()

    # -- Produce ----------------------------------------------------------------------------

    async def produce(self, conn, version: int, body: dict):
        tid = body["transactional_id"]
        topics = body["topic_data"]
        answers = await self.server.blocking(self._produce_all, conn, tid, topics)
        self.data_arrived()
        if body["acks"] == 0:
            return None
        return {"responses": answers, "throttle_time_ms": 0}

    def _produce_all(self, conn, tid, topics) -> list:
        out = []
        for t in topics:
            name = t["name"]
            parts = []
            ready = self.server.handlers.topic_ready(name, conn, op="write")
            for pd in t["partition_data"]:
                index = pd["index"]
                answer = {"index": index, "error_code": Error.NONE, "base_offset": -1,
                          "log_append_time_ms": -1, "log_start_offset": -1}
                if ready != Error.NONE:
                    answer["error_code"] = ready
                else:
                    self._produce_partition(name, index, pd["records"], tid, answer)
                parts.append(answer)
            out.append({"name": name, "partition_responses": parts})
        return out

    def _produce_partition(self, topic: str, index: int, raw, tid, answer: dict) -> None:
        transactional = False
        try:
            if raw is None:
                raise KafkaProtocolError("record batch", 0, "null records")
            p = self.broker._partition(topic, index)
            answer["log_start_offset"] = p.start_offset
            batches = records.decode_produce(raw, p.max_message_bytes * 2 + (1 << 20))
            if not batches:
                raise KafkaProtocolError("record batch", 0, "no record batch")
            base = -1
            for b in batches:
                transactional = b.transactional
                offset = self._append(topic, index, b, tid)
                if base < 0:
                    base = offset
            answer["base_offset"] = base
        except BrokerClosedError:
            raise
        except Exception as e:
            code = error_code(e, transactional)
            answer["error_code"] = code
            answer["error_message"] = str(e)
            if code == Error.UNKNOWN_SERVER_ERROR:
                log.warning("txmq.kafka: produce to %s/%d: %s: %s", topic, index, type(e).__name__, e)

    def _append(self, topic: str, index: int, b, tid) -> int:
        if b.control:
            raise KafkaProtocolError("record batch", 0, "a client may not send control batches")
        if b.count == 0:
            raise KafkaProtocolError("record batch", 0, "a batch of no records")
        txn = None
        if b.transactional:
            producer, txn = self.server.handlers.txns.producer_for(tid, b.producer_id, b.producer_epoch,
                                                                   topic, index)
        elif b.producer_id >= 0:
            key = (topic, b.producer_id, b.producer_epoch)
            producer = self._idempotent.get(key)
            if producer is None or producer.closed or producer._topic is not self.broker._topic(topic):
                producer = self._idempotent[key] = Producer(self.broker, self.broker._topic(topic),
                                                            b.producer_id, b.producer_epoch)
                if len(self._idempotent) > 100_000:
                    self._idempotent.clear()
        else:
            producer = self._plain.get(topic)
            if producer is None or producer._topic is not self.broker._topic(topic):
                producer = self._plain[topic] = self.broker.producer(topic)
        sequence = b.base_sequence if b.producer_id >= 0 and b.base_sequence >= 0 else -1
        return producer.append_spec(b.spec(), index, txn, sequence)

    # -- Fetch ------------------------------------------------------------------------------

    def data_arrived(self, partition=None) -> None:
        """Wake fetches waiting for data (any thread)."""
        loop = self.server.loop
        if self._waiters and loop is not None and self._event is not None:
            loop.call_soon_threadsafe(self._event.set)

    async def fetch(self, conn, version: int, body: dict) -> dict:
        committed = body.get("isolation_level", 0) == READ_COMMITTED
        wanted = [(t["topic"], p) for t in body["topics"] for p in t["partitions"]]
        deadline = time.monotonic() + max(0, body["max_wait_ms"]) / 1000.0
        min_bytes = max(1, body["min_bytes"])
        max_bytes = body.get("max_bytes", 0x7FFFFFFF)
        while True:
            self._event.clear()
            answers, size = await self.server.blocking(self._read_all, conn, wanted, committed, max_bytes)
            left = deadline - time.monotonic()
            if size >= min_bytes or left <= 0 or self.server.stopped:
                break
            self._waiters += 1
            try:
                await asyncio.wait_for(self._event.wait(), left)
            except asyncio.TimeoutError:
                pass
            finally:
                self._waiters -= 1
        topics: dict = {}
        for (name, _), answer in zip(wanted, answers):
            topics.setdefault(name, []).append(answer)
        return {"throttle_time_ms": 0, "error_code": Error.NONE, "session_id": 0,
                "responses": [{"topic": name, "partitions": parts} for name, parts in topics.items()]}

    def _read_all(self, conn, wanted: list, committed: bool, max_bytes: int):
        answers, total = [], 0
        for name, req in wanted:
            answer = self._read_partition(conn, name, req, committed, max(0, max_bytes - total))
            total += len(answer["records"] or b"")
            answers.append(answer)
        return answers, total

    def _read_partition(self, conn, topic: str, req: dict, committed: bool, budget: int) -> dict:
        index = req["partition"]
        answer = {"partition_index": index, "error_code": Error.NONE, "high_watermark": -1,
                  "last_stable_offset": -1, "log_start_offset": -1, "aborted_transactions": None,
                  "preferred_read_replica": -1, "records": b""}
        code = self.server.handlers.topic_ready(topic, conn, op="read", create=False)
        if code != Error.NONE:
            answer["error_code"] = code
            return answer
        try:
            p = self.broker._partition(topic, index)
        except PartitionNotFoundError:
            answer["error_code"] = Error.UNKNOWN_TOPIC_OR_PARTITION
            return answer
        self._listen(p)
        for _ in range(3):                         # retention may close a segment under the read
            try:
                return self._read(p, req["fetch_offset"], min(budget, req["partition_max_bytes"]),
                                  committed, answer)
            except SegmentClosedError:
                continue
        answer["error_code"] = Error.OFFSET_OUT_OF_RANGE
        return answer

    def _read(self, p, offset: int, budget: int, committed: bool, answer: dict) -> dict:
        start, hw, lso = p.start_offset, p.end_offset, p.max_read_position
        answer.update(high_watermark=hw, last_stable_offset=lso, log_start_offset=start)
        if offset < start or offset > hw:
            answer["error_code"] = Error.OFFSET_OUT_OF_RANGE
            return answer
        end = lso if committed else hw
        out = _kafka.Writer(min(budget, FETCH_BUFFER_BYTES) + 1024)
        sent = []                              # (base offset, producer id) of transactional data sent
        seg, pos = p.segment_for(offset)
        last = offset
        while seg is not None:
            info = seg.batch_at(pos)
            if info.base_offset >= end or (len(out) and len(out) >= budget):
                break
            if info.is_control:
                _kafka.write_bytes(out, records.encode_marker(info, bool(info.flags & MARKER_COMMIT)))
            elif not (committed and p.never_delivered(info, True)):   # aborted data: never sent read_committed
                before = len(out)
                _kafka_records.encode_stored_batch(out, seg.batch_bytes(pos))
                if before and len(out) > budget:
                    out.truncate(before)           # whole batches only: it goes in the next fetch
                    break
                if info.is_transactional:
                    sent.append((info.base_offset, info.producer_id))
            last = info.next_offset
            seg, pos = p.next_batch(seg, pos)
        answer["records"] = out.getvalue()
        if committed:
            aborted = self.broker.aborted_transactions(p.topic, p.index, offset, max(last, offset)) \
                if last > offset else []
            # An entry makes a client skip that producer's transactional
            # batches from its first offset to its marker; drop one that
            # would hide data sent here (one txmq producer id may have
            # several transactions open at once).
            answer["aborted_transactions"] = [
                {"producer_id": a.producer_id, "first_offset": a.first_offset} for a in aborted
                if not any(pid == a.producer_id and a.first_offset <= base < a.last_offset
                           for base, pid in sent)]
        return answer

    def _listen(self, p) -> None:
        if p not in self._listening:
            cb = self.data_arrived
            self._listening[p] = cb
            p.add_listener(cb)

    # -- ListOffsets ------------------------------------------------------------------------

    async def list_offsets(self, conn, version: int, body: dict) -> dict:
        committed = body.get("isolation_level", 0) == READ_COMMITTED
        topics = await self.server.blocking(self._list_all, conn, body["topics"], committed)
        return {"throttle_time_ms": 0, "topics": topics}

    def _list_all(self, conn, topics: list, committed: bool) -> list:
        out = []
        for t in topics:
            name = t["name"]
            code = self.server.handlers.topic_ready(name, conn, op="describe", create=False)
            parts = []
            for req in t["partitions"]:
                answer = {"partition_index": req["partition_index"], "error_code": code, "timestamp": -1,
                          "offset": -1, "leader_epoch": 0}
                if code == Error.NONE:
                    try:
                        self._list_one(name, req, committed, answer)
                    except (PartitionNotFoundError, TopicNotFoundError):
                        answer["error_code"] = Error.UNKNOWN_TOPIC_OR_PARTITION
                parts.append(answer)
            out.append({"name": name, "partitions": parts})
        return out

    def _list_one(self, topic: str, req: dict, committed: bool, answer: dict) -> None:
        p = self.broker._partition(topic, req["partition_index"])
        ts = req["timestamp"]
        if ts == LATEST:
            answer["offset"] = p.max_read_position if committed else p.end_offset
        elif ts == EARLIEST:
            answer["offset"] = p.start_offset
        elif ts < 0:
            answer["error_code"] = Error.UNSUPPORTED_VERSION       # -3 (max timestamp) and others
        else:
            offset = p.find_time(ts)
            limit = p.max_read_position if committed else p.end_offset
            if offset >= limit:
                return                              # none at or after it: offset -1, as Kafka answers
            answer["offset"] = offset
            found = p.read(offset, 1, limit)
            if found:
                answer["offset"], answer["timestamp"] = found[0][0], found[0][4]
