"""Messages and message ids as consumers and producers see them.

:class:`Message` is defined in the Cython core (``txmq._batch``) so that
decoding a batch builds the objects without Python-level calls."""

from __future__ import annotations

import operator
from typing import NamedTuple, Sequence

import numpy as np

from txmq import _batch


class MessageId(NamedTuple):
    """Where a message lives: ``(topic, partition, offset)``."""

    topic: str
    partition: int
    offset: int

    def __str__(self) -> str:
        return f"{self.topic}/{self.partition}@{self.offset}"


class AbortedTransaction(NamedTuple):
    """An aborted transaction of a partition, as a Kafka Fetch response
    lists it: its producer id, its first offset there, and the offset of its
    ABORT marker (``last_offset``)."""

    producer_id: int
    first_offset: int
    last_offset: int


# Built in the Cython core, straight from a mapped batch.
Message = _batch.Message


class MessageIds(Sequence):
    """The ids of one ``send_batch``, in input order, without a Python
    object per message until one is asked for. ``partitions`` (int32) and
    ``offsets`` (int64) are numpy arrays; those of a batch that went to one
    partition are made on first use (:meth:`run`)."""

    __slots__ = ("topic", "_partitions", "_offsets", "_partition", "_base", "_n")

    def __init__(self, topic: str, partitions: np.ndarray, offsets: np.ndarray):
        self.topic = topic
        self._partitions = partitions
        self._offsets = offsets
        self._partition = -1
        self._n = len(offsets)

    @classmethod
    def run(cls, topic: str, partition: int, base: int, n: int) -> "MessageIds":
        """The ids of ``n`` messages at offsets ``base`` .. ``base + n - 1``
        of one partition (one batch)."""
        ids = cls.__new__(cls)
        ids.topic = topic
        ids._partitions = ids._offsets = None
        ids._partition, ids._base, ids._n = partition, base, n
        return ids

    @property
    def partitions(self) -> np.ndarray:
        if self._partitions is None:
            self._partitions = np.full(self._n, self._partition, np.int32)
        return self._partitions

    @property
    def offsets(self) -> np.ndarray:
        if self._offsets is None:
            self._offsets = np.arange(self._base, self._base + self._n, dtype=np.int64)
        return self._offsets

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return MessageIds(self.topic, self.partitions[i], self.offsets[i])
        if self._partition >= 0:
            i = operator.index(i)
            if not -self._n <= i < self._n:
                raise IndexError("MessageIds index out of range")
            return MessageId(self.topic, self._partition, self._base + i % self._n)
        return MessageId(self.topic, int(self.partitions[i]), int(self.offsets[i]))

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    def __repr__(self) -> str:
        if len(self) <= 4:
            return f"MessageIds({list(self)!r})"
        return f"MessageIds({self[0]} .. {self[-1]}, {len(self)} ids)"
