"""Subprocess side of tests/client/test_tid_crash.py: a transactional producer doing
Kafka-style consume–process–produce until it is SIGKILLed.

    python tid_crash_worker.py <data> <fsync> <run> <seed> <sub type> <zombie delay> <pace>

``sub type`` is ``exclusive`` or ``failover`` (the subscription takes it
when no consumer is attached). The worker opens the broker, opens the transactional id ``etl-1`` (which
bumps its epoch and fences whatever instance came before), and loops: it
receives a few messages of the input topic from the subscription ``etl``,
begins a transaction, sends the transform of each input (:func:`transform`:
one or two outputs) to the output topic, to several partitions, commits the
subscription's position with :meth:`send_offsets_to_transaction`, and
commits (now and then it aborts instead: those inputs come again). At a
random point inside each transaction it sleeps up to ``pace`` seconds (the
"processing": kills find work left to do, mostly in an open transaction). Every
step is keyed ``<epoch>.<step>``: the key of each output message.

``zombie delay`` >= 0: a second thread opens ``etl-1`` again after that many
seconds, inside the same process. The first instance is then a zombie: its
open transaction was aborted, every later call must raise
ProducerFencedError, and it stops (closing its consumer, so its unacked
messages go to the new instance); the new instance carries on with its own
consumer. The worker exits 3 (traceback on stderr) when a fenced instance
is not refused, when it finds nothing to receive for ``STUCK`` seconds while
``consumer_lag`` says there is, or on any unexpected error.

When the input is exhausted (nothing to receive and ``consumer_lag`` 0) each
instance ends its loop; the worker closes the broker and prints ``DONE``.

Lines, each written with one ``write``; a line that reports a call is
written only after the call returned, "about to" lines (``C``, ``AB``)
before it:

    RT <committed> <aborted>       recovered_transactions of the broker just opened
    E <inst> <pid> <epoch>         instance <inst> (a: main thread, z: zombie opener) opened etl-1
    READY
    B <key> <txn> <ins>            began the step's transaction for inputs p:off=value,..
    C <key> <txn> <ins> <outs>     about to commit: inputs p:off=value,.. and outputs p:off=value,..
    K <key>                        commit() returned
    AB <key>                       about to abort
    D <key>                        abort() returned
    F <epoch> <key> <call>         instance <epoch> was refused with ProducerFencedError in
                                   <call>; <key> is its open step ("-" none); it stops
    END <epoch> <done|fenced>      an instance's loop ended
    DONE
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
import traceback
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers"))
from worker_io import Out, fail  # noqa: E402

IN_TOPIC = "in"
OUT_TOPIC = "out"
IN_PARTITIONS = 3
OUT_PARTITIONS = 3
SUB = "etl"
TID = "etl-1"
P_ABORT = 0.08
STUCK = 5.0           # seconds with nothing to receive while consumer_lag says there is


def transform(value: bytes) -> list:
    """The outputs of one input: ``out-<value>``, and for about a third of
    the inputs a second one ``out-<value>-b``."""
    outs = [b"out-" + value]
    if zlib.crc32(value) % 3 == 0:
        outs.append(b"out-" + value + b"-b")
    return outs


def items(pairs) -> str:
    """``p:off=value,...`` (values hold no spaces or commas)."""
    return ",".join(f"{p}:{off}={v.decode()}" for p, off, v in pairs) or "-"


def parse_items(text: str) -> list:
    if text == "-":
        return []
    out = []
    for item in text.split(","):
        loc, _, value = item.partition("=")
        p, off = loc.split(":")
        out.append((int(p), int(off), value))
    return out


class Fenced(Exception):
    pass


class Instance:
    """One instance of ``etl-1`` and its consumer, running the loop."""

    def __init__(self, broker, tp, out: Out, rng: random.Random, sub_type: str, pace: float):
        self.broker = broker
        self.tp = tp
        self.epoch = tp.epoch
        self.out = out
        self.rng = rng
        self.sub_type = sub_type
        self.pace = pace
        self.cons = None
        self.prod = None              # the output producer, once the first step made it
        self.step = 0

    def attach(self) -> None:
        """Subscribe; an exclusive subscription refuses a second consumer
        until the fenced instance has closed its own."""
        import txmq.errors as E
        deadline = time.monotonic() + 30
        while True:
            try:
                self.cons = self.broker.subscribe(IN_TOPIC, SUB, self.sub_type, initial_position="earliest")
                return
            except E.SubscriptionBusyError:
                if time.monotonic() > deadline:
                    fail(f"instance {self.epoch}: the subscription stayed busy for 30 s")
                time.sleep(0.002)

    def fenced(self, key: str, call: str, txn) -> None:
        """Refused in ``call``: every later call must be refused too."""
        import txmq.errors as E
        self.out.line(f"F {self.epoch} {key} {call}")
        probes = [("begin", self.tp.begin), ("producer", lambda: self.tp.producer(OUT_TOPIC)),
                  ("send_offsets", lambda: self.tp.send_offsets_to_transaction(txn, self.cons, {0: 1}))]
        if txn is not None:
            probes += [("commit", txn.commit), ("abort", txn.abort)]
            if self.prod is not None:
                probes.append(("send", lambda: self.prod.send(b"zombie", partition=0, txn=txn)))
        for name, probe in probes:
            if name == "send_offsets" and txn is None:
                continue
            try:
                probe()
            except E.ProducerFencedError:
                continue
            fail(f"instance {self.epoch} was fenced (in {call}), but {name} afterwards was not refused")
        raise Fenced()

    def run(self) -> None:
        import txmq.errors as E
        state = "error"
        try:
            idle = 0
            idle_since = None
            while True:
                msgs = self.cons.receive_many(self.rng.randint(1, 8), timeout=0.02)
                if not msgs:
                    idle += 1
                    idle_since = idle_since or time.monotonic()
                    lag = self.broker.consumer_lag(IN_TOPIC, SUB)
                    if idle >= 3 and all(v == 0 for v in lag.values()):
                        state = "done"
                        return
                    if time.monotonic() - idle_since > STUCK:
                        fail(f"instance {self.epoch}: nothing to receive for {STUCK} s, yet consumer_lag is {lag}")
                    if self.tp.fenced:       # an idle zombie notices at its next begin
                        try:
                            self.tp.begin()
                        except E.ProducerFencedError:
                            self.fenced("-", "begin", None)
                        fail(f"instance {self.epoch} is fenced, yet begin() succeeded")
                    continue
                idle, idle_since = 0, None
                self.one_step(msgs)
        except Fenced:
            state = "fenced"
        finally:
            self.cons.close()
            self.out.line(f"END {self.epoch} {state}")

    def one_step(self, msgs) -> None:
        import txmq.errors as E
        rng = self.rng
        self.step += 1
        key = f"{self.epoch}.{self.step}"
        txn = None
        call = "begin"
        pause_at = rng.randrange(3) if self.pace else -1
        try:
            txn = self.tp.begin()
            ins = [(m.partition, m.offset, m.value) for m in msgs]
            self.out.line(f"B {key} {txn.id} {items(ins)}")
            if pause_at == 0:
                self.pause()
            todo = [v for m in msgs for v in transform(m.value)]
            nexts = {}
            for p, off, _ in ins:
                nexts[p] = max(nexts.get(p, 0), off + 1)
            offsets_first = rng.random() < 0.3
            if offsets_first:
                call = "send_offsets"
                self.send_offsets(txn, nexts)
            call = "producer"
            prod = self.prod = self.tp.producer(OUT_TOPIC)
            call = "send"
            outs = []
            kbytes = key.encode()
            if rng.random() < 0.5:
                for v in todo:
                    mid = prod.send(v, key=kbytes, partition=rng.randrange(OUT_PARTITIONS), txn=txn)
                    outs.append((mid.partition, mid.offset, v))
            else:
                # Grouped: a batch per chosen partition.
                groups = {}
                for v in todo:
                    groups.setdefault(rng.randrange(OUT_PARTITIONS), []).append(v)
                for p, vs in groups.items():
                    mids = prod.send_batch(vs, keys=[kbytes] * len(vs), partition=p, txn=txn)
                    for mid, v in zip(mids, vs):
                        if mid.partition != p:
                            fail(f"{key}: send_batch to partition {p} returned {mid}")
                        outs.append((mid.partition, mid.offset, v))
            if pause_at == 1:
                self.pause()
            if not offsets_first:
                call = "send_offsets"
                self.send_offsets(txn, nexts)
            if pause_at == 2:
                self.pause()
            if rng.random() < P_ABORT:
                self.out.line(f"AB {key}")
                call = "abort"
                txn.abort()
                self.out.line(f"D {key}")
                return
            self.out.line(f"C {key} {txn.id} {items(ins)} {items(outs)}")
            call = "commit"
            txn.commit()
            self.out.line(f"K {key}")
        except E.ProducerFencedError:
            self.fenced(key if txn is not None else "-", call, txn)

    def pause(self) -> None:
        """The processing time of a step, spent inside its transaction."""
        time.sleep(self.rng.uniform(0, self.pace))

    def send_offsets(self, txn, nexts: dict) -> None:
        """The position after the step's inputs, in one call or split in
        two (one partition each time)."""
        if len(nexts) > 1 and self.rng.random() < 0.3:
            for p in sorted(nexts):
                self.tp.send_offsets_to_transaction(txn, self.cons, {p: nexts[p]})
        else:
            self.tp.send_offsets_to_transaction(txn, self.cons, dict(nexts))


def guarded(fn):
    def run(*args):
        try:
            fn(*args)
        except BaseException as e:
            fail(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    return run


def zombie_opener(broker, out: Out, rng: random.Random, sub_type: str, pace: float, delay: float) -> None:
    time.sleep(delay)
    tp = broker.transactional_producer(TID, timeout=30)
    out.line(f"E z {tp.producer_id} {tp.epoch}")
    inst = Instance(broker, tp, out, rng, sub_type, pace)
    inst.attach()
    inst.run()


def main(argv) -> None:
    data, fsync, run, seed, sub_type = argv[1], argv[2], int(argv[3]), int(argv[4]), argv[5]
    zombie, pace = float(argv[6]), float(argv[7])
    import txmq

    rng = random.Random(seed)
    out = Out()
    broker = txmq.Broker(data, fsync=fsync)
    rt = broker.recovered_transactions
    out.line(f"RT {rt['committed']} {rt['aborted']}")
    tp = broker.transactional_producer(TID, timeout=30)
    out.line(f"E a {tp.producer_id} {tp.epoch}")
    main_inst = Instance(broker, tp, out, random.Random(rng.randrange(1 << 30)), sub_type, pace)
    main_inst.attach()
    out.line("READY")
    threads = []
    if zombie >= 0:
        threads.append(threading.Thread(target=guarded(zombie_opener), daemon=True, args=(
            broker, out, random.Random(rng.randrange(1 << 30)), sub_type, pace, zombie)))
        threads[-1].start()
    guarded(main_inst.run)()
    for t in threads:
        t.join()
    broker.close()
    out.line("DONE")


if __name__ == "__main__":
    main(sys.argv)
