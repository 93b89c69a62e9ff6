"""Machine-independent counts (``counts.py``): flushes per durable commit,
Python-level calls per transactional send and ack, memory blocks per
received message. Each is recorded, rounded to a whole number, for the
gate (``bench/gates.toml`` ``[[count]]``, ceilings equal to today's
counts); nothing here is timed.

They run in a pytest-benchmark session like every other file here, with
``benchmark`` untouched, so ``--benchmark-only`` keeps them: a
``benchmark.extra_info`` entry marks them as used.
"""

from __future__ import annotations

import pytest

import counts


@pytest.mark.parametrize("workload", list(counts.WORKLOADS))
def test_counts(workload, benchmark, results, tmp_path):
    measured = counts.WORKLOADS[workload](str(tmp_path))
    # Counted, not timed: one pedantic round keeps --benchmark-only from skipping it.
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    benchmark.extra_info["counts"] = measured
    for name, raw in measured.items():
        results.add_count(name, round(raw), raw)
