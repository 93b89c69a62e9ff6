"""Lanes: the unit of ownership of a stateful function.

Lane ``i`` is partition ``i`` of every input topic (the inputs are
co-partitioned: same partition count, keys placed by the same partitioner)
together with partition ``i`` of the function's state topic, where the
lane's window state lives as one snapshot per committed step.

A lane has one owner at a time, and ownership is taken by **fencing**: the
instance that receives a message of a lane it does not hold opens the
lane's transactional id ``<function>.lane-<i>``. Opening it bumps the id's
epoch, aborts the previous owner's open transaction and waits for a commit
or abort it had already decided (docs/GUARANTEES.md G9); from then on
every send, ack and commit of the previous owner in that lane raises
:class:`~txmq.errors.ProducerFencedError`. Only then does the new owner
read the state partition: the last committed snapshot there is exactly the
state of the acks committed on the input subscriptions, since both were
written in one transaction and no older owner can commit another.
"""

from __future__ import annotations

import time

from txmq.errors import SubscriptionBusyError
from txmq.functions.windows import WindowState

BUSY_WAIT_S = 10.0          # how long a restore waits for another restore of the lane to finish
FIRST_LOOKBACK = 8          # offsets read back from the end first: ~4 steps of snapshot + marker


def lane_tid(function: str, lane: int) -> str:
    """The transactional id that owns ``lane`` of ``function``."""
    return f"{function}.lane-{lane}"


class Lane:
    """One lane this instance owns: its transactional producer (the
    fencing token, whose ``producer(topic)`` caches a producer per topic),
    its window state, and the snapshot of its last committed step (what an
    aborted step goes back to)."""

    __slots__ = ("index", "tp", "state", "committed")

    def __init__(self, index: int, tp, state: WindowState, committed: bytes):
        self.index = index
        self.tp = tp
        self.state = state
        self.committed = committed

    @property
    def lost(self) -> bool:
        """True once another owner fenced this one."""
        return self.tp.fenced or self.tp.closed

    def roll_back(self) -> None:
        """Return the window state to the last committed step."""
        self.state.load(self.committed, f"lane {self.index} (in memory)")


def acquire(broker, function: str, lane: int, state_topic: str, new_state, txn_timeout: float) -> Lane:
    """Take ``lane``: fence its previous owner, then restore its state from
    the last committed snapshot in ``state_topic`` (a fresh state when there
    is none). ``new_state(lane)`` builds an empty :class:`WindowState`."""
    tp = broker.transactional_producer(lane_tid(function, lane), timeout=txn_timeout)
    try:
        state = new_state(lane)
        raw = last_snapshot(broker, function, state_topic, lane)
        if raw is not None:
            state.load(raw, f"{state_topic}/{lane}")
        return Lane(lane, tp, state, state.to_bytes())
    except BaseException:
        tp.close()
        raise


def last_snapshot(broker, function: str, state_topic: str, lane: int):
    """The value of the last committed message of partition ``lane`` of
    ``state_topic`` (None: there is none), read under read_committed with a
    throwaway subscription ``<function>.restore-<lane>``.

    Only the lane's owner writes that partition, and the caller has just
    fenced every earlier owner, so nothing there is still open: the read
    looks back a few offsets from the end, then further back (4x each time)
    while it finds only aborted snapshots and markers."""
    sub = f"{function}.restore-{lane}"
    consumer = _subscribe_exclusive(broker, state_topic, sub)
    try:
        end = broker.last_stable_offset(state_topic, lane)
        back = FIRST_LOOKBACK
        while True:
            start = max(0, end - back)
            found = _last_in(broker, consumer, state_topic, sub, lane, start)
            if found is not None or start == 0:
                return found
            back *= 4
    finally:
        consumer.unsubscribe()


def _last_in(broker, consumer, topic: str, sub: str, lane: int, start: int):
    """Read partition ``lane`` from ``start`` to its end; the last value."""
    consumer.seek(start, partition=lane)
    last = None
    while True:
        msgs = consumer.receive_many(1000, timeout=0)
        mine = [m for m in msgs if m.partition == lane]
        if mine:
            last = mine[-1].value
            consumer.ack(mine)
            continue
        if broker.consumer_lag(topic, sub)[lane] == 0:
            # (Other partitions' messages may keep coming: they are not read here.)
            return last
        if not msgs:
            time.sleep(0.001)


def _subscribe_exclusive(broker, topic: str, sub: str):
    deadline = time.monotonic() + BUSY_WAIT_S
    while True:
        try:
            return broker.subscribe(topic, sub, "exclusive", initial_position="latest")
        except SubscriptionBusyError:
            # Another instance restores the same lane this moment (ownership
            # moving back and forth while instances join): it is brief.
            if time.monotonic() > deadline:
                raise
            time.sleep(0.001)
