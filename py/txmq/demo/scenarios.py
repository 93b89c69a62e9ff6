"""The demo's run: the two scenarios txmq was built for, on a data
directory, each with a real ``kill -9`` part-way, then checks that
recompute every result from the log (``txmq demo`` prints them:
:mod:`txmq.cli.demo`).

1. The bank (:mod:`txmq.demo.bank`): tellers and a transfer client
   write requests; a read_uncommitted monitor sees transfers while they
   are open and is never held back by them; a read_committed auditor
   with out-of-order delivery gets committed requests past a transfer
   held open, as they come; a read_committed processor applies each
   committed request to the balances exactly once
   (consume-process-produce in one transaction), and waits behind the
   open transfer. The process running it all is SIGKILLed mid-run and
   started again.
2. The window aggregation (:mod:`txmq.demo.windows`): a
   ``txmq.functions`` function sums two input topics into per-window
   totals, in a process that is SIGKILLed mid-run and started again.

Then a Spark job (:mod:`txmq.demo.spark`) totals the window output per product
and writes it back into txmq as one transaction, checked against the same
totals recomputed from the log.

Progress is reported through ``stage(label, total)``, a factory of objects
with ``to(done, detail)``, ``end(line)`` and ``done``; messages through
``say(line)``. Nothing here prints or decides an exit code.
"""

from __future__ import annotations

import os
import random
import shutil
import time

import txmq
from txmq.storage.datadir import DATA_DIR_ENTRIES
from txmq.demo import bank as demo_bank, spark as demo_spark, windows as demo_windows
from txmq.demo.worker import run_and_kill

SIZES = {"small": 3000, "medium": 20_000, "large": 100_000}
MIN_SIZE = 100
DEFAULT_DIR = "txmq-data"
# What a data directory of an earlier demo holds, so it may be replaced.
DEMO_TOPICS = {demo_bank.REQUESTS, demo_bank.BALANCES, *demo_windows.INPUTS, demo_windows.OUTPUT,
               f"{demo_windows.NAME}-state", f"{demo_windows.NAME}-dlq", "demo-orders"}


def parse_size(text: str) -> int:
    """``small``, ``medium``, ``large`` or a number of bank requests."""
    if text in SIZES:
        return SIZES[text]
    try:
        n = int(text.replace("_", ""))
    except ValueError:
        n = 0
    if n < MIN_SIZE:
        raise ValueError(f"expected small, medium, large or a number >= {MIN_SIZE}, not {text!r}")
    return n


class DemoError(Exception):
    """The demo cannot run: its directory is not its own (``run_failed``
    False), or a scenario's worker failed (``run_failed`` True)."""

    def __init__(self, message: str, run_failed: bool = False):
        super().__init__(message)
        self.run_failed = run_failed


def prepare(data_dir: str) -> bool:
    """Make ``data_dir`` an empty directory. One left by an earlier demo is
    replaced; anything else is refused. Returns whether one was replaced."""
    if not os.path.exists(data_dir):
        os.makedirs(data_dir)
        return False
    if not os.path.isdir(data_dir):
        raise DemoError(f"{data_dir} is not a directory: pass another --dir")
    entries = set(os.listdir(data_dir))
    if not entries:
        return False
    topics = os.path.join(data_dir, "topics")
    if (entries <= DATA_DIR_ENTRIES and os.path.isdir(topics)
            and set(os.listdir(topics)) <= DEMO_TOPICS):
        shutil.rmtree(data_dir)
        os.makedirs(data_dir)
        return True
    raise DemoError(f"{data_dir} exists and is not the data directory of an earlier demo: "
                         f"pass another --dir (the demo replaces only its own data)")


def _bank(data_dir: str, seed: int, size: int, rng: random.Random, stage) -> dict:
    kill_at = int(size * rng.uniform(0.35, 0.6))
    st = stage("bank", size)

    def progress(s):
        if s:
            m = s["monitor"]
            st.to(s["produced"], f"run {s['run']}: applied {s['applied']:,}, monitor saw "
                                 f"{m['legs_seen_open']:,} open transfer legs")

    runs = run_and_kill(["bank", data_dir, seed, size],
                        lambda s: s["produced"] >= kill_at and s["applied"] > 0, progress)
    k = runs["killed_status"]
    if runs["killed"]:
        rec = runs["restart_ready"]["recovered"]
        st.end(f"bank: {size:,} requests; the process (clients, monitor, auditor, processor) SIGKILLed after "
               f"{k.get('produced', 0):,} sent and "
               f"{k.get('applied', 0):,} applied; the restart aborted {rec['aborted']} open "
               f"transaction(s) and carried on")
    else:
        st.end("bank: the run finished before the kill point; nothing was killed")
    return runs


def _windows(data_dir: str, seed: int, size: int, rng: random.Random, stage) -> dict:
    events = size
    st = stage("windows: inputs", events)
    with txmq.Broker(data_dir, fsync=demo_windows.FSYNC) as broker:
        sent = demo_windows.produce_inputs(broker, seed, events, lambda n: st.to(st.done + n))
    st.end(f"windows: {sent['events']:,} orders sent to {' and '.join(demo_windows.INPUTS)} "
           f"({sent['aborted_events']} more in aborted transactions)")
    kill_at = int(events * rng.uniform(0.35, 0.6))
    st = stage("windows: function", events)

    def progress(s):
        if s:
            st.to(events - s["lag"], f"run {s['run']}")

    runs = run_and_kill(["windows", data_dir], lambda s: events - s["lag"] >= kill_at, progress)
    if runs["killed"]:
        k = runs["killed_status"]
        m = runs["done"]["metrics"]
        st.end(f"windows: function SIGKILLed after {events - k['lag']:,} of {events:,} orders; the restart "
               f"restored the state of {m['restores']} lane(s) and emitted {m['windows_emitted']:,} more windows")
    else:
        st.end("windows: the function finished before the kill point; nothing was killed")
    runs["sent"] = sent
    return runs


def _check(scenario: str, name: str, expected, got, ok: bool) -> dict:
    return {"scenario": scenario, "check": name, "expected": expected, "got": got,
            "result": "PASS" if ok else "FAIL"}


def _checks(bank_runs: dict, bank: dict, win_runs: dict, win: dict) -> list:
    n = lambda v: f"{v:,}"                  # noqa: E731
    k = bank_runs["killed_status"]
    mon = {key: 0 for key in ("legs_seen_open", "past_max_read_position")}
    for s in (k, bank_runs["done"]):        # each run counts its own
        for key in mon:
            mon[key] += s.get("monitor", {}).get(key, 0)
    total_applied = bank["applied_once"] + bank["applied_twice"] + bank["applied_not_committed"]
    killed_mid = bank_runs["killed"] and 0 < k.get("applied", 0) < total_applied
    held = _held_check(bank_runs["done"].get("hold"))
    wk = win_runs["killed_status"]
    w_done = win["events_committed"] - wk.get("lag", win["events_committed"])
    return [
        _check("bank", "bank process SIGKILLed mid-run, then restarted", "killed with work left",
               f"killed after {n(k.get('applied', 0))} of {n(total_applied)} applied" if bank_runs["killed"]
               else "not killed", killed_mid),
        _check("bank", "monitor (read_uncommitted) saw transfer legs while open", "> 0",
               n(mon["legs_seen_open"]), mon["legs_seen_open"] > 0),
        _check("bank", "monitor read past an open transfer (maxReadPosition)", "> 0",
               n(mon["past_max_read_position"]), mon["past_max_read_position"] > 0),
        _check("bank", "committed requests applied exactly once", n(bank["requests_committed"]),
               n(bank["applied_once"]), bank["applied_once"] == bank["requests_committed"]),
        _check("bank", "requests applied more than once", "0", n(bank["applied_twice"]),
               bank["applied_twice"] == 0),
        _check("bank", "uncommitted requests applied", "0", n(bank["applied_not_committed"]),
               bank["applied_not_committed"] == 0),
        _check("bank", "transfers aborted on purpose, visible committed",
               f"0 of {bank['aborted_on_purpose_in_log']}", n(bank["aborted_on_purpose_committed"]),
               bank["aborted_on_purpose_committed"] == 0 and bank["aborted_on_purpose_in_log"] > 0),
        _check("bank", "committed transfers with both legs", n(bank["transfers_committed"]),
               n(bank["transfers_whole"]), bank["transfers_whole"] == bank["transfers_committed"] > 0),
        _check("bank", "balances = recomputation from committed requests",
               f"{bank['accounts']} accounts, total {n(bank['reserves_expected'])}",
               f"{bank['accounts_matching']} match, total {n(bank['reserves_got'])}",
               bank["accounts_matching"] == bank["accounts"]
               and bank["reserves_got"] == bank["reserves_expected"]),
        _check("bank", "processor lag at the end", "0", n(bank["processor_lag"]), bank["processor_lag"] == 0),
        held,
        _check("windows", "function SIGKILLed mid-run, then restarted", "killed with work left",
               f"killed after {n(w_done)} of {n(win['events_committed'])} orders" if win_runs["killed"]
               else "not killed", win_runs["killed"] and 0 < w_done < win["events_committed"]),
        _check("windows", "windows emitted (recomputed from the inputs)", n(win["windows_expected"]),
               n(win["windows_emitted"]), win["windows_emitted"] == win["windows_expected"] > 0
               and win["windows_unexpected"] == 0),
        _check("windows", "windows emitted more than once", "0", n(win["windows_twice"]), win["windows_twice"] == 0),
        _check("windows", "window totals = recomputation", n(win["windows_expected"]),
               n(win["windows_matching"]), win["windows_matching"] == win["windows_expected"]),
        _check("windows", "orders counted in emitted windows", n(win["events_counted_expected"]),
               n(win["events_counted_got"]), win["events_counted_got"] == win["events_counted_expected"]),
        _check("windows", "orders of aborted transactions seen by the function", "0",
               n(win["aborted_events_counted"]), win["aborted_events_counted"] == 0),
        _check("windows", "function lag at the end", "0", n(win["function_lag"]), win["function_lag"] == 0),
    ]


def _held_check(hold) -> dict:
    """The row of the long-held transfer (the finishing run's): the teller
    requests published while it was open reach the out-of-order auditor
    as they come (p99 under half the hold) and the processor, which reads
    in offset order, only once it ends (its longest delay at least 80 % of
    the hold). The bounds leave room for a loaded machine; a reader that
    waited, or one that did not, misses them by the whole hold."""
    name = "delay past a transfer held open: out-of-order auditor vs processor"
    want_ms, wait_ms = 500 * (hold or {}).get("held_s", 1.0), 800 * (hold or {}).get("held_s", 1.0)
    expected = f"p99 < {want_ms:,.0f} ms vs max >= {wait_ms:,.0f} ms"
    if not hold or not hold["auditor_requests"] or not hold["processor_requests"]:
        return _check("bank", name, expected, "not measured (no request while it was open)", False)
    got = (f"p99 {hold['auditor_p99_ms']:,} ms vs max {hold['processor_max_ms']:,} ms "
           f"({hold['auditor_requests']:,} requests in {hold['held_s']:g} s)")
    return _check("bank", name, expected, got, hold["auditor_p99_ms"] < want_ms and hold["processor_max_ms"] >= wait_ms)


def _spark(data_dir: str, enabled: bool, say) -> tuple:
    """The Spark stage: (check rows, what to put in the JSON)."""
    if not enabled:
        return [], {"ran": False, "reason": "--no-spark"}
    missing = demo_spark.missing()
    if missing:
        return [], {"ran": False, "reason": f"not installed: {', '.join(missing)}"}
    say(f"spark: a local[2] Spark job reads {demo_windows.OUTPUT}, totals each product over its windows "
        f"and writes them to {demo_spark.OUTPUT} ...")
    r = demo_spark.run(data_dir)
    if "error" in r:
        say(f"spark: could not run ({r['error']}); the demo's own checks stand")
        return ([_check("spark", "product totals written by Spark", "-", "not run", True) | {"result": "SKIP"}],
                {"ran": False, "reason": r["error"]})
    with txmq.Broker(data_dir, fsync="commit") as broker:
        want = demo_spark.expected_totals(demo_bank.drain(broker, demo_windows.OUTPUT, "shop.verify"))
        got = demo_spark.written_totals(demo_bank.drain(broker, demo_spark.OUTPUT, "shop.verify"))
    n = lambda x: f"{x:,}"                                                    # noqa: E731
    twice = sum(1 for v in got.values() if len(v) > 1)
    matching = sum(1 for k, v in want.items() if got.get(k) == [v])
    return ([_check("spark", f"window rows read by Spark from {demo_windows.OUTPUT}",
                    n(sum(w for _, _, w in want.values())), n(r["count"]),
                    r["count"] == sum(w for _, _, w in want.values())),
             _check("spark", f"products written by Spark to {demo_spark.OUTPUT} (one transaction)", n(len(want)),
                    n(len(got)), len(got) == len(want) and not set(got) - set(want)),
             _check("spark", "products written twice", "0", n(twice), twice == 0),
             _check("spark", "product totals matching the recomputation from the log", n(len(want)), n(matching),
                    matching == len(want))],
            {"ran": True, **r})


def run(data_dir: str = DEFAULT_DIR, size: int = SIZES["small"], *, seed: int | None = None, keep: bool = True,
        spark: bool = True, stage, say) -> dict:
    """Run both scenarios (and the Spark read when ``spark``) on
    ``data_dir`` and return ``{"ok", "seed", "size", "dir", "kept",
    "seconds", "checks", "bank", "windows", "spark"}``: ``checks`` are rows
    ``{"scenario", "check", "expected", "got", "result"}`` (PASS, FAIL or
    SKIP). Raises :class:`DemoError` when the directory is not the demo's
    or a scenario's worker failed."""
    seed = random.randrange(1 << 31) if seed is None else seed
    rng = random.Random(seed)
    replaced = prepare(data_dir)
    where = os.path.abspath(data_dir)
    say(f"txmq {txmq.__version__} demo on {where} ({'replaced an earlier demo' if replaced else 'new'}), "
        f"size {size:,}, seed {seed}")
    t0 = time.monotonic()
    try:
        bank_runs = _bank(data_dir, seed, size, rng, stage)
        win_runs = _windows(data_dir, seed, size, rng, stage)
    except RuntimeError as e:           # a worker failed: no result to check
        raise DemoError(f"the demo could not run: {e}", run_failed=True) from None
    with txmq.Broker(data_dir, fsync="commit") as broker:
        bank = demo_bank.verify(broker)
        win = demo_windows.verify(broker)
    checks = _checks(bank_runs, bank, win_runs, win)
    spark_rows, spark_info = _spark(data_dir, spark, say)
    checks += spark_rows
    if not keep:
        shutil.rmtree(data_dir, ignore_errors=True)
    return {"ok": all(c["result"] != "FAIL" for c in checks), "seed": seed, "size": size, "dir": where,
            "kept": keep, "seconds": round(time.monotonic() - t0, 1), "checks": checks,
            "bank": {**bank, "runs": bank_runs}, "windows": {**win, "runs": win_runs}, "spark": spark_info}
