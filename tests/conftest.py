import os
import sys

# O(n) self-checks (full log verification after every open, the invariants
# of the Cython tables and of a subscription's lanes after every change) in
# every test, including the brokers that tests start in subprocesses.
os.environ.setdefault("TXMQ_DEBUG", "1")

# The modules read TXMQ_DEBUG when first imported, and txmq's pytest plugin
# (pyproject.toml, addopts) imports them before this file runs: set them.
from txmq import _ackset, _txn  # noqa: E402
from txmq.dispatch import lane_invariant  # noqa: E402

for module in (_ackset, _txn, lane_invariant):
    module.set_debug(os.environ["TXMQ_DEBUG"] == "1")

# Tests import the shared helpers (tests/helpers: killer, damage, worker_io,
# spark_fixtures) and the workers' modules (tests/workers, for the values
# and checks a crash test shares with its worker) by name, from any folder.
TESTS = os.path.dirname(os.path.abspath(__file__))
for folder in ("workers", "helpers"):
    if os.path.join(TESTS, folder) not in sys.path:
        sys.path.insert(0, os.path.join(TESTS, folder))
