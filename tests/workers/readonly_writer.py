"""A writer process for tests/requester/test_readonly.py: holds ``txmq.Broker`` open on
a data directory and keeps appending to topic ``t`` (3 partitions, small
segments) until killed or until ``seconds`` pass (then it closes cleanly).

Every value says what it is, so a reader can check what it sees without
asking the writer:

- ``P|<n>``: a plain message;
- ``C|<txn>|<i>``: data of transaction ``<txn>``, which will be committed;
- ``A|<txn>|<i>``: data of a transaction that will be aborted.

Before it calls ``commit()`` on a transaction it appends ``<txn>`` to the
status file (``argv[2]``, flushed): a reader that sees a ``C`` value whose
transaction is not in that file has seen an open transaction's data.
Up to three transactions are open at once, so open ones hold
maxReadPosition back while plain messages and other transactions pass them.

usage: readonly_writer.py <data dir> <status file> <seconds> <seed> [retention_bytes]
"""

import random
import sys
import time

import txmq


def main() -> None:
    path, status_path, seconds, seed = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    retention = int(sys.argv[5]) if len(sys.argv) > 5 else None
    rnd = random.Random(seed)
    broker = txmq.Broker(path, fsync="never", segment_bytes_max=16384, retention_check_interval=0.05)
    if "t" not in broker.topics():
        broker.create_topic("t", 3, retention_bytes=retention)
    producer = broker.producer("t")
    status = open(status_path, "a")
    print("ready", flush=True)
    open_txns = []            # [(transaction, name, commit?)]
    n_plain = n_txn = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        action = rnd.random()
        if action < 0.35:
            producer.send(b"P|%d" % n_plain, key=b"k%d" % rnd.randrange(8), partition=rnd.randrange(3))
            n_plain += 1
        elif action < 0.45:
            producer.send_batch([b"P|%d" % (n_plain + i) for i in range(5)], partition=rnd.randrange(3))
            n_plain += 5
        elif action < 0.6 and len(open_txns) < 3:
            commit = rnd.random() < 0.6
            name = f"x{n_txn}"
            n_txn += 1
            open_txns.append((broker.new_transaction(timeout=120), name, commit))
        elif action < 0.85 and open_txns:
            txn, name, commit = rnd.choice(open_txns)
            tag = b"C" if commit else b"A"
            k = rnd.randrange(1, 4)
            producer.send_batch([b"%s|%s|%d" % (tag, name.encode(), i) for i in range(k)], txn=txn,
                                partition=rnd.randrange(3), headers=[{"txn": name.encode()}] * k)
        elif open_txns:
            txn, name, commit = open_txns.pop(rnd.randrange(len(open_txns)))
            if commit:
                status.write(name + "\n")
                status.flush()
                txn.commit()
            else:
                txn.abort()
    for txn, name, commit in open_txns:
        if commit:
            status.write(name + "\n")
            status.flush()
            txn.commit()
        else:
            txn.abort()
    broker.close()
    print("closed", flush=True)


if __name__ == "__main__":
    main()
