"""Performance gates for txmq and for code that embeds it.

- :mod:`txmq.testing.gates`: bounds on measured figures (ratios against a
  same-run baseline, exact counts) kept in a TOML file, and the verdict
  of a gate run, with one retry for a bound that noise alone may miss.
- :mod:`txmq.testing.counters`: machine-independent counts (flushes,
  Python-level calls, memory blocks).
- :mod:`txmq.testing.pytest_plugin`: pytest fixtures for the same
  patterns in a user's own suite (``pytest_plugins =
  ["txmq.testing.pytest_plugin"]``); see docs/GATES.md.

Nothing here is imported by ``txmq`` itself.
"""
