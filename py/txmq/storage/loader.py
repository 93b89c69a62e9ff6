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
entry. From the resume point on, every batch is checked. A batch that
fails but is followed by a sound one (``Segment.find_batch``: a bounded
scan for the next batch whose header and CRC check) is **quarantined**:
its bytes are skipped, its offsets lost, the log around it kept; a bad
tail with nothing sound after it ends the log there. A missing or unsound
recovery point, or one past the end of its segment's file, makes every
segment scanned. Holes (zeroed headers, a file that ends inside a header)
and gaps between segments end the log when the recovery point says the
writer ran with ``fsync="never"`` (a power loss keeps no promise, so the
longest consistent prefix is kept and the rest reported); otherwise they
are damage and quarantined too.

Per case:

===============================  ==============  ==============  ===============
case                             writer          read-only       check
===============================  ==============  ==============  ===============
bad batch, sound ones after      quarantined     same            corrupt,
(anywhere; below the resume      (below it: by                   "quarantined"
point found by the first read)   the first read)
bad tail of the last segment     cut there       view ends there corrupt, "cuts"
bad batch past the resume point, cut there, drop same            corrupt, "cuts"
fsync="never"                    later segments
hole / gap, fsync="never"        cut there, drop same            corrupt, "cuts"
                                 later segments
hole / gap, durable or unknown   quarantined     same            corrupt,
                                                                 "quarantined"
segments that overlap            CorruptLogError same error      corrupt,
                                 (path, byte)                    "refuses"
index of a segment missing /     rebuilt by a    same scan       repairable
wrong                            scan
recovery point missing / bad     scan every      scan every      repairable
                                 segment         segment
===============================  ==============  ==============  ===============

Quarantined ranges are kept in ``quarantine.json`` (restored on open where
they still hold), so stats, ``topics describe`` and ``txmq check`` list
them before any read.

Snapshots (``txnbuffer.snap``, ``producers.snap``) belong to the
transaction buffer and the producer state, not to this walk: a bad one is
rebuilt from the log by the writer, replaced by a replay from the log start
by a read-only reader, reported repairable by check.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from txmq._batch import HEADER_SIZE_BYTES
from txmq._segment import Segment
from txmq.errors import CorruptLogError
from txmq.storage.index import (INDEX_ENTRY, batches_end, index_problem, load_entries, rewrite_index, torn)
from txmq.storage.layout import (FSYNC_CODES, INDEX_SUFFIX, QUARANTINE_FILE, RECOVERY_POINT, RECOVERY_POINT_FILE,
                                 SEGMENT_FILES, TIMEINDEX_SUFFIX, parse_recovery_point, read_quarantine,
                                 segment_bases, segment_file)

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
    every cut, quarantine and rebuild as it happens (writer).

    After :meth:`load`, :attr:`quarantined` lists what the walk
    quarantined (:class:`Quarantined`), and :attr:`cut` says where it cut
    the log (position in a segment, reason), or None.
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
        self.quarantined: list = []       # Quarantined, found by this walk or restored from the file
        self.cut = None                   # (segment path, position, reason) where the walk cut the log
        self.bases = [b for b in segment_bases(directory) if min_base is None or b >= min_base]
        self.point = None                 # the recovery point as parsed (check reads it whole)
        self.resume = self._recovery_point()
        if self.resume is not None and self.resume[0] in self.bases and \
                self.resume[1] > os.path.getsize(segment_file(directory, self.resume[0])):
            self.resume = None            # the segment lost bytes it vouched for: scan every segment
        # Holes and gaps between segments end the log (a consistent prefix)
        # when the writer promised nothing after a power loss; otherwise
        # they are damage, quarantined like any other.
        self.holes_end = self.point is not None and self.point[3] == FSYNC_CODES["never"]
        self.saved = self._saved_quarantine()

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
        return self.point[:3]

    def _saved_quarantine(self) -> dict:
        """{segment base: [entry]} of the partition's quarantine file (an
        entry is used only where it still holds); a bad file is ignored:
        reads find the damage again."""
        path = os.path.join(self.directory, QUARANTINE_FILE)
        try:
            entries = read_quarantine(path)
        except CorruptLogError as e:
            if self.mode == CHECK:
                self._problem(path, e.position, f"{e.reason}; the next open rewrites it from what it finds",
                              REPAIRABLE)
            elif self.mode == WRITER:
                self._drop(path, e.position, f"{e.reason}; rewritten from what opening and reads find")
            return {}
        out: dict = {}
        for e in entries:
            out.setdefault(e.segment, []).append(Quarantined(*e))
        return out

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
        segments overlap (writer, read-only)."""
        if self.mode == CHECK:
            return self._check()
        segments = []
        bases = self.bases
        for i, base in enumerate(bases):
            last = i == len(bases) - 1
            next_base = None if last else bases[i + 1]
            plan = self._plan(base)
            # Past the resume point of a writer that ran with fsync="never"
            # nothing was promised, and a power loss can keep a later page of
            # the tail and lose an earlier one: a bad batch there ends the log
            # (the longest consistent prefix), so no commit marker outlives
            # a batch of its transaction.
            cut_from = -1 if plan is None or not self.holes_end else plan[0]
            writable = self.mode == WRITER and last
            if plan is None:
                seg = Segment(segment_file(self.directory, base), base, 0, False, self.index_interval_bytes,
                              self.budget)
                segments.append(seg)
                self._restore(seg)
                if self._trust(seg, next_base):
                    continue
                segments[-1] = seg = self._reopen(seg, False)
                plan = (0, base)
            else:
                seg = Segment(segment_file(self.directory, base), base, self.segment_bytes_max if writable else 0,
                              writable, self.index_interval_bytes, self.budget)
                segments.append(seg)
                self._restore(seg)
            pos, next_offset = plan
            if pos and not self.adopt_index(seg, pos, next_offset, partial=True):
                pos, next_offset = 0, base
            known = len(seg.quarantined())
            # Only the last segment's tail can hold bytes not yet written
            # back; holes elsewhere are damage unless nothing was promised.
            bad = seg.recover(pos, next_offset, True, last or self.holes_end, cut_from)
            self._note_quarantined(seg, known)
            if bad is not None:
                if last or (cut_from >= 0 and bad[0] >= cut_from) or next_base <= seg.next_offset or (self.holes_end and _is_hole(seg.path, bad[0])):
                    self._cut(segments, bad, bases[i + 1:], last)
                    break
                self._quarantine_tail(seg, bad[0], next_base, bad[1])
            elif next_base is not None and seg.next_offset != next_base:
                if next_base < seg.next_offset:
                    raise _gap(seg, seg.size, seg.next_offset, next_base)
                reason = _gap(seg, seg.size, seg.next_offset, next_base).reason
                if self.holes_end:
                    self._cut(segments, (seg.size, reason), bases[i + 1:], False)
                    break
                self._quarantine_tail(seg, seg.size, next_base, reason)
            if self.mode == WRITER:
                if not (pos and pos == seg.size and self._index_current(seg)):
                    self._rewrite(seg)   # (a clean close left it whole: nothing scanned, nothing to write)
                if not last and self.fsync != "never":
                    seg.sync_file()      # rescanned: durable before a recovery point trusts it
        return segments

    def _reopen(self, seg: Segment, writable: bool) -> Segment:
        seg.close(trim=False)
        out = Segment(seg.path, seg.base_offset, self.segment_bytes_max if writable else 0, writable,
                      self.index_interval_bytes, self.budget)
        self._restore(out)
        return out

    def _trust(self, seg: Segment, next_base: int) -> bool:
        """Segment ``seg``, below the resume point, known good up to its
        file size: adopt its indexes and check that its batches end where
        the next segment begins. False when either fails: the caller scans
        it (a bad index is rebuilt; damage is quarantined or cut)."""
        if not self.adopt_index(seg, seg.file_size, next_base):
            return False
        offs, poss, _, _ = seg.index_entries()
        start = (int(poss[-1]), int(offs[-1])) if len(offs) else (0, seg.base_offset)
        end_pos, end = batches_end(seg, seg.size, *start)
        return end == next_base or any(q.end_offset == next_base for q in self._held(seg))

    def _held(self, seg: Segment) -> list:
        return [q for q in self.quarantined if q.segment == seg.base_offset]

    def _restore(self, seg: Segment) -> None:
        """Quarantine in ``seg`` the saved ranges that still hold: the bytes
        there still fail, and a sound batch of the saved end offset starts
        where the range ends (or the range ends the segment)."""
        for q in self.saved.get(seg.base_offset, ()):
            if _still_holds(seg, q):
                seg.quarantine_add(q.position, q.end_position, q.first_offset, q.end_offset, q.reason)
                if q not in self.quarantined:
                    self.quarantined.append(q)

    def _note_quarantined(self, seg: Segment, known: int) -> None:
        """Report the ranges the scan of ``seg`` quarantined."""
        for pos, end_pos, first, end, reason in seg.quarantined():
            q = Quarantined(seg.base_offset, pos, end_pos, first, end, reason)
            if q in self.quarantined:
                continue
            self.quarantined.append(q)
            self._drop(seg.path, pos, f"{reason}; quarantined bytes {pos}..{end_pos} (offsets {first}..{end - 1} "
                                      f"lost; readers skip them)")

    def _quarantine_tail(self, seg: Segment, pos: int, next_base: int, reason: str) -> None:
        """The batches of ``seg`` stop at ``pos`` short of the next segment
        (a bad tail, or a segment that ends early): its bytes from there
        and the offsets up to ``next_base`` are lost, the log goes on."""
        end_pos = max(pos, seg.file_size)
        first = seg.next_offset
        seg.quarantine_add(pos, end_pos, first, next_base, reason)
        q = Quarantined(seg.base_offset, pos, end_pos, first, next_base, reason)
        if q not in self.quarantined:
            self.quarantined.append(q)
        self._drop(seg.path, pos, f"{reason}; quarantined bytes {pos}..{end_pos} (offsets {first}..{next_base - 1} "
                                  f"lost; readers skip them)")

    def adopt_index(self, seg: Segment, size: int, next_offset: int, partial: bool = False) -> bool:
        """Load the on-disk indexes of ``seg`` (:func:`read_index`) when
        they pass; False when they are missing or fail (the caller scans),
        having reported (writer) a damaged one: the scan rebuilds it, which
        ``txmq check`` calls repairable. ``partial``: only the entries below
        a resume point inside the segment are wanted (fewer on disk is not
        damage: the scan writes the rest)."""
        off, tix, problem = read_index(self.directory, seg, size, next_offset, partial)
        if problem is None:
            seg.load_index(off["a"], off["b"], tix["a"], tix["b"], size, next_offset)
            if self.mode == WRITER:
                self.index_written[seg.base_offset] = (len(off), len(tix))
                if not partial and (torn(segment_file(self.directory, seg.base_offset, INDEX_SUFFIX))
                                    or torn(segment_file(self.directory, seg.base_offset, TIMEINDEX_SUFFIX))):
                    self._rewrite(seg)
            return True
        if self.mode == WRITER and (problem != "missing" or size):
            self._drop(segment_file(self.directory, seg.base_offset, INDEX_SUFFIX), 0,
                       f"{problem}; index rebuilt from its segment")
        return False

    def _cut(self, segments: list, bad: tuple, later: list, last: bool) -> None:
        """The log ends at ``bad`` (position, reason) in the last of
        ``segments``: offsets must stay dense, so nothing after survives.
        The writer cuts the files there; a read-only view just ends."""
        seg = segments[-1]
        self.cut = (seg.path, bad[0], bad[1])
        self._drop(seg.path, bad[0], bad[1])
        for base in later:
            self._drop(segment_file(self.directory, base), 0, "segment after a truncated one")
            if self.mode == WRITER:
                for suffix in SEGMENT_FILES:
                    _unlink(segment_file(self.directory, base, suffix))
        self.quarantined = [q for q in self.quarantined
                            if q.segment < seg.base_offset or (q.segment == seg.base_offset and q.position < bad[0])]
        if self.mode != WRITER:
            return
        if not last:
            seg = segments[-1] = self._reopen(seg, True)
            seg.recover(0, seg.base_offset, True, True)
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
        """What opening does (the read-only walk), and every bad range of
        every segment (each scanned from byte 0, read-only), each reported
        with what opening and reads do there. Returns the scanned segments
        (the caller checks their side files, then closes them)."""
        walk = LogLoader(self.directory, READ_ONLY, min_base=self.min_base)
        walk.saved = self.saved
        try:
            opened = walk.load()
        except CorruptLogError as e:
            self._problem(e.path, e.position, f"{e.reason}: segments overlap; opening refuses the partition")
            opened = None
        for seg in opened or ():
            seg.close(False)
        cut_at = (walk.cut[0], walk.cut[1]) if opened is not None and walk.cut is not None else None
        if cut_at is not None and self.published is not None \
                and cut_at == (segment_file(self.directory, self.published[0]), cut_at[1]) \
                and cut_at[1] >= self.published[1]:
            cut_at = None                 # past what the live owner has published: being written now
        segments = []
        dropped = opened is None          # past the cut (or refused): nothing after is the log's
        bases = self.bases
        for i, base in enumerate(bases):
            path = segment_file(self.directory, base)
            seg = Segment(path, base, 0, False, budget=self.budget)
            segments.append(seg)
            bad = seg.recover(0, base, True, False)
            if bad is not None and self.published is not None and self.published[0] == base \
                    and bad[0] >= self.published[1]:
                bad = None                # past what the live owner has published: being written now
            ranges = [(q[0], q[4]) for q in seg.quarantined()]
            if bad is not None:
                ranges.append(bad)
            if cut_at is not None and cut_at[0] == path and not any(r[0] == cut_at[1] for r in ranges):
                ranges.append((cut_at[1], walk.cut[2]))
                ranges.sort()
            if ranges:
                self.damaged.add(base)
            later = len(bases) - i - 1
            for pos, reason in ranges:
                if dropped:
                    self._problem(path, pos, f"{reason}; opening drops this segment (the log is cut before it)")
                elif cut_at == (path, pos):
                    self._problem(path, pos, f"{reason}; opening cuts the log here"
                                  + (f" and drops the {later} later segment(s)" if later else ""))
                    dropped = True
                else:
                    self._problem(path, pos, f"{reason}; opening keeps the log around it: its offsets are "
                                             f"quarantined (lost), readers skip them and report the loss")
                    if cut_at is not None and cut_at[0] == path and pos > cut_at[1]:
                        dropped = True
            if cut_at is not None and cut_at[0] == path:
                dropped = True
            elif not ranges and i + 1 < len(bases) and seg.next_offset != bases[i + 1] and not dropped:
                e = _gap(seg, seg.size, seg.next_offset, bases[i + 1])
                self._problem(e.path, e.position, f"{e.reason}; the offsets between are quarantined (lost), "
                                                  f"readers skip them and report the loss")
        return segments


@dataclass(frozen=True)
class Quarantined:
    """A quarantined range of a segment: bytes [position, end_position) of
    segment ``segment`` that fail their checks, which held offsets
    [first_offset, end_offset), now lost."""

    segment: int
    position: int
    end_position: int
    first_offset: int
    end_offset: int
    reason: str = ""

    def __eq__(self, other) -> bool:
        return isinstance(other, Quarantined) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def key(self) -> tuple:
        return self.segment, self.position

    def as_dict(self) -> dict:
        return {"segment": self.segment, "position": self.position, "end_position": self.end_position,
                "first_offset": self.first_offset, "end_offset": self.end_offset, "reason": self.reason}


def _is_hole(path: str, pos: int) -> bool:
    """Whether the bad bytes at ``pos`` of segment file ``path`` are what a
    power loss leaves of a write that had not reached the disk: a zeroed
    batch header, or a file that ends before a header would."""
    with open(path, "rb") as f:
        head = os.pread(f.fileno(), HEADER_SIZE_BYTES, pos)
    return len(head) < HEADER_SIZE_BYTES or not head[:8].strip(b"\0")


def _still_holds(seg: Segment, q: Quarantined) -> bool:
    """Whether the saved range ``q`` still describes ``seg``: its bytes
    fail (no sound batch of its first offset starts there) and a sound
    batch of its end offset starts at its end, or it ends the file."""
    size = seg.file_size
    if not 0 <= q.position <= q.end_position <= size or q.first_offset >= q.end_offset:
        return False
    if q.position < q.end_position and seg.check_at(q.position, q.first_offset) is None:
        return False
    return q.end_position == size or seg.check_at(q.end_position, q.end_offset) is None


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
