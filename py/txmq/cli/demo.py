"""``txmq demo``: runs :mod:`txmq.demo` on a data directory under the
current folder and prints its checks. Progress goes to stderr, the table
(or ``--json``) to stdout; the exit code is 1 when a check failed.
"""

from __future__ import annotations

import json
import sys

from txmq.cli import exits, output
from txmq.demo import bank, spark as demo_spark, windows
from txmq.demo.scenarios import DEFAULT_DIR, SIZES, DemoError, run

COLUMNS = [("scenario", "scenario"), ("check", "check"), ("expected", "expected"), ("got", "got"),
           ("result", "result")]


class _Stage:
    """One progress bar on stderr when drawing is on, a line when it ends."""

    def __init__(self, label: str, total: int, draw: bool):
        self.bar = output.Progress(label, total, enabled=draw)

    @property
    def done(self) -> int:
        return self.bar.done

    def to(self, done: int, detail: str = "") -> None:
        self.bar.update(max(done, self.bar.done) - self.bar.done, detail)

    def end(self, line: str) -> None:
        self.bar.close()
        _say(line)


def _say(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def demo(data_dir: str = DEFAULT_DIR, size: int = SIZES["small"], *, seed: int | None = None, keep: bool = True,
         spark: bool = True, as_json: bool = False, progress=None, out=None) -> int:
    """Run both scenarios on ``data_dir`` and print the checks; 0 when all
    pass, 1 otherwise."""
    out = out or sys.stdout
    draw = output.wants_progress(progress)
    try:
        result = run(data_dir, size, seed=seed, keep=keep, spark=spark,
                     stage=lambda label, total: _Stage(label, total, draw), say=_say)
    except DemoError as e:
        raise exits.CliError(str(e), exits.PROBLEMS if e.run_failed else exits.USAGE) from None
    code = exits.OK if result["ok"] else exits.PROBLEMS
    if as_json:
        print(json.dumps(result, indent=2, default=str), file=out)
        return code
    _print_table(result, data_dir, out)
    return code


def _print_table(result: dict, data_dir: str, out) -> None:
    where, info = result["dir"], result["spark"]
    print(file=out)
    output.table(result["checks"], COLUMNS, out=out)
    print(file=out)
    if info.get("ran"):
        print(f"Spark read {info['count']:,} window rows of {windows.OUTPUT} and wrote {info['written']:,} "
              f"product totals to {demo_spark.OUTPUT}; the first ones:", file=out)
        for row in info["rows"]:
            print(f"  {row['key']:<12} {row['value']}", file=out)
        print(file=out)
    print("Read the output with Spark (the `txmq` data source):", file=out)
    for topic in (windows.OUTPUT, demo_spark.OUTPUT, bank.BALANCES):
        print(f"  {demo_spark.snippet(where, topic)}", file=out)
    if not info.get("ran") and info.get("reason") != "--no-spark":
        print(f"  ({info['reason']}; install with: {demo_spark.INSTALL})", file=out)
    print(f"Data kept in {where} (`txmq topics list {data_dir}`; --delete removes it)." if result["kept"]
          else "Data deleted (--delete).", file=out)
    print(f"{result['seconds']:.1f} s, seed {result['seed']}: demo {'passed' if result['ok'] else 'FAILED'}",
          file=out)
