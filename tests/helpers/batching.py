"""What the tests of batched sends share (tests/client): a linger no test
waits for, the batches of a partition, senders on threads."""

from __future__ import annotations

import threading

LONG = 60_000          # a linger_ms no test waits for: only size, offset, flush, commit and close append


def batches(broker, topic="t", partition=0):
    """(base offset, count, transactional) of every batch in the partition."""
    p = broker._topics[topic].partitions[partition]
    return [(i.base_offset, i.count, i.is_transactional) for i in p.headers(0, p.end_offset)]


def run_threads(target, n: int) -> None:
    """``target(k)`` on ``n`` threads (k = 0 .. n - 1), started together;
    returns when all have ended."""
    start = threading.Barrier(n)

    def run(k):
        start.wait()
        target(k)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def disk_full(monkeypatch, partition) -> None:
    """Every append to ``partition`` fails as on a full disk (ENOSPC),
    until ``monkeypatch.undo()``."""
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(partition, "append", full)
