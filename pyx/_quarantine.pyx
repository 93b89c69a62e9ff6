# cython: boundscheck=False, wraparound=False
"""The quarantined byte ranges of one segment (docs/FORMAT.md, "Quarantine").

Bytes that fail their checks in the middle of a segment (a flipped byte, a
bad length) are not cut together with the good batches after them. The
segment's forward scan (``Segment.find_batch``: 8 bytes at a time, never
past the mapped bytes it is given) finds the next batch whose header and
CRC check with a base offset at or past the one expected; the bytes in
between become a range ``(position, end position, first offset, end
offset, reason)`` here. Every walk over the batches hops a range
(:meth:`QuarantineRanges.hop`), so its offsets read as lost and everything
around it reads as before. Ranges are found by recovery, or below a
recovery point by the first read that meets the bad bytes, and may be
given back from the partition's ``quarantine.json``.
"""
from libc.stdint cimport int64_t


cdef class QuarantineRanges:

    def __init__(self):
        self.ranges = []

    cdef int add(self, Py_ssize_t pos, Py_ssize_t end_pos, int64_t first, int64_t end, str reason) except -1:
        """Keep a range, in position order; one already starting at ``pos`` stays."""
        cdef Py_ssize_t i = 0
        for entry in self.ranges:
            if entry[0] == pos:
                return 0
            if entry[0] > pos:
                break
            i += 1
        self.ranges.insert(i, (pos, end_pos, first, end, reason))
        self.n = len(self.ranges)
        return 0

    cdef Py_ssize_t hop(self, Py_ssize_t pos, int64_t *expected, Py_ssize_t *follow) except -2:
        """``pos``, or the end of the range(s) starting there. When given,
        ``expected`` moves to the offset after them, and ``follow`` moves
        with each hop that starts where it stands (a verified prefix)."""
        cdef bint moved = True
        while moved:
            moved = False
            for entry in self.ranges:
                if entry[0] == pos and entry[1] >= pos:
                    if follow != NULL and follow[0] == pos:
                        follow[0] = entry[1]
                    pos = entry[1]
                    if expected != NULL:
                        expected[0] = entry[3]
                    moved = entry[1] > entry[0]
                    break
        return pos

    cdef int drop_from(self, Py_ssize_t pos) except -1:
        """Forget the ranges at or past ``pos`` (the segment was cut there)."""
        if self.n:
            self.ranges = [q for q in self.ranges if q[0] < pos]
            self.n = len(self.ranges)
        return 0

    def list(self):
        """The ranges, by position."""
        return list(self.ranges)
