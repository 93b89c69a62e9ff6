"""Half-message worker for the crash tests (killed with SIGKILL).

argv: data_dir fsync first_k count [linger_s]

Sends half messages ``h-<k>`` for k in [first_k, first_k + count) from two
threads while the broker checks back every 50 ms. The outcome of message
k is fixed by k (``decision``), both for its local transaction and for
every check, so the right final state is known whatever the kills hit.

Lines (one write each): ``READY``, ``TRY k`` before a send,
``SENT k half_id state offset`` after it (partition and offset -1 unless committed), ``DONE``. With ``linger_s``
it keeps the broker open (checking back) that long after its sends.
"""

from __future__ import annotations

import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers"))

import txmq  # noqa: E402
from txmq import LocalTransactionState as S  # noqa: E402
from worker_io import Out  # noqa: E402

TOPIC = "orders"

# decision(k): what the local transaction says, then what checks say.
LOCAL_COMMIT, LOCAL_ROLLBACK, CHECK_COMMIT, CHECK_ROLLBACK, NEVER = range(5)


def decision(k: int) -> int:
    return (k * 2654435761 >> 7) % 5


def committed(k: int) -> bool:
    return decision(k) in (LOCAL_COMMIT, CHECK_COMMIT)


def k_of(value: bytes) -> int:
    return int(value.split(b"-")[1])


def local_txn(message, k):
    d = decision(k)
    return S.COMMIT if d == LOCAL_COMMIT else S.ROLLBACK if d == LOCAL_ROLLBACK else S.UNKNOWN


def checker(message):
    d = decision(k_of(message.value))
    if d in (LOCAL_COMMIT, CHECK_COMMIT):
        return S.COMMIT
    if d in (LOCAL_ROLLBACK, CHECK_ROLLBACK):
        return S.ROLLBACK
    return S.UNKNOWN


def open_broker(path, fsync):
    return txmq.Broker(path, fsync=fsync, half_check_interval=0.05, half_check_immunity=0.1,
                       half_max_checks=3, segment_bytes_max=64 * 1024)


def main() -> None:
    path, fsync, first, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    out = Out()
    with open_broker(path, fsync) as broker:
        if TOPIC not in broker.topics():
            broker.create_topic(TOPIC, 3)
        hp = broker.half_producer(TOPIC, "order-svc", checker=checker)
        out.line("READY")
        ks = iter(range(first, first + count))
        lock = threading.Lock()

        def run():
            while True:
                with lock:
                    k = next(ks, None)
                if k is None:
                    return
                out.line(f"TRY {k}")
                r = hp.send_in_transaction(b"h-%d" % k, local_txn, k, key=b"key-%d" % (k % 7))
                mid = r.message_id or (None, -1, -1)
                out.line(f"SENT {k} {r.half_id} {r.state.value} {mid[1]} {mid[2]}")

        threads = [threading.Thread(target=run) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(float(sys.argv[5]) if len(sys.argv) > 5 else 0.0)
    out.line("DONE")


if __name__ == "__main__":
    main()
