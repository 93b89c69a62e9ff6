# cython: boundscheck=False, wraparound=False
"""The send accumulator: one-message sends inside a transaction gathered
into batches, as Kafka's producer accumulator (``batch.size``,
``linger.ms``) and Pulsar's batching producer gather them.

A :class:`SendAccumulator` belongs to one producer, one transaction and
one partition. :meth:`SendAccumulator.add` checks a message (types, size)
and keeps it, with no copy of a ``bytes`` value; :meth:`take` hands the
messages kept so far to the caller as one ``BatchSpec``, which appends
them as one batch, and :meth:`flushed` records the batch's base offset.
Each send gets a :class:`PendingMessageId` that knows its batch and its
index in it: its offset is known once that batch is appended, and asking
for it earlier appends the batch then (through ``flush_cb``).

No policy, no threads: ``add`` and ``take`` run without releasing the GIL
or calling Python code, so a caller's flush lock around ``take`` and the
append is all a background flush needs.
"""
from cpython.bytes cimport PyBytes_CheckExact, PyBytes_GET_SIZE
from cpython.long cimport PyLong_CheckExact
from libc.stdint cimport int64_t

import time

from txmq._batch import BatchSpec, encode_headers
from txmq._partitioner import partition_for
from txmq.errors import BrokerClosedError, InvalidMessageError, MessageTooLargeError


# Per message in a batch: its key and value offsets, its event-time delta
# and a margin for alignment, counted with its bytes against batch_bytes so
# that a batch never outgrows what its limit promised (a segment).
cdef Py_ssize_t MESSAGE_OVERHEAD = 16
# Event times of one batch are stored as int32 deltas from the first.
cdef int64_t SPAN_MAX = (1 << 31) - 2
# Messages per batch at most, however small.
MAX_COUNT = 1 << 16


cdef class SendAccumulator:
    """The open batch of one (producer, transaction, partition), and the
    base offsets of the batches already appended. ``meta`` None: a batching
    producer's sends outside transactions."""
    cdef public object partition      # where the batches go
    cdef public object meta           # the transaction (its coordinator record)
    cdef public object producer       # the producer sending (id, epoch, fence)
    cdef public object lock           # held by a flush around take() and the append
    cdef public object flush_cb       # flush_cb(accumulator): append the open batch now
    cdef public object on_start       # on_start(accumulator) after send() started a batch, or None
    cdef public object error          # what failed a flush: every later use raises it
    cdef readonly str topic
    cdef readonly int partition_index
    cdef readonly Py_ssize_t count    # messages in the open batch
    cdef readonly Py_ssize_t nbytes   # their key and value bytes
    cdef readonly double first_at     # time.monotonic() of the open batch's first message
    cdef Py_ssize_t batch_bytes, max_message_bytes
    cdef int64_t t_min, t_max         # the event times given in the open batch
    cdef list values, keys, headers, times
    cdef bint any_key, any_headers, any_time
    cdef list bases                   # base offset of each appended batch, in order
    cdef Py_ssize_t taken             # batches taken (the open one's number); appended in this order

    def __init__(self, partition, meta, producer, lock, flush_cb, Py_ssize_t batch_bytes,
                 Py_ssize_t max_message_bytes):
        self.partition = partition
        self.meta = meta
        self.producer = producer
        self.lock = lock
        self.flush_cb = flush_cb
        self.topic = partition.topic
        self.partition_index = partition.index
        self.batch_bytes = batch_bytes
        self.max_message_bytes = max_message_bytes
        self.bases = []
        self._reset([])

    cdef _reset(self, list values):
        self.values = values
        self.keys = None
        self.headers = None
        self.times = None
        self.any_key = self.any_headers = self.any_time = False
        self.count = 0
        self.nbytes = 0

    @property
    def batches(self):
        """How many batches were appended."""
        return len(self.bases)

    @property
    def pending(self):
        """Messages not appended yet: in the open batch, or in one taken
        by a flush still appending it (another thread's). A send of the
        producer's that must come after them flushes first; the flush
        waits for the append in progress."""
        return self.count > 0 or len(self.bases) < self.taken

    cpdef PendingMessageId add(self, value, key, headers, event_time):
        """Keep one message (``key`` None or bytes, ``event_time`` None or
        an int); its id, or None when the open batch must be appended
        before this message joins one (it would pass ``batch_bytes``, or
        its event time lies too far from the batch's). Raises
        InvalidMessageError / MessageTooLargeError, keeping nothing, for
        what ``send`` would refuse."""
        cdef Py_ssize_t size
        cdef int64_t t = 0
        if self.error is not None:
            raise self.error
        if not PyBytes_CheckExact(value):
            if isinstance(value, (bytearray, memoryview)):
                value = bytes(value)       # the caller may change it before the batch is appended
            else:
                raise InvalidMessageError("value at index 0 (expected bytes)", value)
        size = PyBytes_GET_SIZE(value)
        if key is not None:
            size += PyBytes_GET_SIZE(key)
        if size > self.max_message_bytes:
            raise MessageTooLargeError(size, self.max_message_bytes)
        if event_time is not None:
            if not PyLong_CheckExact(event_time):
                raise InvalidMessageError("event_time (expected int milliseconds)", event_time)
            try:
                t = event_time
            except OverflowError:
                raise InvalidMessageError("event_time (expected int64 milliseconds)", event_time)
        # What the message adds to the encoded batch besides its bytes:
        # its offsets and event-time delta (and its headers, encoded now so
        # that bad ones are refused by this send, not by the append).
        cdef Py_ssize_t encoded = size + MESSAGE_OVERHEAD
        if headers:
            encoded += len(encode_headers(headers)) + 4
        # Another thread may flush this batch between any two allocations
        # (one may start the garbage collector, which runs Python code):
        # allocate first, then check that no flush came, then change the
        # batch and take the id's place with no allocation in between.
        cdef PendingMessageId mid = PendingMessageId.__new__(PendingMessageId)
        cdef list new_keys, new_headers, new_times
        cdef Py_ssize_t i, batch
        while True:
            i = self.count
            batch = self.taken
            if i and (self.nbytes + encoded > self.batch_bytes or (
                    event_time is not None and self.any_time and (t - self.t_min > SPAN_MAX or self.t_max - t > SPAN_MAX))):
                return None
            new_keys = [None] * i if key is not None and not self.any_key else None
            new_headers = [None] * i if headers and not self.any_headers else None
            new_times = [None] * i if event_time is not None and not self.any_time else None
            if self.count == i and self.taken == batch:
                break
        if event_time is not None:
            if not self.any_time or t < self.t_min:
                self.t_min = t
            if not self.any_time or t > self.t_max:
                self.t_max = t
        if i == 0:
            self.first_at = time.monotonic()
        self.values.append(value)
        if new_keys is not None:
            self.keys = new_keys
            self.any_key = True
        if self.any_key:
            self.keys.append(key)
        if new_headers is not None:
            self.headers = new_headers
            self.any_headers = True
        if self.any_headers:
            self.headers.append(headers or None)
        if new_times is not None:
            self.times = new_times
            self.any_time = True
        if self.any_time:
            self.times.append(event_time)
        self.count = i + 1
        self.nbytes += encoded
        mid.acc = self
        mid.batch = batch
        mid.index = i
        mid.offset_ = -1
        return mid

    def send(self, value, key, headers, event_time):
        """:meth:`add` for a send: the open batch is appended first (through
        ``flush_cb``) when the message does not fit it, and right after when
        the message filled it; ``on_start`` is told when the message
        started a batch. The message's id."""
        cdef PendingMessageId mid = self.add(value, key, headers, event_time)
        while mid is None:              # (another thread may fill the next batch meanwhile)
            self.flush_cb(self)
            mid = self.add(value, key, headers, event_time)
        if mid.index == 0 and self.on_start is not None:
            self.on_start(self)
        if self.nbytes >= self.batch_bytes or self.count >= MAX_COUNT:
            self.flush_cb(self)
        return mid

    def take(self):
        """The open batch as a BatchSpec (None when empty); the next
        messages start a new one. Call :meth:`flushed` or :meth:`failed`
        after appending it."""
        if self.count == 0:
            return None
        # The open batch is swapped out before anything that may run Python
        # code (and so let another thread's add() in): a message added from
        # here on belongs to the next batch, as its id says. (The fresh list
        # is made first: an allocation may run the garbage collector.)
        cdef list fresh = []
        if self.count == 0:
            return None
        values, keys, headers, times = self.values, self.keys, self.headers, self.times
        any_time, t_min, t_max = self.any_time, self.t_min, self.t_max
        self._reset(fresh)
        self.taken += 1
        if any_time:
            # A message sent without an event time takes the batch's send
            # time, as the publish time stands in for it in a batch with none.
            # (Kept within the span of the given ones: deltas are int32.)
            now = min(max(time.time_ns() // 1_000_000, t_max - SPAN_MAX), t_min + SPAN_MAX)
            times = [now if t is None else t for t in times]
        return BatchSpec(values, keys, headers, times)

    def flushed(self, int64_t base):
        """The batch :meth:`take` gave was appended at ``base``."""
        self.bases.append(base)

    def failed(self, error):
        """Appending the batch :meth:`take` gave failed: it and every later
        use of this accumulator raise ``error``."""
        self.error = error
        self.bases.append(-1)

    cdef int64_t base_of(self, Py_ssize_t batch) except? -1:
        """The base offset of batch ``batch``, appending it first if it is
        the open one."""
        if batch >= len(self.bases):
            self.flush_cb(self)
        if batch >= len(self.bases):
            raise RuntimeError("the open batch was not appended")
        cdef int64_t base = self.bases[batch]
        if base < 0:
            raise self.error
        return base

    def __repr__(self):
        return (f"SendAccumulator({self.topic}/{self.partition_index}, {self.meta!r}, "
                f"{self.count} open, {len(self.bases)} appended)")


cdef class PendingMessageId:
    """The id of a message sent into a transaction, or by a batching
    producer: ``(topic, partition, offset)``, like a MessageId. ``topic`` and ``partition`` are known at
    once; reading ``offset`` (or comparing, hashing, unpacking) appends the
    message's batch first if it is still accumulating, and raises what
    that append raised. :meth:`done` says whether it is appended."""
    cdef SendAccumulator acc
    cdef Py_ssize_t batch, index
    cdef int64_t offset_

    @property
    def topic(self):
        return self.acc.topic

    @property
    def partition(self):
        return self.acc.partition_index

    @property
    def offset(self):
        if self.offset_ < 0:
            self.offset_ = self.acc.base_of(self.batch) + self.index
        return self.offset_

    def done(self):
        """True once the message is in the log (its offset known)."""
        return self.offset_ >= 0 or self.batch < len(self.acc.bases)

    def result(self):
        """The plain ``(topic, partition, offset)`` tuple."""
        return (self.acc.topic, self.acc.partition_index, self.offset)

    def __len__(self):
        return 3

    def __iter__(self):
        return iter(self.result())

    def __getitem__(self, i):
        return self.result()[i]

    def __eq__(self, other):
        if isinstance(other, PendingMessageId):
            other = other.result()
        if isinstance(other, tuple):
            return self.result() == other
        return NotImplemented

    def __hash__(self):
        return hash(self.result())

    def __str__(self):
        return f"{self.acc.topic}/{self.acc.partition_index}@{self.offset}"

    def __repr__(self):
        if not self.done():
            return (f"PendingMessageId(topic={self.acc.topic!r}, partition={self.acc.partition_index}, "
                    f"offset=<not appended yet>)")
        return f"PendingMessageId(topic={self.acc.topic!r}, partition={self.acc.partition_index}, offset={self.offset})"


# What ``producer_send`` needs of the client layer, given by it at import
# (``bind_producer_send``): imports point down, so this module names none of it.
cdef object _Transaction = None      # txmq.client.transaction.Transaction
cdef object _OPEN = None             # TxnState.OPEN
cdef object _MessageId = None        # txmq.message.MessageId
_new_id = tuple.__new__              # (a MessageId without its Python-level __new__)


def bind_producer_send(transaction_type, open_state, message_id_type):
    """Give :func:`producer_send` the Transaction class, the OPEN state and
    the MessageId class (txmq.client.producer does, at import)."""
    global _Transaction, _OPEN, _MessageId
    _Transaction, _OPEN, _MessageId = transaction_type, open_state, message_id_type


def producer_send(self, value, key=None, headers=None, event_time=None, partition=None, txn=None,
                  sequence=None):
    """Append one message; return its :class:`MessageId` once it is in the
    log (and durable, under ``fsync="always"``). A batching producer
    (``broker.producer(topic, batching=True)``) returns at once with a
    :class:`~txmq._accumulator.PendingMessageId`, the message joining
    its open batch for the partition (docs/API.md, "A batching
    producer").

    ``value`` and ``key`` are bytes (a str key is UTF-8 encoded);
    ``headers`` a dict or a list of (str, bytes) pairs; ``event_time``
    int milliseconds (default: the publish time); ``partition``
    overrides the partitioner; ``txn`` makes the message part of that
    transaction (visible to READ_COMMITTED readers once it commits, and
    made durable by the commit rather than by this call). Raises
    :class:`~txmq.errors.TransactionTimeoutError` /
    :class:`~txmq.errors.InvalidTxnStateError` when ``txn`` is no longer
    open.

    With ``txn`` (and no ``sequence``) the message joins this
    producer's accumulating batch for the transaction and partition,
    appended as one batch by size, after the broker's ``linger_ms``,
    when an offset is asked for, on :meth:`flush`, or by the commit
    (docs/API.md, "Sends inside a transaction are batched"); it returns
    a :class:`~txmq._accumulator.PendingMessageId` whose ``offset``
    appends the batch first. Everything a send can refuse by itself is
    refused here; an append that fails raises at that flush (a commit
    then aborts).

    ``sequence`` sends with an explicit sequence number (int32) for the
    target partition instead of the next one: resending a sequence that
    is among the partition's last 5 batches of this producer returns the
    original MessageId and appends nothing (retries after a timeout or a
    crash). Sequences are per partition, so on a topic of several
    partitions ``sequence`` needs ``partition=`` or ``key=`` (a resend
    must reach the same partition). A gap raises :class:`~txmq.errors.OutOfOrderSequenceError`,
    an older sequence :class:`~txmq.errors.DuplicateSequenceError`. A
    fenced instance raises :class:`~txmq.errors.ProducerFencedError`.
    """
    # The two batched cases in one compiled call: a send inside a
    # transaction (``txn``, no ``sequence``) joining this producer's open
    # batch for the transaction and partition, and a send of a batching
    # producer outside transactions joining its open batch for the
    # partition; the same checks and partition choice as the general
    # ``Producer._send``, which takes every other send (with the partition
    # already chosen, so round robin does not skip one).
    cdef Py_ssize_t n
    cdef dict accs = None
    cdef bint plain = False
    if (sequence is None and not self.closed and self._owner is None
            and (key is None or type(key) is bytes) and (event_time is None or type(event_time) is int)):
        meta = None
        if txn is None:
            if not self._batched:
                plain = True                  # (unless a transaction's batch waits on the partition: below)
            elif not self._accs:
                accs = self._plain
        elif type(txn) is _Transaction and txn._broker is self._broker and not self._plain:
            meta = txn._meta
            if meta.owner is None and meta.state is _OPEN and self._batching.linger_ms:
                accs = self._accs
        if accs or plain:
            fence = self._fence
            topic = self._topic
            broker = self._broker
            # (a plain append checks the fence and the topic itself)
            if not broker._closed and (plain or ((fence is None or not fence.fenced)
                                                 and broker._topics.get(topic.name) is topic)):
                parts = topic.partitions
                n = len(parts)
                p = None
                if partition is not None:
                    if type(partition) is int and 0 <= partition < n:   # (else the general send raises)
                        p = parts[partition]
                elif key is not None and n > 1:
                    p = parts[partition_for(key, n)]
                elif n == 1:
                    p = parts[0]
                else:
                    p = parts[next(self._rr) % n]
                if p is not None and plain and self._accs:
                    acc = self._accs.get(p)
                    if acc is not None and acc.pending:
                        p = None      # (the general send appends that batch first: this send comes after it)
                if p is not None:
                    if plain:     # one message, in the log when this returns
                        spec = BatchSpec([value], None if key is None else [key], [headers] if headers else None,
                                         None if event_time is None else [event_time])
                        try:
                            return _new_id(_MessageId, (topic.name, p.index, p.append(
                                spec, 0, None, self.producer_id, self.epoch, -1, None, fence)))
                        except BrokerClosedError:
                            self._check_open()   # name what closed: this producer, the broker, or the topic
                            raise
                    acc = accs.get(p)
                    if acc is not None and (<SendAccumulator?>acc).meta is meta:
                        return (<SendAccumulator>acc).send(value, key, headers, event_time)
                    partition = p.index     # (the general send opens its accumulator: the same partition)
    return self._send(value, key, headers, event_time, partition, txn, sequence)
