"""pytest fixtures for gating code that embeds txmq the way txmq gates
itself (docs/GATES.md). Enable with ``pytest_plugins =
["txmq.testing.pytest_plugin"]`` in the root ``conftest.py`` (or ``-p
txmq.testing.pytest_plugin``).

- ``txmq_broker``: a :class:`txmq.Broker` on a temporary directory, closed
  after the test; ``@pytest.mark.txmq(fsync="commit", ...)`` passes
  keyword arguments to the broker (default ``fsync="never"``).
- ``txmq_gate``: ``txmq_gate.ratio(gate, subject, baseline, ...)`` times
  the two callables round by round, alternately, with pytest-benchmark,
  and fails the test when the median ratio misses the gate's bound twice
  (the first measurement and one retry); ``txmq_gate.count(gate, value)``
  fails it when a count is above its ceiling. Gates come from a TOML file
  (:func:`txmq.testing.gates.load`) or are built in place
  (:func:`txmq.testing.gates.floor`).

Under ``--benchmark-disable`` (a unit-test run) ``ratio`` runs each side
once and asserts nothing: timings are judged only in a benchmark run.
"""

from __future__ import annotations

import itertools
import time

import pytest

import txmq
from txmq.testing import gates as gatelib


def pytest_configure(config):
    config.addinivalue_line("markers", "txmq(**broker_kwargs): keyword arguments for the txmq_broker fixture")


@pytest.fixture
def txmq_broker(tmp_path, request):
    marker = request.node.get_closest_marker("txmq")
    kwargs = {"fsync": "never", **(marker.kwargs if marker else {})}
    broker = txmq.Broker(tmp_path / "txmq", **kwargs)
    yield broker
    broker.close()


class GateChecker:
    """What ``txmq_gate`` returns: one test's ratio and count gates."""

    def __init__(self, benchmark, disabled: bool, clock=time.perf_counter):
        self._benchmark = benchmark   # a callable returning pytest-benchmark's fixture, asked for when used
        self._disabled = disabled
        self._clock = clock           # pytest-benchmark's default timer; injectable for tests
        self.verdicts = []

    def ratio(self, gate: gatelib.Gate, subject, baseline, *, ops_per_round: int = 1,
              baseline_ops_per_round: int | None = None, rounds: int = 40, warmup: int = 4,
              kind: str = "rate") -> gatelib.Verdict | None:
        """Time ``subject()`` against ``baseline()`` (each one round), in
        the order A A B B A A B B, ``rounds`` timed rounds each after
        ``warmup``; the ratio is subject's rate ÷ baseline's (``kind="time"``:
        subject's time ÷ baseline's). Retried once when it misses."""
        if self._disabled:
            baseline()
            subject()
            return None
        den_ops = baseline_ops_per_round or ops_per_round
        attempts = []
        for attempt in range(2):
            times = self._alternate(subject, baseline, rounds, warmup, first=attempt == 0)
            med = {side: sorted(t)[len(t) // 2] for side, t in times.items()}
            figure = gatelib.ratio_figure(times["subject"], times["baseline"], med["subject"], med["baseline"],
                                          ops_per_round, den_ops, kind)
            attempts.append({gate.name: figure})
            verdict = gatelib.evaluate([gate], attempts)[0]
            if verdict.passed:
                break
        # Saved with the run (--benchmark-json, --benchmark-save) beside the timings.
        self._benchmark().extra_info["gate"] = verdict.line()
        return self._judge(verdict)

    def count(self, gate: gatelib.Gate, value: float) -> gatelib.Verdict:
        """Hold a machine-independent count to its ceiling (exact: no retry)."""
        return self._judge(gatelib.evaluate([gate], [{gate.name: gatelib.Figure(value)}])[0])

    def _judge(self, verdict):
        self.verdicts.append(verdict)
        if not verdict.passed:
            pytest.fail(f"performance gate: {verdict.line()}", pytrace=False)
        return verdict

    def _alternate(self, subject, baseline, rounds, warmup, first: bool) -> dict:
        """Per-round seconds of both sides. The first attempt goes through
        pytest-benchmark (subject timed by ``benchmark.pedantic``, baseline
        rounds in its untimed setup); the fixture times once per test, so
        the retry uses the same clock directly."""
        clock = self._clock
        base_t, subj_t = [], []
        calls = itertools.count()

        def baseline_rounds():
            if next(calls) % 2 == 0:
                for _ in range(2):
                    t0 = clock()
                    baseline()
                    base_t.append(clock() - t0)

        if first:
            benchmark = self._benchmark()
            benchmark.pedantic(subject, setup=baseline_rounds, rounds=rounds, warmup_rounds=warmup)
            subj_t = list(benchmark.stats.stats.data)
        else:
            for i in range(rounds + warmup):
                baseline_rounds()
                t0 = clock()
                subject()
                if i >= warmup:
                    subj_t.append(clock() - t0)
        return {"subject": subj_t, "baseline": base_t[warmup:]}


@pytest.fixture
def txmq_gate(request):
    # pytest-benchmark's fixture only when a ratio is timed: a count-only
    # test would otherwise be reported as an unused benchmark.
    return GateChecker(lambda: request.getfixturevalue("benchmark"),
                       bool(request.config.getoption("benchmark_disable", False)))
