"""A topic: a name, N partitions, retention settings, and its subscriptions."""

from __future__ import annotations

import os
import re

from txmq.files import read_json, write_json
from txmq.errors import CorruptLogError, InvalidSubscriptionNameError, InvalidTopicNameError
from txmq.storage.partition import Partition

_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
MAX_NAME = 249  # Kafka's limit, so a topic name moves between the two unchanged


def check_topic_name(name) -> str:
    if not isinstance(name, str):
        raise InvalidTopicNameError(name, "must be a str")
    if not name:
        raise InvalidTopicNameError(name, "must not be empty")
    if len(name) > MAX_NAME:
        raise InvalidTopicNameError(name, f"longer than {MAX_NAME} characters")
    if name in (".", ".."):
        raise InvalidTopicNameError(name, "'.' and '..' are reserved")
    if not _NAME.match(name):
        raise InvalidTopicNameError(name, "only ASCII letters, digits, '.', '_' and '-' are allowed")
    return name


def check_subscription_name(name) -> str:
    try:
        return check_topic_name(name)
    except InvalidTopicNameError as e:
        raise InvalidSubscriptionNameError(name, str(e).split(": ", 1)[1]) from None


class Topic:
    """Metadata in ``topic.json``; partitions in numbered folders beside it."""

    def __init__(self, path: str, name: str, config: dict, partition_options: dict):
        self.path = path
        self.name = name
        self.config = config
        self.partitions = [Partition(os.path.join(path, str(i)), name, i, **partition_options)
                           for i in range(config["partitions"])]
        self.subscriptions: dict = {}

    @staticmethod
    def load_config(path: str) -> dict:
        """The topic's ``topic.json``; CorruptLogError (path, byte) when it
        is not a config of at least one partition."""
        file = os.path.join(path, "topic.json")
        config = read_json(file)
        n = config.get("partitions")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise CorruptLogError(file, 0, f"partitions is {n!r}, not an int >= 1")
        for key in ("retention_ms", "retention_bytes"):
            v = config.get(key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise CorruptLogError(file, 0, f"{key} is {v!r}, not an int >= 0 or null")
        return config

    @staticmethod
    def write_config(path: str, config: dict) -> None:
        write_json(os.path.join(path, "topic.json"), config)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "partitions": len(self.partitions),
            "retention_ms": self.config.get("retention_ms"),
            "retention_bytes": self.config.get("retention_bytes"),
            "end_offsets": [p.end_offset for p in self.partitions],
            "start_offsets": [p.start_offset for p in self.partitions],
            "subscriptions": sorted(self.subscriptions),
            # Offsets lost to bytes that failed their checks, per partition
            # that has any (docs/FORMAT.md, "Quarantine").
            "quarantined": {str(p.index): qs for p in self.partitions
                            if (qs := [q.as_dict() | {"path": p.segment_path(q.segment)} for q in p.quarantined()])},
        }

    def close(self) -> None:
        """Close the subscriptions and partitions; an error closing one
        (a file another process damaged) is raised after the others closed."""
        failed = []
        for close in [sub.close for sub in self.subscriptions.values()] + [p.close for p in self.partitions]:
            try:
                close()
            except Exception as e:
                failed.append(e)
        if failed:
            raise failed[0]
