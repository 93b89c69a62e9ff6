"""``txmq check``: verify every file of a data directory, changing nothing.

No broker is opened (opening recovers: it would cut torn tails and rewrite
indexes, the very evidence this reports). Files are read with the same code
the broker reads them with, in read-only mode: segments through the Cython
``Segment`` (mapped read-only; its scan checks magic, lengths, CRC,
offsets and the dense base offsets of every batch and never truncates when
not writable), redo logs through ``_redolog.parse`` and the replay
functions of ``_txn`` (coordinator, pending acks, producer registry),
``_half`` (half messages) and ``txmq.storage.cursor.replay`` (cursors), which read
every payload through ``_reader.Reader`` and so name the first bad byte,
and the fixed-layout files through the parsers of ``txmq.storage.layout``.
A partition's segments are walked by the loader opening uses
(``txmq.storage.loader`` in check mode), so each problem says what opening
does there. Formats: docs/FORMAT.md.

Each problem names a file and the byte where it is, and is one of:

- ``corrupt``: bytes that fail their checks; opening the directory would
  cut the log or redo log there (or refuse the file), losing what follows;
  or bytes that pass them but say something the log does not, which
  opening trusts and so does not repair;
- ``repairable``: derived data (indexes, snapshots, recovery point) that is
  wrong or missing; opening the directory rebuilds it from the log (an
  index entry is wrong when ``txmq.storage.index.index_problem`` says so, the
  predicate opening rebuilds by).

Anything the broker does not write is listed as a note, not a problem.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict

import numpy as np

from txmq import _half, readonly
from txmq._segment import Segment
from txmq._redolog import FILE_HEADER, SNAPSHOT, parse
from txmq._txnlog import replay_coordinator, replay_pending, replay_registry
from txmq.storage import datadir
from txmq.storage.datadir import DATA_DIR_ENTRIES
from txmq.cli import exits, opening
from txmq.cli.output import Progress, emit_json, size, wants_progress
from txmq.storage.cursor import replay as replay_cursor
from txmq._readview import RV_LIVE
from txmq.broker.broker import Broker
from txmq.errors import CorruptLogError, DataDirError, DataDirLockedError, TxmqError
from txmq.storage.index import INDEX_ENTRY, index_problem
from txmq.storage.layout import (INDEX_SUFFIX, PRODUCERS_FILE, PRODUCERS_HEAD, PRODUCERS_MAGIC, PRODUCERS_VERSION,
                                 READVIEW_FILE, RECOVERY_POINT_FILE, RP_POSITION_OFFSET, TIMEINDEX_SUFFIX, TXNBUF_FILE,
                                 TXNBUF_HEAD, TXNBUF_MAGIC, TXNBUF_VERSION, TXNINDEX_ENTRY, TXNINDEX_SUFFIX,
                                 known_files, parse_producer_table, parse_snapshot, parse_txn_tables, segment_file,
                                 txnindex_entries)
from txmq.storage.loader import CHECK, CORRUPT, REPAIRABLE, LogLoader, Problem
from txmq.storage.txnbuffer import MARKER_FLAGS
from txmq.dispatch.subscription import config_problem
from txmq.storage.topic import Topic

REDO_HEADER_SIZE = len(FILE_HEADER)
ABORT_MARKER = MARKER_FLAGS[False]


class Report:
    def __init__(self):
        self.problems: list[Problem] = []
        self.notes: list[str] = []
        self.files = 0
        self.bytes = 0
        self.repaired: list[str] = []

    def problem(self, path: str, position: int, reason: str, kind: str = CORRUPT) -> None:
        self.problems.append(Problem(path, int(position), reason, kind))


def check(args) -> int:
    opening.require_data_dir(args.dir)
    t0 = time.perf_counter()
    repaired = []
    if getattr(args, "repair", False):
        repaired = repair(args.dir)
        repaired += reopen_to_repair(args.dir, check_directory(args.dir).problems)
    report = check_directory(args.dir, wants_progress(args.progress))
    report.repaired = repaired
    seconds = time.perf_counter() - t0
    if args.json:
        emit_json({"path": args.dir, "ok": not report.problems, "files": report.files,
                   "bytes": report.bytes, "seconds": round(seconds, 3),
                   "problems": [asdict(p) for p in report.problems], "notes": report.notes,
                   "repaired": report.repaired})
    else:
        for r in report.repaired:
            print(f"repair: {r}")
        for p in report.problems:
            print(p)
        for n in report.notes:
            print(f"note: {n}")
        verdict = (f"{len(report.problems)} problem(s)" if report.problems else "no problems")
        print(f"checked {report.files:,} files ({size(report.bytes)}) in {seconds:.2f} s: {verdict}")
    return exits.PROBLEMS if report.problems else exits.OK


def repair(path: str) -> list:
    """``txmq check --repair``: restore the ``topic.json`` of every topic
    folder that lost it but holds partition data (opening keeps such a
    folder and does not serve it). Takes the directory's lock, so no
    broker holds it meanwhile. Returns what was done, as sentences."""
    try:
        lock = datadir.DirLock(os.path.abspath(path))
    except DataDirLockedError as e:
        raise exits.locked_error(e.path, e.holder) from None
    done = []
    try:
        tdir = os.path.join(path, "topics")
        for name in sorted(os.listdir(tdir)):
            topic = os.path.join(tdir, name)
            if (datadir.DELETED in name or not os.path.isdir(topic)
                    or os.path.exists(os.path.join(topic, datadir.TOPIC_CONFIG)) or datadir.is_unused_topic(topic)):
                continue
            try:
                config = datadir.rebuild_topic_config(topic)
            except DataDirError as e:
                done.append(f"{topic}: not restored: {e.reason}")
                continue
            Topic.write_config(topic, config)
            done.append(f"{topic}: restored {datadir.TOPIC_CONFIG} ({config['partitions']} partition(s); "
                        f"retention: the broker's defaults)")
    finally:
        lock.release()
    return done


def reopen_to_repair(path: str, before: list) -> list:
    """``txmq check --repair``, second step: what check calls repairable is
    rebuilt by opening the directory, so open it (a broker: it takes the
    lock), read every partition to its end (a read quarantines the bad
    bytes it meets, and ``quarantine.json`` records them), rebuild every
    index that fails the full check (``scrub_indexes``), and close. Returns
    what was done, as sentences: each problem of ``before`` that is gone,
    and each range opening or the reads quarantined or cut."""
    if not before:
        return []
    done = []
    try:
        broker = Broker(path)
    except DataDirLockedError as e:
        raise exits.locked_error(e.path, e.holder) from None
    except TxmqError as e:
        return [f"not repaired: opening the directory fails ({e}); the problems below need a decision"]
    try:
        for topic in broker.topics():
            for part in broker._topics[topic].partitions:
                for _ in part.headers(part.start_offset, part.end_offset):
                    pass
                part.scrub_indexes(None)
                done += [f"{d}" for d in part.dropped]
    finally:
        broker.close()
    after = {(p.path, p.position, p.reason) for p in check_directory(path).problems}
    for p in before:
        if (p.path, p.position, p.reason) not in after:
            done.append(f"{p.path} at byte {p.position}: {'rebuilt' if p.kind == REPAIRABLE else 'handled'} "
                        f"({p.reason})")
    return done


def check_directory(path: str, progress: bool = False) -> Report:
    """Check every file under ``path``; read-only. Against a directory a
    live owner holds, what it is writing now (past the end its read view
    publishes, and the indexes of its active segments, kept in memory
    until the segment rolls) is not reported."""
    report = Report()
    holder = readonly.writer_pid(path)
    if holder is not None:
        report.notes.append(f"process {holder or '(pid not visible)'} holds the directory: checked up to what it "
                            f"has published")
    # Segments are preallocated: count the blocks a file has, not its length.
    total = sum(_allocated(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs
                if os.path.isfile(os.path.join(d, f)))
    bar = Progress(f"check {path}", total, "B", progress)
    try:
        checker = _Checker(path, report, bar, live=holder is not None)
        checker.run()
    finally:
        bar.close()
    return report


class _Checker:
    def __init__(self, root: str, report: Report, bar: Progress, live: bool = False):
        self.root = root
        self.report = report
        self.bar = bar
        self.live = live

    def _done(self, path: str, n: int | None = None) -> None:
        """Count ``path`` as checked: ``n`` bytes (default its length)."""
        if n is None:
            try:
                n = os.path.getsize(path)
            except OSError:
                n = 0
        self.report.files += 1
        self.report.bytes += n
        self.bar.update(n, os.path.relpath(path, self.root))

    def run(self) -> None:
        for name in sorted(os.listdir(self.root)):
            if name not in DATA_DIR_ENTRIES:
                self.report.notes.append(f"{os.path.join(self.root, name)}: not a file txmq writes; not checked")
        if os.path.exists(os.path.join(self.root, datadir.MARKER)):
            try:
                datadir.read_marker(self.root)
            except DataDirError as e:
                self.report.problem(os.path.join(self.root, datadir.MARKER), 0, f"{e.reason}; the broker "
                                                                               f"refuses the directory")
        else:
            self.report.notes.append(f"{os.path.join(self.root, datadir.MARKER)}: missing (a directory of an "
                                     f"earlier release); the next open writes it")
        topics = {}
        tdir = os.path.join(self.root, "topics")
        for name in sorted(os.listdir(tdir)):
            n = self._topic(os.path.join(tdir, name))
            if n is not None:
                topics[name] = n
        sdir = os.path.join(self.root, "subscriptions")
        for topic in sorted(os.listdir(sdir)) if os.path.isdir(sdir) else ():
            for sub in sorted(os.listdir(os.path.join(sdir, topic))):
                self._subscription(os.path.join(sdir, topic, sub), topics.get(topic))
        cdir = os.path.join(self.root, "coordinator")
        for name in sorted(os.listdir(cdir)) if os.path.isdir(cdir) else ():
            path = os.path.join(cdir, name)
            if name.startswith("tc-") and name.endswith(".log"):
                self._redo(path, _replayed(replay_coordinator))
            else:
                self._note_unknown(path)
        producers = os.path.join(self.root, "producers.log")
        if os.path.exists(producers):
            self._redo(producers, _replayed(replay_registry))
        hdir = os.path.join(self.root, "half")
        if os.path.isdir(hdir):
            self._half(hdir)

    def _half(self, hdir: str) -> None:
        """The half messages: their log (a partition), the redo log of their
        state records, and the state table against what that log rebuilds."""
        for name in sorted(os.listdir(hdir)):
            if name not in ("log", "redo.log", "statetable"):
                self._note_unknown(os.path.join(hdir, name))
        ldir = os.path.join(hdir, "log", "0")
        if os.path.isdir(ldir):
            self._partition(ldir)
        redo = os.path.join(hdir, "redo.log")
        if not os.path.exists(redo):
            return
        frames = self._redo(redo, _replayed(_replay_half))
        last = max([i for i, f in enumerate(frames) if f[0] == SNAPSHOT], default=0)
        try:
            base, records, _, _, _ = _half.replay(frames[last:], path=redo)
        except CorruptLogError:
            return                      # reported with the redo log
        table = os.path.join(hdir, "statetable")
        if not os.path.exists(table):
            self.report.problem(table, 0, "missing; rebuilt from the redo log on the next open", REPAIRABLE)
            return
        self._done(table)
        if _half.read_header(table) != base:
            self.report.problem(table, 0, f"header is not a state table's starting at half id {base}; "
                                          f"rebuilt from the redo log on the next open", REPAIRABLE)
            return
        with open(table, "rb") as f:
            f.seek(_half.HEADER_SIZE)
            raw = f.read(len(records))
        got = np.frombuffer(raw[:len(raw) // _half.RECORD_SIZE * _half.RECORD_SIZE], np.uint8)
        want = np.frombuffer(bytes(records), np.uint8)[:len(got)]
        differ = np.flatnonzero((got.reshape(-1, _half.RECORD_SIZE) != want.reshape(-1, _half.RECORD_SIZE))
                                .any(axis=1)) if len(got) else []
        for i in differ[:10]:
            self.report.problem(table, _half.HEADER_SIZE + int(i) * _half.RECORD_SIZE,
                                f"state record of half message {base + int(i)} differs from the redo log; "
                                f"rebuilt on the next open", REPAIRABLE)
        if len(differ) > 10:
            self.report.problem(table, _half.HEADER_SIZE, f"{len(differ) - 10} more state records differ "
                                                          f"from the redo log", REPAIRABLE)

    def _note_unknown(self, path: str) -> None:
        if path.endswith(".tmp") or path.endswith(".compact"):
            self.report.notes.append(f"{path}: a temporary file a stopped write left; removed or "
                                     f"replaced on the next open")
        else:
            self.report.notes.append(f"{path}: not a file txmq writes; not checked")

    # -- topics and partitions ---------------------------------------------------------

    def _topic(self, tdir: str):
        meta = os.path.join(tdir, "topic.json")
        if datadir.DELETED in os.path.basename(tdir):
            self.report.notes.append(f"{tdir}: a topic delete that stopped half way; the next open removes it")
            return None
        if not os.path.isdir(tdir):
            self.report.notes.append(f"{tdir}: not a folder; not a topic, not checked")
            return None
        if not os.path.exists(meta):
            if datadir.is_unused_topic(tdir):
                self.report.notes.append(f"{tdir}: a topic create that stopped before topic.json (no data); "
                                         f"the next open removes it")
                return None
            try:
                datadir.rebuild_topic_config(tdir)
            except DataDirError as e:
                self.report.notes.append(f"{tdir}: not a topic's folder ({e.reason}); kept, not checked")
                return None
            self.report.problem(meta, 0, f"missing, and the folder holds partition data: the broker keeps "
                                         f"it but does not serve the topic; `txmq check --repair "
                                         f"{self.root}` restores it", REPAIRABLE)
            config = datadir.rebuild_topic_config(tdir)
        else:
            config = self._json(meta)
        if config is None:
            return None
        n = config.get("partitions")
        if type(n) is not int or n < 1:
            self.report.problem(meta, 0, f"\"partitions\" is {n!r}, not an int >= 1")
            return None
        for entry in sorted(os.listdir(tdir)):
            if entry != "topic.json" and not (entry.isdigit() and int(entry) < n):
                self._note_unknown(os.path.join(tdir, entry))
        for p in range(n):
            pdir = os.path.join(tdir, str(p))
            if not os.path.isdir(pdir):
                continue          # never opened: an empty partition (docs/FORMAT.md)
            self._partition(pdir)
        return n

    def _json(self, path: str):
        self._done(path)
        try:
            with open(path, "rb") as f:
                raw = f.read()
            value = json.loads(raw)
        except json.JSONDecodeError as e:
            self.report.problem(path, len(e.doc[:e.pos].encode()), f"not valid JSON: {e.msg}")
            return None
        except (UnicodeDecodeError, ValueError) as e:
            self.report.problem(path, 0, f"not valid JSON: {e}")
            return None
        if not isinstance(value, dict):
            self.report.problem(path, 0, "not a JSON object")
            return None
        return value

    def _partition(self, pdir: str) -> None:
        """The segments, walked as opening walks them (the loader in check
        mode: every problem says what opening does there), then each
        segment's side files and the snapshots."""
        names = sorted(os.listdir(pdir))
        loader = LogLoader(pdir, CHECK, published=self._active_segment(pdir))
        # readview (the writer's published positions for read-only readers)
        # is rewritten by every open and not checked here.
        known = known_files(loader.bases)
        for n in names:
            if n not in known:
                self._note_unknown(os.path.join(pdir, n))
        rp = os.path.join(pdir, RECOVERY_POINT_FILE)
        if os.path.exists(rp):
            self._done(rp)
        segments = loader.load()
        self.report.problems += loader.problems
        active = loader.published
        try:
            for seg in segments:
                damaged = seg.base_offset in loader.damaged
                self._done(seg.path, seg.size)
                self._indexes(pdir, seg, damaged, active is not None and active[0] == seg.base_offset)
                if loader.point is not None and loader.point[0] == seg.base_offset:
                    self._recovery_point_in(pdir, loader.point, seg, damaged)
        finally:
            for seg in segments:
                seg.close(False)
        # A log with damage ends early: a snapshot past that end is its
        # consequence, already reported with the damage.
        start = segments[0].base_offset if segments else 0
        end = None if loader.damaged else (segments[-1].next_offset if segments else 0)
        self._snapshot(os.path.join(pdir, TXNBUF_FILE), TXNBUF_MAGIC, TXNBUF_VERSION, TXNBUF_HEAD,
                       parse_txn_tables, start, end)
        self._snapshot(os.path.join(pdir, PRODUCERS_FILE), PRODUCERS_MAGIC, PRODUCERS_VERSION,
                       PRODUCERS_HEAD, parse_producer_table, start, end)

    def _active_segment(self, pdir: str):
        """(base, published size) of the segment a live owner is appending
        to, from the partition's read view; None when no owner is live."""
        if not self.live:
            return None
        try:
            with open(os.path.join(pdir, READVIEW_FILE), "rb") as f:
                rv = readonly.read_readview(f.read())
        except OSError:
            return None
        if rv is None or rv.state != RV_LIVE:
            return None
        return rv.active_base, rv.active_size

    def _entries(self, path: str, entry_size: int, written_later: bool = False):
        """The whole entries of an index-like file, or None when it is
        missing (reported, unless ``written_later``: the live owner's
        active segment); a torn last entry is reported."""
        if not os.path.exists(path):
            if not written_later:
                self.report.problem(path, 0, "missing; rebuilt from the segment on the next open", REPAIRABLE)
            return None
        self._done(path)
        with open(path, "rb") as f:
            raw = f.read()
        whole = len(raw) - len(raw) % entry_size
        if whole != len(raw):
            self.report.problem(path, whole, f"torn last entry ({len(raw) - whole} of {entry_size} bytes)",
                                REPAIRABLE)
        return raw[:whole]

    def _indexes(self, pdir: str, seg: Segment, damaged: bool, active: bool = False) -> None:
        raw = self._entries(segment_file(pdir, seg.base_offset, INDEX_SUFFIX), INDEX_ENTRY.itemsize, active)
        traw = self._entries(segment_file(pdir, seg.base_offset, TIMEINDEX_SUFFIX), INDEX_ENTRY.itemsize, active)
        if raw is not None and traw is not None:       # else opening rebuilds both
            off, tix = np.frombuffer(raw, INDEX_ENTRY), np.frombuffer(traw, INDEX_ENTRY)
            if damaged:
                # Past the damage already reported in the segment: cut with it.
                off = off[:np.argmax(np.append((off["b"] >= seg.size) | (off["a"] >= seg.next_offset), True))]
                tix = tix[:np.argmax(np.append(tix["b"] >= seg.next_offset, True))]
            problem = index_problem(seg, off["a"], off["b"], tix["a"], tix["b"])
            if problem is not None:
                suffix, i, reason = problem
                self.report.problem(segment_file(pdir, seg.base_offset, suffix), i * INDEX_ENTRY.itemsize,
                                    f"entry {reason} of {os.path.basename(seg.path)}; the broker rebuilds "
                                    f"the index from the segment (on open, or in its background index "
                                    f"check)", REPAIRABLE)
        txnindex = segment_file(pdir, seg.base_offset, TXNINDEX_SUFFIX)
        raw = self._entries(txnindex, TXNINDEX_ENTRY.size)
        if raw is not None:
            self._txn_index(txnindex, raw, seg, damaged)

    def _batch_base(self, seg: Segment, offset: int):
        """(position, batch info) of the batch starting at ``offset``, or None."""
        if not seg.base_offset <= offset < seg.next_offset:
            return None
        try:
            pos = seg.locate(offset)
            info = seg.batch_at(pos) if pos >= 0 else None
        except CorruptLogError:
            return None
        if info is None or info.base_offset != offset:
            return None
        return pos, info

    def _txn_index(self, path: str, raw: bytes, seg: Segment, damaged: bool) -> None:
        """Opening cuts a .txnindex at its first entry that fails its CRC
        or whose marker lies outside the segment (repairable); an entry
        that passes both is trusted (``aborted_transactions``, read-only
        readers skip that transaction as aborted), so one that does not
        name an ABORT marker of its transaction is corrupt."""
        size_ = TXNINDEX_ENTRY.size
        entries, bad = txnindex_entries(raw)
        for i, (hi, lo, _pid, first, marker) in enumerate(entries):
            if damaged and marker >= seg.next_offset:
                return                  # opening cuts it with the damaged log
            if not seg.base_offset <= marker < seg.next_offset:
                self.report.problem(path, i * size_, f"entry (first offset {first}, marker {marker}) lies "
                                                     f"outside {os.path.basename(seg.path)}; opening cuts the "
                                                     f"index here", REPAIRABLE)
                return
            found = self._batch_base(seg, marker)
            info = found and found[1]
            if (not info or info.flags & ABORT_MARKER != ABORT_MARKER
                    or (info.txn_hi, info.txn_lo) != (hi, lo) or first > marker):
                self.report.problem(path, i * size_, f"entry (first offset {first}, marker {marker}) does "
                                                     f"not name an ABORT marker of its transaction in "
                                                     f"{os.path.basename(seg.path)}; the broker trusts it "
                                                     f"(that transaction reads as aborted)")
                return
        if bad is not None:
            self.report.problem(path, bad * size_, "entry fails its CRC", REPAIRABLE)

    def _recovery_point_in(self, pdir: str, point: tuple, seg: Segment, damaged: bool) -> None:
        """The recovery point's position is a batch boundary of its segment
        where its next offset starts (or the segment's end)."""
        base, pos, next_offset = point[:3]
        if damaged and pos > seg.size:
            return                      # the segment's damage is reported; the open rescans
        if pos == seg.size:
            ok = next_offset == seg.next_offset
        else:
            found = self._batch_base(seg, next_offset)
            ok = found is not None and found[0] == pos
        if not ok:
            self.report.problem(os.path.join(pdir, RECOVERY_POINT_FILE), RP_POSITION_OFFSET,
                                f"claims segment {base} checked to byte {pos}, where offset {next_offset} "
                                f"starts; its batches say otherwise (they end at byte {seg.size}, "
                                f"offset {seg.next_offset})", REPAIRABLE)

    def _snapshot(self, path: str, magic: bytes, version: int, head, parse_tables, start: int, end):
        if not os.path.exists(path):
            self.report.problem(path, 0, "missing; rebuilt from the log on the next open", REPAIRABLE)
            return
        self._done(path)
        with open(path, "rb") as f:
            raw = f.read()
        try:
            fields, _ = parse_snapshot(path, raw, magic, version, head, parse_tables)
        except CorruptLogError as e:
            self.report.problem(path, e.position, f"{e.reason}; the next open rebuilds it from the log", REPAIRABLE)
            return
        if end is not None and not start <= fields[-1] <= end:
            self.report.problem(path, head.size - 8, f"taken at offset {fields[-1]}, outside the log "
                                                     f"[{start}, {end}]; the next open rebuilds it", REPAIRABLE)

    # -- redo logs -----------------------------------------------------------------------

    def _subscription(self, sdir: str, partitions) -> None:
        if partitions is None:
            self.report.notes.append(f"{sdir}: subscription of a topic that does not exist; not checked")
            return
        meta = os.path.join(sdir, "subscription.json")
        if not os.path.exists(meta):
            self.report.notes.append(f"{sdir}: no subscription.json (a create that stopped half way); "
                                     f"the next open removes it")
            return
        config = self._json(meta)
        problem = None if config is None else config_problem(config)
        if problem is not None:
            self.report.problem(meta, 0, problem)
        for name in sorted(os.listdir(sdir)):
            path = os.path.join(sdir, name)
            if name == "subscription.json":
                continue
            if name.startswith("cursor-") and name.endswith(".log"):
                self._redo(path, _replayed(_replay_cursor))
            elif name.startswith("pending-") and name.endswith(".log"):
                self._redo(path, _replayed(replay_pending))
            else:
                self._note_unknown(path)

    def _redo(self, path: str, validate) -> list:
        """A framed redo log: file header, every frame's length and CRC,
        then what its frames say (``validate(path, frames)`` -> (position,
        reason) of the first bad byte, or None). Returns the frames that
        passed their CRC, ``[(type, payload, position)]``."""
        self._done(path)
        with open(path, "rb") as f:
            data = f.read()
        if not data:
            return []                   # created, header not yet written: opening writes it
        if len(data) < REDO_HEADER_SIZE:
            self.report.problem(path, 0, f"torn file header ({len(data)} bytes)")
            return []
        if data[:4] != FILE_HEADER[:4]:
            self.report.problem(path, 0, f"bad redo-log magic {data[:4].hex()}; the broker refuses the file")
            return []
        if data[4] != FILE_HEADER[4]:
            self.report.problem(path, 4, f"unknown redo-log version {data[4]}; the broker refuses the file")
            return []
        # (a coordinator log keeps zeros written ahead of its end: not a tear)
        frames, end, reason = parse(data, len(FILE_HEADER), os.path.basename(path).startswith("tc-"))
        if reason is not None:
            self.report.problem(path, end, f"{reason}; opening cuts the log here ({len(data) - end:,} "
                                           f"bytes, the frames from here on, are dropped)")
        bad = validate(path, frames)
        if bad is not None:
            self.report.problem(path, bad[0], f"{bad[1]}; the broker refuses the file")
        return frames


def _allocated(path: str) -> int:
    """The bytes a file has on disk (at most its length)."""
    try:
        st = os.stat(path)
    except OSError:
        return 0
    return min(st.st_size, st.st_blocks * 512)


def _replayed(replay):
    """A validator that runs ``replay(frames, path)`` over every frame of
    the redo log at ``path``, as opening replays them: a frame that does not
    parse raises CorruptLogError at its first bad byte, which is where the
    problem is."""

    def validate(path: str, frames):
        try:
            replay(frames, path)
        except CorruptLogError as e:
            return e.position, e.reason
        return None

    return validate


def _replay_half(frames, path: str) -> None:
    _half.replay(frames, path=path)


def _replay_cursor(frames, path: str) -> None:
    replay_cursor(frames, 0, path)   # what opening does with the frames; the start offset changes no verdict


