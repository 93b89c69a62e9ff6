"""The ``txmq`` argument parser and dispatch. docs/CLI.md documents every
command; ``txmq --help`` ends with the exit codes."""

from __future__ import annotations

import argparse
import os
import sys

import txmq

from txmq.cli import admin, bench, bench_gate, check, consume, exits, produce, serve
from txmq.cli.demo import demo
from txmq.demo.scenarios import MIN_SIZE as demo_min_size
from txmq.demo.scenarios import parse_size as parse_demo_size
from txmq.errors import TxmqError

TOPIC_ACTIONS = ("list", "create", "describe", "delete")


def _number(convert, valid, expected: str):
    """An argparse type: ``convert(text)`` when ``valid`` of it, else the
    one-line error that says what was expected."""
    def parse(text: str):
        try:
            v = convert(text)
        except ValueError:
            v = None
        if v is None or not valid(v):
            raise argparse.ArgumentTypeError(f"expected {expected}, not {text!r}")
        return v
    return parse


_positive_int = _number(int, lambda v: v >= 1, "an integer >= 1")
_non_negative_int = _number(int, lambda v: v >= 0, "an integer >= 0")
_seconds = _number(float, lambda v: v > 0, "seconds > 0")


def _bench(args) -> int:
    """``txmq bench``: the gate with ``--gate``, else the benchmarks."""
    bench.check_installed()
    bench_dir = bench.find_bench_dir(args.bench_dir)
    return bench_gate.gate(args, bench_dir) if args.gate else bench.bench(args, bench_dir)


def _demo_size(text: str) -> int:
    try:
        return parse_demo_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _demo_messages(text: str) -> int:
    return max(_positive_int(text), demo_min_size)


def build_parser() -> argparse.ArgumentParser:
    progress = argparse.ArgumentParser(add_help=False)
    g = progress.add_mutually_exclusive_group()
    g.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="draw progress on stderr even when it is not a terminal")
    g.add_argument("--no-progress", dest="progress", action="store_false",
                   help="never draw progress")
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print JSON instead of a table (for scripts)")

    def data_dir(p):
        p.add_argument("dir", metavar="DIR", help="the data directory")

    parser = argparse.ArgumentParser(
        prog="txmq", description="txmq: an embedded transactional message broker. "
                                 "Every command is documented in docs/CLI.md.",
        epilog=exits.EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"txmq {txmq.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    both = [progress, as_json]

    d = sub.add_parser(
        "demo", parents=[progress, as_json],
        help="the bank and the window aggregation, each killed with SIGKILL mid-run; checks exactly-once",
        description="Run txmq's two exactly-once scenarios on a data directory, each with a SIGKILL "
                    "part-way, and check the results against a recomputation from the log. The bank: "
                    "clients send deposits, withdrawals and transfers (one transaction each, some aborted "
                    "on purpose); a read_uncommitted monitor sees open transfers without being held back; "
                    "a read_committed auditor with allow_out_of_order_delivery gets committed requests past "
                    "a transfer held open; a read_committed processor applies each committed request to the "
                    "balances exactly once. The windows: a txmq.functions function sums two input topics into per-window "
                    "totals. Then it shows how to read the output with Spark (and does, when pyspark and "
                    "pyspark_txmq are installed). Progress on stderr, a table of checks on stdout; exit "
                    "1 when a check fails. docs/CLI.md has the details.")
    d.add_argument("--dir", default="txmq-data",
                   help="data directory (default: ./txmq-data); it must be new, empty or an earlier "
                        "demo's, which is replaced")
    d.add_argument("--size", type=_demo_size, default="small",
                   help="small (3,000 bank requests and 3,000 orders: ~10 s on 2 cores), medium (20,000), "
                        "large (100,000), or a number of requests (>= 100)")
    # The old demo's option, still accepted: now a number of requests (at least the minimum).
    d.add_argument("--messages", type=_demo_messages, dest="size", help=argparse.SUPPRESS)
    d.add_argument("--seed", type=_non_negative_int,
                   help="seed of the requests, orders and kill points (default: random, printed)")
    keep = d.add_mutually_exclusive_group()
    keep.add_argument("--keep", dest="keep", action="store_true", default=True,
                      help="keep the data directory after the run and print where (the default)")
    keep.add_argument("--delete", dest="keep", action="store_false",
                      help="delete the data directory after the run")
    d.add_argument("--no-spark", dest="spark", action="store_false",
                   help="do not read the output with Spark even when pyspark and pyspark_txmq are installed")

    # topics
    t = sub.add_parser("topics", help="list, create, describe or delete topics")
    ts = t.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = ts.add_parser("list", parents=both, help="every topic: partitions, offsets, subscriptions")
    data_dir(p)
    p.set_defaults(run=admin.topics_list)
    p = ts.add_parser("create", parents=both, help="create a topic (and the data directory if needed)")
    data_dir(p)
    p.add_argument("topic", metavar="TOPIC")
    p.add_argument("-p", "--partitions", type=_positive_int, default=1, help="number of partitions (default 1)")
    p.add_argument("--retention-ms", type=_non_negative_int, help="delete segments older than this")
    p.add_argument("--retention-bytes", type=_non_negative_int, help="keep at most this many bytes per partition")
    p.set_defaults(run=admin.topics_create)
    p = ts.add_parser("describe", parents=both, help="a topic's partitions and subscriptions")
    data_dir(p)
    p.add_argument("topic", metavar="TOPIC")
    p.set_defaults(run=admin.topics_describe)
    p = ts.add_parser("delete", parents=both, help="delete a topic, its data and its subscriptions")
    data_dir(p)
    p.add_argument("topic", metavar="TOPIC")
    p.set_defaults(run=admin.topics_delete)

    # produce
    p = sub.add_parser("produce", parents=[progress], help="send lines of stdin or a file as messages")
    data_dir(p)
    p.add_argument("topic", metavar="TOPIC")
    p.add_argument("file", metavar="FILE", nargs="?", default="-", help="input file (default: stdin)")
    p.add_argument("--key", help="key of every message (UTF-8)")
    p.add_argument("--partition", type=_non_negative_int, help="send every message to this partition")
    p.add_argument("--json", action="store_true",
                   help="each line is a JSON object: value, key, headers, partition, event_time")
    p.add_argument("--batch-size", type=_positive_int, default=1000,
                   help="messages per send_batch (default 1000)")
    p.add_argument("--transactional", action="store_true",
                   help="send everything in one transaction: all of it is produced, or none")
    p.add_argument("--txn-timeout", type=_seconds, default=900.0,
                   help="timeout of that transaction in seconds (default 900, the broker's maximum)")
    p.add_argument("--json-summary", action="store_true", help="print the summary as JSON on stdout")
    p.set_defaults(run=produce.produce)

    # consume
    p = sub.add_parser("consume", parents=[progress], help="print a topic's messages")
    data_dir(p)
    p.add_argument("topic", metavar="TOPIC")
    p.add_argument("-s", "--subscription",
                   help="read as this durable subscription (created if missing) and acknowledge what is "
                        "printed; without it the read is non-durable")
    p.add_argument("--type", choices=("exclusive", "shared", "failover"), default="exclusive",
                   help="type of a subscription created by --subscription (default exclusive)")
    p.add_argument("--isolation", choices=("read_committed", "read_uncommitted"),
                   help="read_committed (default for new reads) or read_uncommitted")
    p.add_argument("--partition", type=_non_negative_int, help="only this partition")
    p.add_argument("--from", dest="from_", metavar="POS",
                   help="earliest, latest or an offset (default: earliest, or the subscription's cursor)")
    p.add_argument("--until", metavar="POS", default="latest",
                   help="stop before this offset, or at latest (default: the end when the read began)")
    p.add_argument("-n", "--max-messages", type=_positive_int, help="stop after this many messages")
    p.add_argument("--timeout", type=_seconds, default=1.0,
                   help="with --subscription: stop when no message came for this many seconds "
                        "(default 1); a non-durable read never waits")
    p.add_argument("--format", choices=("raw", "json"), default="raw",
                   help="raw: the value and a newline; json: one object per line")
    p.add_argument("--json", action="store_true", help="the same as --format json")
    p.add_argument("--fail-on-data-loss", action="store_true",
                   help="stop with an error (exit 4) on reaching offsets lost to damaged bytes "
                        "(quarantined) instead of passing over them")
    p.add_argument("--skip-data-loss", action="store_true",
                   help="with --subscription: first acknowledge the offsets lost to damaged bytes, so the "
                        "subscription moves past them")
    p.set_defaults(run=consume.consume)

    # transactions
    t = sub.add_parser("transactions", help="list, describe or abort live transactions; end prepared ones")
    ts = t.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = ts.add_parser("list", parents=both, help="live transactions")
    data_dir(p)
    p.set_defaults(run=admin.transactions_list)
    for action, helptext, run in (("describe", "one live transaction and what it holds back",
                                   admin.transactions_describe),
                                  ("abort", "force-abort a live transaction", admin.transactions_abort),
                                  ("commit-prepared", "commit a prepared transaction",
                                   admin.transactions_end_prepared),
                                  ("abort-prepared", "abort a prepared transaction",
                                   admin.transactions_end_prepared)):
        p = ts.add_parser(action, parents=both, help=helptext)
        data_dir(p)
        p.add_argument("txn", metavar="TXN", help="transaction id, (tc,seq)")
        p.set_defaults(run=run)

    # subscriptions
    t = sub.add_parser("subscriptions", help="list, describe or reset subscriptions")
    ts = t.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = ts.add_parser("list", parents=both, help="subscriptions of every topic, or of TOPIC")
    data_dir(p)
    p.add_argument("topic", metavar="TOPIC", nargs="?")
    p.set_defaults(run=admin.subscriptions_list)
    p = ts.add_parser("describe", parents=both, help="a subscription's cursor per partition")
    data_dir(p)
    p.add_argument("topic", metavar="TOPIC")
    p.add_argument("subscription", metavar="SUBSCRIPTION")
    p.set_defaults(run=admin.subscriptions_describe)
    p = ts.add_parser("reset", parents=both, help="move a subscription's cursor")
    data_dir(p)
    p.add_argument("topic", metavar="TOPIC")
    p.add_argument("subscription", metavar="SUBSCRIPTION")
    p.add_argument("--to", required=True, metavar="POS", help="earliest, latest or an offset")
    p.add_argument("--partition", type=_non_negative_int, help="only this partition (needed with an offset "
                                                                "on a topic of several partitions)")
    p.set_defaults(run=admin.subscriptions_reset)

    p = sub.add_parser("stats", parents=both, help="every topic, partition, subscription and live transaction (read-only)")
    data_dir(p)
    p.set_defaults(run=admin.stats)

    p = sub.add_parser("check", parents=both,
                       help="verify every file of a data directory without changing it (exit 1 on problems)")
    data_dir(p)
    p.add_argument("--repair", action="store_true",
                   help="first restore the topic.json of topic folders that lost it but hold partition data "
                        "(needs the directory free, else exit 3); then check")
    p.set_defaults(run=check.check)

    p = sub.add_parser("serve", parents=[progress],
                       help="hold DIR as its owner and serve it over Kafka's protocol (docs/KAFKA.md) "
                            "and/or Arrow Flight (docs/SPARK_CLUSTER.md)")
    data_dir(p)
    p.add_argument("--kafka", metavar="HOST:PORT", default=None,
                   help=f"address to listen on (default {serve.DEFAULT_KAFKA} unless only --flight is given; "
                        "0.0.0.0:PORT for every interface)")
    p.add_argument("--flight", metavar="HOST:PORT",
                   help=f"serve Arrow Flight (for Spark executors, docs/SPARK_CLUSTER.md) on this address, e.g. "
                        f"{serve.DEFAULT_FLIGHT}; alone unless --kafka is given too; the bearer token is in "
                        "DIR/flight.token")
    p.add_argument("--flight-tls-cert", metavar="PEM", help="serve Flight over TLS with this certificate (chain)")
    p.add_argument("--flight-tls-key", metavar="PEM", help="... and this private key")
    p.add_argument("--advertised-host", metavar="HOST",
                   help="the host clients are told to connect to (default: the listening host)")
    p.add_argument("--partitions", type=_number(int, lambda n: 1 <= n <= 10000, "an int from 1 to 10000"),
                   default=1, help="partitions of a topic created on first use (default 1)")
    p.add_argument("--no-auto-create", action="store_true",
                   help="refuse unknown topics instead of creating them on first use")
    p.add_argument("--users", metavar="FILE",
                   help="require SASL (PLAIN, SCRAM-SHA-256) with these users and apply their topic ACLs "
                        "(JSON, docs/KAFKA.md)")
    p.set_defaults(run=serve.serve)

    p = sub.add_parser("bench", parents=both, help="run the benchmarks of bench/ and print their ratios")
    p.add_argument("--bench-dir", help="the benchmarks' directory (default: ./bench or the source tree's)")
    p.add_argument("--file", action="append", metavar="NAME",
                   help="only bench/test_bench_NAME.py (repeatable): send, receive, txn, producers, reopen")
    p.add_argument("-k", metavar="EXPR", help="only the benchmarks whose names match (pytest -k)")
    p.add_argument("--reopen", action="store_true",
                   help="include the reopen-after-SIGKILL benchmarks (they write ~2 GiB)")
    p.add_argument("--gate", action="store_true",
                   help="enforce bench/gates.toml: exit 1 when a figure misses its floor or ceiling twice")
    p.add_argument("--quick", action="store_true", help="with --gate: only the quick subset CI runs")
    p.add_argument("--gates", metavar="FILE", help="with --gate: the gates file (default: gates.toml of the "
                                                   "benchmarks' directory)")
    p.add_argument("--save", metavar="NAME", help="save the run in pytest-benchmark's storage (bench/.benchmarks)")
    p.add_argument("--compare", metavar="NAME", help="compare with the saved run NAME; exit 1 past --compare-fail")
    p.add_argument("--compare-fail", metavar="EXPR", default="median:15%",
                   help="pytest-benchmark's --benchmark-compare-fail (default: median:15%%)")
    p.add_argument("-v", "--verbose", action="store_true", help="show pytest's output on stderr")
    p.set_defaults(run=_bench)
    return parser


def _compat(argv: list) -> list:
    """``txmq topics DIR`` (the command before ``topics`` had actions) lists."""
    if len(argv) >= 2 and argv[0] == "topics" and argv[1] not in TOPIC_ACTIONS and not argv[1].startswith("-"):
        return ["topics", "list", *argv[1:]]
    return argv


def main(argv=None) -> int:
    argv = _compat(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command == "demo":
            return demo(args.dir, args.size, seed=args.seed, keep=args.keep, spark=args.spark,
                        as_json=args.json, progress=args.progress, out=sys.stdout)
        return args.run(args)
    except SystemExit as e:             # argparse: --help (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else exits.USAGE
    except exits.CliError as e:
        return _fail(str(e), e.code)
    except TxmqError as e:
        err = exits.from_broker_error(e)
        return _fail(str(err), err.code)
    except KeyboardInterrupt:
        print("txmq: interrupted", file=sys.stderr)
        return exits.INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`txmq consume ... | head`): stop quietly, and
        # keep the interpreter from complaining when it flushes stdout.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return exits.BROKEN_PIPE


def _fail(message: str, code: int) -> int:
    print(f"txmq: error: {message}", file=sys.stderr)
    return code
