"""The idempotent-producer state of a partition (docs/FORMAT.md, "Idempotent producers").

A batch with a producer id is checked against the producer table under the
partition lock (``_producers.ProducerStates``): the next sequence is
appended, a retried one (one of the producer's last 5 batches) is answered
with the original offsets, anything else raises. ``producers.snap``
(``txmq.storage.layout``) holds the table as of an offset; opening loads
it and replays the batch headers after it. A producer id is forgotten once
its last batch here is older than the expiration, unless it wrote while a
transaction still open here began.
"""

from __future__ import annotations

from txmq._producers import DUPLICATE, FENCED, OUT_OF_ORDER, ProducerStates
from txmq.errors import DuplicateSequenceError, OutOfOrderSequenceError, ProducerFencedError
from txmq.storage.layout import producer_snapshot_bytes

DEFAULT_PRODUCER_EXPIRATION_MS = 7 * 24 * 3600 * 1000


class ProducerState:
    """The producer table of partition ``topic``/``index`` (named in the
    errors it raises). Every method runs under the partition lock."""

    def __init__(self, topic: str, index: int, expiration_ms: int):
        self.topic = topic
        self.index = index
        self.expiration_ms = expiration_ms
        self.table = ProducerStates()
        self.replay_from = 0             # opening: where the replay of batch headers begins

    def __len__(self) -> int:
        return len(self.table)

    def next_sequence(self, producer_id: int, epoch: int) -> int:
        """The sequence the next batch of ``producer_id`` takes; raises
        ProducerFencedError for an epoch older than the table's."""
        seq = self.table.next_sequence(producer_id, epoch)
        if seq == FENCED:
            raise self.fenced(producer_id, epoch)
        return seq

    def check(self, producer_id: int, epoch: int, seq: int, count: int) -> int:
        """For an explicit sequence ``seq`` of a batch of ``count`` messages:
        -1 when the batch is to be appended, or the base offset of the
        cached batch it retries (>= 0). Raises ProducerFencedError,
        OutOfOrderSequenceError (a gap) or DuplicateSequenceError (an
        older sequence)."""
        r = self.table.check(producer_id, epoch, seq, count)
        if r >= 0:
            return r
        if r == FENCED:
            raise self.fenced(producer_id, epoch)
        if r == OUT_OF_ORDER or r == DUPLICATE:
            cls = DuplicateSequenceError if r == DUPLICATE else OutOfOrderSequenceError
            raise cls(self.topic, self.index, producer_id, seq, self.table.next_sequence(producer_id, epoch))
        return -1

    def duplicate(self, producer_id: int, epoch: int, seq: int) -> DuplicateSequenceError:
        """The error for a retry whose sequence was spent by another batch."""
        return DuplicateSequenceError(self.topic, self.index, producer_id, seq,
                                      self.table.next_sequence(producer_id, epoch))

    def fenced(self, producer_id: int, epoch: int) -> ProducerFencedError:
        return ProducerFencedError(producer_id, epoch, f"epoch {self.table.epoch_of(producer_id)} "
                                   f"of the producer id wrote to {self.topic}/{self.index}")

    def record(self, producer_id: int, epoch: int, seq: int, count: int, base: int, publish_time: int) -> None:
        """A batch of ``producer_id`` was appended at ``base``."""
        self.table.record(producer_id, epoch, seq, count, base, publish_time)

    def expire(self, clock, oldest_open_since_ms: int | None) -> int:
        """Forget the producer ids whose last batch here is older than the
        expiration at ``clock()`` (read only when the table holds one);
        return how many. A producer that wrote while a
        transaction still open here began (``oldest_open_since_ms``) is
        kept whatever its age: a retry inside that transaction must still
        find its batches (Kafka never expires a producer with an ongoing
        transaction)."""
        if not len(self.table):
            return 0
        before = clock() - self.expiration_ms
        if oldest_open_since_ms is not None:
            before = min(before, oldest_open_since_ms)
        return self.table.expire(before)

    # -- snapshot and replay ------------------------------------------------------------

    def snapshot_bytes(self, end_offset: int) -> bytes:
        """``producers.snap`` of the table as of ``end_offset`` (the log end)."""
        return producer_snapshot_bytes(end_offset, self.table)

    def restore(self, snapshot) -> None:
        """Take a checked ``layout.read_producer_snapshot`` result: the
        table as of its offset, from which the replay begins."""
        (_, _, self.replay_from), self.table = snapshot

    def replay(self, info) -> None:
        """What the batch header ``info`` (replayed in offset order at
        opening) does to the table: from :attr:`replay_from` on, a data
        batch with a producer id is recorded."""
        if info.producer_id >= 0 and info.base_offset >= self.replay_from and not info.is_control:
            self.table.record(info.producer_id, info.producer_epoch, info.base_sequence, info.count,
                              info.base_offset, info.publish_time)
