"""``txmq demo``: both scenarios run end to end (in this process through
``txmq.cli.main``, and through the installed console script), their checks
pass, and the checks fail when the data is wrong or nothing was killed.

Each run is small (a few hundred requests and orders) but real: the workers
are subprocesses that are SIGKILLed and started again, and the checks read
the data directory back. The console-script run also reads the output with
Spark when pyspark and pyspark_txmq are installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest

import txmq
import txmq.readonly
from txmq.cli import exits, main
from txmq.demo import bank as demo_bank, scenarios as demo_mod, spark as demo_spark, windows as demo_windows
PY_DIR = os.path.dirname(os.path.dirname(os.path.abspath(txmq.__file__)))
SIZE = "300"
SPARK_CHECKS = 4           # rows of the Spark stage's checks
CHECKS = 18                 # rows of the table without Spark


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def rows(out: str) -> dict:
    """{check: (expected, got, result)} from the table: columns are
    separated by two or more spaces."""
    table = {}
    for line in out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) == 5 and cells[0] in ("bank", "windows", "spark"):
            table[cells[1]] = tuple(cells[2:])
    return table


def _script():
    candidate = os.path.join(sysconfig.get_path("scripts"), "txmq")
    return candidate if os.path.isfile(candidate) else shutil.which("txmq")


def test_demo_in_process(capsys, tmp_path, monkeypatch):
    # Without pyspark_txmq the demo says how to install it; fake "missing"
    # here so that the test does not depend on what is installed.
    monkeypatch.setattr(demo_spark, "missing", lambda: ["pyspark_txmq"])
    d = tmp_path / "data"
    code, out, err = run(capsys, "demo", "--dir", d, "--size", SIZE, "--seed", 11)
    table = rows(out)
    assert code == exits.OK, out + err
    assert len(table) == CHECKS and {r[2] for r in table.values()} == {"PASS"}, out
    assert out.rstrip().endswith("demo passed")
    # The numbers behind the PASSes are real ones.
    assert table["committed requests applied exactly once"][0] == table["committed requests applied exactly once"][1]
    assert int(table["monitor (read_uncommitted) saw transfer legs while open"][1].replace(",", "")) > 0
    assert "killed after" in table["bank process SIGKILLed mid-run, then restarted"][1]
    held = re.fullmatch(r"p99 ([\d,]+) ms vs max ([\d,]+) ms \(([\d,]+) requests in 1 s\)",
                        table["delay past a transfer held open: out-of-order auditor vs processor"][1])
    assert held, table
    auditor_p99, processor_max, requests = (int(g.replace(",", "")) for g in held.groups())
    assert requests > 0 and auditor_p99 < processor_max
    assert 'spark.read.format("txmq").option("path", "%s")' % d in out
    assert 'pip install "txmq[spark]"' in out
    assert "SIGKILLed after" in err and "aborted" in err
    # The data stays; the next run replaces it (it is an earlier demo's).
    assert os.path.isdir(d / "topics" / demo_bank.REQUESTS) and f"Data kept in {d}" in out
    assert demo_mod.prepare(str(d)) is True and os.listdir(d) == []


def test_demo_replaces_a_directory_a_killed_owner_left_a_socket_in(tmp_path):
    """A demo worker SIGKILLed while serving leaves control.sock (and maybe
    staging/) behind: still the data directory of an earlier demo."""
    d = tmp_path / "data"
    with txmq.Broker(str(d), fsync="never") as b:
        b.create_topic(demo_bank.REQUESTS)
    (d / "control.sock").touch()
    (d / "staging").mkdir(exist_ok=True)
    assert demo_mod.prepare(str(d)) is True and os.listdir(d) == []
    (d / "notes.txt").touch()
    with pytest.raises(demo_mod.DemoError, match="not the data directory of an earlier demo"):
        demo_mod.prepare(str(d))


@pytest.mark.skipif(_script() is None, reason="the txmq console script is not installed")
def test_demo_console_script_json(tmp_path):
    """The installed command, as a user runs it, with --json. When pyspark
    and pyspark_txmq are importable Spark reads the window output too, and
    its count must be the demo's."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([PY_DIR, os.environ.get("PYTHONPATH", "")]))
    spark = not demo_spark.missing()
    argv = [_script(), "demo", "--size", SIZE, "--seed", "21", "--json"] + ([] if spark else ["--no-spark"])
    r = subprocess.run(argv, cwd=tmp_path, capture_output=True, env=env, timeout=240)
    assert r.returncode == 0, r.stderr.decode() + r.stdout.decode()
    res = json.loads(r.stdout)
    assert res["ok"] is True and res["seed"] == 21 and res["size"] == int(SIZE)
    assert res["dir"] == str(tmp_path / "txmq-data") and os.path.isdir(res["dir"])
    assert [c["result"] for c in res["checks"]] == ["PASS"] * (CHECKS + SPARK_CHECKS * spark)
    bank, win = res["bank"], res["windows"]
    assert bank["runs"]["killed"] and win["runs"]["killed"]
    assert bank["applied_once"] == bank["requests_committed"] > int(SIZE)     # transfers have two legs
    assert bank["applied_twice"] == bank["applied_not_committed"] == 0
    assert bank["aborted_on_purpose_in_log"] > 0 and bank["aborted_on_purpose_committed"] == 0
    assert win["windows_emitted"] == win["windows_expected"] == win["windows_matching"] > 0
    assert win["events_committed"] == int(SIZE)
    if spark:
        sp = res["spark"]
        assert sp["ran"] and sp["count"] == win["windows_output_messages"], sp
        assert 1 <= sp["written"] <= len(demo_windows.PRODUCTS)
        assert len(sp["rows"]) == min(demo_spark.SHOW_ROWS, sp["written"])
        with txmq.readonly.open(res["dir"]) as ro:            # one transaction: one commit marker after the rows
            assert ro.high_watermark(demo_spark.OUTPUT, 0) == sp["written"] + 1


def test_checks_fail(capsys, tmp_path, monkeypatch):
    """A run in which nothing is killed, a request is applied twice and a
    window is emitted twice (written to the data directory before the
    checks read it) fails exactly those checks, and exits 1."""
    real_run_and_kill = demo_mod.run_and_kill
    monkeypatch.setattr(demo_mod, "run_and_kill",
                        lambda argv, when_cb, progress_cb=None: real_run_and_kill(argv, lambda s: False))
    real_bank, real_windows = demo_bank.verify, demo_windows.verify

    def bank_twice(broker):
        # The processor's first update of an account, committed again at the end.
        first = demo_bank.drain(broker, demo_bank.BALANCES, "tamper", "read_committed")[0]
        broker.producer(demo_bank.BALANCES).send(first.value, key=first.key)
        return real_bank(broker)

    def window_twice(broker):
        first = demo_bank.drain(broker, demo_windows.OUTPUT, "tamper")[0]
        broker.producer(demo_windows.OUTPUT).send(first.value, key=first.key, event_time=first.event_time)
        return real_windows(broker)

    monkeypatch.setattr(demo_bank, "verify", bank_twice)
    monkeypatch.setattr(demo_windows, "verify", window_twice)
    code, out, err = run(capsys, "demo", "--dir", tmp_path / "d", "--size", SIZE, "--seed", 5, "--no-spark")
    assert code == exits.PROBLEMS, out + err
    table = rows(out)
    failed = {k for k, v in table.items() if v[2] == "FAIL"}
    assert failed == {
        "bank process SIGKILLed mid-run, then restarted", "function SIGKILLed mid-run, then restarted",
        "committed requests applied exactly once", "requests applied more than once",
        "balances = recomputation from committed requests",
        "windows emitted more than once", "window totals = recomputation", "orders counted in emitted windows",
    }, out
    assert table["requests applied more than once"][:2] == ("0", "1")
    assert table["windows emitted more than once"][:2] == ("0", "1")
    assert table["bank process SIGKILLed mid-run, then restarted"][1] == "not killed"
    assert "nothing was killed" in err
    assert out.rstrip().endswith("demo FAILED")


def test_the_held_transfer_row_fails_when_either_reader_misbehaves():
    """The row of the transfer held open: an auditor that waited behind it,
    a processor that did not, or no request while it was open, fail it."""
    good = {"held_s": 1.0, "auditor_requests": 80, "auditor_p99_ms": 12, "auditor_max_ms": 30,
            "processor_requests": 80, "processor_p99_ms": 990, "processor_max_ms": 1001}
    assert demo_mod._held_check(good)["result"] == "PASS"
    for bad in (dict(good, auditor_p99_ms=995), dict(good, processor_max_ms=40),
                dict(good, auditor_requests=0, auditor_p99_ms=None), None):
        assert demo_mod._held_check(bad)["result"] == "FAIL", bad


def test_demo_json_reports_failure(capsys, tmp_path, monkeypatch):
    """--json carries the same verdict: ok false and the failing check."""
    real_bank = demo_bank.verify

    def lost_update(broker):
        got = real_bank(broker)
        return dict(got, accounts_matching=got["accounts_matching"] - 1)

    monkeypatch.setattr(demo_bank, "verify", lost_update)
    code, out, _ = run(capsys, "demo", "--dir", tmp_path / "d", "--size", SIZE, "--seed", 6, "--no-spark",
                       "--json", "--delete")
    res = json.loads(out)
    assert code == exits.PROBLEMS and res["ok"] is False
    assert res["kept"] is False and not os.path.exists(tmp_path / "d")
    assert res["spark"] == {"ran": False, "reason": "--no-spark"}
    assert [c["check"] for c in res["checks"] if c["result"] == "FAIL"] == [
        "balances = recomputation from committed requests"]


def test_demo_help_and_bad_arguments(capsys, tmp_path):
    code, out, _ = run(capsys, "demo", "--help")
    assert code == 0
    for option in ("--dir", "--size", "--keep", "--delete", "--no-spark", "--seed", "--json", "small", "medium",
                   "large", "SIGKILL", "read_uncommitted", "read_committed", "pyspark_txmq"):
        assert option in out, option
    code, _, err = run(capsys, "demo", "--size", "tiny")
    assert code == exits.USAGE and "expected small, medium, large or a number >= 100" in err
    code, _, err = run(capsys, "demo", "--size", "5")
    assert code == exits.USAGE
    code, _, err = run(capsys, "demo", "--keep", "--delete")
    assert code == exits.USAGE
    # A directory that is not an earlier demo's is never touched.
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    code, _, err = run(capsys, "demo", "--dir", other)
    assert code == exits.USAGE and "is not the data directory of an earlier demo" in err
    assert (other / "notes.txt").read_text() == "keep me"
    with txmq.Broker(str(tmp_path / "real"), fsync="never") as b:
        b.create_topic("orders")
    code, _, err = run(capsys, "demo", "--dir", tmp_path / "real")
    assert code == exits.USAGE and os.path.isdir(tmp_path / "real" / "topics" / "orders")


def test_worker_failure_is_reported(capsys, tmp_path):
    """A worker that cannot run (its data directory is held by another
    process: here, this one) ends the demo with exit 1 and the worker's
    error, not a traceback of the demo."""
    d = tmp_path / "d"
    d.mkdir()
    with txmq.Broker(str(d / "held"), fsync="never"):
        from txmq.demo.worker import run_and_kill
        with pytest.raises(RuntimeError, match="DataDirLockedError"):
            run_and_kill(["bank", str(d / "held"), 1, 100], lambda s: True)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


def test_spark_checks_fail_on_a_wrong_or_doubled_write(capsys, tmp_path, monkeypatch):
    """The Spark stage's checks compare what was written with the totals
    recomputed from the log: a product written twice, or with a wrong
    total, fails them (the job's output stood in for by a writer that
    does exactly that; the real job runs in the console-script test)."""
    def bad_job(data_dir):
        with txmq.Broker(data_dir) as b:
            want = demo_spark.expected_totals(demo_bank.drain(b, demo_windows.OUTPUT, "tamper"))
            if demo_spark.OUTPUT not in b.topics():
                b.create_topic(demo_spark.OUTPUT, 1)
            p = b.producer(demo_spark.OUTPUT)
            keys = sorted(want)
            for i, k in enumerate(keys):
                total, orders, windows = want[k]
                p.send(json.dumps({"total": total + (i == 1), "orders": orders, "windows": windows}).encode(),
                       key=k)
            total, orders, windows = want[keys[0]]
            p.send(json.dumps({"total": total, "orders": orders, "windows": windows}).encode(), key=keys[0])
        return {"count": sum(w for _, _, w in want.values()), "written": len(want) + 1, "rows": []}

    monkeypatch.setattr(demo_spark, "missing", lambda: [])
    monkeypatch.setattr(demo_spark, "run", bad_job)
    code, out, err = run(capsys, "demo", "--dir", tmp_path / "d", "--size", SIZE, "--seed", 7)
    assert code == exits.PROBLEMS, out + err
    table = rows(out)
    assert {k for k, v in table.items() if v[2] == "FAIL"} == {
        "products written twice", "product totals matching the recomputation from the log"}, out
    assert table["products written twice"][:2] == ("0", "1")
