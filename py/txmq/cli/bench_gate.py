"""``txmq bench --gate``: run the benchmarks that ``bench/gates.toml``
names, hold every figure to its floor or ceiling, and fail (exit 1) when a
figure misses its bound twice.

One pytest-benchmark session runs every selected gate's tests
(``--quick``: only the gates marked ``quick``, the subset CI runs). The
session's ``results.json`` holds each figure (``figures``: the median
ratio and the range of the per-round ratios, or a count); the gates that
missed are measured once more in a second session of only their tests,
and a gate fails when that attempt misses too
(:func:`txmq.testing.gates.evaluate`). The report names each gate, its
figure on each attempt with the range over the rounds, and its bound.
"""

from __future__ import annotations

import json
import os
import sys
import time

from txmq.cli import exits
from txmq.cli.bench import _mtime, _run, bench_env, pytest_command
from txmq.cli.output import emit_json, wants_progress
from txmq.testing import gates as gatelib


def gate(args, bench_dir: str) -> int:
    path = args.gates or os.path.join(bench_dir, "gates.toml")
    try:
        gates = gatelib.load(path)
    except OSError as e:
        raise exits.CliError(f"cannot read the gates file {path}: {e.strerror}") from None
    except gatelib.GateFileError as e:
        raise exits.CliError(f"{path}: {e}") from None
    selected = [g for g in gates if g.quick] if args.quick else gates
    if not selected:
        raise exits.CliError(f"{path} has no {'quick ' if args.quick else ''}gate")
    t0 = time.perf_counter()
    attempts = [_attempt(selected, bench_dir, args)]
    verdicts = gatelib.evaluate(selected, attempts)
    retry = gatelib.retry_needed(verdicts)
    if retry:
        print(f"retrying {len(retry)} gate(s) that missed: {', '.join(repr(g.name) for g in retry)}",
              file=sys.stderr)
        attempts.append(_attempt(retry, bench_dir, args))
        verdicts = gatelib.evaluate(selected, attempts)
    seconds = time.perf_counter() - t0
    failed = [v for v in verdicts if not v.passed]
    if args.json:
        emit_json({"gates": path, "quick": bool(args.quick), "seconds": round(seconds, 1), "passed": not failed,
                   "verdicts": [{"name": v.gate.name, "kind": v.gate.kind, "bound": v.gate.bound,
                                 "bound_kind": v.gate.bound_name, "passed": v.passed,
                                 "attempts": [None if f is None else vars(f) for f in v.figures]}
                                for v in verdicts]})
    else:
        print(gatelib.report(verdicts))
        print(f"\n{'quick ' if args.quick else ''}gate: {len(verdicts)} gate(s) in {seconds:.0f} s ({path})")
    if failed:
        raise exits.CliError(f"performance gate failed: {', '.join(repr(v.gate.name) for v in failed)} "
                             f"missed {'its' if len(failed) == 1 else 'their'} bound on the run and on the retry "
                             f"(figures above)", exits.PROBLEMS)
    return exits.OK


def _attempt(gates: list, bench_dir: str, args) -> dict:
    """One session over the tests of ``gates``: ``{gate name: Figure or None}``."""
    targets = list(dict.fromkeys(os.path.join(bench_dir, t) for g in gates for t in g.tests))
    results_path = os.path.join(bench_dir, "results.json")
    before = _mtime(results_path)
    code, log = _run(pytest_command(targets), bench_dir, bench_env(), wants_progress(args.progress),
                     args.verbose)
    if code != 0:
        print("\n".join(log[-30:]), file=sys.stderr)
        raise exits.CliError(f"the gate's benchmarks failed (pytest exit {code}); its output ends above",
                             exits.PROBLEMS)
    figures = {}
    if _mtime(results_path) != before:
        with open(results_path) as f:
            figures = json.load(f).get("figures", {})
    return {g.name: None if g.name not in figures else gatelib.Figure(**figures[g.name]) for g in gates}
