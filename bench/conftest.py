"""Benchmark harness: every txmq figure is paired with a baseline measured in
the same run, and the ratio of the two is printed (and written to
``bench/results.json``) at the end of the session.

A benchmark test calls the ``measure`` fixture instead of ``benchmark``
directly: it runs ``benchmark.pedantic`` (fixed rounds, no calibration, so
both sides of a comparison do the same amount of work) and records the
median seconds per round under ``(comparison, side)``. ``COMPARISONS`` says
which two sides form a ratio and what the goal is; goals are reported,
never asserted here. ``bench/gates.toml`` holds the bounds that
``txmq bench --gate`` enforces on the same ratios (and on the counts of
``test_bench_counts.py``): the session writes each one's figure (median
ratio and the range of the per-round ratios) to ``results.json`` under
``figures`` for it.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass

import pytest

from txmq.testing.gates import Figure, ratio_figure

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS_PATH = os.path.join(HERE, "results.json")


@dataclass(frozen=True)
class Comparison:
    """``ratio = value(numerator) / value(denominator)`` where value is a
    throughput (ops/s) or, with ``kind="time"``, a median time in seconds."""

    name: str
    numerator: str
    denominator: str
    goal: float | None    # None: reported for information, no goal
    goal_op: str          # ">=" or "<="
    kind: str = "rate"    # "rate" (ops/s) or "time" (seconds)
    note: str = ""


COMPARISONS = [
    Comparison("send_batch 1000x100B list, never vs SQLite", "txmq list", "sqlite", 20, ">=",
               note="goal >= 20x SQLite WAL synchronous=OFF"),
    Comparison("send_batch 1000x100B arrow, never vs SQLite", "txmq arrow", "sqlite", 20, ">=",
               note="goal >= 20x SQLite WAL synchronous=OFF"),
    Comparison("send_batch 1000x100B list, never vs os.write", "txmq list", "os.write", 0.5, ">=",
               note="goal >= 50% of os.write"),
    Comparison("send_batch 1000x100B arrow, never vs os.write", "txmq arrow", "os.write", 0.5, ">=",
               note="goal >= 50% of os.write"),
    Comparison("send_batch 1000x1KiB list, always vs write+fsync", "txmq list", "os.write+fsync",
               0.5, ">=", note="goal >= 50% of os.write + os.fsync per batch"),
    Comparison("send_batch 1000x1KiB arrow, always vs write+fsync", "txmq arrow", "os.write+fsync",
               0.5, ">=", note="goal >= 50% of os.write + os.fsync per batch"),
    Comparison("send() 100B vs confluent_kafka produce()", "txmq send", "kafka produce", 0.5, ">=",
               note="goal >= 0.5x the produce() call rate"),
    Comparison("receive_many(1000)+ack(list) vs SQLite read_batch", "txmq receive_many", "sqlite",
               10, ">=", note="goal >= 10x"),
    Comparison("receive_batch(1000)+ack(batch) vs SQLite read_batch", "txmq receive_batch",
               "sqlite", 10, ">=", note="goal >= 10x"),
    Comparison("sustained send_batch 1000x1KiB arrow (300 MiB/round, rolls) vs os.write",
               "txmq arrow", "os.write", None, ">=",
               note="no goal: shows the cost of rolling 256 MiB segments"),
    Comparison("reopen after SIGKILL: 2 GiB / 100 MiB", "2GiB", "100MiB", 2, "<=", kind="time",
               note="goal: open time(2 GiB) <= 2x open time(100 MiB)"),
    # -- transactions (test_bench_txn.py) --
    Comparison("send_batch 100x1KiB, commit every 100 ms vs none, never", "txn 100ms", "plain",
               0.98, ">=", note="goal >= 98% of the non-transactional throughput"),
    Comparison("send_batch 100x1KiB, commit every 100 ms vs none, commit", "txn 100ms", "plain",
               0.98, ">=", note="goal >= 98% of the non-transactional throughput"),
    Comparison("consume-transform-produce 100/txn, never vs SQLite OFF", "txmq", "sqlite", 10, ">=",
               note="goal >= 10x SQLite WAL synchronous=OFF, one SQLite transaction per 100"),
    Comparison("consume-transform-produce 100/txn arrow, never vs SQLite OFF", "txmq arrow", "sqlite",
               10, ">=", note="goal >= 10x: receive_batch + send_batch(array) + ack(batch) in the txn"),
    Comparison("consume-transform-produce 100/txn, commit vs SQLite FULL", "txmq", "sqlite", 5, ">=",
               note="goal >= 5x SQLite WAL synchronous=FULL"),
    Comparison("begin+send+commit, 100k open / 10 open txns", "100k open", "10 open", 0.9, ">=",
               note="goal: commit throughput with 100,000 open >= 90% of that with 10"),
    Comparison("receive_many(100)+ack, read_committed (10% aborted) / read_uncommitted",
               "read_committed", "read_uncommitted", 0.95, ">=", note="goal >= 95%"),
    Comparison("receive_batch+ack, read_committed (10% aborted) / read_uncommitted",
               "read_committed", "read_uncommitted", 0.95, ">=", note="goal >= 95%"),
    Comparison("reopen after SIGKILL: 1M txns / 10k txns", "1M txns", "10k txns", 2, "<=", kind="time",
               note="goal: open time(1,000,000 transactions) <= 2x open time(10,000)"),
    Comparison("reopen after SIGKILL: 1.03M txns (another phase) / 10k txns", "1.02M txns",
               "10k txns", 2, "<=", kind="time",
               note="the same goal at another phase of the compaction and snapshot cycles"),
    # -- idempotent producers (test_bench_producers.py) --
    Comparison("send_batch 100x100B list, named vs anonymous producer, never", "named", "anonymous",
               0.95, ">=", note="goal >= 95% of an anonymous producer's throughput"),
    Comparison("send_batch 1000x100B list, named vs anonymous producer, never", "named", "anonymous",
               0.95, ">=", note="goal >= 95% of an anonymous producer's throughput"),
    Comparison("send_batch 100x100B list, named vs anonymous producer, commit", "named", "anonymous",
               0.95, ">=", note="goal >= 95% of an anonymous producer's throughput"),
    Comparison("send_batch 100x100B, 10k live producer ids / 1 on the partition", "10k ids", "1 id",
               0.95, ">=", note="goal: throughput with 10,000 live ids >= 95% of that with 1"),
    Comparison("send_batch 100x100B sequence=, 10k live producer ids / 1", "10k ids", "1 id",
               0.95, ">=", note="the same goal, explicit sequences (the dedup-cache check)"),
    Comparison("send_batch 100x100B, 10k live ids / 1, 10k producer objects both", "10k ids", "1 id",
               0.95, ">=", note="the table alone: both sides rotate over 10,000 producer objects"),
    # -- half messages (test_bench_half.py) --
    Comparison("send_in_transaction (local txn commits) vs send(), 100B, never", "send_in_transaction",
               "send", 0.5, ">=", note="goal >= 50% of the plain send() rate"),
    Comparison("send_in_transaction (local txn commits) vs send(), 100B, commit", "send_in_transaction",
               "send", None, ">=", note="for information: two fsyncs per half message, none per send()"),
    Comparison("check scan of 1M state records: StateTable.due vs Python loop", "numpy scan", "python loop", 50,
               ">=", note="goal >= 50x a Python loop over the same records"),
]

# comparison group -> the COMPARISONS rows it feeds
GROUPS = {
    "send_batch_100B_never": COMPARISONS[0:4],
    "send_batch_1KiB_always": COMPARISONS[4:6],
    "send_one": COMPARISONS[6:7],
    "receive_ack": COMPARISONS[7:9],
    "send_batch_sustained": COMPARISONS[9:10],
    "reopen": COMPARISONS[10:11],
    "txn_100ms_never": COMPARISONS[11:12],
    "txn_100ms_commit": COMPARISONS[12:13],
    "ctp_never": COMPARISONS[13:15],
    "ctp_commit": COMPARISONS[15:16],
    "txn_open": COMPARISONS[16:17],
    "rc_aborted_receive_many": COMPARISONS[17:18],
    "rc_aborted_receive_batch": COMPARISONS[18:19],
    "txn_reopen": COMPARISONS[19:21],
    "producers_named_100_never": COMPARISONS[21:22],
    "producers_named_1000_never": COMPARISONS[22:23],
    "producers_named_100_commit": COMPARISONS[23:24],
    "producers_live_ids": COMPARISONS[24:25],
    "producers_live_ids_explicit": COMPARISONS[25:26],
    "producers_live_ids_objects": COMPARISONS[26:27],
    "half_send_never": COMPARISONS[27:28],
    "half_send_commit": COMPARISONS[28:29],
    "half_scan": COMPARISONS[29:30],
}


# The README's consume-transform-produce loop message by message (the
# transactional hot path's headline figure), beside the batch loop of ctp_never.
COMPARISONS.append(Comparison(
    "consume-transform-produce 100/txn per-message send+ack, never vs SQLite OFF", "txmq per-message",
    "sqlite", 2, ">=", note="goal >= 2x SQLite WAL synchronous=OFF: send(txn=) and ack(m, txn=) per message"))
GROUPS["ctp_never"].append(COMPARISONS[-1])

# Commits that share one flush of the coordinator log: pipelined by one
# thread with commit_async, or made by four threads at once.
COMPARISONS.append(Comparison(
    "consume-transform-produce 100/txn, commit_async pipelined, commit vs SQLite FULL", "txmq pipelined",
    "sqlite", 4, ">=", note="goal >= 4x SQLite WAL synchronous=FULL: commit_async, futures awaited per round"))
GROUPS["ctp_commit"].append(COMPARISONS[-1])
COMPARISONS.append(Comparison(
    "consume-transform-produce 100/txn, 4 threads, commit vs SQLite FULL", "txmq 4 threads",
    "sqlite", 4, ">=", note="goal >= 4x SQLite WAL synchronous=FULL: four threads, one shared subscription"))
GROUPS["ctp_commit"].append(COMPARISONS[-1])

# send() of a batching producer: like produce(), it returns with the message
# queued for a batch (the round ends with a flush).
COMPARISONS.append(Comparison(
    "send() 100B, batching producer vs confluent_kafka produce()", "txmq send batching", "kafka produce", 1,
    ">=", note="goal >= 1x the produce() call rate: both return with the message queued for a batch"))
GROUPS["send_one"].append(COMPARISONS[-1])


def add_comparison(group: str, *comparisons: Comparison) -> None:
    """Register the comparisons a benchmark module's group feeds (called
    when the module is imported; importing it twice adds them once)."""
    if group not in GROUPS:
        COMPARISONS.extend(comparisons)
        GROUPS[group] = list(comparisons)


class Results:
    """Medians collected over the session: group -> side -> record."""

    def __init__(self):
        self.sides: dict[str, dict[str, dict]] = {}
        self.counts: dict[str, dict] = {}

    def add(self, group: str, side: str, median_s: float, ops_per_round: int, unit: str,
            rounds: int, extra: dict | None = None, round_s: list | None = None):
        """``round_s``: the seconds of every timed round, in order (for the
        range of the per-round ratios)."""
        self.sides.setdefault(group, {})[side] = {
            "median_s_per_round": median_s,
            "ops_per_round": ops_per_round,
            "unit": unit,
            "rounds": rounds,
            "rate_per_s": ops_per_round / median_s if median_s > 0 else None,
            "round_s": list(round_s or ()),
            **(extra or {}),
        }

    def add_count(self, name: str, value: float, raw: float):
        """A machine-independent count (``test_bench_counts.py``): ``value``
        is what the gate compares, ``raw`` the unrounded measurement."""
        self.counts[name] = {"value": value, "raw": raw}

    def figures(self) -> dict:
        """``{gate name: Figure}``: every comparison with both sides, and every count."""
        out = {}
        for c, num, den, _, _ in self.rows():
            out[c.name] = ratio_figure(num["round_s"], den["round_s"], num["median_s_per_round"],
                                       den["median_s_per_round"], num["ops_per_round"], den["ops_per_round"],
                                       c.kind)
        for name, rec in self.counts.items():
            out[name] = Figure(rec["value"])
        return out

    def rows(self):
        for group, comps in GROUPS.items():
            sides = self.sides.get(group, {})
            for c in comps:
                num, den = sides.get(c.numerator), sides.get(c.denominator)
                if num is None or den is None:
                    continue
                if c.kind == "time":
                    ratio = num["median_s_per_round"] / den["median_s_per_round"]
                else:
                    ratio = num["rate_per_s"] / den["rate_per_s"]
                if c.goal is None:
                    met = None
                else:
                    met = ratio >= c.goal if c.goal_op == ">=" else ratio <= c.goal
                yield c, num, den, ratio, met


_RESULTS = Results()


@pytest.fixture(scope="session")
def results() -> Results:
    return _RESULTS


@pytest.fixture
def measure(benchmark, results, request):
    """``measure(group, side, fn, ops_per_round=, unit=, rounds=, warmup=, setup=)``:
    time ``fn`` with pytest-benchmark and record its median."""

    def run(group, side, fn, *, ops_per_round, unit, rounds, warmup=3, setup=None, extra=None):
        benchmark.group = group
        benchmark.extra_info.update({"side": side, "ops_per_round": ops_per_round, "unit": unit})
        kwargs = dict(rounds=rounds, warmup_rounds=warmup, iterations=1)
        if setup is not None:
            kwargs["setup"] = setup
            kwargs.pop("iterations")
        out = benchmark.pedantic(fn, **kwargs)
        stats = getattr(benchmark, "stats", None)
        if stats is not None:  # None under --benchmark-disable
            results.add(group, side, stats.stats.median, ops_per_round, unit, rounds,
                        {"nodeid": request.node.nodeid, **(extra or {})}, stats.stats.data)
        return out

    return run


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "reopen: the reopen-after-SIGKILL benchmark (writes ~2.1 GiB; "
                   "skip with -m 'not reopen')")


def pytest_collection_modifyitems(session, config, items):
    # The reopen benchmark leaves gigabytes of writeback behind it: run it last.
    items.sort(key=lambda item: item.get_closest_marker("reopen") is not None)


def _fmt_rate(rec) -> str:
    r = rec["rate_per_s"]
    unit = rec["unit"]
    if unit == "B":
        return f"{r / 2**20:,.0f} MiB/s"
    if unit == "s":
        return f"{rec['median_s_per_round'] * 1000:,.1f} ms"
    return f"{r:,.0f} {unit}/s"


def _machine() -> dict:
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu": model, "python": platform.python_version(),
            "kernel": platform.release()}


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _RESULTS.sides and not _RESULTS.counts:
        return
    tr = terminalreporter
    tr.section("txmq vs baselines (medians; goals reported, not asserted)")
    if os.environ.get("TXMQ_DEBUG"):
        tr.write_line("WARNING: TXMQ_DEBUG is set; debug checks slow txmq down.")
    rows = []
    for c, num, den, ratio, met in _RESULTS.rows():
        rows.append({
            "comparison": c.name, "txmq_side": c.numerator, "baseline_side": c.denominator,
            "txmq": _fmt_rate(num), "baseline": _fmt_rate(den),
            "ratio": round(ratio, 3),
            "goal": "info" if c.goal is None else f"{c.goal_op} {c.goal:g}", "met": met,
        })
    w = max(len(r["comparison"]) for r in rows) if rows else 10
    tr.write_line(f"{'comparison':<{w}}  {'txmq':>18}  {'baseline':>18}  {'ratio':>8}  {'goal':>6}  met")
    for r in rows:
        tr.write_line(f"{r['comparison']:<{w}}  {r['txmq']:>18}  {r['baseline']:>18}  "
                      f"{r['ratio']:>8.3g}  {r['goal']:>6}  {'-' if r['met'] is None else 'yes' if r['met'] else 'NO'}")
    for name, rec in _RESULTS.counts.items():
        tr.write_line(f"count: {name}: {rec['value']:g} (measured {rec['raw']:.4g})")
    figures = {name: vars(f) for name, f in _RESULTS.figures().items()}
    payload = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": _machine(),
               "comparisons": rows, "sides": _RESULTS.sides, "counts": _RESULTS.counts,
               "figures": figures}
    with open(RESULTS_PATH, "w") as f:
        json.dump(payload, f, indent=2)
    tr.write_line(f"written {RESULTS_PATH}")
