"""A topic: a name, N partitions, retention settings, and its subscriptions.

Partitions open lazily. Until something uses it, a partition is a
:class:`PartitionStub` (its name and folder, nothing open); the first
attribute asked of a stub that it does not have opens the partition in
place: the stub becomes the :class:`Partition` (same object, so a
reference held anywhere stays valid, and the hot paths pay nothing once
it is open). A partition's folder is created when it is first opened: a
topic's folder holds ``topic.json`` and the folders of the partitions
ever opened, and a missing folder is an empty partition (docs/FORMAT.md).
What a stub can say without opening (offsets, from its ``readview``) it
says from there (:meth:`PartitionStub.published`).
"""

from __future__ import annotations

import os
import re
import threading

from txmq._readview import RV_CLOSED, RV_RECOVERING
from txmq.files import read_json, write_json
from txmq.errors import BrokerClosedError, CorruptLogError, InvalidSubscriptionNameError, InvalidTopicNameError
from txmq.storage.layout import (QUARANTINE_FILE, READVIEW_FILE, TXNINDEX_ENTRY, TXNINDEX_SUFFIX, read_readview_file,
                                 segment_bases, segment_file)
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


class PartitionStub:
    """A partition not opened yet (module docstring). ``topic`` and
    ``index`` as a Partition has them; any other attribute opens it."""

    def __init__(self, opener: "Topic", index: int):
        self._opener = opener
        self.topic = opener.name
        self.index = index
        self.path = os.path.join(opener.path, str(index))

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        self._opener.open_partition(self)
        return getattr(self, name)

    def published(self):
        """What the partition's ``readview`` last published, as
        ``txmq._readview`` slot fields (state, log start, log end,
        maxReadPosition, active base, active size), without opening it:
        None when it has no usable one (never opened: no folder, an empty
        partition, is ``(RV_CLOSED, 0, 0, 0, 0, 0)``)."""
        if not os.path.isdir(self.path):
            return (RV_CLOSED, 0, 0, 0, 0, 0)
        rv = read_readview_file(os.path.join(self.path, READVIEW_FILE))
        if rv is None or rv.state == RV_RECOVERING:
            return None
        return (rv.state, rv.log_start, rv.log_end, rv.max_read_position, rv.active_base, rv.active_size)

    def has_quarantine(self) -> bool:
        """Whether its folder holds a ``quarantine.json``: ranges an earlier
        opening or read quarantined, which opening checks against the bytes
        before it reports them."""
        return os.path.exists(os.path.join(self.path, QUARANTINE_FILE))

    def stats(self) -> dict:
        """``Partition.stats`` as far as the readview and the files tell it,
        without opening (``"open": False``; ``producer_ids`` needs the
        partition open: None). A partition without a usable readview, with
        a transaction open, or with quarantined ranges is opened."""
        pub = self.published()
        if pub is None or pub[3] < pub[2] or self.has_quarantine():
            # No usable readview, or a transaction holds maxReadPosition
            # back (a crash left it): open the partition, which ends it.
            # Quarantined ranges are reported as opening finds them.
            return self.__getattr__("stats")()
        _, start, end, max_read, active_base, active_size = pub
        names = os.listdir(self.path) if os.path.isdir(self.path) else []
        bases = [b for b in segment_bases(self.path, names) if start <= b <= active_base]
        # Each aborted transaction with data in the log has one .txnindex
        # entry in the segment of its marker.
        aborted = sum(os.path.getsize(segment_file(self.path, b, TXNINDEX_SUFFIX)) // TXNINDEX_ENTRY.size
                      for b in bases if f"{b:020d}{TXNINDEX_SUFFIX}" in names)
        return {"start_offset": start, "end_offset": end,
                "bytes": active_size + sum(os.path.getsize(segment_file(self.path, b)) for b in bases
                                           if b < active_base),
                "segments": max(1, len(bases)), "truncated_on_open": [], "quarantined": [], "lost_offsets": 0,
                "producer_ids": None,
                "max_read_position": max_read, "open_transactions": 0, "aborted_transactions": aborted,
                "blocked_by": None, "blocked_since_ms": None, "open": False}

    def __repr__(self) -> str:
        return f"Partition({self.topic!r}, {self.index}, not open)"


class Topic:
    """Metadata in ``topic.json``; partitions in numbered folders beside it,
    opened on first use. ``on_open(partition)`` is told of every partition
    opened after the topic (the broker ends what a crash left there)."""

    def __init__(self, path: str, name: str, config: dict, partition_options: dict, on_open=None):
        self.path = path
        self.name = name
        self.config = config
        self.partition_options = partition_options
        self.on_open = on_open
        self._open_lock = threading.RLock()
        self._closed = False
        self.partitions = [PartitionStub(self, i) for i in range(config["partitions"])]
        self.subscriptions: dict = {}

    def open_partition(self, p) -> Partition:
        """Open partition ``p`` (a stub, or its index) in place, if it is not
        open yet; return it. A partition opened for the first time gets
        its folder (made durable, with its entry in the topic's, before the
        partition's first sync, unless fsync is "never")."""
        if type(p) is int:
            p = self.partitions[p]
        if type(p) is PartitionStub:
            with self._open_lock:
                if self._closed:
                    raise BrokerClosedError(f"topic {self.name} is closed")
                if type(p) is PartitionStub:
                    self._open(p)
        return p

    def _open(self, stub: PartitionStub) -> None:
        new = not os.path.isdir(stub.path)
        opened = Partition(stub.path, self.name, stub.index, **self.partition_options)
        if new and opened.fsync != "never":
            # Durable before anything in it is claimed durable (its first
            # sync), not at once: touching thousands of new partitions
            # costs no directory sync each.
            opened.dirs_to_sync = (opened.path, self.path)
        # Readers racing this open find the attributes in the stub's dict
        # first, and its methods once its class is swapped; until then
        # they wait in __getattr__ on the lock held here.
        stub.__dict__.update(opened.__dict__)
        stub.__class__ = Partition
        del stub.__dict__["_opener"]
        if self.on_open is not None:
            self.on_open(stub)

    def opened(self) -> list:
        """The partitions opened so far (the others have nothing to flush,
        snapshot or close)."""
        return [p for p in self.partitions if type(p) is not PartitionStub]

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

    def offsets(self, index: int) -> tuple:
        """(log start, log end) of partition ``index``, from its readview
        when it is not open and has a usable one (else it is opened)."""
        p = self.partitions[index]
        if type(p) is PartitionStub:
            pub = p.published()
            if pub is not None:
                return pub[1], pub[2]
        return p.start_offset, p.end_offset

    def describe(self) -> dict:
        offsets = [self.offsets(i) for i in range(len(self.partitions))]
        return {
            "name": self.name,
            "partitions": len(self.partitions),
            "retention_ms": self.config.get("retention_ms"),
            "retention_bytes": self.config.get("retention_bytes"),
            "end_offsets": [end for _, end in offsets],
            "start_offsets": [start for start, _ in offsets],
            "subscriptions": sorted(self.subscriptions),
            # Offsets lost to bytes that failed their checks, per partition
            # that has any (docs/FORMAT.md, "Quarantine").
            # A partition not open has none unless its quarantine.json
            # says so (then it is opened, to report what opening finds).
            "quarantined": {str(p.index): qs for p in self.partitions
                            if (type(p) is not PartitionStub or p.has_quarantine())
                            and (qs := [q.as_dict() | {"path": p.segment_path(q.segment)} for q in p.quarantined()])},
        }

    def close(self) -> None:
        """Close the subscriptions and the partitions opened; an error
        closing one (a file another process damaged) is raised after the
        others closed."""
        failed = []

        def run(close):
            try:
                close()
            except Exception as e:
                failed.append(e)
        for sub in self.subscriptions.values():
            run(sub.close)
        with self._open_lock:
            self._closed = True          # a stub used after the close must not open its partition
            for p in self.opened():
                run(p.close)
        if failed:
            raise failed[0]
