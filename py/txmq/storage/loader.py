"""The one walk over a partition's segment files at open (Kafka's
LogLoader), in one of three modes that agree on every case:

- ``WRITER`` (``Partition``): may cut a torn tail and rebuild indexes;
- ``READ_ONLY`` (``txmq.readonly`` when no writer is live): writes
  nothing; its view ends where the writer's log will;
- ``CHECK`` (``txmq check``): scans every byte and reports each problem
  with its path, byte and what opening does about it.

The walk (docs/FORMAT.md, "Opening a partition"): segments below the
resume point (the ``recovery-point`` file) are trusted: their indexes are
adopted and their end offset is read from the headers after the last index
entry. From the resume point on, every batch is checked; the first that
fails ends the log there. A missing or unsound recovery point, or one past
the end of its segment's file, makes every segment scanned.

Per case:

===============================  ==============  ==============  ===============
case                             writer          read-only       check
===============================  ==============  ==============  ===============
bad batch at/after resume point  cut there, drop  view ends there corrupt, "cuts"
                                 later segments
bad batch below resume point     kept; a read of  same            corrupt, "keeps"
                                 it raises
                                 CorruptLogError
gap between segments (or a       CorruptLogError  same error      corrupt,
trusted segment that ends short) (path, byte)                    "refuses"
index of a trusted segment       rebuilt by a     same scan,      repairable (or
missing / wrong                  scan; a bad      same error      "refuses")
                                 batch refuses
index of the resume point's      rebuilt by a     same scan       repairable (or
segment missing / wrong          scan from byte                   "cuts")
                                 0; a bad batch
                                 cuts
recovery point missing / bad     scan every       scan every      repairable
                                 segment          segment
===============================  ==============  ==============  ===============

Snapshots (``txnbuffer.snap``, ``producers.snap``) belong to the
transaction buffer and the producer state, not to this walk: a bad one is
rebuilt from the log by the writer, replaced by a replay from the log start
by a read-only reader, reported repairable by check.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from txmq._segment import Segment
from txmq.errors import CorruptLogError
from txmq.storage.index import (INDEX_ENTRY, batches_end, index_problem, load_entries, rewrite_index, torn)
from txmq.storage.layout import (INDEX_SUFFIX, RECOVERY_POINT, RECOVERY_POINT_FILE, SEGMENT_FILES,
                                 TIMEINDEX_SUFFIX, parse_recovery_point, segment_bases, segment_file)

WRITER = "writer"
READ_ONLY = "read-only"
CHECK = "check"
CORRUPT = "corrupt"
REPAIRABLE = "repairable"


@dataclass
class Dropped:
    """What opening a partition cut off or rebuilt: a torn or corrupt tail,
    a bad index."""

    path: str
    position: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path} at byte {self.position}: {self.reason}"


@dataclass
class Problem(Dropped):
    """What ``txmq check`` finds wrong where, with its kind."""

    kind: str = CORRUPT

    def __str__(self) -> str:
        return f"{super().__str__()} [{self.kind}]"


class LogLoader:
    """Walks the segments of partition directory ``directory`` in ``mode``.

    The log below the ``recovery-point`` file's (segment base, position,
    next offset) is trusted. ``min_base``: segments below it are not the
    log's (a writer's retention was deleting them). ``published``:
    (base, size) of a live owner's active segment (check mode: bytes past
    ``size`` are being written, not damage). ``report(Dropped)``: told of
    every cut and rebuild as it happens (writer).
    """

    def __init__(self, directory: str, mode: str, *, segment_bytes_max: int = 0,
                 index_interval_bytes: int = 4096, fsync: str = "never", min_base: int | None = None,
                 published=None, report=None, budget=None):
        self.directory = directory
        self.budget = budget              # the SegmentBudget segments open through (None: the process's)
        self.mode = mode
        self.segment_bytes_max = segment_bytes_max
        self.index_interval_bytes = index_interval_bytes
        self.fsync = fsync
        self.min_base = min_base
        self.published = published
        self._report_cb = report
        self.problems: list = []          # Dropped (writer, read-only) or Problem (check)
        self.index_written: dict = {}     # writer: segment base -> (offset entries, time entries) on disk
        self.damaged: set = set()         # check: bases of segments with a bad batch
        self.bases = [b for b in segment_bases(directory) if min_base is None or b >= min_base]
        self.point = None                 # the recovery point as parsed (check reads it whole)
        self.resume = self._recovery_point()
        if self.resume is not None and self.resume[0] in self.bases and \
                self.resume[1] > os.path.getsize(segment_file(directory, self.resume[0])):
            self.resume = None            # the segment lost bytes it vouched for: scan every segment

    # -- what is trusted -------------------------------------------------------------

    def _recovery_point(self):
        """The recovery point to resume from, or None (scan every segment)."""
        path = os.path.join(self.directory, RECOVERY_POINT_FILE)
        try:
            with open(path, "rb") as f:
                raw = f.read(RECOVERY_POINT.size + 1 if self.mode == CHECK else RECOVERY_POINT.size)
        except OSError:
            if self.mode == CHECK and self.bases:
                self._problem(path, 0, "missing; the next open scans every segment", REPAIRABLE)
            return None
        try:
            self.point = parse_recovery_point(path, raw, self.bases)
        except CorruptLogError as e:
            if self.mode == CHECK:
                self._problem(path, e.position, f"{e.reason}; the next open scans every segment", REPAIRABLE)
            elif self.mode == WRITER and len(raw) == RECOVERY_POINT.size:   # shorter: its first write, cut short
                self._drop(path, e.position, f"invalid recovery point ({e.reason}); scanning every segment")
            return None
        return self.point

    def _plan(self, base: int):
        """(position, next offset) to scan segment ``base`` from, or None
        when it is trusted whole (below the resume point)."""
        if self.resume is None or base > self.resume[0]:
            return 0, base
        if base < self.resume[0]:
            return None
        return self.resume[1], self.resume[2]

    # -- the walk ----------------------------------------------------------------------

    def load(self) -> list:
        """The segments of the log, in order (writer: the last one writable
        with ``segment_bytes_max`` of room). Raises CorruptLogError where
        the log has a gap (writer, read-only)."""
        if self.mode == CHECK:
            return self._check()
        segments = []
        bases = self.bases
        for i, base in enumerate(bases):
            last = i == len(bases) - 1
            next_base = None if last else bases[i + 1]
            plan = self._plan(base)
            if plan is None:
                seg = Segment(segment_file(self.directory, base), base, 0, False, self.index_interval_bytes,
                              self.budget)
                segments.append(seg)
                self._trust(seg, next_base)
                continue
            writable = self.mode == WRITER
            seg = Segment(segment_file(self.directory, base), base, self.segment_bytes_max if last and writable else 0,
                          writable, self.index_interval_bytes, self.budget)
            segments.append(seg)
            pos, next_offset = plan
            if pos and not self.adopt_index(seg, pos, next_offset, partial=True):
                pos, next_offset = 0, base
            bad = seg.recover(pos, next_offset)
            if bad is not None:
                self._cut(segments, bad, bases[i + 1:], last)
                break
            if next_base is not None and seg.next_offset != next_base:
                raise _gap(seg, seg.size, seg.next_offset, next_base)
            if writable:
                if not (pos and pos == seg.size and self._index_current(seg)):
                    self._rewrite(seg)   # (a clean close left it whole: nothing scanned, nothing to write)
                if not last:
                    seg.seal()
                    if self.fsync != "never":
                        seg.sync_file()      # rescanned: durable before a recovery point trusts it
        return segments

    def _trust(self, seg: Segment, next_base: int) -> None:
        """Segment ``seg``, below the resume point, known good up to its
        file size: adopt its indexes (rebuilt by a scan when missing or
        wrong), then check that its batches end where the next segment
        begins."""
        if self.adopt_index(seg, seg.file_size, next_base):
            offs, poss, _, _ = seg.index_entries()
            start = (int(poss[-1]), int(offs[-1])) if len(offs) else (0, seg.base_offset)
            end_pos, end = batches_end(seg, seg.size, *start)
        else:
            bad = seg.recover(0, seg.base_offset)
            if bad is not None:
                raise CorruptLogError(seg.path, bad[0], f"{bad[1]} (below the recovery point, in a segment "
                                                        f"whose index is rebuilt)")
            if self.mode == WRITER:
                self._rewrite(seg)
            end_pos, end = seg.size, seg.next_offset
        if end != next_base:
            raise _gap(seg, end_pos, end, next_base)

    def adopt_index(self, seg: Segment, size: int, next_offset: int, partial: bool = False) -> bool:
        """Load the on-disk indexes of ``seg`` (:func:`read_index`) when
        they pass; False when they are missing or fail (the caller scans),
        having reported a damaged one unless ``partial`` (entries below a
        resume point; the scan rewrites them anyway)."""
        off, tix, problem = read_index(self.directory, seg, size, next_offset, partial)
        if problem is None:
            seg.load_index(off["a"], off["b"], tix["a"], tix["b"], size, next_offset)
            if self.mode == WRITER:
                self.index_written[seg.base_offset] = (len(off), len(tix))
                if not partial and (torn(segment_file(self.directory, seg.base_offset, INDEX_SUFFIX))
                                    or torn(segment_file(self.directory, seg.base_offset, TIMEINDEX_SUFFIX))):
                    self._rewrite(seg)
            return True
        if not partial and self.mode == WRITER and (problem != "missing" or size):
            self._drop(segment_file(self.directory, seg.base_offset, INDEX_SUFFIX), 0,
                       f"{problem}; index rebuilt from its segment")
        return False

    def _cut(self, segments: list, bad: tuple, later: list, last: bool) -> None:
        """The log ends at ``bad`` (position, reason) in the last of
        ``segments``: offsets must stay dense, so nothing after survives.
        The writer cuts the files there; a read-only view just ends."""
        seg = segments[-1]
        self._drop(seg.path, bad[0], bad[1])
        for base in later:
            self._drop(segment_file(self.directory, base), 0, "segment after a truncated one")
            if self.mode == WRITER:
                for suffix in SEGMENT_FILES:
                    _unlink(segment_file(self.directory, base, suffix))
        if self.mode != WRITER:
            return
        if not last:
            seg.close(trim=True)
            seg = segments[-1] = Segment(seg.path, seg.base_offset, self.segment_bytes_max, True,
                                         self.index_interval_bytes, self.budget)
            seg.recover(0, seg.base_offset)
        self._rewrite(seg)

    def _index_current(self, seg: Segment) -> bool:
        """Whether the index files of ``seg`` hold exactly its in-memory
        entries (adopted whole from them: none torn, none past what was
        kept)."""
        offs, _, ts, _ = seg.index_entries()
        sizes = [_size(segment_file(self.directory, seg.base_offset, suffix)) for suffix in (INDEX_SUFFIX,
                                                                                            TIMEINDEX_SUFFIX)]
        return sizes == [len(offs) * INDEX_ENTRY.itemsize, len(ts) * INDEX_ENTRY.itemsize]

    def _rewrite(self, seg: Segment) -> None:
        self.index_written[seg.base_offset] = rewrite_index(self.directory, seg)

    def _drop(self, path: str, position: int, reason: str) -> None:
        dropped = Dropped(path, position, reason)
        self.problems.append(dropped)
        if self._report_cb is not None:
            self._report_cb(dropped)

    def _problem(self, path: str, position: int, reason: str, kind: str = CORRUPT) -> None:
        self.problems.append(Problem(path, int(position), reason, kind))

    # -- check: every byte, and what opening would do with it ------------------------------

    def _check(self) -> list:
        """Every segment scanned from byte 0, read-only; each bad batch and
        gap reported with what the writer's walk does there. Returns the
        segments (the caller checks their side files, then closes them)."""
        segments = []
        cut = False                       # the writer's log ended before this segment
        bases = self.bases
        for i, base in enumerate(bases):
            next_base = None if i == len(bases) - 1 else bases[i + 1]
            path = segment_file(self.directory, base)
            seg = Segment(path, base, 0, False, budget=self.budget)
            segments.append(seg)
            bad = seg.recover(0, base)
            if bad is not None and self.published is not None and self.published[0] == base \
                    and bad[0] >= self.published[1]:
                bad = None                # past what the live owner has published: being written now
            if bad is not None:
                self.damaged.add(base)
            if cut:
                if bad is not None:
                    self._problem(path, bad[0], f"{bad[1]}; opening drops this segment (the log is cut "
                                                f"before it)")
                continue
            plan = self._plan(base)
            if plan is None:
                verdict = self._check_trusted(seg, bad, next_base)
            elif bad is not None and plan[0] and bad[0] < plan[0] and self._adopts(seg, plan[0], plan[1]):
                verdict = "kept"
            else:
                verdict = "cut" if bad is not None else None
                if bad is None and next_base is not None and seg.next_offset != next_base:
                    self._refused(seg, seg.size, seg.next_offset, next_base)
                    cut = True
            if verdict == "kept":
                self._problem(path, bad[0], f"{bad[1]}; below the recovery point, so opening keeps it and "
                                            f"a read of this batch raises CorruptLogError")
            elif verdict == "cut":
                later = len(bases) - i - 1
                self._problem(path, bad[0], f"{bad[1]}; opening cuts the log here"
                                            + (f" and drops the {later} later segment(s)" if later else ""))
                cut = True
            elif verdict == "refused":
                cut = True
        return segments

    def _check_trusted(self, seg: Segment, bad, next_base: int):
        """What the writer's :meth:`_trust` does with ``seg`` (scanned from
        byte 0 here): "kept" (a bad batch it does not scan), "refused"
        (reported here) or None."""
        size = seg.file_size
        off, _, problem = read_index(self.directory, seg, size, next_base)
        if problem is None:
            start = (int(off["b"][-1]), int(off["a"][-1])) if len(off) else (0, seg.base_offset)
            end_pos, end = batches_end(seg, size, *start)
        elif bad is not None:
            self._problem(seg.path, bad[0], f"{bad[1]}; below the recovery point in a segment whose index "
                                            f"opening rebuilds: opening refuses the partition")
            return "refused"
        else:
            end_pos, end = seg.size, seg.next_offset
        if end != next_base:
            self._refused(seg, end_pos, end, next_base)
            return "refused"
        return "kept" if bad is not None else None

    def _adopts(self, seg: Segment, size: int, next_offset: int) -> bool:
        """Whether the writer adopts the indexes of ``seg`` below its
        resume point at byte ``size`` (check mode)."""
        return read_index(self.directory, seg, size, next_offset, partial=True)[2] is None

    def _refused(self, seg: Segment, end_pos: int, end: int, next_base: int) -> None:
        e = _gap(seg, end_pos, end, next_base)
        self._problem(e.path, e.position, f"{e.reason}: offsets are not dense; opening refuses the partition")


def read_index(directory: str, seg: Segment, size: int, next_offset: int, partial: bool = False):
    """(offset entries, time entries, problem) of the on-disk indexes of
    ``seg``, known good up to ``size`` bytes below ``next_offset``;
    ``problem`` is None when they pass the open-time check of
    :func:`index_problem` (order, range, the first and last entries'
    batches; a background scrub checks every entry), else "missing" or
    what is wrong. ``partial``: only the entries below ``size`` (a resume
    point inside the segment) are wanted."""
    off = load_entries(segment_file(directory, seg.base_offset, INDEX_SUFFIX))
    tix = load_entries(segment_file(directory, seg.base_offset, TIMEINDEX_SUFFIX))
    if off is None or tix is None:
        return off, tix, "missing"
    if partial:
        off = off[off["b"] < size]
        limit = off["a"][-1] if len(off) else seg.base_offset
        tix = tix[tix["b"] <= limit]
    found = index_problem(seg, off["a"], off["b"], tix["a"], tix["b"], size, next_offset, every_header=False)
    return off, tix, None if found is None else f"{found[0]} entry {found[1]}: {found[2]}"


def published_segments(bases, log_start: int, active_base: int, active_size: int, log_end: int):
    """``[(base, size, next offset)]`` of the segments a live writer's read
    view vouches for, from segment bases ``bases`` (sorted): the sealed
    ones from ``log_start`` whole (size -1) up to the next one's base, the
    active one to ``active_size`` bytes below ``log_end``; None when the
    segment files do not match the view (retention moved the log start
    after it was read). Each is opened with :func:`open_read_only`."""
    bases = [b for b in bases if log_start <= b <= active_base]
    if not bases or bases[0] != log_start or bases[-1] != active_base:
        return None
    return [(base, active_size, log_end) if base == active_base else (base, -1, bases[i + 1])
            for i, base in enumerate(bases)]


def open_read_only(directory: str, base: int, size: int, next_offset: int, budget=None) -> Segment:
    """Segment ``base`` mapped read-only and known good up to ``size`` bytes
    (-1: its whole file, a sealed segment, whose batches must then end at
    ``next_offset`` or CorruptLogError says where they do) below
    ``next_offset``, with its on-disk indexes when they pass the open-time
    check (else reads walk from byte 0). For a view a writer published:
    nothing is scanned past ``size``."""
    sealed = size < 0
    seg = Segment(segment_file(directory, base), base, 0, False, budget=budget)
    file_size = seg.capacity
    if size < 0:
        size = file_size
    if size > file_size:
        seg.close(False)
        raise CorruptLogError(seg.path, file_size, f"readview claims {size} bytes")
    off, tix, problem = read_index(directory, seg, size, next_offset, partial=True)
    if problem is not None:
        off = tix = _EMPTY
    if sealed:
        # Opening reads a trusted segment's end the same way and refuses a gap.
        start = (int(off["b"][-1]), int(off["a"][-1])) if len(off) else (0, base)
        end_pos, end = batches_end(seg, size, *start)
        if end != next_offset:
            seg.close(False)
            raise _gap(seg, end_pos, end, next_offset)
    seg.load_index(off["a"], off["b"], tix["a"], tix["b"], size, next_offset)
    return seg


_EMPTY = np.empty(0, INDEX_ENTRY)


def _gap(seg: Segment, end_pos: int, end: int, next_base: int) -> CorruptLogError:
    return CorruptLogError(seg.path, end_pos, f"segment ends at offset {end}, next one starts at {next_base}")


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return -1


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
