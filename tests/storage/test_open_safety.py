"""Opening a data directory never deletes what it cannot prove is its own
leftover; bad paths are refused; `txmq check` flags and `--repair`
restores a topic that lost its topic.json; `txmq check` against a live
owner.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import txmq
import txmq.readonly
from txmq.storage import datadir
from txmq.errors import DataDirError, TxmqError

FAST = dict(fsync="never", control_socket=False)


def txmq_cli(*args):
    return subprocess.run([sys.executable, "-m", "txmq.cli", *args], capture_output=True, text=True,
                          timeout=120)


def fill(path, n=1000, partitions=2):
    with txmq.Broker(path, **FAST) as b:
        b.create_topic("t", partitions)
        c = b.subscribe("t", "s", initial_position="earliest")
        b.producer("t").send_batch([b"m%d" % i for i in range(n)])
        ms = c.receive_many(10, timeout=1)
        c.ack(ms)
    return {m.value for m in ms}


def values(path, topic="t"):
    view = txmq.readonly.open(path)
    try:
        return [m.value for p in view.partitions(topic) for m in view.read(topic, p, 0)]
    finally:
        view.close()


def test_a_users_folder_under_topics_is_kept(tmp_path):
    d = tmp_path / "d"
    fill(d)
    notes = d / "topics" / "myproject" / "notes.txt"
    notes.parent.mkdir()
    notes.write_text("mine")
    with txmq.Broker(d, **FAST) as b:
        assert b.topics() == ["t"]
        problems = b.stats()["problems_on_open"]
    assert notes.read_text() == "mine"
    assert any("myproject" in p for p in problems)


def test_topic_without_topic_json_is_kept_flagged_and_repaired(tmp_path):
    d = tmp_path / "d"
    acked = fill(d)
    (d / "topics" / "t" / "topic.json").unlink()
    r = txmq_cli("check", str(d))
    assert r.returncode == 1 and "topic.json" in r.stdout and "--repair" in r.stdout, r.stdout
    with txmq.Broker(d, **FAST) as b:          # twice: nothing is removed by either open
        assert b.topics() == []
        assert any("topics/t" in p and "--repair" in p for p in b.stats()["problems_on_open"])
        with pytest.raises(DataDirError, match="partition data"):
            b.create_topic("t")            # refused: it would replace the kept data
    with txmq.Broker(d, **FAST):
        pass
    assert (d / "subscriptions" / "t" / "s" / "subscription.json").exists()
    r = txmq_cli("check", "--repair", str(d))
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((d / "topics" / "t" / "topic.json").read_text())["partitions"] == 2
    assert sorted(values(d)) == sorted(b"m%d" % i for i in range(1000))
    with txmq.Broker(d, **FAST) as b:
        c = b.subscribe("t", "s")
        got = {m.value for m in c.receive_many(2000, timeout=1)}
    assert got == {b"m%d" % i for i in range(1000)} - acked      # the cursor survived


def test_repair_refuses_a_held_directory(tmp_path):
    d = tmp_path / "d"
    fill(d, 10)
    (d / "topics" / "t" / "topic.json").unlink()
    with txmq.Broker(d, **FAST):
        r = txmq_cli("check", "--repair", str(d))
    assert r.returncode == 3, r.stdout + r.stderr
    assert not (d / "topics" / "t" / "topic.json").exists()


def test_a_create_that_stopped_before_topic_json_is_removed(tmp_path):
    """Killed between the topic's folder and topic.json (partition folders
    come with their first use, after topic.json): no message can be in it,
    so opening removes it and the name can be created again."""
    d = tmp_path / "d"
    with txmq.Broker(d, **FAST):
        pass
    code = ("import txmq; b = txmq.Broker(%r, fsync='commit', control_socket=False); "
            "b.create_topic('t', 3)" % str(d))
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TXMQ_CRASH_AT": "topic.created_partitions"},
                       timeout=60)
    assert r.returncode == -9
    assert sorted(os.listdir(d / "topics" / "t")) == []
    assert datadir.is_unused_topic(str(d / "topics" / "t"))
    with txmq.Broker(d, **FAST) as b:
        assert b.topics() == [] and b.stats()["problems_on_open"] == []
        assert not (d / "topics" / "t").exists()
        b.create_topic("t", 1)
        b.producer("t").send(b"x")


@pytest.mark.parametrize("tmp_bytes", [b"", b'{"partitions": 3, "reten', b'{"partitions": 3}'])
def test_a_create_killed_while_writing_topic_json_is_removed(tmp_path, tmp_bytes):
    """Killed inside topic.json's atomic write: the folder holds only
    topic.json.tmp (empty, torn or whole, never renamed). No message can be
    in it, so opening removes it, and the name can be created again."""
    d = tmp_path / "d"
    with txmq.Broker(d, **FAST):
        pass
    code = ("import os, txmq; from txmq.storage import topic as t\n"
            "def killed(path, config):\n"
            "    with open(os.path.join(path, 'topic.json.tmp'), 'wb') as f: f.write(%r)\n"
            "    os.kill(os.getpid(), 9)\n"
            "t.Topic.write_config = staticmethod(killed)\n"
            "b = txmq.Broker(%r, fsync='commit', control_socket=False); b.create_topic('t', 3)"
            % (tmp_bytes, str(d)))
    r = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert r.returncode == -9
    assert os.listdir(d / "topics" / "t") == ["topic.json.tmp"]
    with txmq.Broker(d, **FAST) as b:
        assert b.topics() == [] and b.stats()["problems_on_open"] == []
        assert not (d / "topics" / "t").exists()
        b.create_topic("t", 1)
        b.producer("t").send(b"x")


def test_a_delete_killed_after_its_rename_finishes_on_open(tmp_path):
    d = tmp_path / "d"
    fill(d, 10)
    code = ("import txmq; b = txmq.Broker(%r, fsync='commit', control_socket=False); "
            "b.delete_topic('t')" % str(d))
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TXMQ_CRASH_AT": "topic.delete_renamed"},
                       timeout=60)
    assert r.returncode == -9
    assert any(datadir.DELETED in n for n in os.listdir(d / "topics"))
    assert (d / "subscriptions" / "t" / "s").exists()
    with txmq.Broker(d, **FAST) as b:
        assert b.topics() == [] and b.stats()["problems_on_open"] == []
        assert os.listdir(d / "topics") == [] and os.listdir(d / "subscriptions") == []
        b.create_topic("t", 2)
        assert b.subscriptions("t") == []          # the deleted topic's subscription is gone


def test_delete_and_unsubscribe_leave_nothing(tmp_path):
    d = tmp_path / "d"
    fill(d, 10)
    with txmq.Broker(d, **FAST) as b:
        b.create_topic("u")
        c = b.subscribe("u", "x")
        c.unsubscribe()
        assert os.listdir(d / "subscriptions" / "u") == []
        b.delete_topic("t")
    assert os.listdir(d / "topics") == ["u"]
    assert sorted(os.listdir(d / "subscriptions")) == ["u"]


def test_a_subscription_folder_with_logs_but_no_config_is_kept(tmp_path):
    d = tmp_path / "d"
    fill(d, 10)
    (d / "subscriptions" / "t" / "s" / "subscription.json").unlink()
    with txmq.Broker(d, **FAST) as b:
        assert b.subscriptions("t") == []
        assert any("subscriptions/t/s" in p for p in b.stats()["problems_on_open"])
    assert (d / "subscriptions" / "t" / "s" / "cursor-0.log").exists()


@pytest.mark.parametrize("bad", [None, 5, 1.5, ["x"], "", "a\0b"])
def test_paths_that_are_not_directories_are_refused(bad):
    with pytest.raises(DataDirError):
        txmq.Broker(bad, **FAST)


def test_empty_path_never_opens_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataDirError, match="non-empty"):
        txmq.Broker("", **FAST)
    assert os.listdir(tmp_path) == []


def test_bytes_and_pathlike_paths(tmp_path):
    with txmq.Broker(os.fsencode(tmp_path / "b"), **FAST) as b:
        assert b.path == str(tmp_path / "b")
    with txmq.Broker(tmp_path / "b", **FAST) as b:
        assert b.path == str(tmp_path / "b")


def test_a_file_and_a_path_through_a_file_are_refused(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(DataDirError, match="is a file"):
        txmq.Broker(f, **FAST)
    with pytest.raises(DataDirError, match="is a file"):
        txmq.Broker(f / "sub", **FAST)
    for args in (["topics", "create", str(f / "sub"), "t"], ["topics", "create", str(f), "t"]):
        r = txmq_cli(*args)
        assert r.returncode == 2, r
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_folder_of_other_things_is_refused(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("x")
    with pytest.raises(DataDirError, match="not a txmq data directory"):
        txmq.Broker(home, **FAST)
    assert os.listdir(home) == [".bashrc"]


def test_marker_written_and_a_directory_of_an_earlier_release_adopted(tmp_path):
    d = tmp_path / "d"
    fill(d, 10)
    assert json.loads((d / datadir.MARKER).read_text())["format"] == datadir.MARKER_FORMAT
    (d / datadir.MARKER).unlink()                # as an earlier release left it
    r = txmq_cli("check", str(d))
    assert r.returncode == 0 and "missing" in r.stdout
    with txmq.Broker(d, **FAST) as b:
        assert b.topics() == ["t"]
    assert (d / datadir.MARKER).exists()
    (d / datadir.MARKER).write_text('{"format": 99}')
    with pytest.raises(DataDirError, match="format 99"):
        txmq.Broker(d, **FAST)
    assert isinstance(DataDirError("x", "y"), TxmqError)


def test_check_against_a_live_owner_reports_no_problem_and_real_sizes(tmp_path):
    d = tmp_path / "d"
    code = f"""
import sys, txmq
b = txmq.Broker({str(d)!r}, control_socket=False)
b.create_topic("t", 2)
c = b.subscribe("t", "s", initial_position="earliest")
p = b.producer("t")
for i in range(20):
    p.send_batch([b"x" * 100] * 100)
with b.transaction() as txn:
    p.send(b"y", txn=txn)
txn = b.new_transaction()
p.send(b"open", txn=txn)
print("READY", flush=True)
sys.stdin.read()
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "READY"
        r = txmq_cli("check", "--json", str(d))
        report = json.loads(r.stdout)
        assert r.returncode == 0 and report["problems"] == [], r.stdout
        assert report["bytes"] < 5 * 1024 * 1024           # segments are preallocated to 256 MiB each
    finally:
        proc.stdin.close()
        proc.wait(60)


def test_the_lock_cannot_be_stolen_by_deleting_or_replacing_LOCK(tmp_path):
    d = tmp_path / "d"
    code = f"""
import sys, txmq
b = txmq.Broker({str(d)!r}, fsync="never", control_socket=False)
b.create_topic("t")
b.producer("t").send(b"x")
print("READY", flush=True)
sys.stdin.read()
b.producer("t").send(b"y")
b.close()
print("CLOSED", flush=True)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "READY"
        (d / "LOCK").unlink()
        assert txmq.readonly.writer_pid(d) == proc.pid
        with pytest.raises(txmq.errors.DataDirLockedError):
            txmq.Broker(d, **FAST)
        (d / "LOCK").write_text("")                  # a fresh file in its place
        with pytest.raises(txmq.errors.DataDirLockedError):
            txmq.Broker(d, **FAST)
        r = txmq_cli("topics", "create", str(d), "u")
        assert r.returncode == 3, r.stderr
        proc.stdin.close()
        assert proc.stdout.readline().strip() == "CLOSED"
    finally:
        proc.kill()
        proc.wait(30)
    with txmq.Broker(d, **FAST) as b:
        assert b.high_watermark("t", 0) == 2 and b.topics() == ["t"]
