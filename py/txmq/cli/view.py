"""What the read-only commands see of a data directory.

:class:`DirectoryView` is the one object every read-only command reads
through (:func:`txmq.cli.opening.open_for_reading` makes it). It sits on
``txmq.readonly``, so it takes no lock and writes no file, and reads the
same way whether another process holds the directory (it shows what that
process has published) or none does (it shows the files as they are:
opening never recovers anything, a transaction a dead owner left open
stays listed until the next owner aborts it).

It has the few calls the commands print from, in the shapes the broker
uses for the same figures (``describe_topic`` is ``Broker.describe_topic``'s
dict), so the lookups of :mod:`txmq.cli.admin` serve a view and a broker
alike. Each partition is viewed once per command: offsets, tables and a
non-durable read of one command agree with each other. What only the
owner's memory holds (attached consumers, delivered-but-unacknowledged
messages, counters since it opened) is not in the files and is not shown.
"""

from __future__ import annotations

import contextlib
import time

from txmq import readonly
from txmq.cli import exits, output
from txmq.errors import DataDirLockedError
from txmq.transactions.records import TxnID


class DirectoryView:
    """A data directory opened read-only, for one command (a context
    manager: closing drops the mappings)."""

    def __init__(self, path: str, progress=None):
        self.ro = readonly.open(path)
        self.path = self.ro.path
        # The pid holding the directory (0: held, pid not visible), or None.
        self.writer_pid = readonly.writer_pid(self.path)
        self._progress = output.wants_progress(progress)
        self._views: dict = {}
        self._txns = None
        self._spinning = False

    def held_by(self) -> str:
        """Who holds the directory, as the output says it."""
        if self.writer_pid is None:
            return "no process holds it"
        who = f"pid {self.writer_pid}" if self.writer_pid else "another process"
        return f"held by {who}"

    # -- topics and partitions -----------------------------------------------------

    def topics(self) -> list:
        return self.ro.topics()

    def partition(self, topic: str, partition: int):
        """The one view of ``topic``/``partition`` this command uses
        (``txmq.readonly.PartitionView``: offsets, segments, ``read``)."""
        key = (topic, partition)
        if key not in self._views:
            with self._busy():
                self._views[key] = self.ro.view(topic, partition, lazy=True)
        return self._views[key]

    def describe_topic(self, name: str) -> dict:
        """``Broker.describe_topic``'s dict: name, partitions, retention,
        start and end offsets, subscriptions."""
        config = self.ro.topic_config(name)
        with self._busy():
            views = [self.partition(name, p) for p in range(config["partitions"])]
        return {"name": name, "partitions": config["partitions"],
                "retention_ms": config.get("retention_ms"), "retention_bytes": config.get("retention_bytes"),
                "end_offsets": [v.log_end for v in views], "start_offsets": [v.log_start for v in views],
                "subscriptions": self.ro.subscriptions(name),
                "quarantined": {str(p): qs for p, v in enumerate(views) if (qs := v.quarantined())}}

    def partition_stats(self, topic: str) -> list:
        """Per partition: start and end offset, last stable offset
        (``max_read_position``), bytes, segments, the live transactions
        that wrote to it, the one holding the last stable offset back, and
        where the view came from (``source``: readview, readview+scan when
        the owner died and the tail was scanned, scan)."""
        out = []
        with self._busy():
            views = [self.partition(topic, p) for p in range(self.ro.topic_config(topic)["partitions"])]
        for p, v in enumerate(views):
            name = f"{topic}/{p}"
            size, segments = v.disk_usage()
            out.append({"start_offset": v.log_start, "end_offset": v.log_end,
                        "max_read_position": v.max_read_position,
                        "bytes": size, "segments": segments,
                        "open_transactions": sum(name in t["partitions"] for t in self.transactions()),
                        "blocked_by": _blocked_by(v), "source": v.source, "quarantined": v.quarantined(),
                        "lost_offsets": sum(q["end_offset"] - q["first_offset"] for q in v.quarantined())})
        return out

    # -- subscriptions ---------------------------------------------------------------

    def subscription_stats(self, topic: str) -> dict:
        """``{name: {type, isolation, allow_out_of_order_delivery, backlog,
        partitions: [...]}}``; per
        partition its mark-delete, the count acknowledged above it, the
        transactions holding acks there and its backlog (None where the
        cursor file is not written yet)."""
        out = {}
        with self._busy():
            for name in self.ro.subscriptions(topic):
                s = self.ro.subscription(topic, name, view_of=self.partition)
                parts = [{"partition": p, "mark_delete": c["mark_delete"],
                          "individually_acked": c.get("acked_above_mark_delete"),
                          "pending_transactions": c["pending_transactions"], "backlog": c.get("backlog")}
                         for p, c in sorted(s["partitions"].items())]
                backlogs = [p["backlog"] for p in parts]
                out[name] = {"type": s["type"], "isolation": s.get("isolation", "read_committed"),
                             "allow_out_of_order_delivery": s["allow_out_of_order_delivery"],
                             "backlog": None if None in backlogs else sum(backlogs), "partitions": parts}
        return out

    # -- transactions -------------------------------------------------------------------

    def transactions(self) -> list:
        """The live transactions, as ``Broker.transactions()`` lists them
        (id, state, age_s, timeout_s, started_ms, partitions,
        subscriptions), sorted by id, each with ``xid`` (a prepared
        transaction's global id, else None) and ``holds_back`` (the
        partitions whose read_committed readers it holds back); a
        prepared one's age counts from when it was prepared. Read once per
        command."""
        if self._txns is None:
            with self._busy():
                txns = self.ro.transactions()
                now_ms = time.time() * 1000
                self._txns = [{"id": t["id"], "state": t["state"],
                               "age_s": round(max(0.0, now_ms - t.get("prepared_ms", t["started_ms"])) / 1000, 3),
                               "timeout_s": t["timeout_ms"] / 1000, "started_ms": t["started_ms"],
                               "partitions": t["partitions"], "subscriptions": t["subscriptions"],
                               "xid": t.get("xid"),
                               "holds_back": [name for name in t["partitions"]
                                              if self._holder(*name.rsplit("/", 1)) == t["id"]]}
                              for t in sorted(txns, key=lambda t: TxnID.parse(t["id"]))]
        return self._txns

    def _holder(self, topic: str, partition: str):
        """The transaction holding ``topic``/``partition``'s readers back,
        or None (also when the topic was deleted since)."""
        if topic not in self.topics():
            return None
        return _blocked_by(self.partition(topic, int(partition)))

    # -- the context ------------------------------------------------------------------

    @contextlib.contextmanager
    def _busy(self):
        # Quick on a directory whose partitions published a readview; a
        # partition its dead owner left without one is scanned, which on a
        # large directory takes a while: show that it is working (once,
        # when a busy call views a partition).
        if self._spinning:
            yield
            return
        self._spinning = True
        try:
            with output.Spinner(f"reading {self.path}", self._progress):
                yield
        finally:
            self._spinning = False

    def close(self) -> None:
        self._views.clear()
        self.ro.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close()
        if isinstance(exc, DataDirLockedError):
            # Only while the owner is opening a partition and has not
            # published it yet.
            raise exits.CliError(f"data directory {self.path} is being opened by another process "
                                 f"({exc.holder}): run the command again once it is open",
                                 exits.LOCKED) from None
        if isinstance(exc, PermissionError):
            raise exits.CliError(f"cannot read {exc.filename}: {exc.strerror}; run as a user who may read "
                                 f"the data directory") from None
        return False


def _blocked_by(view) -> str | None:
    """The transaction whose first batch sits at the last stable offset:
    the open one holding read_committed readers back."""
    if view.max_read_position >= view.log_end:
        return None
    for _, _, info in view.batches(view.max_read_position, view.max_read_position + 1):
        if info.flags & readonly.TRANSACTIONAL:
            return str(TxnID.from_words(info.txn_hi, info.txn_lo))
    return None
