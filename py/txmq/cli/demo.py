"""``txmq demo``: produce and consume on an embedded data directory, restart
the broker part-way, and check every message was acknowledged once."""

from __future__ import annotations

import os
import sys
import threading
import time

import txmq


def _bar(done: int, total: int, width: int = 30) -> str:
    filled = int(width * done / max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + f"] {done:,}/{total:,}"


def demo(data_dir: str, messages: int = 200_000, out=sys.stdout) -> int:
    """Produce keyed orders, consume them with two shared consumers, restart
    the broker part-way, and check every message was acknowledged once."""
    say = lambda *a: print(*a, file=out, flush=True)  # noqa: E731
    fresh = not os.path.exists(data_dir)
    say(f"txmq {txmq.__version__} demo on {os.path.abspath(data_dir)}"
        f" ({'new' if fresh else 'existing'} data directory)")
    topic = "demo-orders"
    sub = f"demo-billing-{time.time_ns()}"
    batch = 1000
    t0 = time.perf_counter()
    with txmq.Broker(data_dir, fsync="commit") as broker:
        if topic not in broker.topics():
            broker.create_topic(topic, partitions=4)
        # The subscription starts at the log end, so this run consumes what it produces.
        broker.subscribe(topic, sub, "shared", initial_position="latest").close()
        producer = broker.producer(topic)
        sent = 0
        while sent < messages:
            n = min(batch, messages - sent)
            values = [b"order-%08d:amount=%d" % (sent + i, (sent + i) % 997) for i in range(n)]
            keys = [b"customer-%d" % ((sent + i) % 100) for i in range(n)]
            producer.send_batch(values, keys=keys)
            sent += n
            if sent % max(messages // 5, 1) < n or sent == messages:
                say("  produce " + _bar(sent, messages))
        produce_s = time.perf_counter() - t0
        say(f"produced {sent:,} messages to {topic!r} (4 partitions, keyed by customer) "
            f"in {produce_s:.2f} s: {sent / produce_s:,.0f} msg/s")

        # Two shared consumers acknowledge the first half, then the broker restarts.
        seen: set = set()
        lock = threading.Lock()

        def consume(consumer, stop_at):
            while True:
                with lock:
                    if len(seen) >= stop_at:
                        return
                ms = consumer.receive_many(500, timeout=0.5)
                if not ms:
                    return
                with lock:
                    for m in ms:
                        assert m.value not in seen, f"delivered twice: {m}"
                        seen.add(m.value)
                consumer.ack(ms)

        t1 = time.perf_counter()
        consumers = [broker.subscribe(topic, sub, "shared", consumer_name=f"c{i}") for i in range(2)]
        threads = [threading.Thread(target=consume, args=(c, messages // 2)) for c in consumers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for c in consumers:
            c.close()
        first = len(seen)
        say(f"consumed and acknowledged {first:,} with 2 shared consumers; restarting the broker")
    with txmq.Broker(data_dir, fsync="commit") as broker:
        c = broker.subscribe(topic, sub, "shared")
        while True:
            ms = c.receive_many(1000, timeout=0.5)
            if not ms:
                break
            for m in ms:
                if m.value in seen:
                    say(f"FAILED: {m} was acknowledged before the restart and delivered again")
                    return 1
                seen.add(m.value)
            c.ack(ms)
        consume_s = time.perf_counter() - t1
        stats = broker.stats()["topics"][topic]
        backlog = stats["subscriptions"][sub]["backlog"]
        c.unsubscribe()
        say(f"after the restart the cursor resumed: {len(seen) - first:,} more, "
            f"{len(seen):,} in all in {consume_s:.2f} s")
        say("")
        say(f"{'partition':>9} {'log end':>10} {'bytes':>12} {'segments':>8}")
        for i, p in enumerate(stats["partitions"]):
            say(f"{i:>9} {p['end_offset']:>10,} {p['bytes']:>12,} {p['segments']:>8}")
    ok = len(seen) == messages and backlog == 0
    say("")
    say(f"{'check':<44} result")
    say(f"{'every produced message consumed':<44} {'yes' if len(seen) == messages else 'NO'} "
        f"({len(seen):,}/{messages:,})")
    say(f"{'no message delivered twice across a restart':<44} yes")
    say(f"{'backlog after acknowledging everything':<44} {backlog}")
    say("demo " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1
