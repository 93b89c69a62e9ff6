"""The ``txmq`` command line: every command's output and exit code, the
read-only ``check`` against planted corruption, and the installed console
script."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import sysconfig
import time

import pytest

import txmq
import txmq.readonly as readonly
from txmq.cli import exits, opening, output
from txmq.cli import main
from damage import batch_positions, flip

PY_DIR = os.path.dirname(os.path.dirname(os.path.abspath(txmq.__file__)))
BENCH_DIR = os.path.join(os.path.dirname(PY_DIR), "bench")


def run(capsys, *argv, stdin: bytes | None = None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def data(tmp_path):
    """A directory with topic ``orders`` (3 partitions, 30 keyed messages, a
    committed and an aborted transaction on partition 0), topic ``empty``,
    and subscription ``billing`` on orders that acknowledged 5 messages."""
    path = str(tmp_path / "data")
    with txmq.Broker(path, fsync="never", linger_ms=0) as b:     # (the aborted send is in the log)
        b.create_topic("orders", partitions=3)
        b.create_topic("empty")
        p = b.producer("orders")
        p.send_batch([b"m%02d" % i for i in range(30)], keys=[b"k%d" % (i % 7) for i in range(30)])
        with b.transaction() as txn:
            p.send(b"committed", partition=0, txn=txn)
        txn = b.new_transaction()
        p.send(b"aborted", partition=0, txn=txn)
        txn.abort()
        c = b.subscribe("orders", "billing", initial_position="earliest")
        c.ack(c.receive_many(5, timeout=1.0))
        c.close()
    return path


def end_offsets(path):
    with txmq.Broker(path, fsync="never") as b:
        return {t: b.describe_topic(t)["end_offsets"] for t in b.topics()}


# -- help, usage, errors -----------------------------------------------------------------

def test_help_documents_exit_codes(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for line in ("3    the data directory is locked by another process",
                 "2    usage or input error", "1    check found problems"):
        assert line in out


def test_usage_error_exits_2(capsys):
    code, _, err = run(capsys, "topics", "list")
    assert code == exits.USAGE and "DIR" in err
    code, _, err = run(capsys, "consume", "x", "t", "--max-messages", "0")
    assert code == exits.USAGE and "integer >= 1" in err


def test_missing_directory_is_not_created(capsys, tmp_path):
    missing = tmp_path / "nope"
    for argv in (["stats", missing], ["topics", "list", missing], ["check", missing],
                 ["consume", missing, "t"], ["subscriptions", "list", missing]):
        code, out, err = run(capsys, *argv)
        assert code == exits.USAGE, argv
        assert f"data directory {missing} does not exist" in err and out == ""
    assert not missing.exists()


def test_not_a_data_directory(capsys, tmp_path):
    code, _, err = run(capsys, "stats", tmp_path)
    assert code == exits.USAGE and "not a txmq data directory" in err


WRITE_COMMANDS = (["produce", "{d}", "orders"], ["topics", "create", "{d}", "new"], ["topics", "delete", "{d}", "empty"],
                  ["consume", "{d}", "orders", "-s", "billing"], ["subscriptions", "reset", "{d}", "orders", "billing",
                                                                  "--to", "latest"],
                  ["transactions", "abort", "{d}", "(0,1)"])


def test_locked_directory_exit_3_for_commands_that_change_it(capsys, data):
    with txmq.Broker(data, fsync="never"):
        for argv in WRITE_COMMANDS:
            code, out, err = run(capsys, *[a.format(d=data) for a in argv])
            assert code == exits.LOCKED, argv
            assert f"data directory {os.path.abspath(data)} is locked: another process (pid {os.getpid()})" in err
            assert ("read-only commands work while it holds the directory: topics list|describe, consume "
                    "without --subscription, subscriptions list|describe, transactions list|describe, stats, "
                    "check") in err
            assert out == ""


def test_unknown_topic_lists_existing(capsys, data):
    code, _, err = run(capsys, "topics", "describe", data, "ordrs")
    assert code == exits.USAGE
    assert "topic 'ordrs' does not exist; existing topics: empty, orders" in err


def test_corrupt_file_on_open_exit_4(capsys, data):
    cursor = os.path.join(data, "subscriptions", "orders", "billing", "cursor-0.log")
    with open(cursor, "r+b") as f:
        f.write(b"JUNK")
    code, _, err = run(capsys, "stats", data)
    assert code == exits.CORRUPT
    assert f"corrupt file {cursor} at byte 0: bad redo-log magic" in err and "txmq check" in err


# -- topics --------------------------------------------------------------------------------

def test_topics_create_list_describe_delete(capsys, tmp_path):
    d = str(tmp_path / "new")
    code, out, _ = run(capsys, "topics", "create", d, "events", "--partitions", "4", "--retention-ms", "60000")
    assert code == 0 and out == f"created topic 'events' with 4 partition(s) in {d}\n"
    code, out, _ = run(capsys, "topics", "create", d, "events")
    assert code == exits.USAGE
    code, out, _ = run(capsys, "topics", "list", d)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["TOPIC", "PARTITIONS", "OFFSETS", "SUBSCRIPTIONS", "RETENTION"]
    assert lines[1].split() == ["events", "4", "0", "0", "60,000", "ms"]
    code, out, _ = run(capsys, "topics", "list", d, "--json")
    assert json.loads(out) == [{"name": "events", "partitions": 4, "retention_ms": 60000, "retention_bytes": None,
                                "end_offsets": [0, 0, 0, 0], "start_offsets": [0, 0, 0, 0], "subscriptions": [],
                                "quarantined": {}}]
    code, out, _ = run(capsys, "topics", d)            # the command before topics had actions
    assert code == 0 and "events" in out
    code, out, _ = run(capsys, "topics", "delete", d, "events")
    assert code == 0 and "deleted topic 'events'" in out
    code, out, _ = run(capsys, "topics", "list", d)
    assert code == 0 and out.startswith("no topics in")


def test_topics_invalid_name(capsys, tmp_path):
    code, _, err = run(capsys, "topics", "create", tmp_path / "d", "bad name")
    assert code == exits.USAGE and "invalid topic name 'bad name'" in err


def test_topics_describe(capsys, data):
    code, out, _ = run(capsys, "topics", "describe", data, "orders")
    assert code == 0
    assert out.startswith("topic orders: 3 partition(s)")
    assert "billing" in out and "read_committed" in out
    code, out, _ = run(capsys, "topics", "describe", data, "orders", "--json")
    info = json.loads(out)
    ends = info["end_offsets"]
    assert sum(ends) == 30 + 2 + 2       # messages, two transactional ones, two markers
    assert [p["end_offset"] for p in info["partition_stats"]] == ends
    assert info["subscription_stats"]["billing"]["isolation"] == "read_committed"


# -- produce and consume -------------------------------------------------------------------------

def test_produce_stdin_then_non_durable_consume(capsys, monkeypatch, data):
    code, out, err = run(capsys, "produce", data, "empty", stdin=b"one\ntwo\r\n\nthree", monkeypatch=monkeypatch)
    assert code == 0 and out == ""
    assert "produced 4 message(s) to 'empty'" in err
    code, out, err = run(capsys, "consume", data, "empty")
    assert code == 0
    assert out == "one\ntwo\n\nthree\n"
    assert "consumed 4 message(s) from 'empty' (a non-durable read, read_committed)" in err
    # Non-durable: no subscription was left behind.
    code, out, _ = run(capsys, "subscriptions", "list", data, "--json")
    assert [(s["topic"], s["subscription"]) for s in json.loads(out)] == [("orders", "billing")]


def test_produce_json_round_trip(capsys, monkeypatch, data):
    lines = [{"value": "plain", "key": "k1", "headers": {"h": "1"}},
             {"value_base64": "AP8=", "partition": 0, "event_time": 1234},
             {"value": {"nested": [1, 2]}, "key": None},
             {"value": "x", "headers": [["a", None], ["b", "\udcff"]]}]
    stdin = "\n".join(json.dumps(x) for x in lines).encode("utf-8", "surrogatepass")
    code, out, _ = run(capsys, "produce", data, "empty", "--json", "--json-summary",
                       stdin=stdin, monkeypatch=monkeypatch)
    assert code == 0
    summary = json.loads(out)
    assert summary["messages"] == 4 and summary["transaction"] is None
    code, out, _ = run(capsys, "consume", data, "empty", "--format", "json")
    assert code == 0
    got = [json.loads(line) for line in out.splitlines()]
    assert [g.get("value") for g in got] == ["plain", None, '{"nested":[1,2]}', "x"]
    assert got[0]["key"] == "k1" and got[0]["headers"] == [["h", "1"]]
    assert got[1]["value_base64"] == "AP8=" and got[1]["event_time"] == 1234
    assert got[3]["headers"] == [["a", None], ["b", "\udcff"]]       # the byte 0xff came back
    with txmq.Broker(data, fsync="never") as b:
        c = b.subscribe("empty", "s", initial_position="earliest")
        ms = c.receive_many(10, timeout=1.0)
        assert [m.value for m in ms] == [b"plain", b"\x00\xff", b'{"nested":[1,2]}', b"x"]
        assert ms[3].headers == [("a", None), ("b", b"\xff")]


def test_produce_key_and_partition(capsys, monkeypatch, tmp_path):
    d = str(tmp_path / "d")
    assert main(["topics", "create", d, "t", "-p", "4"]) == 0
    code, _, _ = run(capsys, "produce", d, "t", "--key", "customer-7", stdin=b"a\nb\n", monkeypatch=monkeypatch)
    assert code == 0
    code, _, _ = run(capsys, "produce", d, "t", "--partition", "3", stdin=b"c\n", monkeypatch=monkeypatch)
    assert code == 0
    with txmq.Broker(d, fsync="never") as b:
        want = b.producer("t").send(b"probe", key=b"customer-7").partition
        ends = b.describe_topic("t")["end_offsets"]
    expected = [0, 0, 0, 0]
    expected[want] += 3                   # a, b and the probe
    expected[3] += 1
    assert ends == expected
    code, out, _ = run(capsys, "consume", d, "t", "--partition", "3", "--json")
    assert [json.loads(x)["value"] for x in out.splitlines()] == (["a", "b", "c", "probe"] if want == 3 else ["c"])
    code, _, err = run(capsys, "produce", d, "t", "--partition", "9", stdin=b"x\n", monkeypatch=monkeypatch)
    assert code == exits.USAGE and "no partition 9" in err


def test_produce_transactional_is_all_or_nothing(capsys, monkeypatch, data):
    before = end_offsets(data)["empty"]
    good = b"".join(b'{"value": "v%d"}\n' % i for i in range(10))
    code, _, err = run(capsys, "produce", data, "empty", "--json", "--transactional", "--batch-size", "3",
                       stdin=good + b"{broken\n", monkeypatch=monkeypatch)
    assert code == exits.USAGE
    assert "line 11: not a JSON object" in err and "nothing was produced: the transaction was aborted" in err
    code, out, _ = run(capsys, "consume", data, "empty", "--isolation", "read_committed")
    assert out == ""
    # Without --transactional the batches before the bad line were produced.
    code, _, err = run(capsys, "produce", data, "empty", "--json", "--batch-size", "3",
                       stdin=good + b"[1]\n", monkeypatch=monkeypatch)
    assert code == exits.USAGE
    assert "line 11: expected a JSON object" in err and "9 message(s) before line 11 were produced" in err
    code, out, _ = run(capsys, "consume", data, "empty")
    assert out.splitlines() == [f"v{i}" for i in range(9)]
    code, out, _ = run(capsys, "produce", data, "empty", "--transactional", "--json-summary",
                       stdin=b"t1\nt2\n", monkeypatch=monkeypatch)
    assert code == 0 and json.loads(out)["transaction"].startswith("(")
    assert end_offsets(data)["empty"] != before


def test_produce_file_with_progress(capsys, tmp_path, data):
    src = tmp_path / "in.txt"
    src.write_bytes(b"".join(b"line-%06d\n" % i for i in range(20_000)))
    code, out, err = run(capsys, "produce", data, "empty", src, "--progress", "--batch-size", "500")
    assert code == 0
    assert "produce empty [" in err and "produced 20,000 message(s)" in err
    code, _, err = run(capsys, "produce", data, "empty", tmp_path / "missing.txt")
    assert code == exits.USAGE and "does not exist" in err


def test_consume_isolation_levels(capsys, data):
    code, out, _ = run(capsys, "consume", data, "orders", "--partition", "0")
    values = out.splitlines()
    assert "committed" in values and "aborted" not in values
    code, out, err = run(capsys, "consume", data, "orders", "--partition", "0", "--isolation", "read_uncommitted")
    assert code == 0 and "read_uncommitted" in err
    assert "committed" in out.splitlines() and "aborted" in out.splitlines()


def test_consume_offsets_and_limits(capsys, data):
    code, out, _ = run(capsys, "consume", data, "orders", "--json")
    every = [json.loads(x) for x in out.splitlines()]
    assert len(every) == 31              # 30 + the committed one; markers and aborted skipped
    p1 = sorted(m["offset"] for m in every if m["partition"] == 1)
    code, out, _ = run(capsys, "consume", data, "orders", "--partition", "1", "--from", p1[1],
                       "--until", p1[3], "--json")
    assert [json.loads(x)["offset"] for x in out.splitlines()] == p1[1:3]
    code, out, _ = run(capsys, "consume", data, "orders", "-n", "4")
    assert code == 0 and len(out.splitlines()) == 4
    code, out, _ = run(capsys, "consume", data, "orders", "--from", "latest")
    assert code == 0 and out == ""
    code, _, err = run(capsys, "consume", data, "orders", "--partition", "1", "--from", "999")
    assert code == exits.USAGE and f"--from 999 is outside orders/1, which holds offsets 0 to {len(p1) - 1}" in err
    code, _, err = run(capsys, "consume", data, "orders", "--from", "2")
    assert code == exits.USAGE and "needs --partition P" in err
    code, _, err = run(capsys, "consume", data, "orders", "--from", "-3")
    assert code == exits.USAGE and "bad offset '-3'" in err
    code, _, err = run(capsys, "consume", data, "orders", "--partition", "1", "--from", "3", "--until", "1")
    assert code == exits.USAGE and "--until 1 is before --from 3" in err


def test_consume_durable_subscription_acks(capsys, data):
    code, out, err = run(capsys, "consume", data, "orders", "-s", "audit", "-n", "10")
    assert code == 0 and len(out.splitlines()) == 10
    assert "subscription 'audit'" in err
    code, out, _ = run(capsys, "consume", data, "orders", "-s", "audit")
    assert len(out.splitlines()) == 21                  # the rest, once
    code, out, _ = run(capsys, "consume", data, "orders", "-s", "audit")
    assert out == ""
    code, out, _ = run(capsys, "subscriptions", "describe", data, "orders", "audit", "--json")
    assert json.loads(out)["backlog"] == 0
    code, _, err = run(capsys, "consume", data, "orders", "-s", "audit", "--isolation", "read_uncommitted")
    assert code == exits.USAGE and "reads read_committed (fixed when it was created)" in err


# -- subscriptions ------------------------------------------------------------------------------

def test_subscription_stats_view_each_partition_once(monkeypatch, data):
    """However many subscriptions, a command views each partition once:
    the figures of one command agree with each other."""
    from txmq.cli.view import DirectoryView
    with txmq.Broker(data, fsync="never") as b:
        b.subscribe("orders", "audit", initial_position="earliest").close()
    viewed = []
    real = readonly.ReadOnlyDirectory.view
    monkeypatch.setattr(readonly.ReadOnlyDirectory, "view",
                        lambda self, topic, p, **kw: viewed.append((topic, p)) or real(self, topic, p, **kw))
    with DirectoryView(data) as v:
        stats = v.subscription_stats("orders")
        assert sorted(stats) == ["audit", "billing"]
        assert [p["partition"] for p in stats["billing"]["partitions"]] == [0, 1, 2]
        v.partition_stats("orders")
    assert sorted(viewed) == [("orders", 0), ("orders", 1), ("orders", 2)]


def test_subscriptions_list_describe_reset(capsys, data):
    code, out, _ = run(capsys, "subscriptions", "list", data)
    assert code == 0
    head, row = out.splitlines()
    assert head.split() == ["TOPIC", "SUBSCRIPTION", "TYPE", "ISOLATION", "BACKLOG"]
    assert row.split() == ["orders", "billing", "exclusive", "read_committed", "26"]
    code, out, _ = run(capsys, "subscriptions", "describe", data, "orders", "billing")
    assert code == 0 and out.startswith("subscription billing on orders: exclusive, read_committed, backlog 26")
    code, out, _ = run(capsys, "subscriptions", "reset", data, "orders", "billing", "--to", "latest", "--json")
    assert code == 0 and json.loads(out)["backlog"] == 0
    code, out, _ = run(capsys, "subscriptions", "reset", data, "orders", "billing", "--to", "earliest")
    assert code == 0 and out.startswith("reset orders/billing to earliest on every partition\n\n"
                                        "subscription billing on orders: exclusive, read_committed, backlog 31\n")
    code, out, _ = run(capsys, "subscriptions", "reset", data, "orders", "billing", "--to", "latest")
    code, out, _ = run(capsys, "subscriptions", "reset", data, "orders", "billing", "--to", "2",
                       "--partition", "1", "--json")
    sub = json.loads(out)
    assert sub["partitions"][1]["mark_delete"] == 2 and sub["type"] == "exclusive"
    code, _, err = run(capsys, "subscriptions", "reset", data, "orders", "billing", "--to", "2")
    assert code == exits.USAGE and "add --partition P" in err
    code, _, err = run(capsys, "subscriptions", "reset", data, "orders", "billing", "--to", "500", "--partition", "1")
    assert code == exits.USAGE and "--to 500 is outside orders/1" in err
    code, _, err = run(capsys, "subscriptions", "describe", data, "orders", "bill")
    assert code == exits.USAGE and "topic 'orders' has no subscription 'bill'; its subscriptions: billing" in err


def test_an_out_of_order_subscription_is_described_reset_and_consumed(capsys, monkeypatch, data):
    """describe shows allow_out_of_order_delivery and a backlog past an open
    transaction (the held broker's: committed data after it counts, the open
    one's does not); reset and consume -s keep the setting."""
    with txmq.Broker(data, fsync="never", linger_ms=0) as b:
        b.subscribe("orders", "ooo", "shared", initial_position="earliest", allow_out_of_order_delivery=True).close()
        txn = b.new_transaction(timeout=120)
        p = b.producer("orders")
        p.send_batch([b"held"] * 4, partition=0, txn=txn)
        p.send_batch([b"past"] * 3, partition=0)
        code, out, _ = run(capsys, "subscriptions", "describe", data, "orders", "ooo")
        assert code == 0 and out.startswith("subscription ooo on orders: shared, read_committed, out of order "
                                            "(allow_out_of_order_delivery), backlog 34\n")    # 30 + committed + 3
        code, out, _ = run(capsys, "subscriptions", "describe", data, "orders", "billing", "--json")
        assert json.loads(out)["allow_out_of_order_delivery"] is False
        code, out, _ = run(capsys, "subscriptions", "describe", data, "orders", "ooo", "--json")
        assert json.loads(out)["backlog"] == 34 == sum(b.consumer_lag("orders", "ooo").values())
        # The commands that attach a consumer keep the setting: they are handed this broker.
        monkeypatch.setattr(opening, "open_for_writing", lambda path, progress=None, create=False: _Held(b))
        code, out, _ = run(capsys, "subscriptions", "reset", data, "orders", "ooo", "--to", "latest", "--json")
        assert code == 0 and json.loads(out)["allow_out_of_order_delivery"] is True
        code, out, _ = run(capsys, "subscriptions", "reset", data, "orders", "ooo", "--to", "earliest")
        assert code == 0
        code, out, err = run(capsys, "consume", data, "orders", "-s", "ooo", "--timeout", "0.5")
        assert code == 0, err
        assert sorted(out.splitlines()) == sorted([f"m{i:02d}" for i in range(30)] + ["committed"] + ["past"] * 3)
        txn.abort()
    code, out, _ = run(capsys, "subscriptions", "describe", data, "orders", "ooo", "--json")
    assert json.loads(out)["backlog"] == 0


# -- transactions -------------------------------------------------------------------------------

class _Held:
    """A broker this test holds open, handed to a command that changes the
    directory as if it were its own: the command does not close it."""

    def __init__(self, broker):
        self.broker = broker

    def __enter__(self):
        return self.broker

    def __exit__(self, *exc):
        pass


def test_transactions_list_describe_abort(capsys, monkeypatch, data):
    code, out, _ = run(capsys, "transactions", "list", data)
    assert code == 0 and out == "no live transactions\n"
    with txmq.Broker(data, fsync="never") as b:
        # list and describe read the held directory (this process holds it);
        # abort needs the owner: it is handed this broker.
        txn = b.new_transaction(timeout=120)
        b.producer("orders").send(b"held", partition=2, txn=txn).offset    # appended now, not only accumulated
        txn.flush()                     # named in the coordinator log now (else within 50 ms)
        monkeypatch.setattr(opening, "open_for_writing", lambda path, progress=None, create=False: _Held(b))
        code, out, _ = run(capsys, "transactions", "list", data)
        assert code == 0
        head, row = out.splitlines()
        assert head.split()[:3] == ["ID", "STATE", "AGE"]
        assert row.split()[0] == str(txn.id) and row.split()[1] == "OPEN" and "orders/2" in row
        code, out, _ = run(capsys, "transactions", "describe", data, str(txn.id), "--json")
        info = json.loads(out)
        assert info["blocking"] == ["orders/2"] and info["timeout_s"] == 120
        code, out, _ = run(capsys, "transactions", "describe", data, str(txn.id))
        assert "holds back:" in out and "orders/2" in out
        code, out, _ = run(capsys, "transactions", "abort", data, f"{txn.id.coordinator},{txn.id.sequence}")
        assert code == 0 and f"aborted transaction {txn.id}" in out
        assert txn.state.value == "ABORTED"
        code, _, err = run(capsys, "transactions", "abort", data, str(txn.id))
        assert code == exits.USAGE and "is not live (live transactions: none)" in err
        code, out, _ = run(capsys, "transactions", "list", data)
        assert code == 0 and out == "no live transactions\n"
        code, _, err = run(capsys, "transactions", "describe", data, str(txn.id))
        assert code == exits.USAGE and f"transaction {txn.id} is not live (live transactions: none)" in err
    code, _, err = run(capsys, "transactions", "describe", data, "seven")
    assert code == exits.USAGE and "bad transaction id 'seven'" in err


# -- stats ----------------------------------------------------------------------------------------

def test_stats(capsys, data):
    code, out, _ = run(capsys, "stats", data)
    assert code == 0
    assert f"data directory {os.path.abspath(data)}" in out and "topic orders" in out and "topic empty" in out
    assert out.startswith(f"data directory {os.path.abspath(data)} (a read-only view; no process holds it)\n")
    assert "transactions: 0 open, 0 committing, 0 aborting, 0 prepared" in out
    code, out, _ = run(capsys, "stats", data, "--json")
    st = json.loads(out)
    assert set(st["topics"]) == {"orders", "empty"} and st["writer_pid"] is None
    assert [p["source"] for p in st["topics"]["orders"]["partitions"]] == ["readview"] * 3
    assert st["topics"]["orders"]["subscriptions"]["billing"]["backlog"] == 26


# -- how read commands open the directory -------------------------------------------------------

def test_read_commands_go_through_open_for_reading(capsys, monkeypatch, data):
    """...and change nothing on a directory no process holds: no recovery,
    no temporary subscription, no file touched."""
    before = _files(data)
    calls = []
    real = opening.open_for_reading
    monkeypatch.setattr(opening, "open_for_reading", lambda path, progress=None: calls.append("r") or real(path))
    monkeypatch.setattr(opening, "open_for_writing",
                        lambda *a, **k: pytest.fail("a read command opened the directory for writing"))
    reads = [["topics", "list", data], ["topics", "describe", data, "orders"], ["consume", data, "orders"],
             ["transactions", "list", data], ["subscriptions", "list", data],
             ["subscriptions", "describe", data, "orders", "billing"], ["stats", data]]
    for argv in reads:
        code, _, _ = run(capsys, *argv)
        assert code == 0, argv
    assert len(calls) == len(reads)
    code, _, err = run(capsys, "transactions", "describe", data, "(0,1)")
    assert code == exits.USAGE and len(calls) == len(reads) + 1
    assert _files(data) == before


def _files(path) -> dict:
    """Every entry under ``path``: a file's size, mtime and SHA-256 (a
    socket, the owner's control.sock, by its kind only)."""
    out = {}
    for d, _, names in os.walk(path):
        for n in names:
            p = os.path.join(d, n)
            st = os.stat(p)
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    out[p] = (st.st_size, st.st_mtime_ns, hashlib.sha256(f.read()).hexdigest())
            else:
                out[p] = stat.S_IFMT(st.st_mode)
    return out


# The owner in another process: it opens the directory, acknowledges 3 of
# billing's messages, leaves a transaction open on orders/0 with a plain
# message after it, prints READY and what it sees, and waits for a line on
# stdin; then it sends and commits one more transaction, commits the open
# one and closes. Its background snapshots are pushed out so that it
# writes nothing of its own while the commands read.
HOLDER = r"""
import json, sys
import txmq, txmq.broker.broker
txmq.broker.broker.SNAPSHOT_INTERVAL = 3600.0
b = txmq.Broker(sys.argv[1], fsync="never", retention_check_interval=3600.0, half_check_interval=3600.0)
c = b.subscribe("orders", "billing")
c.ack(c.receive_many(3, timeout=1.0))
c.close()
p = b.producer("orders")
txn = b.new_transaction(timeout=600)
p.send_batch([b"open-1", b"open-2"], partition=0, txn=txn)
txn.flush()         # (its coordinator log names its partition now, not within the next timeout check)
p.send(b"after-open", partition=0)
st = b.stats()["topics"]["orders"]
print("READY", json.dumps({"txn": str(txn.id), "ends": b.describe_topic("orders")["end_offsets"],
                           "lso": [q["max_read_position"] for q in st["partitions"]],
                           "billing": st["subscriptions"]["billing"]}), flush=True)
sys.stdin.readline()
with b.transaction() as later:
    p.send(b"later", partition=1, txn=later)
txn.commit()
b.close()
print("DONE", flush=True)
"""


def test_read_commands_on_a_directory_another_process_holds(capsys, data):
    def values(*extra):
        code, out, _ = run(capsys, "consume", data, "orders", "--partition", "0", "--json", *extra)
        assert code == 0
        return [json.loads(x)["value"] for x in out.splitlines()]

    committed, uncommitted = values(), values("--isolation", "read_uncommitted")
    assert uncommitted == committed + ["aborted"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([PY_DIR, os.environ.get("PYTHONPATH", "")]))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, data], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env)
    try:
        word, seen = holder.stdout.readline().split(" ", 1)
        assert word == "READY"
        seen = json.loads(seen)
        txn, billing = seen["txn"], seen["billing"]
        before = _files(data)

        # consume: read_committed stops at the open transaction; read_uncommitted reads past it.
        assert values() == committed
        assert values("--isolation", "read_uncommitted") == uncommitted + ["open-1", "open-2", "after-open"]
        code, out, err = run(capsys, "consume", data, "orders", "--partition", "0", "--from", seen["lso"][0],
                             "--isolation", "read_uncommitted")
        assert code == 0 and out == "open-1\nopen-2\nafter-open\n"
        assert "consumed 3 message(s) from 'orders' (a non-durable read, read_uncommitted)" in err

        code, out, _ = run(capsys, "topics", "list", data, "--json")
        assert code == 0
        assert {t["name"]: t["end_offsets"] for t in json.loads(out)}["orders"] == seen["ends"]
        code, out, _ = run(capsys, "topics", "describe", data, "orders", "--json")
        info = json.loads(out)
        assert code == 0 and info["end_offsets"] == seen["ends"]
        assert [q["max_read_position"] for q in info["partition_stats"]] == seen["lso"]
        p0 = info["partition_stats"][0]
        assert (p0["open_transactions"], p0["blocked_by"], p0["source"]) == (1, txn, "readview")
        assert info["subscription_stats"]["billing"]["backlog"] == billing["backlog"] == 23

        code, out, _ = run(capsys, "transactions", "list", data)
        assert code == 0
        head, row = out.splitlines()
        assert row.split()[:2] == [txn, "OPEN"] and row.split()[-4:] == ["orders/0", "-", "-", "orders/0"]
        code, out, _ = run(capsys, "transactions", "describe", data, txn, "--json")
        described = json.loads(out)
        assert code == 0 and described["blocking"] == ["orders/0"] and described["timeout_s"] == 600

        code, out, _ = run(capsys, "subscriptions", "describe", data, "orders", "billing", "--json")
        sub = json.loads(out)
        assert code == 0 and sub["backlog"] == 23
        assert [q["mark_delete"] for q in sub["partitions"]] == [q["mark_delete"] for q in billing["partitions"]]
        code, out, _ = run(capsys, "subscriptions", "list", data)
        assert code == 0 and out.splitlines()[1].split() == ["orders", "billing", "exclusive", "read_committed", "23"]

        code, out, _ = run(capsys, "stats", data)
        assert code == 0
        assert out.startswith(f"data directory {data} (a read-only view; held by pid {holder.pid})\n")
        assert "transactions: 1 open, 0 committing, 0 aborting, 0 prepared" in out
        code, out, _ = run(capsys, "stats", data, "--json")
        st = json.loads(out)
        assert st["writer_pid"] == holder.pid and [t["id"] for t in st["transactions"]] == [txn]

        for argv in WRITE_COMMANDS:           # these need the owner
            code, out, err = run(capsys, *[a.format(d=data) for a in argv])
            assert code == exits.LOCKED and f"(pid {holder.pid}) holds it open" in err, argv
        assert _files(data) == before         # nothing written, created or removed

        out, _ = holder.communicate("go\n", timeout=60)
        assert out.strip() == "DONE" and holder.returncode == 0
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert values() == committed + ["open-1", "open-2", "after-open"]
    code, out, _ = run(capsys, "consume", data, "orders", "--partition", "1")
    assert code == 0 and out.splitlines()[-1] == "later"
    code, out, _ = run(capsys, "transactions", "list", data)
    assert out == "no live transactions\n"


def test_spinner_while_reading_and_opening(capsys, monkeypatch, data):
    monkeypatch.setattr(output, "SPINNER_DELAY_S", 0.0)
    real_view = readonly.ReadOnlyDirectory.view

    def slow_view(self, *a, **k):            # a partition its dead owner left unpublished: scanned
        time.sleep(0.1)
        return real_view(self, *a, **k)

    monkeypatch.setattr(readonly.ReadOnlyDirectory, "view", slow_view)
    code, _, err = run(capsys, "topics", "list", data, "--progress")
    assert code == 0 and f"reading {os.path.abspath(data)}" in err and " s" in err
    code, _, err = run(capsys, "topics", "list", data, "--no-progress")
    assert code == 0 and err == ""
    real_broker = txmq.Broker

    def slow_broker(path, *a, **k):
        time.sleep(0.3)
        return real_broker(path, *a, **k)

    monkeypatch.setattr(txmq, "Broker", slow_broker)
    code, _, err = run(capsys, "topics", "create", data, "more", "--progress")
    assert code == 0 and f"opening {data}" in err


# -- check ----------------------------------------------------------------------------------------

def _tree(path):
    """Every file's bytes and mtime: check must change none."""
    out = {}
    for d, _, files in os.walk(path):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[p] = (fh.read(), os.stat(p).st_mtime_ns)
    return out


@pytest.fixture
def logs(tmp_path):
    """A directory with many batches in one segment and a dense index."""
    path = str(tmp_path / "logs")
    # (linger_ms=0: the aborted send is in the log, with its marker and .txnindex entry)
    with txmq.Broker(path, fsync="never", index_interval_bytes=256, linger_ms=0) as b:
        b.create_topic("t")
        p = b.producer("t")
        for i in range(40):
            p.send_batch([b"value-%d-%d" % (i, j) for j in range(5)])
        txn = b.new_transaction()
        p.send(b"gone", txn=txn)
        txn.abort()
        c = b.subscribe("t", "s", initial_position="earliest")
        for m in c.receive_many(20, timeout=1.0):
            c.ack(m)
    return path


def _segment(path):
    return os.path.join(path, "topics", "t", "0", f"{0:020d}.log")


def _starts(seg):
    return [pos for pos, _, _ in batch_positions(seg)]


def _frame_positions(log):
    with open(log, "rb") as f:
        raw = f.read()
    pos, out = 8, []
    while pos + 9 <= len(raw):
        out.append(pos)
        pos += 8 + struct.unpack_from("<I", raw, pos)[0]
    return out


def _problems(capsys, path):
    code, out, _ = run(capsys, "check", path, "--json")
    report = json.loads(out)
    assert report["ok"] == (code == 0)
    return code, [(p["path"], p["position"], p["reason"], p["kind"]) for p in report["problems"]]


def test_check_clean_directory(capsys, monkeypatch, logs, data):
    def no_broker(*a, **k):
        raise AssertionError("check opened a broker")

    monkeypatch.setattr(txmq, "Broker", no_broker)
    for path in (logs, data):
        code, out, _ = run(capsys, "check", path)
        assert code == 0, out
        assert out.splitlines()[-1].endswith(": no problems")
        code, problems = _problems(capsys, path)
        assert code == 0 and problems == []


def test_check_flipped_byte_in_a_batch(capsys, logs):
    seg = _segment(logs)
    positions = _starts(seg)
    target = positions[7]
    flip(seg, target + 100)                      # inside the 8th batch's sections
    before = _tree(logs)
    code, problems = _problems(capsys, logs)
    assert code == exits.PROBLEMS
    # The batches after it are sound: the bad one is quarantined, not cut
    # with them (test_loader_agreement).
    assert problems[0][:3] == (seg, target, "CRC mismatch; opening keeps the log around it: its offsets are "
                                            "quarantined (lost), readers skip them and report the loss")
    assert problems[0][3] == "corrupt"
    assert _tree(logs) == before                  # nothing modified
    code, out, _ = run(capsys, "check", logs)
    assert f"{seg} at byte {target}: CRC mismatch" in out and out.splitlines()[-1].endswith("problem(s)")


def test_check_segment_truncated_mid_batch(capsys, logs):
    seg = _segment(logs)
    positions = _starts(seg)
    cut = positions[-3] + 40                      # inside the header of the third batch from the end
    os.truncate(seg, cut)
    code, problems = _problems(capsys, logs)
    assert code == exits.PROBLEMS
    segment_problems = [p for p in problems if p[0] == seg]
    assert segment_problems == [(seg, positions[-3], "batch header past the end of the segment; "
                                                     "opening cuts the log here", "corrupt")]


def test_check_corrupt_index_entry(capsys, monkeypatch, logs):
    index = _segment(logs)[:-4] + ".index"
    assert os.path.getsize(index) >= 5 * 16
    with open(index, "r+b") as f:
        f.seek(3 * 16 + 8)
        wrong = struct.unpack("<q", f.read(8))[0] + 8   # past the fourth entry's batch start
        f.seek(4 * 16 + 8)                        # the position of the fifth entry
        f.write(struct.pack("<q", wrong))
    code, problems = _problems(capsys, logs)
    assert code == exits.PROBLEMS
    assert len(problems) == 1
    path, position, reason, kind = problems[0]
    assert (path, position, kind) == (index, 64, "repairable")
    assert f"position {wrong}) points away from the batch of that offset" in reason
    monkeypatch.setenv("TXMQ_DEBUG", "0")        # "repairable" means this
    with txmq.Broker(logs, fsync="never") as b:
        part = b._topics["t"].partitions[0]
        # Opening (when the shift also breaks the time index's check, which
        # depends on the ms the fixture's batches got), the broker's scrub
        # timer or this call rebuilds it, and each one says so.
        part.scrub_indexes(None)
        assert [str(d) for d in part.dropped if "index rebuilt" in str(d)] != []
    assert _problems(capsys, logs) == (exits.OK, [])


def test_open_reports_the_active_segments_index_it_rebuilt(capsys, monkeypatch, logs):
    """The active segment's last index entry is checked on open, below a
    recovery point that covers the whole segment: a wrong one is rebuilt
    by the scan and reported (stats' truncated_on_open, the log), as for a
    sealed segment; check found it repairable and then finds clean."""
    index = _segment(logs)[:-4] + ".index"
    last = os.path.getsize(index) // 16 - 1
    with open(index, "r+b") as f:
        f.seek(last * 16 + 8)
        wrong = struct.unpack("<q", f.read(8))[0] + 8
        f.seek(last * 16 + 8)
        f.write(struct.pack("<q", wrong))
    code, problems = _problems(capsys, logs)
    assert code == exits.PROBLEMS and [p[3] for p in problems] == ["repairable"]
    monkeypatch.setenv("TXMQ_DEBUG", "0")
    with txmq.Broker(logs, fsync="never") as b:
        part = b._topics["t"].partitions[0]
        assert part.scrub_indexes(None) == 0          # opening rebuilt it already
        rebuilt = [str(d) for d in part.dropped if "index rebuilt" in str(d)]
        assert len(rebuilt) == 1 and rebuilt[0].startswith(index), rebuilt
        assert rebuilt == [t for t in b.stats()["topics"]["t"]["partitions"][0]["truncated_on_open"]
                           if "index rebuilt" in t]
        c = b.subscribe("t", "s2", initial_position="earliest")
        assert len(c.receive_many(300, timeout=1.0)) == 200
    assert _problems(capsys, logs) == (exits.OK, [])


def _open_once(path, monkeypatch):
    """Open and close a broker and its partition (partitions open on first
    use) as a user does: without TXMQ_DEBUG's O(n) verify, which would
    rebuild a wrong index itself."""
    monkeypatch.setenv("TXMQ_DEBUG", "0")
    with txmq.Broker(path, fsync="never") as b:
        assert b.high_watermark("t", 0) > 0


@pytest.fixture
def sealed(tmp_path):
    """A directory whose partition has sealed segments (their indexes are
    adopted on open, not rescanned) with a dense index."""
    path = str(tmp_path / "sealed")
    with txmq.Broker(path, fsync="never", segment_bytes_max=8192, index_interval_bytes=256) as b:
        b.create_topic("t")
        p = b.producer("t")
        for i in range(60):
            p.send_batch([b"value-%d-%d" % (i, j) for j in range(5)])
            time.sleep(0.002)                     # a time index entry per index entry
    pdir = os.path.join(path, "topics", "t", "0")
    assert len([n for n in os.listdir(pdir) if n.endswith(".log")]) >= 2
    return path


@pytest.mark.parametrize("suffix, field", [(".index", 8), (".index", 0), (".timeindex", 0)])
def test_check_shifted_index_entry_of_a_sealed_segment(capsys, monkeypatch, sealed, suffix, field):
    """A wrong entry that is still in order (a shifted position, offset or
    time) is one check reports repairable and the broker's background index
    check (every entry of a sealed segment; opening checks only order,
    range and the ends) rebuilds; check then finds clean, and the broker
    reads right before and after."""
    index = os.path.join(sealed, "topics", "t", "0", f"{0:020d}{suffix}")
    with open(index, "r+b") as f:
        f.seek(2 * 16 + field)
        value = struct.unpack("<q", f.read(8))[0]
        f.seek(2 * 16 + field)
        f.write(struct.pack("<q", value + (8 if field else 1)))
    code, problems = _problems(capsys, sealed)
    assert code == exits.PROBLEMS and len(problems) == 1
    assert problems[0][:2] == (index, 32) and problems[0][3] == "repairable"
    assert "the broker rebuilds the index" in problems[0][2]
    monkeypatch.setenv("TXMQ_DEBUG", "0")
    with txmq.Broker(sealed, fsync="never") as b:
        c = b.subscribe("t", "s", initial_position="earliest")
        assert [m.value for m in c.receive_many(300, timeout=1.0)][:6] == [
            b"value-0-%d" % j for j in range(5)] + [b"value-1-0"]
        part = b._topics["t"].partitions[0]
        part.scrub_indexes(None)                  # (an offset shift is caught on open already)
        assert part.scrub_indexes(None) == 0
        assert "index rebuilt" in str(b.stats()["topics"]["t"]["partitions"][0]["truncated_on_open"])
    assert _problems(capsys, sealed) == (exits.OK, [])


def test_check_torn_index_of_a_sealed_segment_is_repaired_by_open(capsys, monkeypatch, sealed):
    index = os.path.join(sealed, "topics", "t", "0", f"{0:020d}.index")
    with open(index, "ab") as f:
        f.write(b"\1\2\3")
    code, problems = _problems(capsys, sealed)
    assert code == exits.PROBLEMS and problems[0][:2] == (index, os.path.getsize(index) - 3)
    _open_once(sealed, monkeypatch)
    assert _problems(capsys, sealed) == (exits.OK, [])


def test_check_torn_and_misordered_time_index(capsys, logs):
    tindex = _segment(logs)[:-4] + ".timeindex"
    with open(tindex, "ab") as f:
        f.write(b"\1\2\3")
    code, problems = _problems(capsys, logs)
    size = os.path.getsize(tindex) - 3
    assert code == exits.PROBLEMS and problems == [(tindex, size, "torn last entry (3 of 16 bytes)", "repairable")]


def test_check_corrupt_redo_log_frame(capsys, logs):
    cursor = os.path.join(logs, "subscriptions", "t", "s", "cursor-0.log")
    frames = _frame_positions(cursor)
    assert len(frames) >= 5
    flip(cursor, frames[3] + 10)                 # payload of the fourth frame
    code, problems = _problems(capsys, logs)
    assert code == exits.PROBLEMS
    size = os.path.getsize(cursor)
    assert problems == [(cursor, frames[3], f"frame CRC mismatch; opening cuts the log here ({size - frames[3]:,} "
                                            f"bytes, the frames from here on, are dropped)", "corrupt")]


def test_check_cursor_frames_replayed_as_the_broker_replays_them(capsys, logs):
    """An ACK_RANGE that ends before it starts acknowledges nothing: the
    broker opens the cursor and check agrees; an ACK_RANGE of the wrong
    size is refused by both, at the byte where its missing end should be."""
    from txmq._redolog import FRAME_HEADER_BYTES, frame
    from txmq.storage.cursor import ACK_RANGE
    from txmq.errors import CorruptLogError
    cursor = os.path.join(logs, "subscriptions", "t", "s", "cursor-0.log")
    with open(cursor, "ab") as f:
        f.write(frame(ACK_RANGE, struct.pack("<qq", 30, 25)))
    assert _problems(capsys, logs) == (exits.OK, [])
    with txmq.Broker(logs, fsync="never") as b:
        assert b.subscribe("t", "s").receive(timeout=1.0).message_id.offset == 20
    end = os.path.getsize(cursor)
    with open(cursor, "ab") as f:
        f.write(frame(ACK_RANGE, struct.pack("<q", 30)))
    code, problems = _problems(capsys, logs)
    assert code == exits.PROBLEMS and len(problems) == 1
    missing_end = end + FRAME_HEADER_BYTES + 8       # the payload holds the start only
    assert problems[0][:2] == (cursor, missing_end) and problems[0][3] == "corrupt"
    assert problems[0][2].startswith("cursor frame of type 5: ") and "refuses the file" in problems[0][2]
    with pytest.raises(CorruptLogError, match="cursor frame") as e:
        txmq.Broker(logs, fsync="never")
    assert (e.value.path, e.value.position) == (cursor, missing_end)


def test_check_coordinator_frame_that_does_not_parse(capsys, logs):
    """A frame with a right CRC whose payload is wrong is found by replay,
    at the byte of the transaction id it names."""
    from txmq._redolog import FRAME_HEADER_BYTES, frame
    tc = os.path.join(logs, "coordinator", "tc-0.log")
    end = os.path.getsize(tc)
    with open(tc, "ab") as f:
        f.write(frame(5, b"\0" * 16))             # COMMITTING a transaction never begun
        f.write(frame(7, b"\0" * 16))
    code, problems = _problems(capsys, logs)
    assert code == exits.PROBLEMS
    assert len(problems) == 1 and problems[0][:2] == (tc, end + FRAME_HEADER_BYTES)
    assert "coordinator frame of type 5" in problems[0][2] and "before its BEGIN" in problems[0][2]


def test_check_txnindex_and_snapshot(capsys, logs):
    pdir = os.path.join(logs, "topics", "t", "0")
    txnindex = os.path.join(pdir, f"{0:020d}.txnindex")
    assert os.path.getsize(txnindex) == 48         # the aborted transaction
    flip(txnindex, 30)
    snap = os.path.join(pdir, "txnbuffer.snap")
    flip(snap, 20)
    code, problems = _problems(capsys, logs)
    assert code == exits.PROBLEMS
    assert (txnindex, 0, "entry fails its CRC", "repairable") in problems
    assert (snap, os.path.getsize(snap) - 4, "CRC mismatch; the next open rebuilds it from the log",
            "repairable") in problems
    assert len(problems) == 2


def _rewrite_txnindex_entry(path, **change):
    from txmq.storage.layout import TXNINDEX_ENTRY, txnindex_bytes as _txnindex_bytes
    with open(path, "rb") as f:
        hi, lo, pid, first, marker, _ = TXNINDEX_ENTRY.unpack(f.read(48))
    entry = dict(hi=hi, lo=lo, pid=pid, first=first, marker=marker) | change
    with open(path, "wb") as f:
        f.write(_txnindex_bytes([tuple(entry.values())]))
    return entry


def test_check_txnindex_entry_that_names_no_abort_marker_is_corrupt(capsys, monkeypatch, logs):
    """An entry with a good CRC whose marker is a batch of the segment but
    no ABORT marker of its transaction is trusted by opening: check calls
    it corrupt, and it still is after an open."""
    txnindex = os.path.join(logs, "topics", "t", "0", f"{0:020d}.txnindex")
    from txmq.storage.layout import txnindex_bytes as _txnindex_bytes
    entry = _rewrite_txnindex_entry(txnindex, marker=0)          # the first data batch
    for _ in range(2):
        code, problems = _problems(capsys, logs)
        assert code == exits.PROBLEMS and len(problems) == 1
        assert problems[0][:2] == (txnindex, 0) and problems[0][3] == "corrupt"
        assert f"marker 0) does not name an ABORT marker" in problems[0][2]
        _open_once(logs, monkeypatch)
    with open(txnindex, "rb") as f:
        assert f.read() == _txnindex_bytes([tuple(entry.values())])       # kept as it was


def test_check_txnindex_entry_outside_its_segment_is_repaired_by_open(capsys, monkeypatch, logs):
    txnindex = os.path.join(logs, "topics", "t", "0", f"{0:020d}.txnindex")
    _rewrite_txnindex_entry(txnindex, marker=10**9)
    code, problems = _problems(capsys, logs)
    assert code == exits.PROBLEMS and len(problems) == 1
    assert problems[0][:2] == (txnindex, 0) and problems[0][3] == "repairable"
    assert "opening cuts the index here" in problems[0][2]
    _open_once(logs, monkeypatch)
    assert _problems(capsys, logs) == (exits.OK, [])


def test_check_recovery_point_the_broker_refuses(capsys, monkeypatch, logs):
    """A recovery point whose CRC checks but whose next offset lies below
    its segment is refused by opening (it scans every segment) and so
    reported by check; one open replaces it."""
    from txmq._crc32c import crc32c_of
    rp = os.path.join(logs, "topics", "t", "0", "recovery-point")
    with open(rp, "rb") as f:
        magic, version, base, pos, _, _ = struct.unpack("<4sB3xqqqI4x", f.read())
    body = struct.pack("<4sB3xqqq", magic, version, base, pos, base - 1)
    with open(rp, "wb") as f:
        f.write(body + struct.pack("<I4x", crc32c_of(body)))
    code, problems = _problems(capsys, logs)
    assert code == exits.PROBLEMS and len(problems) == 1
    assert problems[0][:2] == (rp, 16) and problems[0][3] == "repairable"
    assert f"next offset {base - 1} is out of range; the next open scans every segment" in problems[0][2]
    _open_once(logs, monkeypatch)
    assert _problems(capsys, logs) == (exits.OK, [])


def test_check_recovery_point_off_a_batch_boundary(capsys, logs):
    from txmq._crc32c import crc32c_of
    rp = os.path.join(logs, "topics", "t", "0", "recovery-point")
    with open(rp, "rb") as f:
        raw = f.read()
    magic, version, base, pos, next_offset, _ = struct.unpack("<4sB3xqqqI4x", raw)
    body = struct.pack("<4sB3xqqq", magic, version, base, pos - 8, next_offset)
    with open(rp, "wb") as f:
        f.write(body + struct.pack("<I4x", crc32c_of(body)))
    code, problems = _problems(capsys, logs)
    assert code == exits.PROBLEMS and len(problems) == 1
    assert problems[0][:2] == (rp, 16) and f"checked to byte {pos - 8}" in problems[0][2]


# -- bench ------------------------------------------------------------------------------------------

@pytest.mark.skipif(not os.path.isfile(os.path.join(BENCH_DIR, "conftest.py")), reason="no bench/ directory")
def test_bench_runs_a_selection_and_prints_ratios(capsys, tmp_path):
    pytest.importorskip("pytest_benchmark")
    # A copy: bench/conftest.py writes results.json beside itself, and the
    # project's own results must stay as the last full run left them.
    copy = tmp_path / "bench"
    copy.mkdir()
    for name in os.listdir(BENCH_DIR):
        if name.endswith(".py"):
            shutil.copy(os.path.join(BENCH_DIR, name), copy / name)
    code, out, err = run(capsys, "bench", "--bench-dir", copy, "--file", "receive", "--json", "--progress")
    assert code == 0, err
    report = json.loads(out)
    names = [r["comparison"] for r in report["comparisons"]]
    assert names == ["receive_many(1000)+ack(list) vs SQLite read_batch",
                     "receive_batch(1000)+ack(batch) vs SQLite read_batch"]
    assert all(r["ratio"] > 0 for r in report["comparisons"])
    assert "bench [" in err and "3 tests" in err
    code, out, _ = run(capsys, "bench", "--bench-dir", copy, "--file", "receive", "-k", "nothing_matches")
    assert code == 0 and out.startswith("no comparison completed")
    code, _, err = run(capsys, "bench", "--bench-dir", copy, "--file", "nope")
    assert code == exits.USAGE and "no benchmark file 'nope'" in err and "receive" in err


# -- demo and the console script ------------------------------------------------------------------

def _script():
    found = shutil.which("txmq")
    candidate = os.path.join(sysconfig.get_path("scripts"), "txmq")
    return candidate if os.path.isfile(candidate) else found


@pytest.mark.skipif(_script() is None, reason="the txmq console script is not installed")
def test_console_script(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([PY_DIR, os.environ.get("PYTHONPATH", "")]))
    d = str(tmp_path / "d")

    def sh(*argv, stdin=b""):
        return subprocess.run([_script(), *argv], input=stdin, capture_output=True, env=env, timeout=60)

    r = sh("topics", "create", d, "t", "-p", "2")
    assert r.returncode == 0, r.stderr
    r = sh("produce", d, "t", "--key", "k", stdin=b"x\ny\n")
    assert r.returncode == 0 and b"produced 2 message(s)" in r.stderr
    r = sh("consume", d, "t")
    assert r.returncode == 0 and r.stdout == b"x\ny\n"
    r = sh("consume", d, "nope")
    assert r.returncode == 2 and r.stderr == b"txmq: error: topic 'nope' does not exist; existing topics: t\n"
    r = sh("check", d)
    assert r.returncode == 0 and r.stdout.endswith(b": no problems\n")
    r = sh("--help")
    assert r.returncode == 0 and b"exit codes:" in r.stdout


def test_check_half_messages(capsys, tmp_path):
    """The half log, its redo log and the state table: a clean store passes;
    a scribbled state record is reported (repairable) where it is."""
    from txmq import LocalTransactionState as S
    path = str(tmp_path / "half")
    with txmq.Broker(path, fsync="never") as b:
        b.create_topic("t")
        hp = b.half_producer("t", "g")
        for i in range(20):
            hp.send_in_transaction(b"%d" % i, lambda m, a, i=i: (S.COMMIT, S.ROLLBACK, S.UNKNOWN)[i % 3])
    code, problems = _problems(capsys, path)
    assert code == 0 and problems == []
    table = os.path.join(path, "half", "statetable")
    with open(table, "r+b") as f:
        f.seek(64 + 5 * 28 + 20)                  # the state of half message 5
        f.write(struct.pack("<i", 3))
    before = _tree(path)
    code, problems = _problems(capsys, path)
    assert code == exits.PROBLEMS and _tree(path) == before
    assert problems == [(table, 64 + 5 * 28, "state record of half message 5 differs from the redo log; "
                                             "rebuilt on the next open", "repairable")]
    redo = os.path.join(path, "half", "redo.log")
    flip(redo, os.path.getsize(redo) - 3)
    code, problems = _problems(capsys, path)
    assert any(p[0] == redo and "CRC" in p[2] for p in problems)
