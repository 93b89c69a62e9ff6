"""The SQLite queue a user would build instead of txmq: the baseline of the
benchmarks (reused by later ones).

Schema::

    messages(id INTEGER PRIMARY KEY, topic TEXT, partition INTEGER,
             key BLOB, value BLOB, ts INTEGER)        -- ts: publish ms
    cursor(subscription TEXT, partition INTEGER, offset INTEGER,
           PRIMARY KEY (subscription, partition))     -- offset: last id read

``transform_batch`` is the consume-transform-produce baseline of the
transaction benchmarks: the output rows go to another topic of the same
table, and the inputs are marked consumed by moving the cursor, in the same
SQLite transaction.

``journal_mode=WAL``; ``synchronous`` is a parameter (``OFF`` for the
comparisons with ``fsync="never"``, ``FULL`` / ``NORMAL`` for durable ones).
There is no secondary index on (topic, partition, id): ids grow with every
insert, so ``id > cursor`` is a rowid range scan, which is the fastest read
for one topic, and every insert stays as cheap as it can be. A multi-topic
user would add that index and pay for it on each insert.
"""

from __future__ import annotations

import sqlite3
import time

SCHEMA = """
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    topic TEXT NOT NULL,
    partition INTEGER NOT NULL,
    key BLOB,
    value BLOB NOT NULL,
    ts INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS cursor (
    subscription TEXT NOT NULL,
    partition INTEGER NOT NULL,
    offset INTEGER NOT NULL,
    PRIMARY KEY (subscription, partition)
);
"""

SYNCHRONOUS = ("OFF", "NORMAL", "FULL", "EXTRA")


class SqliteQueue:
    """One topic partition and one subscription cursor in a SQLite WAL file."""

    def __init__(self, path, *, synchronous: str = "OFF", topic: str = "t", partition: int = 0,
                 subscription: str = "s"):
        if synchronous not in SYNCHRONOUS:
            raise ValueError(f"synchronous must be one of {SYNCHRONOUS}, not {synchronous!r}")
        self.topic = topic
        self.partition = partition
        self.subscription = subscription
        # isolation_level=None: we issue BEGIN / COMMIT ourselves.
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        mode = self.db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise RuntimeError(f"journal_mode is {mode}, not wal")
        self.db.execute(f"PRAGMA synchronous={synchronous}")
        self.db.executescript(SCHEMA)
        self.db.execute("INSERT OR IGNORE INTO cursor VALUES (?, ?, 0)", (subscription, partition))

    def insert_batch(self, values, keys=None) -> int:
        """Insert ``values`` (and their ``keys``) in one transaction; return
        the id of the last row."""
        ts = time.time_ns() // 1_000_000
        t, p = self.topic, self.partition
        if keys is None:
            rows = [(t, p, None, v, ts) for v in values]
        else:
            rows = [(t, p, k, v, ts) for k, v in zip(keys, values)]
        cur = self.db.cursor()
        cur.execute("BEGIN")
        try:
            cur.executemany(
                "INSERT INTO messages (topic, partition, key, value, ts) VALUES (?, ?, ?, ?, ?)", rows)
            last = cur.execute("SELECT last_insert_rowid()").fetchone()[0]
            cur.execute("COMMIT")
        except BaseException:
            cur.execute("ROLLBACK")
            raise
        return last

    def read_batch(self, n: int) -> list:
        """Up to ``n`` rows ``(id, key, value, ts)`` after the cursor; the
        cursor moves past them in the same transaction (read + ack)."""
        return self._consume(n, None)

    def transform_batch(self, n: int, fn, out_topic: str) -> int:
        """Consume-transform-produce in one transaction: up to ``n`` rows
        after the cursor, ``fn(value)`` of each inserted into ``out_topic``
        (same partition, same key), the cursor moved past them (the inputs
        marked consumed), one COMMIT. Return how many rows were moved."""
        return len(self._consume(n, (fn, out_topic)))

    def _consume(self, n: int, transform) -> list:
        """One transaction: read up to ``n`` rows after the cursor, insert
        ``transform``'s outputs (if any), move the cursor past the rows."""
        cur = self.db.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            (offset,) = cur.execute("SELECT offset FROM cursor WHERE subscription = ? AND partition = ?",
                                    (self.subscription, self.partition)).fetchone()
            columns = "id, key, value, ts" if transform is None else "id, key, value"
            rows = cur.execute(
                f"SELECT {columns} FROM messages WHERE id > ? AND topic = ? AND partition = ? "
                "ORDER BY id LIMIT ?", (offset, self.topic, self.partition, n)).fetchall()
            if rows:
                if transform is not None:
                    fn, out_topic = transform
                    ts = time.time_ns() // 1_000_000
                    cur.executemany(
                        "INSERT INTO messages (topic, partition, key, value, ts) VALUES (?, ?, ?, ?, ?)",
                        [(out_topic, self.partition, k, fn(v), ts) for _, k, v in rows])
                cur.execute("UPDATE cursor SET offset = ? WHERE subscription = ? AND partition = ?",
                            (rows[-1][0], self.subscription, self.partition))
            cur.execute("COMMIT")
        except BaseException:
            cur.execute("ROLLBACK")
            raise
        return rows

    def count(self) -> int:
        return self.db.execute("SELECT count(*) FROM messages").fetchone()[0]

    def close(self) -> None:
        self.db.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
