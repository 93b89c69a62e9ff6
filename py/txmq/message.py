"""Messages and message ids as consumers and producers see them."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np


class MessageId(NamedTuple):
    """Where a message lives: ``(topic, partition, offset)``."""

    topic: str
    partition: int
    offset: int

    def __str__(self) -> str:
        return f"{self.topic}/{self.partition}@{self.offset}"


class Message:
    """One delivered message.

    ``headers`` is the ordered list of ``(str, bytes | None)`` pairs as sent
    (empty when none); ``properties`` is the same as a dict of str, for
    Pulsar-style use. Times are milliseconds since the epoch.
    """

    __slots__ = ("value", "key", "headers", "message_id", "event_time", "publish_time",
                 "redelivery_count", "txn_id")

    def __init__(self, value, key, headers, message_id, event_time, publish_time,
                 redelivery_count=0, txn_id=None):
        self.value = value
        self.key = key
        self.headers = headers if headers is not None else []
        self.message_id = message_id
        self.event_time = event_time
        self.publish_time = publish_time
        self.redelivery_count = redelivery_count
        self.txn_id = txn_id

    @property
    def topic(self) -> str:
        return self.message_id.topic

    @property
    def partition(self) -> int:
        return self.message_id.partition

    @property
    def offset(self) -> int:
        return self.message_id.offset

    @property
    def properties(self) -> dict:
        return {k: (v.decode("utf-8", "replace") if v is not None else None) for k, v in self.headers}

    def __repr__(self) -> str:
        v = self.value if len(self.value) <= 40 else self.value[:37] + b"..."
        return (f"Message({self.message_id}, key={self.key!r}, value={v!r}, "
                f"redelivery_count={self.redelivery_count})")


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
