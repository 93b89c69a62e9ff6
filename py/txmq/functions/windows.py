"""Event-time windows of the function runner: which windows an event falls
in, the watermark, and the window state of one lane with its snapshot.

Semantics (Flink's, with one emission per window):

- A **tumbling** window of ``size_ms`` covers ``[k * size, (k + 1) * size)``;
  a **sliding** window of ``size_ms`` every ``slide_ms`` covers
  ``[k * slide, k * slide + size)``, so an event falls in ``ceil(size /
  slide)`` of them (fewer when ``slide`` does not divide ``size``).
- The **watermark** of a lane is the smallest, over the function's inputs,
  of the largest event time seen on that input, minus
  ``max_out_of_orderness_ms``; until every input has been seen on the lane
  there is none. The smallest over the inputs (as Flink's operators take
  it) keeps a fast input from making a slow one's events late; an input
  with no data holds the watermark back.
- A window is **emitted** once, when the watermark reaches its end plus
  ``allowed_lateness_ms``: its totals go out and it is forgotten.
- An event is **late** when every window it falls in has been emitted;
  it is then not counted anywhere (the runner drops it and counts it, or
  sends it to the late topic). An event of a sliding window whose newer
  windows are still open counts in those.

Each event moves the watermark as it is processed, so which events are late
depends only on the order of a lane's events, never on how they were split
into steps (a restarted function replays them the same way).

Snapshot layout: the value of one state-topic message, UTF-8 JSON::

    {"v": 1, "lane": <int>, "size_ms": <int>, "slide_ms": <int>,
     "max_event_ms": {"<input topic>": <int>, ...},   inputs seen on the lane
     "windows": [[<key hex | null>, <start ms>, <total>, <count>], ...]}

``total`` is the sum of the amounts (int or float; JSON keeps both exact).
"""

from __future__ import annotations

import json

from txmq.errors import CorruptLogError, InvalidArgumentError

SNAPSHOT_VERSION = 1


def _check_ms(name: str, value, low: int) -> int:
    if type(value) is not int or value < low:
        raise InvalidArgumentError(name, value, f"an int of milliseconds >= {low}")
    return value


class Sliding:
    """Sliding (hopping) windows of ``size_ms`` starting every ``slide_ms``
    (``slide_ms <= size_ms``), aligned to event time 0."""

    __slots__ = ("size_ms", "slide_ms")

    def __init__(self, size_ms: int, slide_ms: int):
        self.size_ms = _check_ms("size_ms", size_ms, 1)
        self.slide_ms = _check_ms("slide_ms", slide_ms, 1)
        if slide_ms > size_ms:
            raise InvalidArgumentError("slide_ms", slide_ms, f"at most size_ms ({size_ms})")

    def starts(self, event_ms: int) -> range:
        """Start times of the windows holding ``event_ms``, oldest first."""
        last = event_ms - event_ms % self.slide_ms
        first = last - ((self.size_ms - 1 - (event_ms - last)) // self.slide_ms) * self.slide_ms
        return range(first, last + 1, self.slide_ms)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size_ms={self.size_ms}, slide_ms={self.slide_ms})"


class Tumbling(Sliding):
    """Tumbling windows: back to back, ``size_ms`` each, aligned to event time 0."""

    __slots__ = ()

    def __init__(self, size_ms: int):
        super().__init__(size_ms, size_ms)

    def starts(self, event_ms: int) -> range:
        """The start of the one window holding ``event_ms``."""
        start = event_ms - event_ms % self.size_ms
        return range(start, start + 1)

    def __repr__(self) -> str:
        return f"Tumbling(size_ms={self.size_ms})"


class WindowState:
    """The open windows of one lane, the largest event time per input, and
    the watermark they give. Not thread-safe: one lane has one owner."""

    __slots__ = ("lane", "window", "inputs", "out_of_orderness_ms", "lateness_ms", "max_event_ms",
                 "windows", "watermark")

    def __init__(self, lane: int, window: Sliding, inputs, out_of_orderness_ms: int, lateness_ms: int):
        self.lane = lane
        self.window = window
        self.inputs = tuple(inputs)
        self.out_of_orderness_ms = out_of_orderness_ms
        self.lateness_ms = lateness_ms
        self.max_event_ms: dict = {}          # input topic -> largest event time seen on this lane
        self.windows: dict = {}               # (key, start) -> [total, count]
        self.watermark = None                 # None until every input has been seen

    def add(self, topic: str, event_ms: int, key, amount) -> bool:
        """Count ``amount`` for ``key`` in every window of ``event_ms`` not
        yet emitted, then advance the watermark; False (nothing counted)
        when the event is late."""
        wm = self.watermark
        size = self.window.size_ms
        counted = False
        for start in self.window.starts(event_ms):
            if wm is not None and start + size + self.lateness_ms <= wm:
                continue                      # emitted already
            agg = self.windows.get((key, start))
            if agg is None:
                self.windows[(key, start)] = [amount, 1]
            else:
                agg[0] += amount
                agg[1] += 1
            counted = True
        seen = self.max_event_ms.get(topic)
        if seen is None or event_ms > seen:
            self.max_event_ms[topic] = event_ms
            if len(self.max_event_ms) == len(self.inputs):
                self.watermark = min(self.max_event_ms.values()) - self.out_of_orderness_ms
        return counted

    def fire(self) -> list:
        """Take out the windows the watermark has passed (end + allowed
        lateness): ``[(key, start, end, total, count)]`` by start, then key."""
        wm = self.watermark
        if wm is None or not self.windows:
            return []
        size = self.window.size_ms
        due_before = wm - self.lateness_ms - size      # start <= this: emitted
        done = [(k, s) for k, s in self.windows if s <= due_before]
        done.sort(key=lambda ks: (ks[1], b"" if ks[0] is None else ks[0]))
        out = []
        for ks in done:
            total, count = self.windows.pop(ks)
            out.append((ks[0], ks[1], ks[1] + size, total, count))
        return out

    # -- snapshot --------------------------------------------------------------

    def to_bytes(self) -> bytes:
        """The snapshot (layout in the module docstring)."""
        return json.dumps({
            "v": SNAPSHOT_VERSION, "lane": self.lane,
            "size_ms": self.window.size_ms, "slide_ms": self.window.slide_ms,
            "max_event_ms": self.max_event_ms,
            "windows": [[None if k is None else k.hex(), s, agg[0], agg[1]]
                        for (k, s), agg in self.windows.items()],
        }, separators=(",", ":")).encode()

    def load(self, raw: bytes, where: str) -> None:
        """Replace the state by snapshot ``raw`` (read from ``where``).
        Raises :class:`CorruptLogError` for bytes that are no snapshot of
        this lane, and :class:`InvalidArgumentError` when the snapshot was
        written with another window."""
        try:
            snap = json.loads(raw)
            if snap["v"] != SNAPSHOT_VERSION or snap["lane"] != self.lane:
                raise ValueError(f"version {snap['v']} lane {snap['lane']}, wanted lane {self.lane}")
            size, slide = snap["size_ms"], snap["slide_ms"]
            max_event = {str(t): int(ms) for t, ms in snap["max_event_ms"].items()}
            windows = {(None if k is None else bytes.fromhex(k), int(s)): [total, int(count)]
                       for k, s, total, count in snap["windows"]}
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptLogError(where, 0, f"function state snapshot: {e}") from None
        if (size, slide) != (self.window.size_ms, self.window.slide_ms):
            raise InvalidArgumentError("window", self.window,
                                       f"the window the state was written with (size_ms={size}, slide_ms={slide})")
        self.max_event_ms = {t: ms for t, ms in max_event.items() if t in self.inputs}
        self.windows = windows
        self.watermark = (min(self.max_event_ms.values()) - self.out_of_orderness_ms
                          if len(self.max_event_ms) == len(self.inputs) else None)
