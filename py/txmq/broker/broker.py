"""The embedded broker: a data directory, its topics and subscriptions.

Layout of a data directory (docs/FORMAT.md has every file's bytes)::

    <data>/txmq.json                              marks a data directory (txmq.storage.datadir)
    <data>/LOCK                                   one writer process (flock)
    <data>/topics/<topic>/topic.json              partitions, retention
    <data>/topics/<topic>/<p>/...                 the partition log
    <data>/subscriptions/<topic>/<sub>/subscription.json
    <data>/subscriptions/<topic>/<sub>/cursor-<p>.log
    <data>/subscriptions/<topic>/<sub>/pending-<p>.log   acks held by open transactions
    <data>/coordinator/tc-<id>.log                transaction log per coordinator
                                                  (and transactional ids homed there)
    <data>/producers.log                          producer-id counter, named producers
    <data>/half/log/0/, half/statetable, half/redo.log   half messages (txmq.storage.half_messages)
    <data>/control.sock                           the owner's control socket (txmq.control)
    <data>/staging/<job>/<attempt>/               batches staged by other processes (txmq.ingest)

Opening recovers in this order: partitions (log, then transaction buffer),
subscriptions (cursor, then pending acks), coordinators; then every
transaction left unfinished is ended — decided ones as decided, every other
one (open in a coordinator log, or known only to a partition or a
subscription) aborted; then the producer registry, and last the half
messages (their commits interrupted by a crash append to topics that are
open by then).
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import shutil
import threading
import time

from txmq.client.consumer import Consumer
from txmq._crc32c import crc32c_of
from txmq.transactions.coordinator import TransactionCoordinator
from txmq.errors import (BrokerClosedError, DataDirError, InvalidArgumentError,
                         InvalidTxnStateError, InvalidTxnTimeoutError, IsolationLevelMismatchError,
                         OutOfOrderDeliveryError, PartitionNotFoundError,
                         SubscriptionBusyError,
                         SubscriptionNotFoundError, SubscriptionTypeError, TopicBusyError,
                         TopicExistsError, TopicNotFoundError, TransactionNotFoundError)
from txmq.message import AbortedTransaction
from txmq.client.producer import Producer
from txmq.transactions.producer_ids import ProducerRegistry
from txmq.scheduler import MIN_INTERVAL, Scheduler
from txmq import crashpoints
from txmq.storage import datadir
from txmq.files import sync_dir
from txmq.client.half_producer import HalfProducer
from txmq.storage.half_messages import HalfStore
from txmq.broker.control_socket import ControlServer
from txmq.broker.ingester import Ingester
from txmq.storage.staging import clean_staging
from txmq.options import (INT32_MAX, TIMEOUT_MAX_SECONDS, choice_option, flag_option, int_option,
                          open_files_option, partitions_option, retention_options, seconds_option)
from txmq.storage.log import segment_budget
from txmq.storage.delivery import ISOLATIONS
from txmq.dispatch.subscription import POSITIONS, TYPES, Subscription
from txmq.storage.topic import Topic, check_subscription_name, check_topic_name
from txmq.client.transaction import Transaction
from txmq.client.accumulator import SendBatching
from txmq.client.transactional_producer import TransactionalProducer
from txmq.broker.prepared import PreparedTransactions
from txmq.broker.recovery import Recovery
from txmq.transactions.records import TxnID, TxnState, txn_info

log = logging.getLogger("txmq.broker")

FSYNC_MODES = ("commit", "always", "never")
MiB = 1024 * 1024
TIMEOUT_CHECK_INTERVAL = 0.05     # seconds between transaction timeout checks
RETRY_INTERVAL = 0.5              # ... between retries of a failed commit / abort fan-out
SNAPSHOT_INTERVAL = 5.0           # ... between transaction-buffer snapshots
EPOCH_MAX = 32767                 # int16: past it a transactional id gets a new producer id
RESERVED_PREFIX = "__txmq."       # producer names txmq keeps for itself


class Broker(Recovery, PreparedTransactions):
    """An embedded broker on a data directory.

    ``fsync``: ``"commit"`` (default) makes cursor and transaction state
    durable and leaves plain sends in the page cache when they return;
    ``"always"`` makes every acknowledged send durable (threads share
    syncs); ``"never"`` syncs nothing. Every mode survives ``kill -9``.

    ``segment_bytes_max`` sizes segment files; ``max_message_bytes`` limits
    one message (default 5 MiB, at most half a segment); ``retention_ms`` / ``retention_bytes`` are the defaults of
    topics that set none (None: keep everything); retention only ever
    deletes whole segments below every subscription's mark-delete.

    Transactions: ``num_coordinators`` transaction coordinators (default 4)
    share new transactions, the threads that begin them round-robin (one
    thread's go to one coordinator); ``transaction_timeout_max`` seconds
    (default 900) bounds the timeout a transaction may ask for. A prepared
    transaction (:meth:`Transaction.prepare`) waits for its commit or
    abort however long that takes, unless ``prepared_timeout`` seconds are
    set (default None: for ever): the broker then aborts one prepared that
    long ago.

    Producers: ``producer_id_expiration`` seconds (default 7 days) after its
    last batch, a partition forgets a producer id's sequences. One-message
    sends inside a transaction are batched (docs/API.md, "Sends inside a
    transaction are batched"): a batch is appended when it holds
    ``batch_bytes`` (default 64 KiB), when it is ``linger_ms`` old (default
    5), when a message's offset is asked for, and at the latest by the
    commit; ``linger_ms=0`` appends every send when it is made.

    Half messages (:meth:`half_producer`): every ``half_check_interval``
    seconds (default 60) the broker checks back on PREPARED half messages
    stored more than ``half_check_immunity`` seconds ago (default 6); after
    ``half_max_checks`` (default 15) unanswered or UNKNOWN checks one goes to
    the ``txmq.half-check-max`` topic. Resolved records are compacted away
    ``half_retention`` seconds (default 3 days) after they were stored.

    ``control_socket`` (default True): listen on ``<data>/control.sock``
    for requests of other processes (:mod:`txmq.control`): staged ingest
    from Spark tasks and other writers (:mod:`txmq.ingest`).

    ``open_files_max``: how many segment files stay open at once (a
    descriptor and a mapping each; idle ones are parked and reopened on
    use); None (default) shares the process's budget, half of
    ``RLIMIT_NOFILE``. Partitions open lazily: opening the directory opens
    those recovery needs, the others open on first use (docs/API.md).
    """

    def __init__(self, path, fsync: str = "commit", *, segment_bytes_max: int = 256 * MiB,
                 max_message_bytes: int | None = None, index_interval_bytes: int = 4096,
                 retention_ms: int | None = None, retention_bytes: int | None = None,
                 retention_check_interval: float = 60.0, num_coordinators: int = 4,
                 transaction_timeout_max: float = 900.0, producer_id_expiration: float = 7 * 24 * 3600.0,
                 half_check_interval: float = 60.0, half_check_immunity: float = 6.0, half_max_checks: int = 15,
                 half_retention: float = 3 * 24 * 3600.0, control_socket: bool = True,
                 linger_ms: int = 5, batch_bytes: int = 64 * 1024, open_files_max: int | None = None,
                 prepared_timeout: float | None = None):
        self.path = datadir.resolve(path)
        self._closed = True
        # Every option is checked before the directory is touched.
        fsync = choice_option("fsync", fsync, FSYNC_MODES)
        segment_bytes_max = int_option("segment_bytes_max", segment_bytes_max, 4096, INT32_MAX)
        # (Batch offsets are int32: no batch, so no segment, reaches 2 GiB.)
        if max_message_bytes is None:
            max_message_bytes = min(5 * MiB, segment_bytes_max // 2)
        max_message_bytes = int_option("max_message_bytes", max_message_bytes, 1, segment_bytes_max // 2)
        index_interval_bytes = int_option("index_interval_bytes", index_interval_bytes, 1, INT32_MAX)
        retention_ms, retention_bytes = retention_options(retention_ms, retention_bytes)
        retention_check_interval = seconds_option("retention_check_interval", retention_check_interval,
                                                  MIN_INTERVAL)
        num_coordinators = int_option("num_coordinators", num_coordinators, 1, 1024)
        transaction_timeout_max = seconds_option("transaction_timeout_max", transaction_timeout_max, 0.0,
                                                 above=True, maximum=TIMEOUT_MAX_SECONDS)
        producer_id_expiration = seconds_option("producer_id_expiration", producer_id_expiration, 0.0,
                                                above=True, maximum=TIMEOUT_MAX_SECONDS)
        half_check_interval = seconds_option("half_check_interval", half_check_interval, MIN_INTERVAL)
        half_check_immunity = seconds_option("half_check_immunity", half_check_immunity)
        half_retention = seconds_option("half_retention", half_retention)
        half_max_checks = int_option("half_max_checks", half_max_checks, 0)
        control_socket = flag_option("control_socket", control_socket)
        linger_ms = int_option("linger_ms", linger_ms, 0, 60_000)
        batch_bytes = int_option("batch_bytes", batch_bytes, 1, INT32_MAX)
        self._batching = SendBatching(linger_ms, batch_bytes)
        open_files_max = open_files_option(open_files_max)
        self.prepared_timeout = seconds_option("prepared_timeout", prepared_timeout, 0.0, above=True,
                                               maximum=TIMEOUT_MAX_SECONDS, optional=True)
        self.fsync = fsync
        self.num_coordinators = num_coordinators
        self.transaction_timeout_max = transaction_timeout_max
        self._coordinators: list[TransactionCoordinator] = []
        self._tc_rr = itertools.count()
        self._tc_of_thread = threading.local()   # .tc: the coordinator of this thread's new transactions
        self.recovered_transactions = {"committed": 0, "aborted": 0}
        self._recovered_ids = set()      # the transactions counted there (one partition opened later
                                         # may abort a transaction another already counted)
        self.retention_ms = retention_ms
        self.retention_bytes = retention_bytes
        self._partition_options = dict(fsync=fsync, segment_bytes_max=segment_bytes_max,
                                       max_message_bytes=max_message_bytes,
                                       index_interval_bytes=index_interval_bytes,
                                       producer_expiration_ms=int(producer_id_expiration * 1000),
                                       budget=segment_budget(open_files_max))
        self._recovering = True            # partitions opened now are ended by recovery, not _partition_opened
        self._producer_ids = None
        self._half = None
        self._control = None
        self._services: list = []      # front ends close() stops first (attach)
        self._named_live: dict = {}        # (topic, name) -> the live Producer instance
        self._tid_live: dict = {}          # transactional id -> the live TransactionalProducer
        self._tid_lock = threading.Lock()
        self._lock = threading.RLock()
        self._topics: dict[str, Topic] = {}
        self._closed = True
        self.problems_on_open: list[str] = []
        unmarked = datadir.prepare(self.path)
        self._dir_lock = datadir.DirLock(self.path)
        try:
            if unmarked:
                datadir.mark(self.path, fsync != "never")
            os.makedirs(os.path.join(self.path, "topics"), exist_ok=True)
            os.makedirs(os.path.join(self.path, "subscriptions"), exist_ok=True)
            # Recovery builds many small objects and frees none: the cyclic
            # collector would only rescan them.
            gc_was_on = gc.isenabled()
            gc.disable()
            try:
                self._recover()
                self._recover_transactions()
                self._recovering = False
                self._producer_ids = ProducerRegistry(os.path.join(self.path, "producers.log"), fsync)
                # A damaged registry must not hand out an id still in use.
                in_use = [pid for tc in self._coordinators for pid, _ in tc.tids.values()]
                in_use += [p.producers.max_producer_id() for t in self._topics.values() for p in t.opened()]
                self._producer_ids.reserve_above(max(in_use, default=-1))
                self._half = HalfStore(self, os.path.join(self.path, "half"), fsync, self._partition_options,
                                       check_immunity=half_check_immunity, max_checks=half_max_checks,
                                       retention=half_retention)
                self._half.recover()
            finally:
                if gc_was_on:
                    gc.enable()
        except BaseException:
            for t in self._topics.values():
                t.close()
            for tc in self._coordinators:
                tc.close()
            if self._producer_ids is not None:
                self._producer_ids.close()
            if self._half is not None:
                self._half.close()
            self._dir_lock.release()
            raise
        self._closed = False
        self._scheduler = Scheduler()
        self._scheduler.every(retention_check_interval, self.enforce_retention)
        self._scheduler.every(TIMEOUT_CHECK_INTERVAL, self._expire_transactions)
        self._scheduler.every(RETRY_INTERVAL, self._retry_transactions)
        self._scheduler.every(SNAPSHOT_INTERVAL, self._snapshot_txn_buffers)
        self._scheduler.every(half_check_interval, self.check_half_messages)
        if self._batching.enabled:
            # (asleep while no batch is open: see Scheduler.on_demand)
            self._batching.timer = self._scheduler.on_demand(max(MIN_INTERVAL, linger_ms / 1000.0),
                                                             self._batching.flush_due)
        self._ingester = Ingester(self)
        if control_socket:
            try:
                self._control = ControlServer(self, self._control_handlers())
            except BaseException:
                self.close()
                raise

    def _check_open(self) -> None:
        if self._closed:
            raise BrokerClosedError(f"broker on {self.path} is closed")

    def _topic(self, name: str) -> Topic:
        check_topic_name(name)
        try:
            return self._topics[name]
        except KeyError:
            raise TopicNotFoundError(name) from None

    # -- topics ----------------------------------------------------------------

    def create_topic(self, name: str, partitions: int = 1, *, retention_ms: int | None = None,
                     retention_bytes: int | None = None) -> None:
        """Create a topic of ``partitions`` partitions (fixed from now on)."""
        self._check_open()
        check_topic_name(name)
        partitions = partitions_option(partitions)
        retention_ms, retention_bytes = retention_options(retention_ms, retention_bytes)
        with self._lock:
            if name in self._topics:
                raise TopicExistsError(name)
            tdir = os.path.join(self.path, "topics", name)
            if os.path.lexists(tdir):
                # Only a create that stopped before topic.json is replaced;
                # a folder with data was kept on open and stays kept.
                if not (os.path.isdir(tdir) and datadir.is_unused_topic(tdir)):
                    raise DataDirError(tdir, datadir.orphan_topic_reason(tdir))
                shutil.rmtree(tdir)
            os.makedirs(tdir)
            config = {"partitions": partitions, "retention_ms": retention_ms,
                      "retention_bytes": retention_bytes}
            # The partitions' folders come with their first use (txmq.storage.topic).
            topic = Topic(tdir, name, config, self._partition_options, self._partition_opened)
            crashpoints.reached("topic.created_partitions")
            Topic.write_config(tdir, config)
            if self.fsync != "never":
                sync_dir(tdir)
                sync_dir(os.path.dirname(tdir))
            self._topics[name] = topic

    def topics(self) -> list:
        """Names of every topic, sorted."""
        self._check_open()
        return sorted(self._topics)

    def describe_topic(self, name: str) -> dict:
        """Partitions, offsets, retention and subscriptions of a topic."""
        self._check_open()
        return self._topic(name).describe()

    def delete_topic(self, name: str, *, force: bool = False) -> None:
        """Delete a topic, its data and its subscriptions. Refused while
        consumers are attached unless ``force`` (they are then closed), and
        while a PREPARED transaction writes or acknowledges on it (only its
        commit or abort ends it)."""
        self._check_open()
        with self._lock:
            topic = self._topic(name)
            prepared = [m.id for tc in self._coordinators for m in list(tc.txns.values())
                        if m.state is TxnState.PREPARED and (any(t == name for t, _ in m.partitions)
                                                             or any(t == name for t, _ in m.subscriptions))]
            if prepared:
                raise TopicBusyError(name, 0, prepared)
            consumers = [c for s in topic.subscriptions.values() for c in list(s.consumers)]
            if consumers and not force:
                raise TopicBusyError(name, len(consumers))
            for c in consumers:
                c.close()
            del self._topics[name]
            topic.close()
            # Renaming the topic's folder is the delete (opening removes a
            # renamed folder and the topic's subscriptions with it).
            sync = self.fsync != "never"
            gone = [datadir.rename_deleted(topic.path, sync)]
            crashpoints.reached("topic.delete_renamed")
            sdir = os.path.join(self.path, "subscriptions", name)
            if os.path.isdir(sdir):
                gone.append(datadir.rename_deleted(sdir, sync))
            for folder in reversed(gone):
                shutil.rmtree(folder, ignore_errors=True)
            # The coordinators' decision records name partitions by topic:
            # forgotten now, or recovery would put a deleted topic's commits
            # into a new topic of the same name.
            for tc in self._coordinators:
                tc.compact()

    # -- producers and consumers --------------------------------------------------

    def producer(self, topic: str, name: str | None = None, *, batching: bool = False) -> Producer:
        """A producer for ``topic``. Every producer is idempotent (a fresh
        producer id, sequences per partition). With ``name`` it is a named
        producer: it keeps its producer id across restarts and continues its
        sequences (see :attr:`Producer.last_sequence`), and opening the same
        name on the topic again fences the older instance
        (:class:`~txmq.errors.ProducerFencedError`).

        ``batching=True`` batches its one-message sends outside
        transactions as sends inside them are (``linger_ms``,
        ``batch_bytes``): ``send`` returns a
        :class:`~txmq._accumulator.PendingMessageId` before the message is
        in the log (docs/API.md, "A batching producer"). Without it (and
        with ``linger_ms=0``) a send outside a transaction is in the log
        when it returns."""
        self._check_open()
        if type(batching) is not bool:
            raise InvalidArgumentError("batching", batching, "True or False")
        t = self._topic(topic)
        if name is None:
            return Producer(self, t, self._producer_ids.allocate(), batching=batching)
        _name_bytes("name", name)
        if name.startswith(RESERVED_PREFIX):
            raise InvalidArgumentError("name", name, f"a name not starting with {RESERVED_PREFIX!r} (reserved)")
        p = Producer(self, t, self._producer_ids.id_of(name), name=name, batching=batching)
        with self._tid_lock:
            old = self._named_live.get((topic, name))
            self._named_live[(topic, name)] = p
        if old is not None:
            old.fenced = True
        return p

    def _named_closed(self, producer: Producer) -> None:
        with self._tid_lock:
            key = (producer.topic, producer.name)
            if self._named_live.get(key) is producer:
                del self._named_live[key]

    def transactional_producer(self, transactional_id: str, timeout: float = 60.0) -> TransactionalProducer:
        """The instance of transactional id ``transactional_id`` (Kafka's
        ``transactional.id``): a stable name mapped to (producer id, epoch)
        in its coordinator's log. Opening it bumps the epoch durably, aborts
        the open transaction of the previous instance and fences that
        instance; ``timeout`` is the default of its transactions. A commit
        or abort of the previous instance already decided is waited for;
        :class:`~txmq.errors.ConcurrentTransactionsError` if it takes more
        than 10 s (retry)."""
        self._check_open()
        raw = _name_bytes("transactional_id", transactional_id)
        self._check_timeout(timeout)
        tc = self._coordinators[crc32c_of(raw) % self.num_coordinators]
        with self._tid_lock:
            old = self._tid_live.get(transactional_id)
            if old is not None:
                old._fence()       # may raise ConcurrentTransactionsError: the old one stays listed
                del self._tid_live[transactional_id]
            current = max((c.tids[transactional_id] for c in self._coordinators if transactional_id in c.tids),
                          default=None)
            if current is None or current[1] >= EPOCH_MAX:
                pid, epoch = self._producer_ids.allocate(), 0
            else:
                pid, epoch = current[0], current[1] + 1
            tc.record_producer(transactional_id, pid, epoch)
            tp = TransactionalProducer(self, transactional_id, pid, epoch, tc, float(timeout))
            self._tid_live[transactional_id] = tp
        return tp

    def _transactional_closed(self, tp: TransactionalProducer) -> None:
        with self._tid_lock:
            if self._tid_live.get(tp.transactional_id) is tp:
                del self._tid_live[tp.transactional_id]

    def allocate_producer_id(self) -> int:
        """A producer id never handed out before in this data directory
        (from the persistent counter that every producer's id comes from):
        what a Kafka idempotent producer's InitProducerId gets."""
        self._check_open()
        return self._producer_ids.allocate()

    def attach(self, service) -> None:
        """Tie ``service`` (any object with a ``stop()`` method: a front end
        such as :func:`txmq.kafka.serve_kafka`'s server) to this broker:
        :meth:`close` stops it before anything else closes. Raises
        :class:`~txmq.errors.BrokerClosedError` if the broker is closed."""
        with self._lock:
            self._check_open()
            if service not in self._services:
                self._services.append(service)

    def detach(self, service) -> None:
        """Forget ``service`` (it stopped by itself); no-op if not attached."""
        with self._lock:
            if service in self._services:
                self._services.remove(service)

    def half_producer(self, topic: str, group: str, checker=None) -> HalfProducer:
        """A producer of half messages (RocketMQ's transactional messages)
        to ``topic`` for producer group ``group``:
        :meth:`HalfProducer.send_in_transaction` stores a half message,
        runs a local transaction and commits, rolls back or leaves the
        message for check-back. ``checker(message) ->
        LocalTransactionState`` answers the broker's checks for the group's
        PREPARED half messages; several live producers of a group may
        register one, and each check asks one of them at random."""
        self._check_open()
        t = self._topic(topic)
        _name_bytes("group", group)
        if checker is not None and not callable(checker):
            raise InvalidArgumentError("checker", checker, "None or a callable(message) -> LocalTransactionState")
        pid = self._producer_ids.id_of(f"{RESERVED_PREFIX}half/{topic}/{group}")
        return HalfProducer(self, self._half, t, group, checker, pid)

    def check_half_messages(self) -> int:
        """Run one round of half-message check-back now (the broker runs one
        every ``half_check_interval``); return how many checks were sent.
        Compacts the half-message records when they have grown."""
        if self._closed:
            return 0
        try:
            sent = self._half.check()
            self._half.maybe_compact()
        except BrokerClosedError:
            return 0
        return sent

    def resume_half_checks(self, half_ids=None) -> list:
        """Check DISCARDED half messages (given up after
        ``half_max_checks``) again, from a check count of 0: every one, or
        those of ``half_ids``. Returns the half ids resumed. A message
        committed after this is in its topic and still in the check-max
        topic, where it was copied when discarded."""
        self._check_open()
        return self._half.resume(half_ids)

    def ingest_staged(self, job: str, attempts, sink=None) -> dict:
        """Append the listed staged attempts of ``job`` (see
        :mod:`txmq.ingest`) as one transaction and delete the job's staging;
        with ``sink`` = (key, batch id), once per batch id. Returns
        ``{"messages", "skipped"}``. Other processes reach this through
        :func:`txmq.ingest.commit`."""
        self._check_open()
        return self._ingester.ingest(job, attempts, sink)

    def sink_batch_id(self, sink: str) -> int:
        """The last batch id :meth:`ingest_staged` committed for ``sink``
        (-1: none)."""
        self._check_open()
        return self._ingester.last_batch(sink)

    def _control_handlers(self) -> dict:
        def ingest(req):
            return self.ingest_staged(req["job"], req["attempts"], req.get("sink"))

        def discard(req):
            self._ingester.discard(req["job"])

        return {"ping": lambda req: {"pid": os.getpid(), "path": self.path},
                "ingest": ingest,
                "last_batch": lambda req: {"batch_id": self.sink_batch_id(req["sink"])},
                "discard": discard}

    def subscribe(self, topic: str, subscription: str, type: str = "exclusive", *,
                  isolation: str = "read_committed", initial_position: str = "latest",
                  ack_timeout: float | None = None, nack_delay: float = 1.0,
                  consumer_name: str | None = None, fail_on_data_loss: bool = False,
                  allow_out_of_order_delivery: bool = False) -> Consumer:
        """Attach a consumer to ``subscription`` on ``topic``, creating the
        subscription at ``initial_position`` if it does not exist.

        ``type``: ``"exclusive"`` (one consumer), ``"shared"`` (messages
        spread over consumers) or ``"failover"`` (one active consumer per
        partition). ``isolation`` is fixed when the subscription is created;
        a consumer asking for another level gets
        :class:`IsolationLevelMismatchError`. ``ack_timeout`` seconds (None:
        never) redelivers what a consumer holds unacknowledged that long;
        ``nack_delay`` seconds is how long a nacked message waits.
        ``fail_on_data_loss``: on reaching offsets lost to bytes that failed
        their checks (quarantined), raise :class:`DataLossError` (path and
        byte) instead of passing over them; either way they stay
        unacknowledged until :meth:`Consumer.skip_data_loss`.

        ``allow_out_of_order_delivery`` (Pulsar's name; shared and
        read_committed only, fixed when the subscription is created, as
        its isolation): an open transaction no longer holds back what
        follows it. Every committed batch is delivered as soon as its
        transaction's fate is known, past open transactions; an open
        transaction's batches are delivered when it commits, never if it
        aborts. Offset order is not kept then (a shared subscription does
        not promise it); everything else is (docs/API.md,
        "Out-of-order delivery"). Asked with ``exclusive`` or ``failover``,
        with ``read_uncommitted``, or with another value than the
        subscription has, it raises :class:`OutOfOrderDeliveryError`; so
        does asking such a subscription for ``exclusive`` or ``failover``.
        """
        self._check_open()
        choice_option("subscription type", type, TYPES)
        choice_option("isolation", isolation, ISOLATIONS)
        choice_option("initial_position", initial_position, POSITIONS)
        flag_option("allow_out_of_order_delivery", allow_out_of_order_delivery)
        if allow_out_of_order_delivery:
            _check_out_of_order(subscription, type, isolation)
        ack_timeout = seconds_option("ack_timeout", ack_timeout, 0.0, above=True, optional=True)
        nack_delay = seconds_option("nack_delay", nack_delay)
        check_subscription_name(subscription)
        with self._lock:
            t = self._topic(topic)
            sub = t.subscriptions.get(subscription)
            if sub is None:
                sub = Subscription(self, t, subscription,
                                   os.path.join(self.path, "subscriptions", topic, subscription),
                                   type=type, isolation=isolation, initial_position=initial_position,
                                   ack_timeout=ack_timeout, nack_delay=nack_delay,
                                   allow_out_of_order_delivery=allow_out_of_order_delivery)
                t.subscriptions[subscription] = sub
            else:
                if sub.isolation != isolation:
                    raise IsolationLevelMismatchError(subscription, sub.isolation, isolation)
                if sub.out_of_order and type != "shared":
                    raise OutOfOrderDeliveryError(
                        subscription, f"it delivers out of order (allow_out_of_order_delivery=True), so it "
                                      f"cannot become {type}", True, type)
                if sub.out_of_order != allow_out_of_order_delivery:
                    raise OutOfOrderDeliveryError(
                        subscription, f"it was created with allow_out_of_order_delivery={sub.out_of_order}; a "
                                      f"consumer asked for {allow_out_of_order_delivery} (fixed at creation)",
                        sub.out_of_order, allow_out_of_order_delivery)
                with sub.cond:
                    if sub.type != type:
                        if sub.consumers:
                            raise SubscriptionTypeError(subscription, sub.type, type)
                        sub.type = type
                        sub.write_config()
                    if not sub.consumers:
                        sub.ack_timeout = ack_timeout
                        sub.nack_delay = nack_delay
            return Consumer(self, sub, consumer_name, fail_on_data_loss)

    def _unsubscribe(self, consumer: Consumer) -> None:
        with self._lock:
            sub = consumer._sub
            others = [c for c in sub.consumers if c is not consumer]
            if others:
                raise SubscriptionBusyError(sub.topic.name, sub.name)
            consumer.close()
            self._forget_applied(sub.pending_acks)   # (a subscription made again later starts clean)
            sub.topic.subscriptions.pop(sub.name, None)
            sub.close()
            datadir.remove_renamed(sub.path, self.fsync != "never")

    def subscriptions(self, topic: str) -> list:
        """Names of the subscriptions of ``topic``."""
        self._check_open()
        return sorted(self._topic(topic).subscriptions)

    def _subscription(self, topic: str, name: str) -> Subscription:
        t = self._topic(topic)
        check_subscription_name(name)
        try:
            return t.subscriptions[name]
        except KeyError:
            raise SubscriptionNotFoundError(topic, name) from None

    # -- transactions --------------------------------------------------------------------

    def new_transaction(self, timeout: float = 60.0) -> Transaction:
        """Begin a transaction; the coordinator aborts it if it is still open
        ``timeout`` seconds from now (at most ``transaction_timeout_max``).

        The transactions one thread begins here go to one coordinator (the
        threads are spread over ``num_coordinators`` round-robin), so the
        commits one thread pipelines with ``commit_async`` share one sync."""
        self._check_open()
        try:
            tc = self._tc_of_thread.tc
        except AttributeError:
            tc = self._tc_of_thread.tc = self._coordinators[next(self._tc_rr) % self.num_coordinators]
        return self._begin(tc, timeout)

    def _check_timeout(self, timeout) -> None:
        if (not isinstance(timeout, (int, float)) or isinstance(timeout, bool)
                or not 0 < timeout <= self.transaction_timeout_max):
            raise InvalidTxnTimeoutError(timeout, self.transaction_timeout_max)

    def _begin(self, tc: TransactionCoordinator, timeout, owner=None) -> Transaction:
        self._check_timeout(timeout)
        return Transaction(self, tc, tc.begin(float(timeout), owner))

    def transaction(self, timeout: float = 60.0) -> Transaction:
        """``with broker.transaction() as txn:`` commits on normal exit and
        aborts on an exception."""
        return self.new_transaction(timeout)

    def _coordinator_of(self, meta) -> TransactionCoordinator:
        return self._coordinators[meta.id.coordinator]

    def _participant_exists(self, participant) -> bool:
        """False once the topic (or subscription) of a participant is gone:
        a deleted participant has nothing left to commit or abort."""
        topic = getattr(participant, "topic", None)
        name = topic if isinstance(topic, str) else topic.name
        t = self._topics.get(name)
        if t is None or self._closed:
            return False
        if isinstance(topic, str):
            return participant in t.partitions
        sub = t.subscriptions.get(participant.name)
        return sub is not None and sub.pending_acks is participant

    def _meta(self, txn_id):
        txn_id = TxnID.parse(txn_id)
        if txn_id.coordinator < len(self._coordinators):
            meta = self._coordinators[txn_id.coordinator].txns.get(txn_id)
            if meta is not None:
                return meta
        raise TransactionNotFoundError(txn_id)

    def transactions(self) -> list:
        """Every live transaction: id, state, age and timeout (seconds),
        participants. Ended transactions are forgotten."""
        self._check_open()
        metas = [m for tc in self._coordinators for m in list(tc.txns.values())]
        return [txn_info(m) for m in sorted(metas, key=lambda m: m.id)]

    def transaction_info(self, txn_id) -> dict:
        """One live transaction (see :meth:`transactions`); ``txn_id`` is a
        TxnID, a (coordinator, sequence) pair or ``"(tc,seq)"``. Raises
        :class:`TransactionNotFoundError` when it is not live."""
        self._check_open()
        return txn_info(self._meta(txn_id))

    def abort_transaction(self, txn_id) -> None:
        """Force-abort a live transaction (an operator's tool for one that
        holds readers back); its owner's later calls fail. A PREPARED one
        is refused (:class:`InvalidTxnStateError`): another party may hold
        its outcome, so only :meth:`abort_prepared` ends it."""
        self._check_open()
        meta = self._meta(txn_id)
        if meta.state is TxnState.PREPARED:
            raise InvalidTxnStateError(meta.id, meta.state.value, "force-abort (abort_prepared ends a prepared "
                                                                  "transaction)")
        tc = self._coordinator_of(meta)
        tc.end(meta, False, reason="forced")
        tc.write_deferred()        # (an operator's end: tools reading the directory see it at once)

    def _forget_applied(self, participant) -> None:
        """No coordinator log holds a decision ``participant`` applied
        (TransactionCoordinator.forget_applied): it moved its cursor."""
        for tc in self._coordinators:
            tc.forget_applied(participant)

    def _expire_transactions(self) -> None:
        # Every coordinator, those past num_coordinators too (kept from an
        # opening with more: they begin nothing, but their restored prepared
        # transactions have a prepared timeout like any other).
        for tc in self._coordinators:
            if self._closed:
                return
            tc.expire()

    def _retry_transactions(self) -> None:
        for tc in self._coordinators:
            if self._closed:
                return
            tc.retry_pending()

    def _snapshot_txn_buffers(self) -> None:
        for t in list(self._topics.values()):
            for p in t.opened():
                if self._closed:
                    return
                try:
                    p.snapshot_txn_buffer(if_changed=True)
                    p.expire_producers()
                    p.scrub_indexes()
                except BrokerClosedError:
                    pass

    # -- background work ------------------------------------------------------------

    def enforce_retention(self) -> int:
        """Delete the segments that retention allows (and what staged
        ingest left over: tombstones after ten minutes, staged jobs after a
        day, :func:`txmq.ingest.clean_staging`); return how many."""
        if self._closed:
            return 0
        deleted = clean_staging(self.path, time.time())
        with self._lock:
            topics = list(self._topics.values())
        for topic in topics:
            r_ms = topic.config.get("retention_ms", None)
            r_bytes = topic.config.get("retention_bytes", None)
            r_ms = self.retention_ms if r_ms is None else r_ms
            r_bytes = self.retention_bytes if r_bytes is None else r_bytes
            if r_ms is None and r_bytes is None:
                continue
            for p in topic.partitions:
                pub = p.published()
                if pub is not None and pub[1] == pub[4]:
                    continue             # one segment: nothing retention may delete (and a stub stays shut)
                subs = list(topic.subscriptions.values())
                keep_from = min((s.mark_delete(p.index) for s in subs), default=p.end_offset)
                deleted += p.delete_segments(keep_from, r_ms, r_bytes)
        return deleted

    def flush(self) -> None:
        """Write every partition's indexes and recovery point now."""
        self._check_open()
        for t in list(self._topics.values()):
            for p in t.opened():
                p.flush()

    # -- the Kafka-facing view of a partition ----------------------------------------

    def _partition(self, topic: str, partition: int):
        self._check_open()
        parts = self._topic(topic).partitions
        if type(partition) is not int or not 0 <= partition < len(parts):
            raise PartitionNotFoundError(topic, partition)
        return parts[partition]

    def high_watermark(self, topic: str, partition: int) -> int:
        """The log end offset of a partition: the offset its next message
        gets (Kafka's high watermark; every appended message counts)."""
        return self._partition(topic, partition).end_offset

    def last_stable_offset(self, topic: str, partition: int) -> int:
        """Kafka's last stable offset: the first offset of the oldest
        transaction still open in the partition, or the high watermark when
        none is. READ_COMMITTED readers stop here (maxReadPosition)."""
        return self._partition(topic, partition).max_read_position

    def aborted_transactions(self, topic: str, partition: int, from_offset: int,
                             to_offset: int | None = None) -> list:
        """The aborted transactions with data in ``[from_offset,
        to_offset)`` (default: to the last stable offset; none for an empty
        range) of a partition, as :class:`AbortedTransaction`
        ``(producer_id, first_offset, last_offset)``, ordered by first
        offset: what a Kafka Fetch response
        carries so that a read_committed client drops their messages. Read
        from the per-segment aborted-transaction indexes (``.txnindex``)."""
        p = self._partition(topic, partition)
        if to_offset is None:
            to_offset = p.max_read_position
        for name, v in (("from_offset", from_offset), ("to_offset", to_offset)):
            if type(v) is not int or v < 0:
                raise InvalidArgumentError(name, v, "an int offset >= 0")
        if to_offset <= from_offset:
            return []                   # an empty range (from past the last stable offset, say)
        return [AbortedTransaction(*e) for e in p.aborted_transactions(from_offset, to_offset)]

    def consumer_lag(self, topic: str, subscription: str) -> dict:
        """``{partition: lag}`` of a subscription: the messages it has yet to
        acknowledge below the last stable offset (READ_COMMITTED) or the
        high watermark (READ_UNCOMMITTED). Markers, and for READ_COMMITTED
        aborted messages, are never delivered and never count, so the lag
        reaches 0 once everything deliverable is acknowledged (a Kafka
        client's offset arithmetic counts markers and stops at 1)."""
        self._check_open()
        stats = self._subscription(topic, subscription).stats()
        return {p["partition"]: p["backlog"] for p in stats["partitions"]}

    # -- state -------------------------------------------------------------------------

    def stats(self) -> dict:
        """Plain dicts: per topic its partitions (log end, bytes, segments)
        and subscriptions (type, isolation, backlog, mark-delete, unacked,
        consumers)."""
        self._check_open()
        with self._lock:
            topics = dict(self._topics)
        return {
            "path": self.path,
            "fsync": self.fsync,
            "problems_on_open": list(self.problems_on_open),
            "topics": {name: {
                "partitions": [p.stats() for p in t.partitions],
                "subscriptions": {s: sub.stats() for s, sub in t.subscriptions.items()},
            } for name, t in topics.items()},
            "transactions": {
                "open": sum(len(tc.txns) for tc in self._coordinators),
                "prepared": sum(1 for tc in self._coordinators for m in list(tc.txns.values())
                                if m.state is TxnState.PREPARED),
                "begun": sum(tc.stats["begun"] for tc in self._coordinators),
                "committed": sum(tc.stats["committed"] for tc in self._coordinators),
                "aborted": sum(tc.stats["aborted"] for tc in self._coordinators),
                "timed_out": sum(tc.stats["timed_out"] for tc in self._coordinators),
                "recovered": dict(self.recovered_transactions),
                "coordinator_problems_on_open": [p for tc in self._coordinators for p in tc.problems],
            },
            "producers": {
                "registry_problems_on_open": list(self._producer_ids.problems),
                "transactional_ids_open": len(self._tid_live),
            },
            "half": self._half.stats(),
        }

    def close(self) -> None:
        """Close every consumer, write indexes and recovery points, release
        the data directory."""
        if self._closed:
            return
        for tc in self._coordinators:
            tc.drain()                  # commit_async commits decided so far: synced and applied
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for service in list(self._services):
            service.stop()
        if self._control is not None:
            self._control.close()
        self._scheduler.stop()
        failed = []          # an error closing one part (a file another process damaged) ends no other

        def attempt(close) -> None:
            try:
                close()
            except Exception as e:
                failed.append(e)

        # What open transactions (the next open aborts them) and batching
        # producers accumulated goes to the log, as a Kafka producer's close
        # sends its batches.
        attempt(self._batching.flush_all)
        attempt(self._half.close)
        for t in self._topics.values():
            for sub in t.subscriptions.values():
                for c in list(sub.consumers):
                    c.closed = True
            attempt(t.close)
        self._topics.clear()
        for tc in self._coordinators:
            attempt(tc.close)
        attempt(self._producer_ids.close)
        self._dir_lock.release()
        if failed:
            raise failed[0]

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"Broker({self.path!r}, fsync={self.fsync!r})"


def _check_out_of_order(subscription: str, type: str, isolation: str) -> None:
    """Refuse ``allow_out_of_order_delivery`` where it does not apply."""
    if type != "shared":
        raise OutOfOrderDeliveryError(subscription, f"allow_out_of_order_delivery needs a shared subscription, not "
                                                    f"{type} (exclusive and failover deliver in offset order)",
                                      None, type)
    if isolation != "read_committed":
        raise OutOfOrderDeliveryError(subscription, "allow_out_of_order_delivery needs isolation read_committed "
                                                    f"(not {isolation}, which an open transaction never holds back)",
                                      None, isolation)


def _name_bytes(what: str, name) -> bytes:
    """The UTF-8 bytes of a producer name or transactional id (stored as a
    u16-length string)."""
    try:
        raw = name.encode("utf-8") if isinstance(name, str) else None
    except UnicodeEncodeError:
        raw = None
    if not raw or len(raw) > 0xFFFF:
        raise InvalidArgumentError(what, name, "a non-empty str of at most 65535 UTF-8 bytes")
    return raw

