"""Subprocess side of tests/functions/test_function_crash.py: a windowed two-input
aggregation run by ``txmq.functions`` until it is SIGKILLed.

    python function_crash_worker.py <data> <fsync> <seed> <window> <instances> <pace>

``window`` is ``tumbling:<size>`` or ``sliding:<size>:<slide>`` (the same in
every run: the state was written with it). The worker opens the broker and
runs ``instances`` instances (1 or 2, one thread each, failover lanes) of
the function ``agg``: inputs ``a`` and ``b``, output ``totals``, the
amount of each message its value. Values starting with ``x`` are poison
(the function always raises: they end in ``agg-dlq``); some others fail on
their first delivery only (:func:`transient`). Each step sleeps up to
``pace`` seconds now and then inside the function, so kills land inside
open transactions. Each instance runs until nothing has arrived for
``IDLE`` seconds.

Lines: ``READY`` once the instances exist, ``M <json>`` the metrics of
each instance as it ends, ``DONE`` after the broker closed. Exit 3 (via
worker_io.fail) on any unexpected error.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
import traceback
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers"))
from worker_io import Out, fail  # noqa: E402

INPUTS = ("a", "b")
PARTITIONS = 3
OUTPUT = "totals"
NAME = "agg"
OOO_MS = 40               # max_out_of_orderness_ms
LATENESS_MS = 30          # allowed_lateness_ms
MAX_REDELIVERIES = 2
IDLE = 0.6                # seconds without input before an instance ends


def window_of(spec: str):
    from txmq.functions import Sliding, Tumbling
    kind, *ms = spec.split(":")
    return Tumbling(int(ms[0])) if kind == "tumbling" else Sliding(int(ms[0]), int(ms[1]))


def transient(m) -> bool:
    """About one message in 9 fails on its first delivery (and again on
    the first delivery after a restart: redelivery counts live in memory)."""
    return m.redelivery_count == 0 and zlib.crc32(m.value + (m.key or b"")) % 9 == 0


def make_fn(rng: random.Random, pace: float):
    def fn(m):
        if m.value.startswith(b"x"):
            raise ValueError("poison")
        if transient(m):
            raise RuntimeError("transient")
        if pace and rng.random() < 0.03:
            time.sleep(rng.uniform(0, pace))
        return int(m.value)
    return fn


def main(argv) -> None:
    data, fsync, seed, spec, instances, pace = argv[1], argv[2], int(argv[3]), argv[4], int(argv[5]), float(argv[6])
    import txmq
    from txmq.functions import Function

    rng = random.Random(seed)
    out = Out()
    broker = txmq.Broker(data, fsync=fsync)
    fns = [Function(broker, NAME, INPUTS, OUTPUT, make_fn(random.Random(rng.randrange(1 << 30)), pace),
                    window=window_of(spec), max_out_of_orderness_ms=OOO_MS, allowed_lateness_ms=LATENESS_MS,
                    max_redeliveries=MAX_REDELIVERIES, batch_size=rng.randint(1, 30), retry_backoff=0.001,
                    transaction_timeout=30.0, instance=f"i{i}")
           for i in range(instances)]
    out.line("READY")

    def run(f):
        try:
            f.run(idle_timeout=IDLE)
            out.line("M " + json.dumps(f.metrics()))
            f.close()
        except BaseException as e:
            fail(f"{f.instance}: {type(e).__name__}: {e}\n{traceback.format_exc()}")

    threads = [threading.Thread(target=run, args=(f,)) for f in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    broker.close()
    out.line("DONE")


if __name__ == "__main__":
    main(sys.argv)
