"""``txmq bench``: run the benchmarks of ``bench/`` and print their ratios.

The benchmarks run in a subprocess, ``python -m pytest <bench> --benchmark-only``
(pytest-benchmark), exactly as bench/README.md runs them; each comparison
times txmq and its baseline in the same run, and ``bench/conftest.py``
writes the medians and ratios to ``bench/results.json`` at the end of the
session, which this command reads and prints. Goals are reported, never
asserted, as in the suite itself; ``--gate`` enforces the bounds of
``bench/gates.toml`` instead (``txmq.cli.bench_gate``).

``--save NAME`` and ``--compare NAME`` hand the run to pytest-benchmark's
own storage (``bench/.benchmarks``): absolute figures on one machine, a
branch against main, ``--compare-fail`` (``median:15%`` by default) as the
threshold that fails the run.

The reopen benchmarks (marker ``reopen``, ~2 GiB of writes) are left out
unless ``--reopen``. ``TXMQ_DEBUG`` is dropped from the benchmarks'
environment: its O(n) checks would skew every figure.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import time

import txmq
from txmq.cli import exits
from txmq.cli.output import Progress, emit_json, table, wants_progress

_COLLECTED = re.compile(r"collected (\d+) items?(?: / (\d+) deselected)?(?: / (\d+) selected)?")
_RESULT = re.compile(r"^(\S+::\S+.*?) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")


def find_bench_dir(explicit: str | None) -> str:
    """``--bench-dir``, else ``./bench``, else the ``bench/`` of the source
    tree txmq is imported from (an editable install)."""
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(txmq.__file__))))
    candidates = [explicit] if explicit else [os.path.join(os.getcwd(), "bench"),
                                              os.path.join(pkg_root, "bench")]
    for c in candidates:
        if c and os.path.isfile(os.path.join(c, "conftest.py")):
            return os.path.abspath(c)
    if explicit:
        raise exits.CliError(f"{explicit} holds no benchmarks (no conftest.py): pass the project's bench/ "
                             f"directory")
    raise exits.CliError("no bench/ directory found: run from the txmq source tree or pass --bench-dir DIR")


def pytest_command(targets: list, *extra) -> list:
    """The pytest-benchmark run of bench/README.md over ``targets``."""
    return [sys.executable, "-m", "pytest", *targets, "-v", "-p", "no:cacheprovider", "--benchmark-only",
            "-o", "addopts=", "--color=no", *extra]


def bench_env() -> dict:
    """The benchmarks' environment: no ``TXMQ_DEBUG`` (its O(n) checks
    would skew every figure), and the txmq this command runs first on the
    path (the benchmarks must time it). The benchmarks are a pytest
    session of their own: run from inside a pytest-xdist worker (the test
    suite), the worker's variables would make pytest-benchmark turn itself
    off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
    env.pop("TXMQ_DEBUG", None)
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(txmq.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([pkg_parent] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


INSTALL = 'pip install "txmq[bench]"'


def check_installed() -> None:
    """The benchmarks need pytest-benchmark (the ``bench`` extra): say how
    to install it rather than fail inside the subprocess."""
    missing = []
    for module in ("pytest", "pytest_benchmark"):
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise exits.CliError(f"the benchmarks need {' and '.join(missing)}, which are not installed: "
                             f"install them with: {INSTALL}")


def bench(args, bench_dir: str) -> int:
    """Run the benchmarks of ``bench_dir`` and print their comparisons."""
    targets = []
    for name in args.file or ():
        path = os.path.join(bench_dir, name if name.endswith(".py") else f"test_bench_{name}.py")
        if not os.path.isfile(path):
            have = sorted(f[len("test_bench_"):-3] for f in os.listdir(bench_dir)
                          if f.startswith("test_bench_") and f.endswith(".py"))
            raise exits.CliError(f"no benchmark file {name!r} in {bench_dir}; the files are: {', '.join(have)}")
        targets.append(path)
    extra = []
    if args.k:
        extra += ["-k", args.k]
    if not args.reopen:
        extra += ["-m", "not reopen"]
    if args.save:
        extra += [f"--benchmark-save={args.save}"]
    if args.compare:
        # Saved runs are stored as NNNN_NAME.json: match the name after the counter.
        extra += [f"--benchmark-compare=*_{args.compare}", f"--benchmark-compare-fail={args.compare_fail}"]
    cmd = pytest_command(targets or [bench_dir], *extra)
    env = bench_env()
    results_path = os.path.join(bench_dir, "results.json")
    before = _mtime(results_path)
    t0 = time.perf_counter()
    code, log = _run(cmd, bench_dir, env, wants_progress(args.progress), args.verbose)
    seconds = time.perf_counter() - t0
    if code not in (0, 5):              # 5: pytest collected nothing
        regressed = [line for line in log if "Performance has regressed" in line or line.startswith("\t")]
        if args.compare and regressed:
            print("\n".join(regressed), file=sys.stderr)
            raise exits.CliError(f"slower than the saved run {args.compare!r} by more than {args.compare_fail} "
                                 f"(the comparisons above)", exits.PROBLEMS)
        tail = "\n".join(log[-30:])
        print(tail, file=sys.stderr)
        raise exits.CliError(f"the benchmarks failed (pytest exit {code}); its output ends above", exits.PROBLEMS)
    rows = []
    if _mtime(results_path) != before:
        with open(results_path) as f:
            rows = json.load(f)["comparisons"]
    if args.json:
        emit_json({"bench_dir": bench_dir, "seconds": round(seconds, 1), "results": results_path,
                   "comparisons": rows})
        return exits.OK
    if not rows:
        print(f"no comparison completed in {seconds:.0f} s (each needs both of its sides selected; "
              f"see `txmq bench --help` for the selection options)")
        return exits.OK
    table([dict(r, met="-" if r["met"] is None else "yes" if r["met"] else "NO") for r in rows],
          [("comparison", "comparison"), ("txmq", "txmq"), ("baseline", "baseline"), ("ratio", "ratio"),
           ("goal", "goal"), ("met", "met")])
    print(f"\n{len(rows)} comparison(s) in {seconds:.0f} s; medians and rounds in {results_path}")
    return exits.OK


def _mtime(path: str):
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _run(cmd, cwd, env, progress: bool, verbose: bool):
    """Run pytest, drawing a bar over its tests; (exit code, output lines)."""
    log = []
    bar = Progress("bench", None, "tests", progress)
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            log.append(line)
            if verbose:
                print(line, file=sys.stderr)
            m = _COLLECTED.search(line)
            if m:
                bar.total = int(m.group(3) or m.group(1)) - (0 if m.group(3) else int(m.group(2) or 0))
                bar.update(0)
            m = _RESULT.match(line)
            if m:
                bar.update(1, m.group(1).split("::", 1)[1][:60])
        code = proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        bar.close()
    return code, log
