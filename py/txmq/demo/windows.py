"""The window aggregation of ``txmq demo`` (the Pulsar Functions example
of exactly-once): a ``txmq.functions`` function sums the orders of two
input topics into per-product totals per event-time window.

- Inputs ``shop.web-orders`` and ``shop.store-orders`` (4 partitions each,
  keyed by product, so both put a product in the same lane): JSON
  ``{"order", "amount"}`` in cents, event times out of order by at most
  ``OOO_MS``, so no event is ever late. Some are sent in transactions; a
  few transactions are aborted and their (huge) amounts must never count.
- The function ``sales-per-window``: tumbling windows of ``WINDOW_MS``;
  each window is emitted once, when the lane's watermark passes its end,
  to ``shop.sales-totals`` (key the product, value ``{"start", "end",
  "total", "count"}``). Its state is in ``sales-per-window-state``, written
  in each step's transaction with the outputs and the acks.

:func:`produce_inputs` runs in the demo's process; :func:`worker` in the
process the demo SIGKILLs and starts again; :func:`verify` recomputes the
windows from the committed inputs.
"""

from __future__ import annotations

import json
import random

import txmq
from txmq.demo.bank import drain
from txmq.functions import Function, Tumbling

INPUTS = ("shop.web-orders", "shop.store-orders")
OUTPUT = "shop.sales-totals"
NAME = "sales-per-window"
PARTITIONS = 4
PRODUCTS = tuple(f"product-{i:02d}" for i in range(10))
WINDOW_MS = 500
WINDOWS = 30                    # event time spans about this many windows
OOO_MS = 50                     # max_out_of_orderness_ms
BASE_MS = 1_704_103_200_000     # 2024-01-01 10:00 UTC: the first event time
BATCH = 20                      # the function's batch size: many small steps, so a kill lands in one
ABORTED_AMOUNT = 10 ** 9
FSYNC = "commit"


def produce_inputs(broker, seed: int, events: int, progress_cb=None) -> dict:
    """Send ``events`` orders, half to each input, in small batches; some in
    a transaction, a few in one that is aborted."""
    rng = random.Random(seed)
    for topic in INPUTS:
        if topic not in broker.topics():
            broker.create_topic(topic, PARTITIONS)
    sent = aborted = 0
    # Event times span about WINDOWS windows whatever the size.
    step_ms = max(1, WINDOWS * WINDOW_MS * 2 // max(events, 1))
    for n_topic, topic in enumerate(INPUTS):
        prod = broker.producer(topic)
        clock = BASE_MS
        todo = events // 2 + (n_topic < events % 2)
        i = batches = 0
        while i < todo:
            n = min(rng.randint(1, 20), todo - i)
            values, keys, times = [], [], []
            for _ in range(n):
                clock += rng.randint(0, 2 * step_ms)
                values.append(json.dumps({"order": f"{topic}:{i}", "amount": rng.randint(100, 20000)}).encode())
                keys.append(rng.choice(PRODUCTS).encode())
                times.append(clock + rng.randint(0, OOO_MS))
                i += 1
            if rng.random() < 0.2:
                with broker.transaction() as txn:
                    prod.send_batch(values, keys=keys, event_times=times, txn=txn)
            else:
                prod.send_batch(values, keys=keys, event_times=times)
            batches += 1
            if batches == 2 or rng.random() < 0.03:
                txn = broker.new_transaction()
                prod.send_batch([json.dumps({"order": "aborted", "amount": ABORTED_AMOUNT}).encode()] * 3,
                                keys=[rng.choice(PRODUCTS).encode() for _ in range(3)],
                                event_times=[clock] * 3, txn=txn)
                txn.abort()
                aborted += 3
            sent += n
            if progress_cb:
                progress_cb(n)
    return {"events": sent, "aborted_events": aborted}


def amount_of(m) -> int:
    """The function: what an order adds to its product's window total."""
    return json.loads(m.value)["amount"]


def _lag(broker) -> int:
    return sum(sum(broker.consumer_lag(t, NAME).values()) for t in INPUTS)


def worker(data: str, run: int, report) -> None:

    broker = txmq.Broker(data, fsync=FSYNC)
    report.line("READY", {"run": run, "recovered": broker.stats()["transactions"]["recovered"]})
    f = Function(broker, NAME, INPUTS, OUTPUT, amount_of, window=Tumbling(WINDOW_MS),
                 max_out_of_orderness_ms=OOO_MS, batch_size=BATCH, instance=f"run-{run}")
    while True:
        # A status after every step, so that the demo's kill lands where it aims.
        got, lag = f.step(0.05), _lag(broker)
        report.line("S", {"run": run, "lag": lag})
        if not got and not lag:
            break
    metrics = f.metrics()
    f.close()
    broker.close()
    report.line("DONE", {"run": run, "lag": 0, "metrics": metrics})


def expected_windows(events) -> dict:
    """``{(key, start): (total, count)}`` of the windows the function must
    have emitted once it has processed ``events`` (topic, lane, key, event
    time, amount): per lane, every window whose end the lane's final
    watermark has reached."""
    top: dict = {}                  # lane -> {topic: largest event time}
    sums: dict = {}                 # (lane, key, start) -> [total, count]
    for topic, lane, key, t, amount in events:
        seen = top.setdefault(lane, {})
        seen[topic] = max(seen.get(topic, t), t)
        s = t - t % WINDOW_MS
        agg = sums.setdefault((lane, key, s), [0, 0])
        agg[0] += amount
        agg[1] += 1
    out = {}
    for (lane, key, s), (total, count) in sums.items():
        if len(top[lane]) == len(INPUTS) and s + WINDOW_MS <= min(top[lane].values()) - OOO_MS:
            out[(key, s)] = (total, count)
    return out


def verify(broker) -> dict:
    events = [(m.topic, m.partition, m.key, m.event_time, amount_of(m))
              for t in INPUTS for m in drain(broker, t, "shop.verify")]
    want = expected_windows(events)
    got: dict = {}
    for m in drain(broker, OUTPUT, "shop.verify"):
        r = json.loads(m.value)
        got.setdefault((m.key, r["start"]), []).append((r["total"], r["count"]))
    return {
        "events_committed": len(events),
        "aborted_events_counted": sum(1 for e in events if e[4] == ABORTED_AMOUNT),
        "windows_expected": len(want),
        "windows_emitted": len(got),
        "windows_output_messages": sum(len(v) for v in got.values()),
        "windows_twice": sum(1 for v in got.values() if len(v) > 1),
        "windows_matching": sum(1 for k, v in want.items() if got.get(k) == [v]),
        "windows_unexpected": sum(1 for k in got if k not in want),
        "events_counted_expected": sum(c for _, c in want.values()),
        "events_counted_got": sum(c for v in got.values() for _, c in v),
        "function_lag": _lag(broker),
    }
