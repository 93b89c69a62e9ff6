"""Exit codes of the ``txmq`` command and the one-line errors behind them.

Every failure the command line reports is a :class:`CliError`: a sentence
that says what was wrong and how to fix it, and the exit code. Broker errors
(``txmq.errors``) are turned into one by :func:`from_broker_error`.
"""

from __future__ import annotations

from txmq import errors

OK = 0
PROBLEMS = 1        # check found problems; demo failed; benchmarks failed
USAGE = 2           # bad arguments or input: unknown topic, bad offset, missing directory
LOCKED = 3          # another process holds the data directory
CORRUPT = 4         # the broker refused a damaged file while opening or reading
REFUSED = 5         # the broker refused the operation in its current state
INTERRUPTED = 130   # Ctrl-C
BROKEN_PIPE = 141   # the reader of stdout went away (128 + SIGPIPE)

# What works while another process holds the directory (they open it
# through txmq.readonly, txmq.cli.opening.open_for_reading; check reads files).
READ_ONLY_COMMANDS = ("topics list|describe", "consume without --subscription", "subscriptions list|describe",
                      "transactions list|describe", "stats", "check")

EPILOG = """\
exit codes:
  0    success
  1    check found problems, the demo failed, a benchmark or a performance gate failed
  2    usage or input error (bad option, unknown topic, subscription or
       transaction, bad offset, unreadable input, missing data directory)
  3    the data directory is locked by another process (for a command
       that changes it; read-only commands work beside its owner)
  4    a file of the data directory is corrupt (path and byte are printed;
       run `txmq check DIR`)
  5    the broker refused the operation (topic busy, transaction state, ...)
  130  interrupted (Ctrl-C)
  141  stdout was closed early (e.g. piped into `head`)
"""


class CliError(Exception):
    """A failure to print as ``txmq: error: <message>`` and exit with ``code``."""

    def __init__(self, message: str, code: int = USAGE):
        super().__init__(message)
        self.code = code


# Errors that say the user's input was wrong (exit 2); any other broker
# error is a refusal of the operation (exit 5).
_INPUT_ERRORS = (
    errors.TopicNotFoundError, errors.TopicExistsError, errors.PartitionNotFoundError,
    errors.SubscriptionNotFoundError, errors.InvalidTopicNameError,
    errors.InvalidSubscriptionNameError, errors.InvalidArgumentError, errors.InvalidMessageError,
    errors.MessageTooLargeError, errors.TransactionNotFoundError, errors.InvalidTxnTimeoutError,
    errors.IsolationLevelMismatchError, errors.SubscriptionTypeError, errors.DataDirError,
)


def from_broker_error(e: errors.TxmqError) -> CliError:
    """The CliError for a broker error no command turned into a better one."""
    if isinstance(e, errors.DataDirLockedError):
        return locked_error(e.path, e.holder)
    if isinstance(e, errors.CorruptLogError):
        return CliError(f"corrupt file {e.path} at byte {e.position}: {e.reason}; "
                        f"run `txmq check` on the data directory for a full report", CORRUPT)
    if isinstance(e, errors.DataLossError):
        return CliError(f"{e}; or run without --fail-on-data-loss to pass over them", CORRUPT)
    if isinstance(e, errors.StorageFullError):
        return CliError(f"{e}: free space on its file system and run the command again", REFUSED)
    if isinstance(e, errors.IsolationLevelMismatchError):
        return CliError(f"subscription {e.subscription!r} reads {e.have} (fixed when it was "
                        f"created), not {e.wanted}: drop --isolation or pass --isolation {e.have}")
    if isinstance(e, _INPUT_ERRORS):
        return CliError(str(e), USAGE)
    return CliError(str(e), REFUSED)


def locked_error(path: str, holder: str | None) -> CliError:
    who = f" ({holder})" if holder else ""
    return CliError(f"data directory {path} is locked: another process{who} holds it open. "
                    f"Stop that process (or wait for it to exit) and run the command again; "
                    f"read-only commands work while it holds the directory: {', '.join(READ_ONLY_COMMANDS)}",
                    LOCKED)
