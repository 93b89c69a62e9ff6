"""What the command line prints: tables for people, JSON for scripts, and
progress on stderr for long work.

Results go to stdout; progress, spinners and summaries of streaming
commands go to stderr, so a pipe only ever sees results. Progress is drawn
when stderr is a terminal, or always with ``--progress``; ``--no-progress``
turns it off.
"""

from __future__ import annotations

import json
import sys
import threading
import time

# A spinner appears only once the work has taken this long: quick opens
# print nothing.
SPINNER_DELAY_S = 0.3
REDRAW_S = 0.1
_SPIN = "|/-\\"


def emit_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


def table(rows: list, columns: list, out=None) -> None:
    """Print ``rows`` (dicts) as aligned columns. ``columns`` lists
    ``(key, title)``; numbers are right-aligned with thousands separators."""
    out = out or sys.stdout
    cells = [[_cell(r.get(k)) for k, _ in columns] for r in rows]
    numeric = [all(isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)
                   for r in rows if r.get(k) is not None) for k, _ in columns]
    widths = [max([len(t)] + [len(c[i]) for c in cells]) for i, (_, t) in enumerate(columns)]

    def line(values):
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
        return "  ".join(parts).rstrip()

    print(line([t.upper() for _, t in columns]), file=out)
    for c in cells:
        print(line(c), file=out)


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.3f}".rstrip("0").rstrip(".")
    if isinstance(v, (list, tuple, set)):
        return ", ".join(str(x) for x in v) or "-"
    return str(v)


def size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n} B"


def wants_progress(flag) -> bool:
    """``flag`` from --progress / --no-progress: True, False or None (auto)."""
    if flag is not None:
        return flag
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    """A progress line on stderr: a bar when the total is known, else a
    spinner with the count. Redrawn at most every REDRAW_S seconds;
    :meth:`close` clears it. Does nothing when disabled."""

    def __init__(self, label: str, total: int | None = None, unit: str = "", enabled: bool = False):
        self.label = label
        self.total = total
        self.unit = unit
        self.enabled = enabled
        self.done = 0
        self.detail = ""
        self._t0 = time.monotonic()
        self._drawn = 0.0
        self._spin = 0
        self._width = 0

    def update(self, n: int = 1, detail: str | None = None) -> None:
        self.done += n
        if detail is not None:
            self.detail = detail
        if self.enabled and time.monotonic() - self._drawn >= REDRAW_S:
            self.draw()

    def draw(self) -> None:
        elapsed = time.monotonic() - self._t0
        if self.total:
            frac = min(self.done / self.total, 1.0)
            filled = int(30 * frac)
            text = (f"{self.label} [{'#' * filled}{'.' * (30 - filled)}] {frac:4.0%} "
                    f"{self._amount(self.done)}/{self._amount(self.total)}")
        else:
            self._spin += 1
            text = f"{self.label} {_SPIN[self._spin % 4]} {self._amount(self.done)}"
        text += f"  {elapsed:.1f} s"
        if self.detail:
            text += f"  {self.detail}"
        text = text[:200]
        sys.stderr.write("\r" + text.ljust(self._width))
        sys.stderr.flush()
        self._width = len(text)
        self._drawn = time.monotonic()

    def _amount(self, n) -> str:
        return size(n) if self.unit == "B" else f"{n:,}{' ' + self.unit if self.unit else ''}"

    def close(self) -> None:
        if self.enabled and self._width:
            sys.stderr.write("\r" + " " * self._width + "\r")
            sys.stderr.flush()
            self._width = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Spinner:
    """``with Spinner("opening data", enabled):`` draws a spinner and the
    elapsed time on stderr from a thread while the block runs (a broker
    open, whose recovery reports no progress of its own)."""

    def __init__(self, label: str, enabled: bool):
        self.label = label
        self.enabled = enabled
        self._stop = threading.Event()
        self._thread = None
        self._t0 = time.monotonic()
        self._width = 0

    def _run(self) -> None:
        if self._stop.wait(SPINNER_DELAY_S):
            return
        spin = 0
        while True:
            text = f"{self.label} {_SPIN[spin % 4]} {time.monotonic() - self._t0:.1f} s"
            sys.stderr.write("\r" + text.ljust(self._width))
            sys.stderr.flush()
            self._width = len(text)
            spin += 1
            if self._stop.wait(REDRAW_S):
                return

    def __enter__(self):
        if self.enabled:
            self._t0 = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="txmq-cli-spinner", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            if self._width:
                sys.stderr.write("\r" + " " * self._width + "\r")
                sys.stderr.flush()
