"""The exactly-once function runner (Pulsar Functions' EFFECTIVELY_ONCE,
Kafka Streams' exactly_once_v2) over the embedded broker.

A step is one broker transaction: receive a batch from the function's
subscription on each input topic, acknowledge it in the transaction, call
the function on each message, send the outputs (and, for a windowed
function, the emitted windows and the lane's state snapshot) in the
transaction, commit. The outputs of an input are committed iff its ack is
(G6), so a crash anywhere in a step leaves either the whole step or none of
it. The acks come first so that an abort (an exception, a fence, a
timeout) hands every message of the step back to the broker, which
delivers it again with ``redelivery_count`` + 1.

Stateless functions run plain transactions on a shared (or failover)
subscription: any instance may take any message, and the pending-ack rules
(G7) keep two instances from committing one input twice. Windowed
functions own their state by lane (:mod:`txmq.functions.lanes`): one
transaction per lane per step, through the lane's transactional producer,
on a failover subscription.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import NamedTuple

from txmq.errors import (InvalidArgumentError, InvalidTxnTimeoutError, ProducerFencedError, TopicExistsError,
                         TransactionConflictError, TransactionError, TxmqError)
from txmq.functions import lanes as _lanes
from txmq.functions.windows import Sliding, WindowState

SUBSCRIPTION_TYPES = ("shared", "failover", "exclusive")
BACKOFF_MAX_S = 0.5             # longest pause between retries of failing steps
ERROR_HEADER_BYTES = 1000


class Record(NamedTuple):
    """One output of a stateless function. ``key`` None: no key;
    ``event_time`` None: the input's; ``headers``: a dict or (str, bytes)
    pairs. A function may also return bare bytes (the input's key and event
    time), a list of outputs, or None (no output)."""

    value: bytes
    key: bytes | None = None
    event_time: int | None = None
    headers: object = None


class _FunctionError(Exception):
    """The user function raised on ``message``, which gets another try."""

    def __init__(self, message, error: BaseException):
        super().__init__(f"function raised on {message.message_id}: {error!r}")
        self.message = message
        self.error = error


def _ensure_topic(broker, topic: str, partitions: int) -> int:
    """Create ``topic`` when missing; return its partition count."""
    if topic not in broker.topics():
        try:
            broker.create_topic(topic, partitions)
        except TopicExistsError:
            pass                   # another instance made it meanwhile
    return broker.describe_topic(topic)["partitions"]


def _origin_headers(m, error: BaseException | None) -> list:
    """A dead-lettered or late message's headers: its own, where it came
    from, and the error that sent it there."""
    out = list(m.headers) + [("txmq-origin", str(m.message_id).encode())]
    if error is not None:
        out.append(("txmq-error", f"{type(error).__name__}: {error}"[:ERROR_HEADER_BYTES]
                    .encode("utf-8", "replace")))
    return out


class Function:
    """Run ``fn`` over the ``inputs`` topics into ``output``, exactly once.

    >>> f = Function(broker, "upper", ["words"], "shouted",   # doctest: +SKIP
    ...              lambda m: m.value.upper())
    >>> f.run(idle_timeout=1.0)                               # until idle 1 s

    **Stateless** (``window=None``): ``fn(message)`` returns bytes (one
    output with the input's key and event time), a :class:`Record`, a list
    of them, or None. The subscription ``name`` on each input is
    ``"shared"`` by default (``"failover"`` / ``"exclusive"`` allowed).

    **Windowed** (``window=`` a :class:`~txmq.functions.Tumbling` or
    :class:`~txmq.functions.Sliding`): ``fn(message)`` returns the amount
    (int or float) the message adds to its key's total, a ``(key, amount)``
    pair, or None (not counted). Per lane (partition index of the
    co-partitioned inputs) the runner keeps per-window totals and counts,
    and when the watermark (the smallest over the inputs of the largest
    event time seen, minus ``max_out_of_orderness_ms``) reaches a window's
    end plus ``allowed_lateness_ms`` it sends one message for each key of
    the window to ``output``: key = the key, value = JSON ``{"start",
    "end", "total", "count"}``, event time = end - 1. An event whose
    windows have all been emitted is **late**: it is dropped and counted
    (``metrics()["late"]``), or, with ``late_topic``, sent there. The state
    lives in ``state_topic`` (default ``<name>-state``, one partition per
    lane), one snapshot per committed step, written in the step's
    transaction; a lane's new owner fences the old one and restores the
    last committed snapshot before it processes the lane's messages. The
    subscription must be ``"failover"`` (default) or ``"exclusive"``.

    **Failures**: an exception from ``fn`` aborts the step (every message of
    it comes again); when the message that raised had already been
    delivered ``max_redeliveries`` times before, it goes instead to
    ``dead_letter_topic`` (default ``<name>-dlq``; headers ``txmq-origin``
    and ``txmq-error`` added) and is acknowledged, in the step's
    transaction. Conflicts, timeouts and fences abort the step and retry.
    Other errors (a bad output, a closed broker) abort the step and are
    raised.

    Missing output, dead-letter, late and state topics are created (one
    partition; the state topic one per lane). ``instance`` names this
    instance (its consumer name, which orders failover assignment).
    ``clock`` (seconds since the epoch) stamps ``last_commit_time_ms``.
    Not thread-safe: one thread drives an instance (see :meth:`start`).
    """

    def __init__(self, broker, name: str, inputs, output: str, fn, *, window: Sliding | None = None,
                 max_out_of_orderness_ms: int = 0, allowed_lateness_ms: int = 0, late_topic: str | None = None,
                 dead_letter_topic: str | None = None, max_redeliveries: int = 3, batch_size: int = 100,
                 subscription_type: str | None = None, initial_position: str = "earliest",
                 state_topic: str | None = None, instance: str | None = None,
                 transaction_timeout: float = 60.0, poll_interval: float = 0.05, retry_backoff: float = 0.01,
                 clock=time.time):
        inputs = [inputs] if isinstance(inputs, str) else list(inputs)
        if not inputs or len(set(inputs)) != len(inputs) or not all(isinstance(t, str) for t in inputs):
            raise InvalidArgumentError("inputs", inputs, "one topic name or a list of distinct ones")
        if output in inputs:
            raise InvalidArgumentError("output", output, "a topic that is not an input")
        if not callable(fn):
            raise InvalidArgumentError("fn", fn, "a callable fn(message)")
        if window is not None and not isinstance(window, Sliding):
            raise InvalidArgumentError("window", window, "None, Tumbling(size_ms) or Sliding(size_ms, slide_ms)")
        for arg, value in (("max_out_of_orderness_ms", max_out_of_orderness_ms),
                           ("allowed_lateness_ms", allowed_lateness_ms), ("max_redeliveries", max_redeliveries)):
            if type(value) is not int or value < 0:
                raise InvalidArgumentError(arg, value, "an int >= 0")
        if type(batch_size) is not int or batch_size < 1:
            raise InvalidArgumentError("batch_size", batch_size, "an int >= 1")
        if subscription_type is None:
            subscription_type = "shared" if window is None else "failover"
        if subscription_type not in SUBSCRIPTION_TYPES or (window is not None and subscription_type == "shared"):
            allowed = SUBSCRIPTION_TYPES if window is None else SUBSCRIPTION_TYPES[1:]
            raise InvalidArgumentError("subscription_type", subscription_type, " | ".join(allowed) +
                                       ("" if window is None else " (a windowed function owns its lanes)"))
        if late_topic is not None and window is None:
            raise InvalidArgumentError("late_topic", late_topic, "None for a function without a window")
        if (not isinstance(transaction_timeout, (int, float)) or isinstance(transaction_timeout, bool)
                or not 0 < transaction_timeout <= broker.transaction_timeout_max):
            raise InvalidTxnTimeoutError(transaction_timeout, broker.transaction_timeout_max)
        for arg, value in (("poll_interval", poll_interval), ("retry_backoff", retry_backoff)):
            if not isinstance(value, (int, float)) or value < 0:
                raise InvalidArgumentError(arg, value, "seconds >= 0")
        self.name = name
        self.instance = instance if instance is not None else f"{name}-{uuid.uuid4().hex[:12]}"
        self.inputs = tuple(inputs)
        self.output = output
        self.window = window
        self.dead_letter_topic = dead_letter_topic or f"{name}-dlq"
        self.late_topic = late_topic
        self.state_topic = None
        self._broker = broker
        self._fn = fn
        self._ooo_ms = max_out_of_orderness_ms
        self._lateness_ms = allowed_lateness_ms
        self._max_redeliveries = max_redeliveries
        self._batch_size = batch_size
        self._txn_timeout = transaction_timeout
        self._poll_interval = poll_interval
        self._retry_backoff = retry_backoff
        self._clock = clock
        self._failures_in_row = 0
        self._rr = 0
        self._lanes: dict = {}                   # lane index -> lanes.Lane (windowed only)
        self._thread = None
        self._stop = threading.Event()
        self._error = None
        self.closed = False
        self._m = dict(received=0, processed=0, committed=0, aborted=0, failures=0, dead_lettered=0, late=0,
                       outputs=0, windows_emitted=0, restores=0, fenced=0, conflicts=0)
        self._last_commit_ms = None

        partitions = [broker.describe_topic(t)["partitions"] for t in inputs]
        if window is not None:
            if len(set(partitions)) != 1:
                raise InvalidArgumentError("inputs", dict(zip(inputs, partitions)),
                                           "co-partitioned topics (the same partition count)")
            self.state_topic = state_topic or f"{name}-state"
            if self.state_topic in inputs or self.state_topic == output:
                raise InvalidArgumentError("state_topic", self.state_topic, "a topic of its own")
            have = _ensure_topic(broker, self.state_topic, partitions[0])
            if have < partitions[0]:
                raise InvalidArgumentError("state_topic", self.state_topic,
                                           f"a topic of at least {partitions[0]} partitions (one per lane)")
        for topic in (output, self.dead_letter_topic, late_topic):
            if topic is not None:
                _ensure_topic(broker, topic, 1)
        self._consumers = []
        try:
            for t in inputs:
                self._consumers.append(broker.subscribe(
                    t, name, subscription_type, initial_position=initial_position, nack_delay=0.0,
                    consumer_name=self.instance))
        except BaseException:
            for c in self._consumers:
                c.close()
            raise
        self._consumer_of = {c.topic: c for c in self._consumers}
        if window is None:
            self._producer = broker.producer(output)
            self._dead_producer = None

    # -- running -------------------------------------------------------------------

    def step(self, timeout: float | None = None) -> int:
        """Receive one batch (waiting up to ``timeout`` seconds, default
        ``poll_interval``) and process it: one transaction (stateless) or
        one per lane (windowed). Return how many messages were received;
        a step that aborted returns them too (they come again)."""
        if self.closed:
            raise InvalidArgumentError("function", self.name, "an open function (this one is closed)")
        msgs = self._receive(self._poll_interval if timeout is None else timeout)
        if not msgs:
            return 0
        self._m["received"] += len(msgs)
        if self.window is None:
            self._step_stateless(msgs)
            return len(msgs)
        by_lane: dict = {}
        for m in msgs:
            by_lane.setdefault(m.partition, []).append(m)
        for index, lane_msgs in by_lane.items():
            self._step_lane(index, lane_msgs)
        return len(msgs)

    def run(self, *, idle_timeout: float | None = None) -> None:
        """Process until :meth:`stop` is called or, with ``idle_timeout``,
        until nothing has arrived for that many seconds."""
        idle_since = time.monotonic()
        while not self._stop.is_set():
            if self.step():
                idle_since = time.monotonic()
            elif idle_timeout is not None and time.monotonic() - idle_since >= idle_timeout:
                return

    def start(self) -> "Function":
        """Run in a background thread until :meth:`stop` (or :meth:`close`)."""
        if self._thread is not None:
            raise InvalidArgumentError("function", self.name, "a function not started yet")
        self._stop.clear()
        self._thread = threading.Thread(target=self._run_in_thread, name=f"txmq-function-{self.instance}",
                                        daemon=True)
        self._thread.start()
        return self

    def _run_in_thread(self) -> None:
        try:
            self.run()
        except BaseException as e:      # raised again by stop()
            self._error = e

    def stop(self) -> None:
        """Stop the background thread after its current step; raise the
        error that ended it early, if one did."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        err, self._error = self._error, None
        if err is not None:
            raise err

    def close(self) -> None:
        """Stop, give up every lane (an open transaction is aborted) and
        close the consumers: their unacknowledged messages go to the other
        instances. The subscriptions and the state stay."""
        if self.closed:
            return
        try:
            self.stop()
        finally:
            self.closed = True
            for lane in list(self._lanes.values()):
                self._drop(lane)
            for c in self._consumers:
                c.close()

    def __enter__(self) -> "Function":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- one step ----------------------------------------------------------------------

    def _receive(self, timeout: float) -> list:
        cons = self._consumers
        n = self._batch_size
        if len(cons) == 1:
            return cons[0].receive_many(n, timeout)
        k = self._rr = (self._rr + 1) % len(cons)
        order = cons[k:] + cons[:k]
        out: list = []
        for c in order:
            out += c.receive_many(n - len(out), 0)
            if len(out) >= n:
                return out
        if out or timeout <= 0:
            return out
        deadline = time.monotonic() + timeout
        wait = min(self._poll_interval, timeout) / len(cons)
        while True:
            for c in order:
                got = c.receive_many(n, min(wait, max(deadline - time.monotonic(), 0)))
                if got:
                    return got
            if time.monotonic() >= deadline:
                return []

    def _ack(self, msgs: list, txn) -> None:
        if len(self._consumers) == 1:
            self._consumers[0].ack(msgs, txn=txn)
            return
        by_topic: dict = {}
        for m in msgs:
            by_topic.setdefault(m.topic, []).append(m)
        for topic, ms in by_topic.items():
            self._consumer_of[topic].ack(ms, txn=txn)

    def _call(self, m, dead: list):
        """``fn(m)``; a message out of tries goes to ``dead`` (result None)."""
        try:
            return self._fn(m)
        except Exception as e:
            if m.redelivery_count >= self._max_redeliveries:
                dead.append((m, e))
                return None
            raise _FunctionError(m, e) from e

    def _step_stateless(self, msgs: list) -> None:
        txn = self._broker.new_transaction(self._txn_timeout)
        try:
            self._ack(msgs, txn)
            fn, maxr = self._fn, self._max_redeliveries       # _call, inlined: the hot path
            values, keys, times, headers, dead = [], [], [], None, []
            keyed = False
            for m in msgs:
                try:
                    r = fn(m)
                except Exception as e:
                    if m.redelivery_count >= maxr:
                        dead.append((m, e))
                        continue
                    raise _FunctionError(m, e) from e
                if type(r) is bytes:             # the common case, kept short
                    k = m.key
                    values.append(r)
                    keys.append(k)
                    times.append(m.event_time)
                    if k is not None:
                        keyed = True
                    if headers is not None:
                        headers.append(None)
                elif r is not None:
                    headers, has_key = self._add_records(r, m, values, keys, times, headers)
                    keyed = keyed or has_key
            if values:
                self._producer.send_batch(values, keys=keys if keyed else None, headers=headers,
                                          event_times=times, txn=txn)
            if dead:
                if self._dead_producer is None:
                    self._dead_producer = self._broker.producer(self.dead_letter_topic)
                self._dead_letter(self._dead_producer, dead, txn)
            txn.commit()
        except BaseException as e:
            self._failed(txn, e, msgs, None)
            return
        self._done(len(msgs), len(values), len(dead), 0, 0)

    def _add_records(self, r, m, values, keys, times, headers):
        """Append the outputs of one ``fn`` result; returns the headers
        list (made on the first output that has headers) and whether any
        output had a key."""
        has_key = False
        for rec in r if type(r) in (list, tuple) else (r,):
            if isinstance(rec, Record):
                value, key, et, h = rec.value, rec.key, rec.event_time, rec.headers
            elif isinstance(rec, (bytes, bytearray, memoryview)):
                value, key, et, h = rec, m.key, None, None
            else:
                raise InvalidArgumentError("function result", rec,
                                           "bytes, a Record, a list of them, or None")
            if h is not None and headers is None:
                headers = [None] * len(values)
            values.append(value)
            keys.append(key)
            times.append(m.event_time if et is None else et)
            if headers is not None:
                headers.append(h)
            has_key = has_key or key is not None
        return headers, has_key

    def _step_lane(self, index: int, msgs: list) -> None:
        lane = self._lanes.get(index)
        if lane is None or lane.lost:
            if lane is not None:
                self._drop(lane)
            try:
                self._acquire(index)
            finally:
                # The fence may just have handed back the previous owner's
                # uncommitted messages of this lane, older than these: give
                # these back too, so that the lane's events come again in
                # offset order (redeliveries go out by offset, before fresh
                # ones) and none is taken for late. They were not processed,
                # so they come back uncounted (a released message is no
                # redelivery: max_redeliveries counts failed tries only).
                self._give_back(msgs, counted=False)
            return
        try:
            txn = lane.tp.begin()
        except ProducerFencedError as e:
            self._failed(None, e, msgs, lane)
            return
        state = lane.state
        try:
            self._ack(msgs, txn)
            dead, late = [], []
            for m in msgs:
                r = self._call(m, dead)
                if r is None:
                    continue
                key, amount = r if type(r) is tuple else (m.key, r)
                if type(amount) not in (int, float) or not (key is None or type(key) is bytes):
                    raise _FunctionError(m, TypeError(
                        f"a windowed function returns an int or float amount, or a (bytes key, amount) "
                        f"pair, or None; got {r!r}"))
                if not state.add(m.topic, m.event_time, key, amount):
                    late.append(m)
            fired = state.fire()
            snapshot = state.to_bytes()
            if fired:
                lane.tp.producer(self.output).send_batch(
                    [json.dumps({"start": s, "end": e, "total": t, "count": c}, separators=(",", ":")).encode()
                     for _, s, e, t, c in fired],
                    keys=[k for k, *_ in fired], event_times=[e - 1 for _, _, e, _, _ in fired], txn=txn)
            if late and self.late_topic is not None:
                lane.tp.producer(self.late_topic).send_batch(
                    [m.value for m in late], keys=[m.key for m in late],
                    headers=[_origin_headers(m, None) for m in late],
                    event_times=[m.event_time for m in late], txn=txn)
            if dead:
                self._dead_letter(lane.tp.producer(self.dead_letter_topic), dead, txn)
            lane.tp.producer(self.state_topic).send(snapshot, partition=index, txn=txn)
            txn.commit()
        except BaseException as e:
            self._failed(txn, e, msgs, lane)
            return
        lane.committed = snapshot
        self._done(len(msgs), len(fired), len(dead), len(late), len(fired))

    def _dead_letter(self, producer, dead: list, txn) -> None:
        producer.send_batch([m.value for m, _ in dead], keys=[m.key for m, _ in dead],
                            headers=[_origin_headers(m, e) for m, e in dead],
                            event_times=[m.event_time for m, _ in dead], txn=txn)

    def _done(self, processed: int, outputs: int, dead: int, late: int, windows: int) -> None:
        m = self._m
        m["processed"] += processed
        m["committed"] += 1
        m["outputs"] += outputs
        m["dead_lettered"] += dead
        m["failures"] += dead           # the last exception of each: it sent the message there
        m["late"] += late
        m["windows_emitted"] += windows
        self._last_commit_ms = int(self._clock() * 1000)
        self._failures_in_row = 0

    def _failed(self, txn, error: BaseException, msgs: list, lane) -> None:
        """Abort the step and give its messages back: the abort redelivers
        what the transaction had acknowledged; a nack, what it had not got
        to. Then retry (function errors, conflicts, fences, timeouts) or
        raise."""
        if txn is not None:
            try:
                txn.abort()
            except (TransactionError, ProducerFencedError):
                pass                # already ended: timed out, or aborted by the fence
            except TxmqError:
                if not isinstance(error, TxmqError):
                    raise
        self._give_back(msgs)
        m = self._m
        m["aborted"] += txn is not None
        if lane is not None:
            if isinstance(error, ProducerFencedError) or lane.lost:
                m["fenced"] += 1
                self._drop(lane)
            else:
                lane.roll_back()
        if isinstance(error, _FunctionError):
            m["failures"] += 1
        elif isinstance(error, TransactionConflictError):
            m["conflicts"] += 1
        elif not isinstance(error, (TransactionError, ProducerFencedError)):
            raise error
        self._failures_in_row += 1
        if self._retry_backoff:
            time.sleep(min(self._retry_backoff * 2 ** min(self._failures_in_row - 1, 10), BACKOFF_MAX_S))

    def _give_back(self, msgs: list, counted: bool = True) -> None:
        """Nack what the step received: messages an aborted transaction
        had acknowledged are queued again already (the nack passes over
        them), the others would otherwise stay with this consumer.
        ``counted`` False releases them instead (never processed: their
        redelivery_count stays)."""
        by_topic: dict = {}
        for m in msgs:
            by_topic.setdefault(m.topic, []).append(m)
        for topic, ms in by_topic.items():
            consumer = self._consumer_of[topic]
            try:
                consumer.nack(ms) if counted else consumer.release(ms)
            except TxmqError:
                pass                # a closed consumer gave its messages back already

    # -- lanes ----------------------------------------------------------------------------

    def _new_state(self, index: int) -> WindowState:
        return WindowState(index, self.window, self.inputs, self._ooo_ms, self._lateness_ms)

    def _acquire(self, index: int):
        lane = _lanes.acquire(self._broker, self.name, index, self.state_topic, self._new_state,
                              self._txn_timeout)
        self._lanes[index] = lane
        self._m["restores"] += 1
        return lane

    def _drop(self, lane) -> None:
        if self._lanes.get(lane.index) is lane:
            del self._lanes[lane.index]
        try:
            lane.tp.close()
        except TxmqError:
            pass                    # the broker closed first: nothing of it is left to end

    # -- metrics ------------------------------------------------------------------------

    def metrics(self) -> dict:
        """Counters of this instance as a plain dict of numbers and strings
        (JSON-ready, no broker objects):

        - ``received``: messages received (a retried message again each time);
          ``processed``: inputs of committed steps (dead-lettered and late
          ones included); ``committed`` / ``aborted``: step transactions;
        - ``failures``: exceptions from the function (those of aborted
          steps, and the last one of each dead-lettered message); ``dead_lettered``,
          ``late``, ``outputs`` (messages sent to the output topic),
          ``windows_emitted``; ``conflicts``: steps aborted on an ack
          conflict; ``restores``: lanes taken (state read back);
          ``fenced``: lanes lost to another instance;
        - ``lag``: inputs still to process on the function's subscriptions
          (all instances), ``lag_by_input`` ``{topic: {partition: lag}}``;
        - ``last_commit_time_ms`` (None before the first commit), ``lanes``:
          the lanes this instance owns."""
        lag_by_input = {}
        for t in self.inputs:
            try:
                lag_by_input[t] = dict(self._broker.consumer_lag(t, self.name))
            except TxmqError:
                lag_by_input[t] = {}        # the broker is closed: unknown
        return {
            "function": self.name,
            "instance": self.instance,
            **self._m,
            "lag": sum(sum(v.values()) for v in lag_by_input.values()),
            "lag_by_input": lag_by_input,
            "last_commit_time_ms": self._last_commit_ms,
            "lanes": sorted(self._lanes),
        }

    def __repr__(self) -> str:
        return f"Function({self.name!r}, {list(self.inputs)} -> {self.output!r}, instance={self.instance!r})"
