"""Subprocess side of tests/storage/test_crash.py: work on a broker until SIGKILLed.

    python crash_worker.py produce <data> <fsync> <cycle> <seed>
    python crash_worker.py consume <data> <fsync> <cycle> <seed>

Both modes print ``READY`` once the broker is open, then one line per
completed operation, written and flushed only *after* the call returned:

    A <cycle>:<seq> <partition> <offset>     a send (or batch element) was acknowledged
    T <p>:<off> ...                         about to ack these offsets individually
    K <p>:<off> ...                         ...and the ack returned
    TC <p> <off>                            about to ack_cumulative(<p>, <off>)
    KC <p> <off>                            ...and it returned

Every value names itself (see :func:`make_value`) so the parent can tell a
duplicate, a torn batch or damaged contents from the log alone.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
import time

TOPIC = "t"
PARTITIONS = 4
SEGMENT_BYTES = 64 * 1024
WORK_SUB = "work"
BROKER_OPTS = dict(segment_bytes_max=SEGMENT_BYTES, max_message_bytes=16 * 1024)


def filler(cycle: int, seq: int, short: bool = False) -> bytes:
    n = (seq * 7919 + cycle * 31) % (8 if short else 300)
    d = hashlib.blake2b(f"{cycle}:{seq}".encode(), digest_size=32).digest()
    return (d * (n // 32 + 1))[:n]


def key_of(seq: int) -> bytes:
    return f"k{seq % 23}".encode()


def headers_of(cycle: int, seq: int) -> list:
    return [("id", f"{cycle}:{seq}".encode())]


def make_value(cycle: int, seq: int, bid: int, gi: int, gn: int, flags: str) -> bytes:
    """``cycle:seq:bid:gi:gn:flags:filler``; ``bid`` -1 for a single send,
    else the batch's id, ``gi``/``gn`` the index and size of the part of the
    batch bound for this message's partition; ``flags`` K (keyed), H
    (headers), S (short filler, for batches of over a thousand messages)."""
    return f"{cycle}:{seq}:{bid}:{gi}:{gn}:{flags}:".encode() + filler(cycle, seq, "S" in flags)


def parse_value(value: bytes) -> dict:
    """The fields of a value; raises ValueError if it is not well-formed."""
    parts = value.split(b":", 6)
    if len(parts) != 7:
        raise ValueError(f"malformed value {value[:60]!r}")
    cycle, seq, bid, gi, gn = (int(x) for x in parts[:5])
    flags = parts[5].decode()
    if parts[6] != filler(cycle, seq, "S" in flags):
        raise ValueError(f"bad filler in value {value[:60]!r}")
    if bid >= 0 and not 0 <= gi < gn:
        raise ValueError(f"bad batch fields in {value[:60]!r}")
    return {"cycle": cycle, "seq": seq, "bid": bid, "gi": gi, "gn": gn, "flags": flags,
            "id": f"{cycle}:{seq}"}


def check_message(key, value, headers) -> dict:
    """Parse a stored message and check its key and headers against its value."""
    f = parse_value(value)
    want_key = key_of(f["seq"]) if "K" in f["flags"] else None
    if key != want_key:
        raise ValueError(f"message {f['id']}: key {key!r}, expected {want_key!r}")
    want_headers = headers_of(f["cycle"], f["seq"]) if "H" in f["flags"] else []
    if list(map(tuple, headers or [])) != want_headers:
        raise ValueError(f"message {f['id']}: headers {headers!r}, expected {want_headers!r}")
    return f


class Out:
    def __init__(self):
        self.fd = sys.stdout.fileno()

    def write(self, lines) -> None:
        data = "".join(lines).encode()
        while data:  # one write per operation, so a kill cuts at most its tail
            n = os.write(self.fd, data)
            data = data[n:]


def produce_some(prod, rng, cycle, state, out, partition_for) -> None:
    r = rng.random()
    seq = state["seq"]
    if r < 0.5:
        flags = ""
        key = None
        if rng.random() < 0.5:
            flags += "K"
            key = key_of(seq)
        headers = None
        if rng.random() < 0.3:
            flags += "H"
            headers = dict(headers_of(cycle, seq))
        mid = prod.send(make_value(cycle, seq, -1, 0, 1, flags), key=key, headers=headers)
        state["seq"] = seq + 1
        out.write([f"A {cycle}:{seq} {mid.partition} {mid.offset}\n"])
        return
    # One batch in ten has more messages than one pwritev takes pieces
    # (IOV_MAX), so a kill can land between the writes of a single batch.
    big = rng.random() < 0.1
    n = rng.randint(1030, 1100) if big else rng.randint(2, 16)
    bid = state["bid"]
    state["bid"] = bid + 1
    seqs = list(range(seq, seq + n))
    state["seq"] = seq + n
    if big or r < 0.8:
        values = [make_value(cycle, s, bid, i, n, "S" if big else "") for i, s in enumerate(seqs)]
        ids = prod.send_batch(values)
    else:
        keys = [key_of(s) for s in seqs]
        targets = [partition_for(k, PARTITIONS) for k in keys]
        pos_in_group, size = {}, {}
        for t in targets:
            size[t] = size.get(t, 0) + 1
        values = []
        for s, t in zip(seqs, targets):
            gi = pos_in_group.get(t, 0)
            pos_in_group[t] = gi + 1
            values.append(make_value(cycle, s, bid, gi, size[t], "K"))
        ids = prod.send_batch(values, keys=keys)
    out.write([f"A {cycle}:{s} {m.partition} {m.offset}\n" for s, m in zip(seqs, ids)])


def main(argv) -> None:
    mode, data, fsync, cycle, seed = argv[1], argv[2], argv[3], int(argv[4]), int(argv[5])
    import txmq
    from txmq._partitioner import partition_for

    rng = random.Random(seed)
    out = Out()
    broker = txmq.Broker(data, fsync=fsync, **BROKER_OPTS)
    prod = broker.producer(TOPIC)
    state = {"seq": 0, "bid": 0}
    cons = None
    if mode == "consume":
        cons = broker.subscribe(TOPIC, WORK_SUB, "exclusive", initial_position="earliest")
    out.write(["READY\n"])
    pending = []
    while True:
        if mode == "produce":
            produce_some(prod, rng, cycle, state, out, partition_for)
            if rng.random() < 0.5:   # bound the volume the parent re-reads each cycle
                time.sleep(0.001)
            continue
        if rng.random() < 0.3:
            produce_some(prod, rng, cycle, state, out, partition_for)
        pending.extend(cons.receive_many(rng.randint(1, 60), timeout=0.01))
        if not pending:
            continue
        r = rng.random()
        if r < 0.75:
            rng.shuffle(pending)
            k = rng.randint(1, len(pending))
            batch, pending = pending[:k], pending[k:]
            ids = " ".join(f"{m.partition}:{m.offset}" for m in batch)
            out.write([f"T {ids}\n"])
            cons.ack(batch if len(batch) > 1 or rng.random() < 0.5 else batch[0])
            out.write([f"K {ids}\n"])
        elif r < 0.85:
            m = rng.choice(pending)
            out.write([f"TC {m.partition} {m.offset}\n"])
            cons.ack_cumulative(m)
            out.write([f"KC {m.partition} {m.offset}\n"])
            pending = [x for x in pending
                       if not (x.partition == m.partition and x.offset <= m.offset)]
        # else: keep holding them; some stay unacknowledged until the kill


if __name__ == "__main__":
    main(sys.argv)
