"""The performance gates can fail: the evaluator on synthetic figures, the
count gates of ``bench/gates.toml`` measured for real (and with a planted
regression of each kind), the ratio fixture on a fake clock, and
``txmq bench --gate`` end to end over a planted figure. Nothing here is
timed: a ratio's figures are synthetic or come from a fake clock.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import textwrap

import pytest

import txmq
from txmq.testing import gates
from txmq.testing.counters import FlushCounter, count_blocks, count_calls
from txmq.testing.pytest_plugin import GateChecker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")
GATES_FILE = os.path.join(BENCH, "gates.toml")

pytestmark = pytest.mark.skipif(not os.path.isfile(GATES_FILE), reason="no bench/ directory")


@pytest.fixture(scope="module")
def counts_module():
    sys.path.insert(0, BENCH)
    try:
        import counts
        yield counts
    finally:
        sys.path.remove(BENCH)


# -- the evaluator ----------------------------------------------------------------------

FLOOR = gates.Gate("send() vs produce()", "ratio", gates.FLOOR, 0.25, ("t.py::test",))
CEILING = gates.Gate("reopen 2 GiB / 100 MiB", "ratio", gates.CEILING, 2.0, ("t.py::test",))


def fig(value, low=None, high=None):
    return gates.Figure(value, low if low is not None else value * 0.9, high or value * 1.1, 40)


def test_a_median_below_its_floor_twice_fails_naming_figure_floor_and_range():
    [v] = gates.evaluate([FLOOR], [{FLOOR.name: fig(0.21, 0.18, 0.24)}, {FLOOR.name: fig(0.22, 0.19, 0.23)}])
    assert not v.passed
    line = v.line()
    assert line.startswith("FAIL ratio 'send() vs produce()'")
    assert "0.21 (rounds p10-p90 0.18-0.24, 40 rounds); retried: 0.22 (rounds p10-p90 0.19-0.23" in line
    assert line.endswith("floor 0.25")
    assert "FAILED: 'send() vs produce()'" in gates.report([v])


def test_one_miss_is_retried_and_a_met_retry_passes():
    first = gates.evaluate([FLOOR, CEILING], [{FLOOR.name: fig(0.2), CEILING.name: fig(1.1)}])
    assert [v.passed for v in first] == [False, True]
    assert gates.retry_needed(first) == [FLOOR]
    # The retry session measures only the gate that missed.
    again = gates.evaluate([FLOOR, CEILING], [{FLOOR.name: fig(0.2), CEILING.name: fig(1.1)},
                                              {FLOOR.name: fig(0.3)}])
    assert all(v.passed for v in again) and gates.retry_needed(again) == []
    assert "retried: 0.3" in again[0].line()


def test_a_ceiling_fails_above_it_and_a_missing_figure_fails():
    [v] = gates.evaluate([CEILING], [{CEILING.name: fig(2.5)}, {CEILING.name: fig(2.4)}])
    assert not v.passed and "ceiling 2" in v.line()
    [v] = gates.evaluate([CEILING], [{CEILING.name: None}, {CEILING.name: None}])
    assert not v.passed and "no figure" in v.line()


def test_the_ratio_figure_is_the_ratio_of_medians_with_the_per_round_range():
    f = gates.ratio_figure([2.0, 4.0], [1.0, 1.0], 2.0, 1.0, 10, 10)     # rates: 5 vs 10 ops/s
    assert f.value == 0.5 and (f.low, f.high, f.rounds) == (0.25, 0.5, 2)
    # From the 10th to the 90th percentile: one outlying round does not widen it.
    num = [1.0] * 10 + [100.0]
    f = gates.ratio_figure(num, [1.0] * 11, 1.0, 1.0, 1, 1)
    assert f.value == 1.0 and (f.low, f.high, f.rounds) == (1.0, 1.0, 11)
    f = gates.ratio_figure([3.0], [1.5], 3.0, 1.5, 1, 1, kind="time")
    assert f.value == 2.0


@pytest.mark.parametrize("text,error", [
    ('[[ratio]]\ncomparison = "x"\ntests = ["a.py"]\n', "exactly one numeric floor or ceiling"),
    ('[[ratio]]\ncomparison = "x"\nfloor = 1\nceiling = 2\ntests = ["a.py"]\n', "exactly one"),
    ('[[count]]\nname = "x"\nfloor = 1\ntests = ["a.py"]\n', "a count is gated by a ceiling"),
    ('[[ratio]]\ncomparison = "x"\nfloor = 1\n', "needs tests"),
    ('[[ratio]]\ncomparison = "x"\nfloor = 1\ntests = ["a.py"]\nflor = 2\n', "unknown keys"),
    ('[[count]]\nname = "x"\nceiling = 1\ntests = ["a"]\n[[count]]\nname = "x"\nceiling = 1\ntests = ["a"]\n',
     "gated twice"),
])
def test_a_malformed_gates_file_is_refused(text, error):
    with pytest.raises(gates.GateFileError, match=error):
        gates.parse(text)


# -- bench/gates.toml itself --------------------------------------------------------------

def _test_functions(path) -> set:
    with open(path) as f:
        return {n.name for n in ast.parse(f.read()).body if isinstance(n, ast.FunctionDef)}


def test_every_gate_names_tests_that_exist_and_a_comparison_the_benchmarks_record():
    all_gates = gates.load(GATES_FILE)
    sources = "".join(open(os.path.join(BENCH, f)).read() for f in os.listdir(BENCH) if f.endswith(".py"))
    quick_files = set()
    for g in all_gates:
        for node in g.tests:
            path, _, rest = node.partition("::")
            assert os.path.isfile(os.path.join(BENCH, path)), (g.name, node)
            if rest:
                assert rest.split("[")[0] in _test_functions(os.path.join(BENCH, path)), (g.name, node)
            if g.quick:
                quick_files.add(path)
        if g.kind == "ratio":
            assert json.dumps(g.name) in sources, f"no benchmark records the comparison {g.name!r}"
    # The quick subset covers what CI must hold: produce, receive, the
    # transactional loop, half messages, reopen, and the counts.
    assert {"test_bench_send.py", "test_bench_receive.py", "test_bench_txn.py", "test_bench_half.py",
            "test_bench_counts.py"} <= quick_files
    assert any("reopen" in g.name for g in all_gates if g.quick)


def test_the_count_gates_hold_today_and_cover_every_count(tmp_path, counts_module):
    count_gates = {g.name: g for g in gates.load(GATES_FILE) if g.kind == "count"}
    measured = counts_module.measure_all(str(tmp_path))
    assert set(measured) == set(count_gates)
    verdicts = gates.evaluate(list(count_gates.values()),
                              [{name: gates.Figure(round(v)) for name, v in measured.items()}])
    assert all(v.passed for v in verdicts), gates.report(verdicts)
    # Exact: today's count is the ceiling, not a bound with room under it.
    assert all(v.figures[0].value == v.gate.bound for v in verdicts), gates.report(verdicts)


def _count_verdict(name, value):
    g = {g.name: g for g in gates.load(GATES_FILE)}[name]
    return gates.evaluate([g], [{name: gates.Figure(round(value))}])[0]


def test_a_planted_extra_flush_per_commit_fails_its_count_gate(tmp_path, monkeypatch, counts_module):
    commit = txmq.Transaction.commit
    marker = os.open(tmp_path / "extra", os.O_CREAT | os.O_WRONLY, 0o644)

    def commit_and_flush_again(self, *a, **kw):
        out = commit(self, *a, **kw)
        os.fdatasync(marker)
        return out

    monkeypatch.setattr(txmq.Transaction, "commit", commit_and_flush_again)
    name = "flushes per commit: consume-transform-produce, fsync=commit"
    v = _count_verdict(name, counts_module.flushes(str(tmp_path))[name])
    os.close(marker)
    assert not v.passed and v.line().startswith(f"FAIL count {name!r}: 2; ceiling 1")


def test_the_flush_counter_sees_the_msync_made_in_the_cython_core(tmp_path):
    with txmq.Broker(tmp_path / "d", fsync="always") as b:
        b.create_topic("t", 1)
        p = b.producer("t")
        p.send(b"x")
        with FlushCounter() as f:
            for _ in range(5):
                p.send(b"x")
    assert f.by_kind["msync"] == 5, f.by_kind


def test_a_planted_python_call_per_send_fails_its_count_gate(tmp_path, monkeypatch, counts_module):
    from txmq.client.producer import Producer
    send = Producer.send

    def wrapped(self, *a, **kw):
        return send(self, *a, **kw)

    monkeypatch.setattr(Producer, "send", wrapped)
    name = "python calls per send(txn=)"
    v = _count_verdict(name, counts_module.calls(str(tmp_path))[name])
    assert not v.passed and "FAIL count" in v.line()


def test_a_planted_object_per_received_message_fails_its_count_gate(tmp_path, monkeypatch, counts_module):
    from txmq.client.consumer import Consumer
    receive_many = Consumer.receive_many
    kept = []

    def receive_and_keep(self, *a, **kw):
        msgs = receive_many(self, *a, **kw)
        kept.extend(m.offset + (1 << 40) for m in msgs)     # one more int, one block, per message
        return msgs

    monkeypatch.setattr(Consumer, "receive_many", receive_and_keep)
    out = counts_module.blocks(str(tmp_path))
    name = "memory blocks held per received message (receive_many(1000))"
    v = _count_verdict(name, out[name])
    assert not v.passed and v.line().startswith(f"FAIL count {name!r}: 3;")
    # ... and what it keeps after the ack is a leak the other gate sees.
    name = "memory blocks left per message after receive_many(1000) + ack(list)"
    assert not _count_verdict(name, out[name]).passed


def test_count_helpers_count():
    def three():
        def f():
            pass
        f(), f(), f()

    assert count_calls(three) == 4
    kept, blocks = count_blocks(lambda: [object() for _ in range(100)])
    # tracemalloc sees every thread (the suite's Spark session has some):
    # hold this file's lines to the exact count.
    here = sum(n for where, n in blocks.where.items() if where.startswith("test_perf_gates.py:"))
    assert len(kept) == 100 and 100 <= here <= 102 and blocks.count >= here


# -- the ratio fixture, on a fake clock -----------------------------------------------------

class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class FakeBenchmark:
    """pytest-benchmark's pedantic protocol on a fake clock."""

    def __init__(self, clock):
        self.clock, self.extra_info, self.stats = clock, {}, None

    def pedantic(self, fn, setup, rounds, warmup_rounds):
        data = []
        for i in range(rounds + warmup_rounds):
            setup()
            t0 = self.clock()
            fn()
            if i >= warmup_rounds:
                data.append(self.clock() - t0)
        self.stats = type("S", (), {"stats": type("T", (), {"data": data})})


def checker(clock):
    bench = FakeBenchmark(clock)
    return GateChecker(lambda: bench, disabled=False, clock=clock), bench


def test_a_planted_slowdown_fails_the_ratio_gate_after_one_retry():
    clock = FakeClock()
    calls = {"subject": 0}

    def baseline():
        clock.now += 1.0

    def subject():                     # planted: 4x slower than the baseline
        calls["subject"] += 1
        clock.now += 4.0

    gate_checker, bench = checker(clock)
    with pytest.raises(pytest.fail.Exception) as e:
        gate_checker.ratio(gates.floor("pipeline vs list", 0.5), subject, baseline, rounds=10, warmup=2)
    assert calls["subject"] == 2 * 12                      # measured, then retried
    assert "FAIL ratio 'pipeline vs list': 0.25 (rounds p10-p90 0.25-0.25, 10 rounds); retried: 0.25" in str(e.value)
    assert "floor 0.5" in bench.extra_info["gate"]


def test_the_ratio_gate_passes_at_speed_and_judges_nothing_when_disabled():
    clock = FakeClock()

    def side():
        clock.now += 1.0

    gate_checker, _ = checker(clock)
    v = gate_checker.ratio(gates.floor("a vs b", 0.9), side, side, rounds=10, warmup=2)
    assert v.passed and len(v.figures) == 1
    ran = []
    disabled = GateChecker(lambda: pytest.fail("no benchmark under --benchmark-disable"), disabled=True)
    assert disabled.ratio(gates.floor("a vs b", 99), lambda: ran.append(1), lambda: ran.append(2)) is None
    assert ran == [2, 1]


# -- txmq bench --gate, end to end -------------------------------------------------------------

FAKE_CONFTEST = '''
import json, os

def pytest_terminal_summary(terminalreporter):
    # A planted figure in place of a measured one: the gate's plumbing, untimed.
    figures = json.load(open(os.path.join(os.path.dirname(__file__), "planted.json")))
    json.dump({"figures": figures}, open(os.path.join(os.path.dirname(__file__), "results.json"), "w"))
'''


@pytest.mark.parametrize("floor,code", [(0.2, 0), (0.3, 1)])
def test_bench_gate_exits_1_naming_the_gate_that_missed_twice(floor, code, tmp_path, capsys):
    pytest.importorskip("pytest_benchmark")
    from txmq.cli import main

    d = tmp_path / "bench"
    d.mkdir()
    (d / "conftest.py").write_text(FAKE_CONFTEST)
    (d / "test_bench_fake.py").write_text("def test_fake(benchmark):\n"
                                          "    benchmark.pedantic(lambda: None, rounds=1)\n")
    (d / "planted.json").write_text(json.dumps({"fake send": {"value": 0.25, "low": 0.2, "high": 0.3,
                                                              "rounds": 40}}))
    (d / "gates.toml").write_text(textwrap.dedent(f'''
        [[ratio]]
        comparison = "fake send"
        floor = {floor}
        tests = ["test_bench_fake.py::test_fake"]
        quick = true
    '''))
    assert main(["bench", "--gate", "--quick", "--bench-dir", str(d), "--no-progress"]) == code
    out, err = capsys.readouterr()
    if code:
        assert "FAIL ratio 'fake send': 0.25 (rounds p10-p90 0.2-0.3, 40 rounds); retried: 0.25" in out
        assert "retrying 1 gate(s) that missed: 'fake send'" in err
        assert "performance gate failed: 'fake send'" in err
    else:
        assert "ok   ratio 'fake send': 0.25" in out and "retrying" not in err
