"""What a new user of the command line meets first: --version, creating
in an empty folder, aborting a transaction a stopped owner left open,
Ctrl-C in the middle of `txmq produce`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import txmq
import txmq.readonly

CLI = [sys.executable, "-m", "txmq.cli"]


def cli(*args, **kw):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, **kw)


def test_version():
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"txmq {txmq.__version__}"


def test_topics_create_in_an_existing_empty_folder(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    r = cli("topics", "create", str(d), "t", "-p", "2")
    assert r.returncode == 0, r.stderr
    with txmq.readonly.open(d) as view:
        assert view.topics() == ["t"]


def test_abort_of_a_transaction_a_killed_owner_left_open(tmp_path):
    d = tmp_path / "d"
    code = f"""
import sys, txmq
b = txmq.Broker({str(d)!r}, control_socket=False)
b.create_topic("t")
txn = b.new_transaction(timeout=600)
b.producer("t").send(b"x", txn=txn)
txn.flush()
print(txn.id, flush=True)
sys.stdin.read()
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    txn_id = proc.stdout.readline().strip()
    proc.kill()
    proc.wait(30)
    r = cli("transactions", "abort", str(d), txn_id)
    assert r.returncode == 0, r.stderr
    assert "aborted on open" in r.stdout
    r = cli("transactions", "abort", str(d), txn_id)          # now it is gone: a clear error
    assert r.returncode == 2 and "not live" in r.stderr


def test_ctrl_c_during_produce_says_what_was_produced(tmp_path):
    d = tmp_path / "d"
    assert cli("topics", "create", str(d), "t").returncode == 0
    proc = subprocess.Popen([*CLI, "produce", str(d), "t", "--batch-size", "10", "--no-progress"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin.write(b"".join(b"line %d\n" % i for i in range(25)))
    proc.stdin.flush()
    with txmq.readonly.open(d) as view:           # wait until the first two batches are in
        deadline = time.monotonic() + 30
        while view.high_watermark("t", 0) < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    err = err.decode()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    n = int(re.search(r"interrupted \(([\d,]+) message\(s\) before line", err).group(1).replace(",", ""))
    with txmq.readonly.open(d) as view:
        assert view.high_watermark("t", 0) == n == 20


def test_bench_without_the_bench_extra_says_how_to_install_it(tmp_path):
    """Hide pytest_benchmark from the command's interpreter: one line naming
    the extra, exit 2, no traceback."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'pytest_benchmark':\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, _Hide())\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hide), os.environ.get("PYTHONPATH", "")]))
    r = cli("bench", "--file", "send", env=env)
    assert r.returncode == 2, r.stderr
    assert 'pip install "txmq[bench]"' in r.stderr and "pytest_benchmark" in r.stderr
    assert "Traceback" not in r.stderr
