"""Subprocess side of tests/client/test_producer_crash.py: named producers that are
SIGKILLed mid-stream, restart, resend their last batches and go on.

    python producer_crash_worker.py <mode> <data> <fsync> <cycle> <seed> <threads> <small> [<clean batches>]

Every named producer (a *stream*, see :data:`STREAMS`) sends one fixed,
endless sequence of batches: batch ``k`` holds the messages
``batch_values(stream, k)`` (``size(k)`` of them) at base sequence
``base(k)`` (sequences count messages, Kafka style). So the log a correct
broker holds after any number of kills is fully determined: each stream's
batches 0, 1, 2, ... in order, each once and whole, on its partition.

On start the worker opens the broker and its named producers, reads each
one's ``last_sequence``, finds the batch ``K`` that ends there, and resends
its last ``N`` batches (``N`` random in 1..5, explicit ``sequence=``): each
must answer with the offsets the batch already has in the log (read back
and compared: the values and the batch header) and append nothing. Then it
prints ``READY`` and sends batches ``K+1, K+2, ...`` (with ``sequence=``,
or now and then without it so the broker picks the next sequence), one
line per batch the broker acknowledged, until it is killed.

``mode``:

- ``stream``: as above, until killed (or, with ``<clean batches>``, that
  many batches per stream, then a clean close and ``DONE``).
- ``dup``: after the restart and the resends, sends batches older than the
  last 5 again: each must raise DuplicateSequenceError and append nothing;
  resends the last 5 (all still cached: original offsets), a batch whose
  count differs from the cached one with the same base sequence, and a
  sequence inside the last batch (both refused); then one new batch each
  and ``DONE``.
- ``gap``: after the restart and the resends, sends with a gap (base
  sequences past the next one, one past and far past): each must raise
  OutOfOrderSequenceError (not its Duplicate subclass) naming the expected
  next sequence and append nothing; then the right next batch, and ``DONE``.

``threads`` 1 sends from one thread in random stream order, else one
thread per stream (two streams share partition 0). ``small`` 1 writes a
recovery point and producer-state snapshot every 4 KiB, so kills land in
those paths and restarts restore from a snapshot plus a short replay.

Lines (each written with one ``write`` after the call returned; a line
without its newline was cut by the kill):

    READY
    R <stream> <K> <k,k,...>      the resends of batches k.. after the restart returned their
                                  original offsets (K: last batch found; -1 none)
    D <stream> <k>                resending old batch k raised DuplicateSequenceError
    A <stream> <k> <offset>       batch k was acknowledged; its first message is at <offset>
    O <stream> <seq> <expected>   (gap) sequence <seq> raised OutOfOrderSequenceError
    X <stream> <what>             (dup) a refused mismatching resend: <what>
    DONE

The worker checks what it can itself and exits 3 with a message on stderr
when the broker answers wrongly.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers"))
from worker_io import Out, fail  # noqa: E402

TOPIC = "events"
PARTITIONS = 2
# stream -> (producer name, partition). "a" and "c" share partition 0.
STREAMS = {"a": ("svc-a", 0), "b": ("svc-b", 1), "c": ("svc-c", 0)}
SEGMENT_BYTES = 64 * 1024
BROKER_OPTS = dict(segment_bytes_max=SEGMENT_BYTES)
CACHED = 5            # batches per producer and partition whose offsets a retry gets back


def size(k: int) -> int:
    """Messages in batch ``k``: mostly 1..7, now and then a bigger one."""
    if k % 13 == 12:
        return 20 + k % 17
    return 1 + (k * 5 + k // 7) % 7


_bases = [0]
_bases_lock = threading.Lock()


def base(k: int) -> int:
    """Base sequence of batch ``k``: the messages of the batches before it."""
    with _bases_lock:
        while len(_bases) <= k + 1:
            n = len(_bases) - 1
            _bases.append(_bases[-1] + size(n))
        return _bases[k]


def last_seq(k: int) -> int:
    """Sequence of the last message of batch ``k`` (-1 for k = -1)."""
    return base(k + 1) - 1


def batch_of_last_sequence(seq: int) -> int:
    """The batch that ends at sequence ``seq`` (-1 for -1); ValueError when
    ``seq`` is not the end of a batch."""
    if seq == -1:
        return -1
    k = 0
    while last_seq(k) < seq:
        k += 1
    if last_seq(k) != seq:
        raise ValueError(f"last sequence {seq} is inside batch {k} ({base(k)}..{last_seq(k)})")
    return k


def value(stream: str, k: int, i: int) -> bytes:
    pad = (k * 31 + i * 7) % 97
    return f"{stream}:{k}:{i}:".encode() + bytes([97 + (k + i) % 26]) * pad


def batch_values(stream: str, k: int) -> list:
    return [value(stream, k, i) for i in range(size(k))]


def parse(v: bytes) -> tuple:
    """(stream, k, i) of a stored value; ValueError when it is not exactly
    what :func:`value` makes."""
    parts = v.split(b":", 3)
    if len(parts) != 4:
        raise ValueError(f"malformed value {v[:40]!r}")
    s, k, i = parts[0].decode(), int(parts[1]), int(parts[2])
    if s not in STREAMS or value(s, k, i) != v:
        raise ValueError(f"damaged value {v[:40]!r}")
    return s, k, i


class Failure(Exception):
    pass


class Stream:
    def __init__(self, broker, stream: str):
        self.broker = broker
        self.stream = stream
        self.name, self.partition = STREAMS[stream]
        self.prod = broker.producer(TOPIC, name=self.name)
        self.part = broker._topic(TOPIC).partitions[self.partition]
        self.offsets = {}                     # k -> first offset, as this process learnt them

    def where(self) -> str:
        return f"{self.stream} ({self.name}, {TOPIC}/{self.partition})"

    def last(self) -> int:
        return self.prod.last_sequence[self.partition]

    def end(self) -> int:
        return self.part.end_offset

    def send(self, k: int, rng: random.Random, explicit: bool = True):
        values = batch_values(self.stream, k)
        seq = base(k) if explicit else None
        if len(values) == 1 and rng.random() < 0.5:
            mid = self.prod.send(values[0], partition=self.partition, sequence=seq)
            return [mid.offset]
        ids = self.prod.send_batch(values, partition=self.partition, sequence=seq)
        return [int(x) for x in ids.offsets]

    def check_in_log(self, k: int, offsets, how: str) -> None:
        """``offsets`` (what a send of batch k returned) are where batch k is
        in the log, as one batch of this producer at its base sequence."""
        n = size(k)
        if list(offsets) != list(range(offsets[0], offsets[0] + n)):
            raise Failure(f"{self.where()}: {how} of batch {k} returned offsets {list(offsets)}")
        got = self.part.read(offsets[0], n)
        vals = [m[2] for m in got]
        if vals != batch_values(self.stream, k) or [m[0] for m in got] != list(offsets):
            raise Failure(f"{self.where()}: {how} of batch {k} returned offsets {offsets[0]}.., but the log "
                          f"holds {[v[:16] for v in vals]} there")
        info = got[0][-1]
        if (info.base_offset, info.count, info.producer_id, info.base_sequence) != \
                (offsets[0], n, self.prod.producer_id, base(k)):
            raise Failure(f"{self.where()}: {how} of batch {k}: the batch at {offsets[0]} is {info!r} with "
                          f"producer {info.producer_id} base sequence {info.base_sequence}; expected count {n}, "
                          f"producer {self.prod.producer_id}, base sequence {base(k)}")

    def recover(self, rng: random.Random, resend_old: bool) -> int:
        """Find the last batch from last_sequence and resend the last N
        batches; return K (the last batch, -1 none)."""
        ls = self.last()
        try:
            K = batch_of_last_sequence(ls)
        except ValueError as e:
            raise Failure(f"{self.where()}: after the restart: {e}") from None
        end = self.end()
        n = min(rng.randint(1, CACHED), K + 1)
        ks = list(range(K - n + 1, K + 1))
        if rng.random() < 0.3:
            rng.shuffle(ks)
        for k in ks:
            offsets = self.send(k, rng)
            self.check_in_log(k, offsets, "the resend after the restart")
            self.offsets[k] = offsets[0]
        olds = []
        if resend_old and K >= CACHED and rng.random() < 0.4:
            olds = [K - CACHED - rng.randrange(min(K - CACHED + 1, 20))]
            for k in olds:
                self.expect_duplicate(k, rng)
        if self.end() != end or self.last() != ls:
            raise Failure(f"{self.where()}: resending batches {ks} + old {olds} appended: end offset "
                          f"{end} -> {self.end()}, last sequence {ls} -> {self.last()}")
        self.recovered = (K, ks, olds)
        return K

    def expect_duplicate(self, k: int, rng: random.Random) -> None:
        import txmq.errors as E
        try:
            offsets = self.send(k, rng)
        except E.DuplicateSequenceError as e:
            if e.sequence != base(k):
                raise Failure(f"{self.where()}: DuplicateSequenceError for batch {k} names sequence "
                              f"{e.sequence}, sent {base(k)}") from None
        except E.OutOfOrderSequenceError as e:
            raise Failure(f"{self.where()}: resending old batch {k} (sequence {base(k)}, last "
                          f"{self.last()}) raised {e!r}, not DuplicateSequenceError") from None
        else:
            raise Failure(f"{self.where()}: resending batch {k}, older than the last {CACHED}, returned "
                          f"{offsets[:3]}.. instead of raising DuplicateSequenceError")


def report_recovery(out: Out, streams: dict) -> None:
    for s, st in streams.items():
        K, ks, olds = st.recovered
        out.line(f"R {s} {K} {','.join(map(str, ks)) or '-'}")
        for k in olds:
            out.line(f"D {s} {k}")


def stream_loop(st: Stream, k: int, rng: random.Random, out: Out, limit: int | None) -> int:
    """Send batches k, k+1, ... of ``st``; return the next k."""
    sent = 0
    while limit is None or sent < limit:
        offsets = st.send(k, rng, explicit=rng.random() < 0.75)
        if rng.random() < 0.02:
            st.check_in_log(k, offsets, "the send")
        st.offsets[k] = offsets[0]
        out.line(f"A {st.stream} {k} {offsets[0]}")
        r = rng.random()
        if r < 0.05:
            # A retry while still running (a lost reply): the same batch, or one of the
            # last 5, answers with its offsets.
            j = k - rng.randrange(min(CACHED, k + 1))
            again = st.send(j, rng)
            if again[0] != st.offsets.get(j, again[0]):
                raise Failure(f"{st.where()}: retrying batch {j} returned offset {again[0]}, "
                              f"first sent at {st.offsets[j]}")
            st.check_in_log(j, again, "a retry")
        k += 1
        sent += 1
        if rng.random() < 0.3:      # bound the volume the parent reads back
            time.sleep(0.001)
    return k


def run_thread(st, k, rng, out, limit, result):
    try:
        result[st.stream] = stream_loop(st, k, rng, out, limit)
    except BaseException as e:
        fail(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")


def dup_probe(streams: dict, nexts: dict, rng: random.Random, out: Out) -> None:
    import txmq.errors as E
    for s, st in streams.items():
        K = nexts[s] - 1
        if K < CACHED:
            raise Failure(f"{st.where()}: dup probe needs more than {CACHED} batches, has {K + 1}")
        end, ls = st.end(), st.last()
        # Everything older than the last 5: refused, nothing appended.
        olds = sorted({K - CACHED} | {0} | {rng.randrange(K - CACHED + 1) for _ in range(6)})
        for k in olds:
            st.expect_duplicate(k, rng)
            out.line(f"D {s} {k}")
        # The last 5 are all still cached.
        for k in range(K - CACHED + 1, K + 1):
            offsets = st.send(k, rng)
            st.check_in_log(k, offsets, "resending a cached batch")
        # Same base sequence as a cached batch, another count; a sequence inside a batch.
        tries = [("count", base(K), batch_values(s, K) + [b"extra"])]
        if size(K) > 1:
            tries += [("short", base(K), batch_values(s, K)[:-1]), ("inside", base(K) + 1, [b"inside"])]
        if size(K) > 2:
            tries.append(("inside", last_seq(K), [b"inside"]))
        for what, seq, vals in tries:
            try:
                got = st.prod.send_batch(vals, partition=st.partition, sequence=seq)
            except E.OutOfOrderSequenceError:
                out.line(f"X {s} {what}")
            else:
                raise Failure(f"{st.where()}: batch {K} is {size(K)} messages at {base(K)}; sending "
                              f"{len(vals)} at {seq} ({what}) returned {list(got.offsets)}")
        if st.end() != end or st.last() != ls:
            raise Failure(f"{st.where()}: refused resends appended: end offset {end} -> {st.end()}, "
                          f"last sequence {ls} -> {st.last()}")
        # And the producer goes on from where it was.
        offsets = st.send(K + 1, rng)
        st.check_in_log(K + 1, offsets, "the send after the refused ones")
        out.line(f"A {s} {K + 1} {offsets[0]}")
        nexts[s] = K + 2


def gap_probe(streams: dict, nexts: dict, rng: random.Random, out: Out) -> None:
    import txmq.errors as E
    for s, st in streams.items():
        k = nexts[s]
        end, ls = st.end(), st.last()
        expected = base(k)
        for seq, vals in [(base(k + 1), batch_values(s, k + 1)), (expected + 1, batch_values(s, k)),
                          (base(k + 3), batch_values(s, k + 3)), (expected + 1000, [b"far"])]:
            try:
                got = (st.prod.send(vals[0], partition=st.partition, sequence=seq) if len(vals) == 1
                       else st.prod.send_batch(vals, partition=st.partition, sequence=seq))
            except E.DuplicateSequenceError as e:
                raise Failure(f"{st.where()}: sequence {seq} past the next ({expected}) raised {e!r}") from None
            except E.OutOfOrderSequenceError as e:
                if e.expected != expected or e.sequence != seq:
                    raise Failure(f"{st.where()}: {e!r} for sequence {seq}: expected {e.expected} "
                                  f"(should be {expected})") from None
                out.line(f"O {s} {seq} {expected}")
            else:
                raise Failure(f"{st.where()}: sequence {seq} with a gap (next is {expected}) returned {got}")
        if st.end() != end or st.last() != ls:
            raise Failure(f"{st.where()}: refused sends appended: end offset {end} -> {st.end()}, "
                          f"last sequence {ls} -> {st.last()}")
        offsets = st.send(k, rng)
        st.check_in_log(k, offsets, "the send after the refused ones")
        out.line(f"A {s} {k} {offsets[0]}")
        nexts[s] = k + 1


def main(argv) -> None:
    mode, data, fsync, cycle, seed = argv[1], argv[2], argv[3], int(argv[4]), int(argv[5])
    threads, small = int(argv[6]), argv[7] == "1"
    clean = int(argv[8]) if len(argv) > 8 else None
    import txmq
    if small:
        import txmq.storage.log
        txmq.storage.log.CHECKPOINT_BYTES = 4 * 1024

    rng = random.Random(seed)
    out = Out()
    try:
        broker = txmq.Broker(data, fsync=fsync, **BROKER_OPTS)
        names = list(STREAMS)
        rng.shuffle(names)
        streams = {s: Stream(broker, s) for s in names}
        nexts = {s: st.recover(rng, resend_old=mode == "stream") + 1 for s, st in streams.items()}
        out.line("READY")
        report_recovery(out, streams)
        if mode == "dup":
            dup_probe(streams, nexts, rng, out)
        elif mode == "gap":
            gap_probe(streams, nexts, rng, out)
        elif mode != "stream":
            raise SystemExit(f"unknown mode {mode}")
        if mode == "stream" and threads > 1:
            result = {}
            ts = [threading.Thread(target=run_thread, daemon=True,
                                   args=(st, nexts[s], random.Random(rng.randrange(1 << 30)), out, clean, result))
                  for s, st in streams.items()]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        elif mode == "stream":
            left = {s: clean for s in streams}
            live = list(streams)
            while live:
                s = rng.choice(live)
                n = rng.randint(1, 4) if clean is None else min(rng.randint(1, 4), left[s])
                nexts[s] = stream_loop(streams[s], nexts[s], rng, out, n)
                if clean is not None:
                    left[s] -= n
                    if left[s] <= 0:
                        live.remove(s)
        broker.close()
        out.line("DONE")
    except Failure as e:
        fail(f"[cycle {cycle} seed {seed}] {e}")
    except BaseException as e:
        fail(f"[cycle {cycle} seed {seed}] {type(e).__name__}: {e}\n{traceback.format_exc()}")


if __name__ == "__main__":
    main(sys.argv)
