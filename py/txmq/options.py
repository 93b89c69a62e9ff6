"""The options of a broker and of its topics, checked in one place.

``Broker()`` and ``create_topic()`` share some (retention); every option
they take is checked here, once, before anything is opened or written. A
value outside what an option accepts raises
:class:`~txmq.errors.InvalidArgumentError` naming the option and the value.

Bools are refused wherever a number is asked for (Python counts ``True`` as
the int 1; txmq never does), and seconds must be finite: ``nan`` compares
false with everything and would slip through a range check, and an infinite
period or timeout cannot be stored in milliseconds.
"""

from __future__ import annotations

import math
import numbers
import operator

from txmq.errors import InvalidArgumentError

INT32_MAX = 2**31 - 1
PARTITIONS_MAX = 10_000
# The longest transaction timeout (or producer id expiration) a broker may
# allow: stored as int64 milliseconds, and 31 years is past any real use.
TIMEOUT_MAX_SECONDS = 1e9


def int_option(name: str, value, low: int, high: int | None = None, *, optional: bool = False):
    """``value`` as an int in [low, high] (no upper bound when ``high`` is
    None); None passes when ``optional``. numpy integers are ints; bools
    and floats are not."""
    if value is None and optional:
        return None
    number = None
    if not isinstance(value, bool):
        try:
            number = operator.index(value)
        except TypeError:
            pass
    if number is None or number < low or (high is not None and number > high):
        allowed = f"an int >= {low}" if high is None else f"an int from {low} to {high}"
        raise InvalidArgumentError(name, value, ("None or " if optional else "") + allowed)
    return number


def seconds_option(name: str, value, minimum: float = 0.0, *, above: bool = False,
                   maximum: float | None = None, optional: bool = False):
    """``value`` as float seconds, finite, >= ``minimum`` (> when ``above``)
    and at most ``maximum``; None passes when ``optional``."""
    if value is None and optional:
        return None
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if ok:
        seconds = float(value)
        ok = (math.isfinite(seconds) and (seconds > minimum if above else seconds >= minimum)
              and (maximum is None or seconds <= maximum))
    if not ok:
        allowed = f"finite seconds {'>' if above else '>='} {minimum:g}"
        if maximum is not None:
            allowed += f" and <= {maximum:g}"
        raise InvalidArgumentError(name, value, ("None or " if optional else "") + allowed)
    return seconds


def choice_option(name: str, value, choices: tuple) -> str:
    """``value`` if it is one of the strings ``choices``."""
    if type(value) is not str or value not in choices:
        raise InvalidArgumentError(name, value, " | ".join(choices))
    return value


def flag_option(name: str, value) -> bool:
    """``value`` if it is a bool (a truthy string is not a yes)."""
    if type(value) is not bool:
        raise InvalidArgumentError(name, value, "True or False")
    return value


def retention_options(retention_ms, retention_bytes) -> tuple:
    """``(retention_ms, retention_bytes)``: each None (keep everything) or
    an int >= 0. The broker's defaults and each topic's own settings."""
    return (int_option("retention_ms", retention_ms, 0, optional=True),
            int_option("retention_bytes", retention_bytes, 0, optional=True))


def partitions_option(partitions) -> int:
    return int_option("partitions", partitions, 1, PARTITIONS_MAX)


def open_files_option(open_files_max):
    """None (share the process's budget, sized from ``RLIMIT_NOFILE``:
    ``txmq._budget.default_open_files``) or an int >= 4: how many segment
    files a broker or a read-only view keeps open at once (a descriptor
    and a mapping each)."""
    return int_option("open_files_max", open_files_max, 4, optional=True)
