"""Messages and message ids as consumers and producers see them.

:class:`Message` is defined in the Cython core (``txmq._batch``) so that
decoding a batch builds the objects without Python-level calls."""

from __future__ import annotations

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
    object per message until one is asked for."""

    __slots__ = ("topic", "partitions", "offsets")

    def __init__(self, topic: str, partitions: np.ndarray, offsets: np.ndarray):
        self.topic = topic
        self.partitions = partitions
        self.offsets = offsets

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return MessageIds(self.topic, self.partitions[i], self.offsets[i])
        return MessageId(self.topic, int(self.partitions[i]), int(self.offsets[i]))

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    def __repr__(self) -> str:
        if len(self) <= 4:
            return f"MessageIds({list(self)!r})"
        return f"MessageIds({self[0]} .. {self[-1]}, {len(self)} ids)"
