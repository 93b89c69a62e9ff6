"""Performance gates: bounds on measured figures, kept in one reviewed TOML
file, and the verdict a gate run gives.

A figure is either

- a **ratio** against a baseline measured in the same run (txmq's rate ÷
  SQLite's, open time at 2 GiB ÷ at 100 MiB), with the range of the
  per-round ratios beside its median; noise moves it, so its bound sits
  below (a floor) or above (a ceiling) the medians measured, by a margin
  for the noise that was measured; or
- a **count** that does not depend on the machine (flushes per commit,
  Python calls per send, memory blocks per received message), bounded
  exactly: its ceiling is today's count.

The file (``bench/gates.toml`` for txmq itself)::

    [[ratio]]
    comparison = "send() 100B vs confluent_kafka produce()"   # its name in the results
    floor = 0.25               # or ceiling = ... for lower-is-better figures
    tests = ["test_bench_send.py::test_send_one_100B"]         # what measures it
    quick = true               # part of the quick subset CI runs
    measured = "median 0.29 (0.16-0.30) over 5 runs"           # where the bound came from

    [[count]]
    name = "python calls per send()"
    ceiling = 8
    tests = ["test_bench_counts.py"]

A gate run measures every gate, then measures the failing ones once more;
a gate fails only when both attempts miss its bound (:func:`evaluate`), so
one noisy attempt does not fail a build.
"""

from __future__ import annotations

import statistics
import tomllib
from dataclasses import dataclass, field

FLOOR, CEILING = ">=", "<="


@dataclass(frozen=True)
class Gate:
    name: str
    kind: str                     # "ratio" or "count"
    op: str                       # FLOOR or CEILING
    bound: float
    tests: tuple = ()
    quick: bool = False
    measured: str = ""

    def met_by(self, value: float) -> bool:
        return value >= self.bound if self.op == FLOOR else value <= self.bound

    @property
    def bound_name(self) -> str:
        return "floor" if self.op == FLOOR else "ceiling"


@dataclass(frozen=True)
class Figure:
    """One attempt's figure for a gate: the median ratio (or the count) and
    the range of the per-round ratios, from their 10th to their 90th
    percentile (None for a count)."""

    value: float
    low: float | None = None
    high: float | None = None
    rounds: int = 0

    def describe(self) -> str:
        if self.low is None or self.rounds == 0:
            return f"{self.value:.4g}"
        return f"{self.value:.4g} (rounds p10-p90 {self.low:.3g}-{self.high:.3g}, {self.rounds} rounds)"


@dataclass
class Verdict:
    gate: Gate
    figures: list = field(default_factory=list)    # one per attempt; None where it recorded nothing

    @property
    def passed(self) -> bool:
        return any(f is not None and self.gate.met_by(f.value) for f in self.figures)

    def line(self) -> str:
        g = self.gate
        shown = "; retried: ".join("no figure (the tests recorded none: skipped or failed?)" if f is None
                                   else f.describe() for f in self.figures)
        status = "ok  " if self.passed else "FAIL"
        return f"{status} {g.kind} {g.name!r}: {shown}; {g.bound_name} {g.bound:g}"


def floor(name: str, bound: float) -> Gate:
    """A ratio gate built in place: the ratio must stay >= ``bound``."""
    return Gate(name, "ratio", FLOOR, float(bound))


def ceiling(name: str, bound: float, kind: str = "count") -> Gate:
    """A count (or, with ``kind="ratio"``, a lower-is-better ratio) that
    must stay <= ``bound``."""
    return Gate(name, kind, CEILING, float(bound))


def by_name(gates: list[Gate]) -> dict:
    return {g.name: g for g in gates}


class GateFileError(ValueError):
    """The gates file is malformed (the message names the entry)."""


def _gate(kind: str, entry: dict, where: str) -> Gate:
    name = entry.get("comparison" if kind == "ratio" else "name")
    if not name:
        raise GateFileError(f"{where}: needs {'comparison' if kind == 'ratio' else 'name'}")
    bounds = [(op, entry[key]) for op, key in ((FLOOR, "floor"), (CEILING, "ceiling")) if key in entry]
    if len(bounds) != 1 or not isinstance(bounds[0][1], (int, float)):
        raise GateFileError(f"{where} {name!r}: needs exactly one numeric floor or ceiling")
    if kind == "count" and bounds[0][0] != CEILING:
        raise GateFileError(f"{where} {name!r}: a count is gated by a ceiling")
    tests = entry.get("tests", [])
    if not tests or not all(isinstance(t, str) for t in tests):
        raise GateFileError(f"{where} {name!r}: needs tests = [pytest node ids that measure it]")
    unknown = set(entry) - {"comparison", "name", "floor", "ceiling", "tests", "quick", "measured"}
    if unknown:
        raise GateFileError(f"{where} {name!r}: unknown keys {sorted(unknown)}")
    return Gate(name, kind, bounds[0][0], float(bounds[0][1]), tuple(tests), bool(entry.get("quick", False)),
                entry.get("measured", ""))


def parse(text: str) -> list[Gate]:
    """The gates of a TOML document (``[[ratio]]`` and ``[[count]]`` entries)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise GateFileError(str(e)) from None
    unknown = set(doc) - {"ratio", "count"}
    if unknown:
        raise GateFileError(f"unknown tables {sorted(unknown)}: expected [[ratio]] and [[count]]")
    gates = [_gate(kind, entry, f"[[{kind}]] #{i + 1}")
             for kind in ("ratio", "count") for i, entry in enumerate(doc.get(kind, []))]
    names = [g.name for g in gates]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise GateFileError(f"gated twice: {sorted(dup)}")
    return gates


def load(path) -> list[Gate]:
    with open(path, encoding="utf-8") as f:
        return parse(f.read())


def evaluate(gates: list[Gate], attempts: list[dict]) -> list[Verdict]:
    """Verdicts for ``gates`` given the attempts in order, each
    ``{gate name: Figure or None}`` for the gates that attempt measured
    (None: it was asked to and recorded nothing, a miss).

    A gate is judged on each attempt that measured it until one meets its
    bound: it passes if any did, so a bound missed once and met on the
    retry is met."""
    verdicts = []
    for g in gates:
        v = Verdict(g)
        for attempt in attempts:
            if v.figures and v.passed:
                break
            if g.name in attempt:
                v.figures.append(attempt[g.name])
        verdicts.append(v)
    return verdicts


def retry_needed(verdicts: list[Verdict]) -> list[Gate]:
    """The gates that failed their only attempt so far."""
    return [v.gate for v in verdicts if not v.passed and len(v.figures) < 2]


def report(verdicts: list[Verdict]) -> str:
    failed = [v for v in verdicts if not v.passed]
    lines = [v.line() for v in verdicts]
    lines.append(f"{len(verdicts) - len(failed)} of {len(verdicts)} gates met"
                 + (f"; FAILED: {', '.join(repr(v.gate.name) for v in failed)}" if failed else ""))
    return "\n".join(lines)


def ratio_figure(num_round_s: list, den_round_s: list, num_median_s: float, den_median_s: float,
                 num_ops: int, den_ops: int, kind: str = "rate") -> Figure:
    """A comparison's figure from its two sides: the ratio of the medians,
    and the range of the ratios of round i of one side to round i of the
    other (rates for ``kind="rate"``, times for ``kind="time"``), from the
    10th to the 90th percentile: one round that met a page fault or a
    collection does not widen it, a drift between the sides does."""
    def ratio(tn, td):
        return tn / td if kind == "time" else (num_ops / tn) / (den_ops / td)

    per_round = sorted(ratio(a, b) for a, b in zip(num_round_s, den_round_s) if a > 0 and b > 0)
    value = ratio(num_median_s, den_median_s)
    if not per_round:
        return Figure(value)
    if len(per_round) < 3:
        return Figure(value, per_round[0], per_round[-1], len(per_round))
    deciles = statistics.quantiles(per_round, n=10, method="inclusive")
    return Figure(value, deciles[0], deciles[-1], len(per_round))
