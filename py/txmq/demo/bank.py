"""The bank of ``txmq demo`` (the isolation-level proposal's example):
deposits, withdrawals and transfers to one request topic, a monitor that
reads it uncommitted, a processor that reads it committed and keeps the
balances exactly once.

Topics (4 partitions each, keyed by account so that an account's requests
keep their order):

- ``bank.requests``: one message per request, JSON ``{"id", "kind",
  "account", "amount", "transfer", "intent"}``; ``amount`` is signed (a
  withdrawal or a transfer's debit leg is negative). A transfer is one
  transaction with two messages, its debit and its credit leg (usually on
  two partitions); ``intent`` "abort" marks the transfers the client
  aborts on purpose.
- ``bank.balances``: what the processor did, one message per applied
  request: ``{"request", "account", "amount", "balance"}``.

The worker process (:func:`worker`) runs everything that writes: tellers
(client threads sending deposits and withdrawals, plain sends), a transfer
client (each transfer held open while it is "checked", so that deposits
arrive behind it; the first transfer of each run is held open
``HOLD_S``), the monitor (subscription ``bank.monitor``,
read_uncommitted), the auditor (subscription ``bank.auditor``, shared,
read_committed with ``allow_out_of_order_delivery``: committed requests
past an open transfer at once, never an uncommitted one) and the processor
(subscription ``bank.processor``, read_committed; each batch's balance
updates and its position are one transaction of the transactional producer
``bank.processor``, Kafka's consume-process-produce). While the long
transfer is open, the auditor and the processor time the teller requests
published meanwhile: the auditor gets them as they come, the processor
only once the transfer ends (it reads in offset order). The demo SIGKILLs it mid-run and starts it
again: the clients carry on after the last request of theirs in the log,
the processor takes the balances from the last committed updates and
reads on from its committed position.

:func:`verify` then reads the directory and recomputes everything from the
committed requests.
"""

from __future__ import annotations

import json
import random
import threading
import time

import txmq
from txmq.errors import TransactionNotFoundError

REQUESTS = "bank.requests"
BALANCES = "bank.balances"
MONITOR = "bank.monitor"
AUDITOR = "bank.auditor"            # read_committed, out of order
PROCESSOR = "bank.processor"        # subscription and transactional id
PARTITIONS = 4
ACCOUNTS = tuple(f"acct-{i:02d}" for i in range(12))
TELLERS = 3
TRANSFER_CLIENT = "T"
PROCESSOR_BATCH = 50
ABORT_SHARE = 0.15                  # transfers aborted on purpose
HOLD_MAX_S = 0.03                   # a transfer stays open up to this long ...
HOLD_S = 1.0                        # ... but the first one of each run: this long
REQUESTS_PER_S = 1500               # the clients' pace: a few seconds of traffic for the small size
FSYNC = "commit"


# -- the plan: what each client sends (the same in every run of a seed) --------------------------

def plan(seed: int, requests: int) -> dict:
    """``{client: [op, ...]}``. A teller's op is ``(kind, account,
    amount)``; a transfer's ``(from, to, amount, abort)``. One request in
    ten is a transfer; at least one transfer is aborted on purpose."""
    rng = random.Random(seed)
    transfers = max(4, requests // 10)
    ops: dict = {}
    for t in range(TELLERS):
        n = (requests - transfers) // TELLERS + (t < (requests - transfers) % TELLERS)
        mine = []
        for _ in range(n):
            acct = rng.choice(ACCOUNTS)
            if rng.random() < 0.6:
                mine.append(("deposit", acct, rng.randint(1, 500) * 10))
            else:
                mine.append(("withdrawal", acct, -rng.randint(1, 300) * 10))
        ops[f"A{t + 1}"] = mine
    mine = []
    for i in range(transfers):
        src, dst = rng.sample(ACCOUNTS, 2)
        mine.append((src, dst, rng.randint(1, 200) * 10, i == 1 or rng.random() < ABORT_SHARE))
    ops[TRANSFER_CLIENT] = mine
    return ops


def _request(rid: str, kind: str, account: str, amount: int, transfer=None, intent="commit") -> bytes:
    return json.dumps({"id": rid, "kind": kind, "account": account, "amount": amount,
                       "transfer": transfer, "intent": intent}, separators=(",", ":")).encode()


def drain(broker, topic: str, name: str, isolation: str = "read_committed") -> list:
    """Every message of ``topic`` deliverable under ``isolation``, through
    a throwaway subscription."""
    c = broker.subscribe(topic, name, "exclusive", isolation=isolation, initial_position="earliest")
    out: list = []
    try:
        while True:
            ms = c.receive_many(5000, timeout=0)
            if not ms:
                return out
            out += ms
    finally:
        c.unsubscribe()


# -- the worker process ----------------------------------------------------------------------------

class _Bank:
    def __init__(self, broker, seed: int, requests: int, run: int):
        self.broker = broker
        self.ops = plan(seed, requests)
        self.run = run
        self.clients_done = threading.Event()
        self.stop = threading.Event()
        self.errors: list = []
        self.produced = 0           # ops sent, every run
        self.applied = 0            # requests applied, every run
        self.mon = {"seen": 0, "transfer_legs": 0, "legs_seen_open": 0, "past_max_read_position": 0,
                    "delay_ms_max": 0}
        self._delays: list = []
        self.duration_s = max(1.0, requests / REQUESTS_PER_S)
        # The long-held transfer: its window (wall ms) and the delays of
        # the teller requests published in it, per reader.
        self.hold = {"from_ms": None, "until_ms": None}
        self.held: dict = {AUDITOR: [], PROCESSOR: []}

    def status(self) -> dict:
        d = sorted(self._delays[-2000:])
        return {"run": self.run, "produced": self.produced, "applied": self.applied,
                "clients_done": self.clients_done.is_set(), "monitor": dict(self.mon),
                "delay_ms_median": d[len(d) // 2] if d else None, "hold": self.hold_report()}

    def hold_report(self):
        """Once the long-held transfer of this run has ended: the teller
        requests published while it was open, and their delivery delays
        (p99 and max, ms) at the auditor (out of order) and at the
        processor (offset order); else None."""
        if self.hold["until_ms"] is None:
            return None
        out = {"held_s": HOLD_S}
        for who, name in ((AUDITOR, "auditor"), (PROCESSOR, "processor")):
            d = sorted(self.held[who])
            out[f"{name}_requests"] = len(d)
            out[f"{name}_p99_ms"] = round(d[min(len(d) - 1, len(d) * 99 // 100)]) if d else None
            out[f"{name}_max_ms"] = round(d[-1]) if d else None
        return out

    def _time_held(self, who: str, msgs: list) -> None:
        """Note the delays of the teller requests among ``msgs`` published
        while the long-held transfer was open (first deliveries only)."""
        start, end = self.hold["from_ms"], self.hold["until_ms"]
        if start is None:
            return
        now_ms = time.time() * 1000
        for m in msgs:
            if start <= m.publish_time < (end if end is not None else now_ms + 1) and m.txn_id is None \
                    and m.redelivery_count == 0:
                self.held[who].append(now_ms - m.publish_time)

    def _thread(self, target, *args) -> threading.Thread:
        def run():
            try:
                target(*args)
            except BaseException as e:      # reported by the worker, which exits with an error
                self.errors.append(e)
                self.stop.set()
        t = threading.Thread(target=run, name=f"txmq-demo-{target.__name__}", daemon=True)
        t.start()
        return t

    # clients

    def resume_points(self) -> dict:
        """Per client, the op to go on from: one past its last op with a
        message in the log (committed, or aborted by the recovery of a
        kill: a transfer cut off is not sent again, as a client that never
        heard back would not know whether to)."""
        nxt = {c: 0 for c in self.ops}
        for m in drain(self.broker, REQUESTS, "bank.resume", "read_uncommitted"):
            client, op = json.loads(m.value)["id"].split(":")[:2]
            nxt[client] = max(nxt[client], int(op) + 1)
        return nxt

    def _pace(self, t0: float, done: int, n: int) -> None:
        wait = t0 + done * self.duration_s / n - time.monotonic()
        if wait > 0:
            time.sleep(wait)

    def teller(self, client: str, start: int) -> None:
        ops = self.ops[client]
        prod = self.broker.producer(REQUESTS)
        t0 = time.monotonic()
        for i in range(start, len(ops)):
            if self.stop.is_set():
                return
            self._pace(t0, i - start, len(ops))
            kind, acct, amount = ops[i]
            prod.send(_request(f"{client}:{i}", kind, acct, amount), key=acct.encode())
            self.produced += 1

    def transfers(self, start: int) -> None:
        ops = self.ops[TRANSFER_CLIENT]
        prod = self.broker.producer(REQUESTS)
        hold = min(HOLD_MAX_S, 0.5 * self.duration_s / len(ops))
        t0 = time.monotonic()
        for i in range(start, len(ops)):
            if self.stop.is_set():
                return
            self._pace(t0, i - start, len(ops))
            src, dst, amount, abort = ops[i]
            rid, intent = f"{TRANSFER_CLIENT}:{i}", "abort" if abort else "commit"
            txn = self.broker.new_transaction(timeout=30)
            prod.send(_request(rid + ":debit", "transfer", src, -amount, rid, intent), key=src.encode(), txn=txn)
            # The transfer stays open while it is checked: deposits and
            # withdrawals keep arriving behind it on its partitions. The
            # first one of the run, for HOLD_S: its debit leg in the log now.
            if i == start:
                txn.flush()
                self.hold["from_ms"] = time.time() * 1000
                time.sleep(HOLD_S)
            else:
                time.sleep(hold)
            prod.send(_request(rid + ":credit", "transfer", dst, amount, rid, intent), key=dst.encode(), txn=txn)
            if i == start:
                self.hold["until_ms"] = time.time() * 1000
            if abort:
                txn.abort()
            else:
                txn.commit()
            self.produced += 1

    def _read(self, consumer, batch: int, handle) -> None:
        """``handle(messages)`` of every receive of ``consumer`` (a reader
        of REQUESTS) until the clients are done and nothing is left."""
        lag = self.broker.consumer_lag
        while not self.stop.is_set():
            ms = consumer.receive_many(batch, timeout=0.05)
            if ms:
                handle(ms)
            elif self.clients_done.is_set() and not any(lag(REQUESTS, consumer.subscription).values()):
                return

    # the monitor: read_uncommitted, not exactly-once, never held back

    def monitor(self) -> None:
        b = self.broker
        c = b.subscribe(REQUESTS, MONITOR, "exclusive", isolation="read_uncommitted",
                        initial_position="earliest")
        mon = self.mon

        def seen(ms):
            now_ms = time.time() * 1000
            for m in ms:
                mon["seen"] += 1
                # Past maxReadPosition: a message the processor (read_committed)
                # cannot read yet, because a transfer ahead of it is open.
                if m.offset >= b.last_stable_offset(REQUESTS, m.partition):
                    mon["past_max_read_position"] += 1
                if m.txn_id is not None:
                    mon["transfer_legs"] += 1
                    try:
                        mon["legs_seen_open"] += b.transaction_info(m.txn_id)["state"] == "OPEN"
                    except TransactionNotFoundError:
                        pass            # ended already
                delay = now_ms - m.publish_time
                self._delays.append(delay)
                mon["delay_ms_max"] = max(mon["delay_ms_max"], round(delay, 1))
            c.ack(ms)

        self._read(c, 1000, seen)

    # the auditor: read_committed out of order, never held back by an open transfer

    def auditor(self) -> None:
        c = self.broker.subscribe(REQUESTS, AUDITOR, "shared", initial_position="earliest",
                                  allow_out_of_order_delivery=True)

        def audited(ms):
            self._time_held(AUDITOR, ms)
            c.ack(ms)

        self._read(c, 1000, audited)

    # the processor: read_committed, exactly once

    def restore(self) -> dict:
        """The balances of the last committed update of each account."""
        balances = {a: 0 for a in ACCOUNTS}
        updates = drain(self.broker, BALANCES, "bank.restore", "read_committed")
        for m in updates:
            u = json.loads(m.value)
            balances[u["account"]] = u["balance"]
        self.applied = len(updates)
        return balances

    def processor(self) -> None:
        b = self.broker
        tp = b.transactional_producer(PROCESSOR, timeout=30)
        out = tp.producer(BALANCES)
        balances = self.restore()
        c = b.subscribe(REQUESTS, PROCESSOR, "exclusive", isolation="read_committed",
                        initial_position="earliest")

        def process(ms):
            self._time_held(PROCESSOR, ms)
            values, keys, positions = apply(balances, ms)
            txn = tp.begin()
            out.send_batch(values, keys=keys, txn=txn)
            tp.send_offsets_to_transaction(txn, c, positions)
            txn.commit()
            self.applied += len(ms)

        self._read(c, PROCESSOR_BATCH, process)


def apply(balances: dict, msgs: list):
    """Apply requests to ``balances`` (in place): the balance updates to
    send, their keys, and the subscription's next position per partition."""
    values, keys, positions = [], [], {}
    for m in msgs:
        r = json.loads(m.value)
        balance = balances[r["account"]] = balances[r["account"]] + r["amount"]
        values.append(json.dumps({"request": r["id"], "account": r["account"], "amount": r["amount"],
                                  "balance": balance}, separators=(",", ":")).encode())
        keys.append(m.key)
        positions[m.partition] = max(positions.get(m.partition, 0), m.offset + 1)
    return values, keys, positions


def worker(data: str, seed: int, requests: int, run: int, report) -> None:
    broker = txmq.Broker(data, fsync=FSYNC)
    for topic in (REQUESTS, BALANCES):
        if topic not in broker.topics():
            broker.create_topic(topic, PARTITIONS)
    bank = _Bank(broker, seed, requests, run)
    report.line("READY", {"run": run, "recovered": broker.stats()["transactions"]["recovered"],
                          "open_transactions": len(broker.transactions())})
    starts = bank.resume_points()
    bank.produced = sum(starts.values())
    stop_status = threading.Event()
    report.every(bank.status, stop_status)
    clients = [bank._thread(bank.teller, c, starts[c]) for c in bank.ops if c != TRANSFER_CLIENT]
    clients.append(bank._thread(bank.transfers, starts[TRANSFER_CLIENT]))
    readers = [bank._thread(bank.monitor), bank._thread(bank.auditor), bank._thread(bank.processor)]
    for t in clients:
        t.join()
    bank.clients_done.set()
    for t in readers:
        t.join()
    stop_status.set()
    if bank.errors:
        raise bank.errors[0]
    broker.close()
    report.line("DONE", bank.status())


# -- verification (in the demo's process, the worker gone) ------------------------------------------

def verify(broker) -> dict:
    """Recompute the bank from the committed requests and compare with
    what the processor committed."""
    committed = [json.loads(m.value) for m in drain(broker, REQUESTS, "bank.verify-rc", "read_committed")]
    everything = [json.loads(m.value) for m in drain(broker, REQUESTS, "bank.verify-ru", "read_uncommitted")]
    updates = [json.loads(m.value) for m in drain(broker, BALANCES, "bank.verify-rc", "read_committed")]

    want = {a: 0 for a in ACCOUNTS}
    for r in committed:
        want[r["account"]] += r["amount"]
    got = {a: 0 for a in ACCOUNTS}
    times: dict = {}
    for u in updates:
        got[u["account"]] = u["balance"]
        times[u["request"]] = times.get(u["request"], 0) + 1
    committed_ids = {r["id"] for r in committed}
    legs: dict = {}
    for r in committed:
        if r["transfer"]:
            legs.setdefault(r["transfer"], set()).add(r["id"].rsplit(":", 1)[1])
    intended = {r["transfer"] for r in everything if r["transfer"] and r["intent"] == "commit"}
    return {
        "requests_committed": len(committed),
        "requests_in_log": len(everything),
        "applied_once": sum(1 for rid in committed_ids if times.get(rid) == 1),
        "applied_twice": sum(1 for n in times.values() if n > 1),
        "applied_not_committed": sum(1 for rid in times if rid not in committed_ids),
        "aborted_on_purpose_in_log": len({r["transfer"] for r in everything if r["intent"] == "abort"}),
        "aborted_on_purpose_committed": sum(1 for r in committed if r["intent"] == "abort"),
        "transfers_committed": len(legs),
        "transfers_whole": sum(1 for s in legs.values() if s == {"debit", "credit"}),
        "transfers_cut_by_kill": len(intended - set(legs)),
        "accounts": len(ACCOUNTS),
        "accounts_matching": sum(1 for a in ACCOUNTS if got[a] == want[a]),
        "reserves_expected": sum(want.values()),
        "reserves_got": sum(got.values()),
        "processor_lag": sum(broker.consumer_lag(REQUESTS, PROCESSOR).values()),
    }
