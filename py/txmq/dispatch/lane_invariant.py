"""The lane invariant of a subscription (stated in
:mod:`txmq.dispatch.subscription`) and its check under ``TXMQ_DEBUG``.

With ``TXMQ_DEBUG=1`` in the environment at import (the test suite sets
it), the subscription and its pending-ack handle call :func:`changed` after
every operation that changes a lane, under the subscription's lock, and a
broken invariant raises ``AssertionError`` there. The full check is O(n) in
the lane's window ``[mark_delete, read_offset)`` and its dispatch state, so
it is paced as the Cython tables pace theirs (pyx/_debug.pxd): after every
change while the window holds up to ``DEBUG_SMALL`` offsets, after every
n/64-th change of a larger one, O(64) amortised per change.

Off (the default), a change costs the callers one flag test,
``if lane_invariant.DEBUG:``, and no call. :func:`set_debug` turns the
check on or off.
"""

from __future__ import annotations

import os

import numpy as np

from txmq.storage.delivery import TRANSACTIONAL

DEBUG = os.environ.get("TXMQ_DEBUG") == "1"
DEBUG_SMALL = 1024


def set_debug(on: bool) -> bool:
    """Turn the lane check on or off; return whether it was on."""
    global DEBUG
    was, DEBUG = DEBUG, bool(on)
    return was


def changed(lane) -> None:
    """Count one change of ``lane``; run :func:`check_lane` when it is due."""
    lane.debug_changes += 1
    if lane.debug_changes < lane.debug_next:
        return
    n = max(0, lane.read_offset - lane.cursor.mark_delete)
    lane.debug_next = lane.debug_changes + 1 + (0 if n <= DEBUG_SMALL else n // 64)
    check_lane(lane)


def check_lane(lane) -> None:
    """Raise AssertionError unless ``lane`` keeps the lane invariant: every
    offset of ``[mark_delete, read_offset)`` is settled (acknowledged in the
    cursor, or pending in an open transaction), lost to quarantined bytes
    (passed over until skipped, in no dispatch state), or in exactly one
    dispatch state (outstanding at one consumer, individually or in one
    batch delivery; waiting in the read buffer; queued for redelivery;
    parked behind its open transaction or released by its commit, under
    out-of-order delivery), and no dispatch state holds what it must not
    (see the module :mod:`txmq.dispatch.subscription`). Under
    read_committed, nothing outstanding, buffered or queued belongs to a
    transaction that is open or aborted; a parked span holds batches of its
    own transaction only, a released span batches of a committed one."""
    name = f"lane of partition {lane.partition.index}"
    lo = lane.cursor.mark_delete
    hi = max(lo, lane.read_offset)
    n = hi - lo
    settled, pending = _settled(lane, lo, hi)
    state = np.zeros(n, np.int64)            # dispatch states an unsettled offset is in

    outstanding = np.fromiter(lane.outstanding, np.int64, len(lane.outstanding))
    _in_window(name, "outstanding", outstanding, lo, lane.read_offset)
    at = outstanding - lo
    _none_of(name, "outstanding", outstanding[settled[at]], "acknowledged or pending")
    np.add.at(state, at, 1)

    in_range = np.zeros(n + 1, np.int64)      # batch deliveries covering each offset
    for start, end, _ in lane.ranges:
        if not start < end <= lane.read_offset:
            raise AssertionError(f"{name}: batch delivery [{start}, {end}) outside [{lo}, {lane.read_offset})")
        if end > lo:
            in_range[max(start, lo) - lo] += 1
            in_range[end - lo] -= 1
    in_range = np.cumsum(in_range[:n])
    _none_of(name, "in two batch deliveries", np.flatnonzero(in_range > 1) + lo, "")
    _none_of(name, "in a batch delivery", np.flatnonzero((in_range > 0) & pending) + lo, "and pending")
    delivered = (in_range > 0) & ~settled
    state += delivered

    buffered = np.fromiter((m.offset for m in lane.buffer[lane.buf_i:]), np.int64)
    buffered = buffered[buffered >= lo]
    _in_window(name, "buffered", buffered, lo, lane.read_offset)
    buffered -= lo
    buffered = buffered[~settled[buffered]]
    state[buffered] += 1

    waiting = _waiting(lane, name, lo, n)       # parked or released spans covering each offset
    _none_of(name, "parked or released twice", np.flatnonzero(waiting > 1) + lo, "")
    waiting = (waiting > 0) & ~settled
    state += waiting

    queued = np.unique(np.fromiter((off for _, off in lane.redeliver), np.int64, len(lane.redeliver)))
    queued = queued[queued >= lo]
    _in_window(name, "queued", queued, lo, lane.read_offset)
    queued -= lo
    queued = queued[~settled[queued]]
    # Out of order, a parked or released offset goes out from there: queued
    # as well, it would be delivered twice (or before its commit).
    _none_of(name, "queued for redelivery", queued[waiting[queued]] + lo, "and parked or released")
    # A redelivery entry is dropped when it comes up if its offset is
    # settled or outstanding again; in a batch delivery or in the read
    # buffer it would be delivered twice.
    _none_of(name, "queued for redelivery", queued[delivered[queued]] + lo, "and in a batch delivery")
    _none_of(name, "queued for redelivery", np.intersect1d(queued, buffered) + lo, "and in the read buffer")
    queued = queued[state[queued] == 0]
    state[queued] += 1

    unsettled = ~settled
    _none_of(name, "in two dispatch states", np.flatnonzero(unsettled & (state > 1)) + lo, "")
    # Offsets lost to quarantined bytes are passed over, never delivered,
    # and stay unacknowledged until skipped: a state of their own.
    quarantined = np.zeros(n, bool)
    for first, end in lane.partition.lost_offsets(lo, hi):
        quarantined[first - lo:end - lo] = True
    _none_of(name, "lost to quarantined bytes", np.flatnonzero(quarantined & unsettled & (state > 0)) + lo,
             "and in a dispatch state")
    stray = np.flatnonzero(unsettled & ~quarantined & (state == 0)) + lo
    _none_of(name, "in no state", stray[stray >= lane.partition.start_offset],
             "(neither settled nor outstanding, buffered, queued, parked, released or lost to quarantined bytes)")
    if lane.parked or lane.released or lane.read_committed:
        _check_transactions(lane, name, lo, hi, state.astype(bool) & unsettled & ~waiting)


def _waiting(lane, name: str, lo: int, n: int):
    """How many parked or released spans cover each offset of [lo, lo + n)."""
    cover = np.zeros(n + 1, np.int64)
    spans = [("parked", a, b) for ranges in lane.parked.values() for a, b in ranges]
    spans += [("released", a, b) for a, b in lane.released]
    for what, a, b in spans:
        if not a < b <= lane.read_offset:
            raise AssertionError(f"{name}: {what} span [{a}, {b}) outside [.., {lane.read_offset}) (read_offset)")
        if b > lo:
            cover[max(a, lo) - lo] += 1
            cover[b - lo] -= 1
    return np.cumsum(cover[:n])


def _check_transactions(lane, name: str, lo: int, hi: int, handed) -> None:
    """Parked spans hold batches of their own transaction, released spans
    batches of a committed one; under read_committed, no offset ``handed``
    (outstanding, in a batch delivery, buffered or queued) is of an open or
    aborted transaction (G2). O(headers of [lo, hi) and of the spans)."""
    p = lane.partition
    ongoing, aborted = p.ongoing, p.aborted
    for key, ranges in lane.parked.items():
        for a, b in ranges:
            for info in p.headers(max(a, p.start_offset), b):
                if not info.flags & TRANSACTIONAL or (info.txn_hi, info.txn_lo) != key:
                    raise AssertionError(f"{name}: parked span [{a}, {b}) of transaction {key} holds the batch at "
                                         f"{info.base_offset} of another")
    for a, b in lane.released:
        for info in p.headers(max(a, p.start_offset), b):
            key = (info.txn_hi, info.txn_lo)
            if not info.flags & TRANSACTIONAL or ongoing.contains(*key) or aborted.contains(*key):
                raise AssertionError(f"{name}: released span [{a}, {b}) holds the batch at {info.base_offset}, "
                                     f"not of a committed transaction")
    if not lane.read_committed or not p.txns.seen:
        return
    for info in p.headers(max(lo, p.start_offset), hi):
        if not info.flags & TRANSACTIONAL or info.is_control:
            continue
        if ongoing.contains(info.txn_hi, info.txn_lo) or aborted.contains(info.txn_hi, info.txn_lo):
            a, b = max(info.base_offset, lo) - lo, min(info.next_offset, hi) - lo
            bad = np.flatnonzero(handed[a:b]) + lo + a
            _none_of(name, "handed out", bad, f"(read_committed) of the open or aborted transaction "
                                             f"{(info.txn_hi, info.txn_lo)}")


def _settled(lane, lo: int, hi: int):
    """(settled, pending) masks of [lo, hi): acknowledged in the cursor
    (markers and aborted batches passed over count as acknowledged) or
    held by an open transaction."""
    acked = np.zeros(hi - lo, bool)
    for start, end in lane.cursor.acked.ranges():
        if end > lo and start < hi:
            acked[max(start, lo) - lo:min(end, hi) - lo] = True
    pending = np.zeros(hi - lo, bool)
    for txn in lane.pending.txns():
        # (the table holds a transaction's acks as ranges)
        for start, end in lane.pending.ranges_of(txn):
            if end > lo and start < hi:
                pending[max(start, lo) - lo:min(end, hi) - lo] = True
        cumulative = lane.pending.peek_cumulative(txn)
        if cumulative >= lo:
            pending[:min(cumulative + 1, hi) - lo] = True
    return acked | pending, pending


def _in_window(name: str, what: str, offsets, lo: int, read_offset: int) -> None:
    bad = offsets[(offsets < lo) | (offsets >= read_offset)]
    if len(bad):
        raise AssertionError(f"{name}: {what} offset {int(bad[0])} outside [{lo}, {read_offset})"
                             f" (mark-delete, read_offset)")


def _none_of(name: str, what: str, offsets, why: str) -> None:
    if len(offsets):
        raise AssertionError(f"{name}: offset {int(offsets[0])} {what} {why}".rstrip()
                             + (f" ({len(offsets)} such)" if len(offsets) > 1 else ""))
