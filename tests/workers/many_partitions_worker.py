"""A process with a low descriptor limit (``RLIMIT_NOFILE``, set before
txmq sizes its budgets) working on a topic of more partitions than that
limit, for tests/broker/test_many_partitions.py.

    python many_partitions_worker.py NOFILE owner PATH PARTITIONS ROUNDS
        create the topic, send ROUNDS messages to every partition round-robin,
        receive and acknowledge them all through a subscription, print
        ``READY {json}``, wait for a line on stdin, close, print ``DONE``
    python many_partitions_worker.py NOFILE reader PATH ROUNDS
        read every partition's messages round-robin, one message per
        partition per pass (each pass maps every partition's segment again),
        print ``{json}``: values per partition, how many descriptors it held
        at most
    python many_partitions_worker.py NOFILE crash PATH PARTITIONS
        send to every partition round-robin (plain sends, and every 7th a
        transaction over three partitions), print ``SENT p offset value``
        per acknowledged send and ``COMMITTED p:offset:value ...`` per
        returned commit, until killed
"""

from __future__ import annotations

import json
import os
import resource
import sys

NOFILE = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))

import txmq  # noqa: E402 - the limit is set first: txmq sizes its budgets from it
from txmq import readonly  # noqa: E402


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def owner(path: str, partitions: int, rounds: int) -> None:
    most = 0
    with txmq.Broker(path, fsync="never") as b:
        b.create_topic("t", partitions=partitions)
        p = b.producer("t")
        for r in range(rounds):
            for i in range(partitions):
                p.send(b"%d-%d" % (i, r), partition=i)
                most = max(most, open_fds())
        c = b.subscribe("t", "s", initial_position="earliest")
        got = {}
        while sum(len(v) for v in got.values()) < partitions * rounds:
            ms = c.receive_many(1000, timeout=5.0)
            if not ms:
                break
            for m in ms:
                got.setdefault(m.message_id.partition, []).append(m.value.decode())
            c.ack(ms)
            most = max(most, open_fds())
        lag = sum(b.consumer_lag("t", "s").values())
        print("READY", json.dumps({"got": got, "lag": lag, "most_fds": most}), flush=True)
        sys.stdin.readline()
        c.close()
    print("DONE", flush=True)


def reader(path: str, rounds: int) -> None:
    most = 0
    values = {}
    with readonly.open(path) as ro:
        n = len(ro.partitions("t"))
        for r in range(rounds):
            for i in range(n):
                for m in ro.read("t", i, r, r + 1):
                    values.setdefault(i, []).append(m.value.decode())
                most = max(most, open_fds())
        arrow_rows = sum(rb.num_rows for i in range(n) for rb in ro.read_arrow("t", i, 0))
    print(json.dumps({"values": values, "most_fds": most, "arrow_rows": arrow_rows}), flush=True)


def crash(path: str, partitions: int) -> None:
    b = txmq.Broker(path, fsync="commit")
    if "t" not in b.topics():
        b.create_topic("t", partitions=partitions)
    p = b.producer("t")
    print("READY", flush=True)
    n = 0
    while True:
        i = n % partitions
        if n % 7 == 6:
            with b.transaction() as txn:
                ids = [p.send(b"t%d" % n, partition=(i + k * 37) % partitions, txn=txn) for k in range(3)]
            print("COMMITTED " + " ".join(f"{m.partition}:{m.offset}:t{n}" for m in ids), flush=True)
        else:
            m = p.send(b"s%d" % n, partition=i)
            print(f"SENT {m.partition} {m.offset} s{n}", flush=True)
        n += 1


if __name__ == "__main__":
    mode = sys.argv[2]
    if mode == "owner":
        owner(sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    elif mode == "reader":
        reader(sys.argv[3], int(sys.argv[4]))
    elif mode == "crash":
        crash(sys.argv[3], int(sys.argv[4]))
    else:
        raise SystemExit(f"unknown mode {mode}")
