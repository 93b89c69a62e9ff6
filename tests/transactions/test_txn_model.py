"""Hypothesis stateful test of the whole transaction state (docs/GUARANTEES.md;
G1, G2, G3, G6, G7, G8) against a small pure-Python reference model.

The broker runs on a temp dir (fsync="never") with two topics of two
partitions each and, per topic, five subscriptions with one consumer each:
exclusive / read_committed, failover / read_uncommitted, shared /
read_committed, shared / read_uncommitted, and shared / read_committed with
``allow_out_of_order_delivery`` (past open transactions). Random rules begin transactions;
send plainly or in a transaction (one message or a batch); receive; ack in
a transaction, individually or cumulatively, including acks that must
conflict; ack by MessageId in a transaction messages not yet delivered;
prepare transactions, use them (refused), and end them through their
handle or the broker;
consume-process-produce in one transaction; ack plainly, cumulatively, or
nack; commit, abort or force-abort; use ended transactions; let a short
transaction time out; reconnect a consumer; read a whole topic with a new
subscription; close and reopen the broker (recovery aborts every
transaction still open, and keeps every prepared one, G11).

The model knows every partition's log (data messages and the one-offset
COMMIT / ABORT markers: data offsets are not dense), every transaction's
state, first offset per partition, participants and pending acks, and per
subscription and partition which offsets are acknowledged, outstanding at
the consumer, or deliverable (again) with which redelivery count.

Checked at every delivery: the message is deliverable (READ_COMMITTED: plain
or committed, below the first offset of every open transaction there;
out of order: plain or committed, anywhere below the log end;
READ_UNCOMMITTED: any data message; never acknowledged, pending in an open
transaction or already outstanding), with the right bytes, transaction id
and redelivery count, and fresh deliveries come in offset order per
partition (but out of order); a receive_many(k) returning fewer than k
leaves nothing deliverable (so an open transaction's messages are
deliverable out of order as soon as it commits). After every step: broker.transactions() is exactly the open
transactions with their partitions and subscriptions; per partition the end
offset, max_read_position and open-transaction count; per subscription
partition the unacked count and a mark-delete that never passes a message
the model has not seen acknowledged, and out of order its backlog: the
committed and plain messages not acknowledged; every transaction handle's
state.

Shrinking is off by default: shrinking a failure of this machine takes
longer than the suite's 300 s timeout (which would hide the report), so a
failure is reported at once with its full step list. Set
TXMQ_MODEL_SHRINK=1 (and --timeout=0) for a minimal example.
"""

import os
import shutil
import sys
import tempfile
import time
from collections import defaultdict

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

import txmq
from txmq import MessageId, TxnState
from txmq.dispatch import lane_invariant
from txmq.errors import (BrokerClosedError, InvalidTxnStateError, SubscriptionTypeError, TransactionConflictError,
                         TransactionNotFoundError, TransactionTimeoutError)

TOPICS = ("a", "b")
PARTS = 2
SUBS = (("xrc", "exclusive", "read_committed"),
        ("fru", "failover", "read_uncommitted"),
        ("src", "shared", "read_committed"),
        ("sru", "shared", "read_uncommitted"),
        ("soo", "shared", "read_committed"))
OUT_OF_ORDER = {"soo"}        # allow_out_of_order_delivery=True
SUB_INFO = {name: (type_, iso) for name, type_, iso in SUBS}
SUB_KEYS = [(t, s) for t in TOPICS for s, _, _ in SUBS]
PARTITION_KEYS = [(t, p) for t in TOPICS for p in range(PARTS)]
ISOLATIONS = ("read_committed", "read_uncommitted")

LONG_TIMEOUT = 600.0          # never reached within one example
SHORT_TIMEOUT = 0.3           # the timeout rule (the broker checks every 0.05 s); wide enough
                              # that the sends before it never race it, even on a loaded machine
MAX_OPEN = 4                  # open transactions at a time
MAX_PREPARED = 2              # prepared ones (they hold readers back until ended)
MAX_TIMEOUTS = 1              # per example: each costs ~0.35 s of waiting
REOPEN_EVERY = 20             # steps of a broker life before it may be reopened
FRESH_READER_EVERY = 10       # steps between two whole-topic readers

EXAMPLES = 50
STEPS_PER_EXAMPLE = 80
MIN_STEPS = 2000              # a run takes at least 2,000 steps
assert EXAMPLES * STEPS_PER_EXAMPLE >= MIN_STEPS

HANDLE_STATE = {"open": TxnState.OPEN, "prepared": TxnState.PREPARED, "committed": TxnState.COMMITTED,
                "aborted": TxnState.ABORTED}


class MTxn:
    """The model of one transaction."""

    def __init__(self, handle):
        self.handle = handle
        self.id = handle.id
        self.state = "open"               # open | prepared | committed | aborted
        self.stale = False                # its handle is of an earlier broker life
        self.how = None                   # commit | abort | forced | timeout | recovery
        self.first = {}                   # (topic, p) -> its first data offset there
        self.parts = set()                # (topic, p) registered
        self.subs = set()                 # (topic, sub) registered
        self.indiv = defaultdict(set)     # (topic, sub, p) -> offsets acked individually
        self.cum = {}                     # (topic, sub, p) -> offset acked cumulatively

    def __repr__(self):
        return f"MTxn({self.id}, {self.state}, {self.how})"


class MLane:
    """The model of one subscription on one partition."""

    def __init__(self):
        self.acked = set()                # data offsets acknowledged in the cursor
        self.outstanding = {}             # offset -> Message held by the consumer
        self.count = {}                   # offset -> redelivery count of its next delivery
        # offset -> how much higher than ``count`` its next redelivery count
        # may be: a message acked by id in a transaction before this life
        # delivered it, then aborted, counts + 1 only if the reader had
        # already read past it (the model does not track the read position).
        self.extra = {}
        self.hw = 0                       # fresh deliveries of this broker life are below this


class TxnModel(RuleBasedStateMachine):
    steps = 0                             # summed over every example of a run
    rule_counts = {}                      # rule name -> times run, likewise

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="txmq-txnmodel-")
        self.broker = txmq.Broker(self.dir, fsync="never")
        for t in TOPICS:
            self.broker.create_topic(t, partitions=PARTS)
        self._connect()
        self.log = {k: [] for k in PARTITION_KEYS}          # ("d", value, MTxn | None) or ("m", MTxn)
        self.lanes = {(t, s, p): MLane() for t, s in SUB_KEYS for p in range(PARTS)}
        self.delivered = {k: {} for k in SUB_KEYS}           # (p, offset) -> Message, this broker life
        self.txns = []                                       # MTxn of this broker life
        self.ids = set()                                     # every TxnID handed out, every life
        self.serial = 0
        self.fresh_subs = 0
        self.timeouts = 0
        self.timed_out_this_life = 0
        self.life_steps = 0
        self.last_fresh = -FRESH_READER_EVERY

    def _connect(self):
        self.producers = {t: self.broker.producer(t) for t in TOPICS}
        self.consumers = {k: self._subscribe(k) for k in SUB_KEYS}

    def _subscribe(self, key):
        t, s = key
        type_, iso = SUB_INFO[s]
        return self.broker.subscribe(t, s, type_, isolation=iso, initial_position="earliest", nack_delay=0,
                                     allow_out_of_order_delivery=s in OUT_OF_ORDER)

    def teardown(self):
        self.broker.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _step(self):
        cls = type(self)
        cls.steps += 1
        name = sys._getframe(1).f_code.co_name
        cls.rule_counts[name] = cls.rule_counts.get(name, 0) + 1
        self.life_steps += 1

    # -- model queries ----------------------------------------------------------------------

    def open_txns(self):
        return [T for T in self.txns if T.state == "open"]

    def prepared_txns(self):
        return [T for T in self.txns if T.state == "prepared"]

    def live_txns(self):
        """Open or prepared: holding their data back and their acks pending."""
        return [T for T in self.txns if T.state in ("open", "prepared")]

    def ended_txns(self):
        """Ended in this broker life, with a handle of it."""
        return [T for T in self.txns if T.state not in ("open", "prepared") and not T.stale]

    def mrp(self, tp):
        """max_read_position: the first offset of the oldest open transaction, or the log end."""
        firsts = [T.first[tp] for T in self.live_txns() if tp in T.first]
        return min(firsts) if firsts else len(self.log[tp])

    def visible(self, t, p, o, iso, out_of_order=False):
        """Whether offset ``o`` may be delivered under ``iso`` now (out of
        order: plain or committed, whatever is open before it)."""
        entry = self.log[(t, p)][o]
        if entry[0] != "d":
            return False
        if iso == "read_uncommitted":
            return True
        txn = entry[2]
        return (txn is None or txn.state == "committed") and (out_of_order or o < self.mrp((t, p)))

    def visible_to(self, s, t, p, o):
        """:meth:`visible` for subscription ``s``."""
        return self.visible(t, p, o, SUB_INFO[s][1], s in OUT_OF_ORDER)

    def owner(self, key, o):
        """The open transaction holding ``o`` pending on lane ``key``, or None."""
        holders = [T for T in self.live_txns() if o in T.indiv.get(key, ()) or T.cum.get(key, -1) >= o]
        assert len(holders) <= 1, f"model: {key} offset {o} pending in {holders}"
        return holders[0] if holders else None

    def lane_state(self, key, o):
        lane = self.lanes[key]
        if o in lane.acked:
            return "acked"
        if self.owner(key, o) is not None:
            return "pending"
        if o in lane.outstanding:
            return "outstanding"
        return "available"

    def deliverable(self, key, o):
        t, s, p = key
        return self.visible_to(s, t, p, o) and self.lane_state(key, o) == "available"

    def available(self, sub):
        t, s = sub
        return [(p, o) for p in range(PARTS) for o in range(len(self.log[(t, p)]))
                if self.deliverable((t, s, p), o)]

    def outstanding(self, sub):
        t, s = sub
        return sorted((p, o) for p in range(PARTS) for o in self.lanes[(t, s, p)].outstanding)

    def _value(self, t, p):
        self.serial += 1
        return b"%s%d-%06d" % (t.encode(), p, self.serial)

    def _any_delivered(self):
        return any(self.delivered.values())

    # -- transactions in the model ----------------------------------------------------------

    def _begin(self, timeout):
        h = self.broker.new_transaction(timeout=timeout)
        assert h.state is TxnState.OPEN
        assert h.id not in self.ids, f"TxnID {h.id} handed out twice"
        self.ids.add(h.id)
        T = MTxn(h)
        self.txns.append(T)
        return T

    def _txn(self, data, allow_new=True, avoid=()):
        """An open transaction (not one of ``avoid``), or a new one."""
        choices = [T for T in self.open_txns() if T not in avoid]
        if (allow_new and len(self.open_txns()) < MAX_OPEN) or not choices:
            choices = choices + ["new"]
        T = data.draw(st.sampled_from(choices), label="txn")
        return self._begin(LONG_TIMEOUT) if T == "new" else T

    def _end(self, T, commit, how):
        """Commit or abort ``T`` in the model: a marker on every partition
        with its data; its pending acks applied (commit) or made deliverable
        again with redelivery count + 1 (abort)."""
        assert T.state in ("open", "prepared")
        T.state = "committed" if commit else "aborted"
        T.how = how
        for tp in T.first:
            self.log[tp].append(("m", T))
        for key in set(T.indiv) | set(T.cum):
            t, s, p = key
            lane = self.lanes[key]
            offsets = set(T.indiv.get(key, ()))
            if key in T.cum:
                offsets.update(o for o in range(T.cum[key] + 1) if self.log[(t, p)][o][0] == "d")
            for o in sorted(offsets):
                if commit:
                    lane.acked.add(o)
                    lane.outstanding.pop(o, None)
                    lane.count.pop(o, None)
                    lane.extra.pop(o, None)
                    continue
                if o in lane.acked or self.owner(key, o) is not None:
                    continue
                if o not in T.indiv.get(key, ()) and not self.visible_to(s, t, p, o):
                    continue            # under the cumulative ack but never deliverable here
                assert o not in lane.outstanding, f"model: {key}@{o} pending and outstanding"
                if (p, o) in self.delivered[(t, s)]:
                    lane.count[o] = lane.count.get(o, 0) + 1
                else:
                    lane.extra[o] = lane.extra.get(o, 0) + 1

    # -- rules: transactions -----------------------------------------------------------------

    @precondition(lambda self: self.open_txns())
    @rule(data=st.data(), how=st.sampled_from(["commit", "commit", "abort", "forced"]))
    def end(self, data, how):
        """Commit, abort, or force-abort (broker.abort_transaction) an open transaction."""
        self._step()
        T = data.draw(st.sampled_from(self.open_txns()), label="txn")
        if how == "commit":
            T.handle.commit()
        elif how == "abort":
            T.handle.abort()
        else:
            self.broker.abort_transaction(T.id)
        self._end(T, how == "commit", how)
        with pytest.raises(TransactionNotFoundError):
            self.broker.transaction_info(T.id)     # ended transactions are forgotten

    @precondition(lambda self: self.ended_txns())
    @rule(data=st.data(), op=st.sampled_from(["send", "ack", "ack_cumulative", "commit", "abort", "force_abort"]))
    def use_ended(self, data, op):
        """Any operation in an ended transaction fails and changes nothing;
        aborting an aborted one (by its owner, forced, timeout) is a no-op; a
        timed-out one fails with TransactionTimeoutError (G8)."""
        self._step()
        T = data.draw(st.sampled_from(self.ended_txns()), label="txn")
        err = TransactionTimeoutError if T.how == "timeout" else InvalidTxnStateError
        h = T.handle
        if op == "send":
            t, p = data.draw(st.sampled_from(PARTITION_KEYS), label="partition")
            with pytest.raises(err):
                self.producers[t].send(b"never", partition=p, txn=h)
        elif op in ("ack", "ack_cumulative"):
            subs = [k for k in SUB_KEYS if self.delivered[k]
                    and (op == "ack" or SUB_INFO[k[1]][0] != "shared")]
            if not subs:
                return
            sub = data.draw(st.sampled_from(subs), label="sub")
            m = self.delivered[sub][data.draw(st.sampled_from(sorted(self.delivered[sub])), label="message")]
            with pytest.raises(err):
                if op == "ack":
                    self.consumers[sub].ack(m, txn=h)
                else:
                    self.consumers[sub].ack_cumulative(m, txn=h)
        elif op == "commit":
            with pytest.raises(err):
                h.commit()
        elif op == "abort":
            if T.how == "commit":
                with pytest.raises(InvalidTxnStateError):
                    h.abort()
            else:
                h.abort()            # aborted already (by an abort, a force-abort, a timeout): a no-op
        else:
            with pytest.raises(TransactionNotFoundError):
                self.broker.abort_transaction(T.id)

    @precondition(lambda self: self.open_txns() and len(self.prepared_txns()) < MAX_PREPARED)
    @rule(data=st.data())
    def prepare(self, data):
        """Prepare an open transaction: it keeps holding its data back and
        its acks pending, and only its commit or abort ends it (G11)."""
        self._step()
        T = data.draw(st.sampled_from(self.open_txns()), label="txn")
        T.handle.prepare(xid=f"model-{T.id}")
        T.state = "prepared"

    @precondition(lambda self: self.prepared_txns())
    @rule(data=st.data(), how=st.sampled_from(["commit", "abort", "commit_prepared", "abort_prepared"]))
    def end_prepared(self, data, how):
        """Commit or abort a prepared transaction, through its handle or,
        after a reopen or at will, through the broker (commit_prepared /
        abort_prepared, which a second time do nothing)."""
        self._step()
        T = data.draw(st.sampled_from(self.prepared_txns()), label="txn")
        commit = how.startswith("commit")
        if T.stale or how.endswith("prepared"):
            (self.broker.commit_prepared if commit else self.broker.abort_prepared)(T.id)
            (self.broker.commit_prepared if commit else self.broker.abort_prepared)(T.id)
        else:
            T.handle.commit() if commit else T.handle.abort()
        self._end(T, commit, "commit" if commit else "abort")
        assert self.broker.prepared_outcome(T.id) is (TxnState.COMMITTED if commit else TxnState.ABORTED)
        assert self.broker.forget_prepared(T.id) is True

    @precondition(lambda self: self.prepared_txns())
    @rule(data=st.data(), op=st.sampled_from(["send", "ack", "prepare", "force_abort"]))
    def use_prepared(self, data, op):
        """A prepared transaction takes no more sends or acks, is not
        prepared twice and is not force-aborted; nothing changes."""
        self._step()
        T = data.draw(st.sampled_from(self.prepared_txns()), label="txn")
        if op == "force_abort":
            with pytest.raises(InvalidTxnStateError):
                self.broker.abort_transaction(T.id)
            return
        if T.stale:
            return                          # (its handle died with its broker)
        h = T.handle
        if op == "send":
            t, p = data.draw(st.sampled_from(PARTITION_KEYS), label="partition")
            with pytest.raises(InvalidTxnStateError):
                self.producers[t].send(b"never", partition=p, txn=h)
        elif op == "ack":
            subs = [k for k in SUB_KEYS if self.delivered[k]]
            if not subs:
                return
            sub = data.draw(st.sampled_from(subs), label="sub")
            m = self.delivered[sub][data.draw(st.sampled_from(sorted(self.delivered[sub])), label="message")]
            with pytest.raises(InvalidTxnStateError):
                self.consumers[sub].ack(m, txn=h)
        else:
            with pytest.raises(InvalidTxnStateError):
                h.prepare()

    @precondition(lambda self: self.timeouts < MAX_TIMEOUTS)
    @rule(data=st.data())
    def time_out(self, data):
        """A transaction with a short timeout sends (and maybe acks), then
        its coordinator aborts it (G8)."""
        self._step()
        self.timeouts += 1
        T = self._begin(SHORT_TIMEOUT)
        h = T.handle
        t, p = data.draw(st.sampled_from(PARTITION_KEYS), label="partition")
        subs = [k for k in SUB_KEYS if self.outstanding(k)]
        sub = data.draw(st.sampled_from(subs), label="sub") if subs and data.draw(st.booleans()) else None
        value = self._value(t, p)
        try:
            mid = self.producers[t].send(value, partition=p, txn=h)
        except TransactionTimeoutError:     # the machine was slow: nothing was appended
            pass
        else:
            assert mid.offset == len(self.log[(t, p)])
            self.log[(t, p)].append(("d", value, T))
            T.first.setdefault((t, p), mid.offset)
            T.parts.add((t, p))
        if sub is not None:
            pp, o = self.outstanding(sub)[0]
            key = (sub[0], sub[1], pp)
            try:
                self.consumers[sub].ack(self.lanes[key].outstanding[o], txn=h)
            except TransactionTimeoutError:
                pass
            else:
                T.indiv[key].add(o)
                del self.lanes[key].outstanding[o]
        deadline = time.monotonic() + 10
        while h.state is not TxnState.ABORTED:
            assert time.monotonic() < deadline, f"{h.id} still {h.state} 10 s after its {SHORT_TIMEOUT} s timeout"
            time.sleep(0.01)
        self._end(T, False, "timeout")
        self.timed_out_this_life += 1
        with pytest.raises(TransactionTimeoutError):
            self.producers[t].send(b"late", partition=p, txn=h)
        with pytest.raises(TransactionTimeoutError):
            h.commit()
        h.abort()                             # already aborted by the broker: a no-op

    # -- rules: producing -------------------------------------------------------------------

    @rule(data=st.data(), tp=st.sampled_from(PARTITION_KEYS), n=st.integers(1, 4),
          mode=st.sampled_from(["plain", "txn", "txn"]))
    def send(self, data, tp, n, mode):
        """One message (send) or a batch (send_batch), plainly or in a transaction."""
        self._step()
        t, p = tp
        T = self._txn(data) if mode == "txn" else None
        h = T.handle if T else None
        values = [self._value(t, p) for _ in range(n)]
        if n == 1:
            offsets = [self.producers[t].send(values[0], partition=p, txn=h).offset]
        else:
            offsets = [int(o) for o in self.producers[t].send_batch(values, partition=p, txn=h).offsets]
        end = len(self.log[tp])
        assert offsets == list(range(end, end + n)), (offsets, end)
        for v in values:
            self.log[tp].append(("d", v, T))
        if T is not None:
            T.parts.add(tp)
            T.first.setdefault(tp, end)

    # -- rules: consuming -------------------------------------------------------------------

    def _check_delivery(self, sub, m):
        t, s = sub
        iso = SUB_INFO[s][1]
        assert m.topic == t
        p, o = m.partition, m.offset
        key = (t, s, p)
        lane = self.lanes[key]
        log = self.log[(t, p)]
        assert 0 <= o < len(log) and log[o][0] == "d", f"{s} delivered {m.message_id}: not a data message"
        _, value, txn = log[o]
        assert m.value == value, (m, value)
        assert m.txn_id == (txn.id if txn else None), (m.message_id, m.txn_id, txn)
        if iso == "read_committed":
            assert txn is None or txn.state == "committed", \
                f"G2: {s} delivered {m.message_id} of {txn.state} transaction {txn.id}"
            assert o < self.mrp((t, p)) or s in OUT_OF_ORDER, \
                f"G2: {s} delivered {m.message_id} at or past max_read_position {self.mrp((t, p))}"
        state = self.lane_state(key, o)
        assert state == "available", f"{s} delivered {m.message_id} which is {state}"
        low = lane.count.get(o, 0)
        high = low + lane.extra.pop(o, 0)
        assert low <= m.redelivery_count <= high, \
            f"{s}: {m.message_id} redelivery_count {m.redelivery_count}, expected {low}..{high}"
        lane.count[o] = m.redelivery_count
        if o >= lane.hw:
            skipped = [x for x in range(lane.hw, o) if self.deliverable(key, x)]
            assert not skipped or s in OUT_OF_ORDER, \
                f"{s}: {m.message_id} delivered before {t}/{p}@{skipped} (offset order)"
            lane.hw = o + 1
        lane.outstanding[o] = m
        self.delivered[sub][(p, o)] = m

    def _receive(self, sub, k):
        got = self.consumers[sub].receive_many(k, timeout=0)
        assert len(got) <= k
        for m in got:
            self._check_delivery(sub, m)
        if len(got) < k:
            left = self.available(sub)
            assert not left, f"{sub}: receive_many({k}) gave {len(got)} while {left} were deliverable"

    @rule(data=st.data(), k=st.integers(1, 8), every=st.booleans())
    def receive(self, data, k, every):
        """receive_many(k) on one subscription, or on every one."""
        self._step()
        for sub in SUB_KEYS if every else [data.draw(st.sampled_from(SUB_KEYS), label="sub")]:
            self._receive(sub, k)

    @precondition(lambda self: any(self.outstanding(k) for k in SUB_KEYS))
    @rule(data=st.data())
    def reconnect(self, data):
        """Close a consumer and attach a new one: what it held comes again."""
        self._step()
        sub = data.draw(st.sampled_from([k for k in SUB_KEYS if self.outstanding(k)]), label="sub")
        self.consumers[sub].close()
        self.consumers[sub] = self._subscribe(sub)
        t, s = sub
        for p in range(PARTS):
            lane = self.lanes[(t, s, p)]
            for o in lane.outstanding:
                lane.count[o] = lane.count.get(o, 0) + 1
            lane.outstanding.clear()

    # -- rules: acknowledging ----------------------------------------------------------------

    @precondition(lambda self: self._any_delivered())
    @rule(data=st.data(), op=st.sampled_from(["ack", "ack", "ack_cumulative", "nack"]))
    def ack_plain(self, data, op):
        """Plain ack / ack_cumulative / nack of delivered messages that no open
        transaction holds (plain acks do not check pending acks)."""
        self._step()

        def free(key, o):
            return self.owner(key, o) is None

        def free_below(key, o):
            return not any(key in T.cum or any(x <= o for x in T.indiv.get(key, ())) for T in self.live_txns())

        if op == "nack":
            subs = [k for k in SUB_KEYS if self.outstanding(k)]
            if not subs:
                return
            sub = data.draw(st.sampled_from(subs), label="sub")
            chosen = data.draw(st.lists(st.sampled_from(self.outstanding(sub)), min_size=1, max_size=3,
                                        unique=True), label="messages")
            t, s = sub
            self.consumers[sub].nack([self.lanes[(t, s, p)].outstanding[o] for p, o in chosen])
            for p, o in chosen:
                lane = self.lanes[(t, s, p)]
                del lane.outstanding[o]
                lane.count[o] = lane.count.get(o, 0) + 1
            return
        ok = free if op == "ack" else free_below
        cands = {k: [po for po in sorted(self.delivered[k]) if ok((k[0], k[1], po[0]), po[1])] for k in SUB_KEYS}
        subs = [k for k in SUB_KEYS if cands[k]]
        if not subs:
            return
        sub = data.draw(st.sampled_from(subs), label="sub")
        t, s = sub
        if op == "ack_cumulative" and SUB_INFO[s][0] == "shared":
            with pytest.raises(SubscriptionTypeError):
                self.consumers[sub].ack_cumulative(self.delivered[sub][cands[sub][0]])
            return
        if op == "ack":
            chosen = data.draw(st.lists(st.sampled_from(cands[sub]), min_size=1, max_size=3, unique=True),
                               label="messages")
            self.consumers[sub].ack([self.delivered[sub][po] for po in chosen])
        else:
            p, o = data.draw(st.sampled_from(cands[sub]), label="message")
            self.consumers[sub].ack_cumulative(self.delivered[sub][(p, o)])
            chosen = [(p, x) for x in range(o + 1) if self.log[(t, p)][x][0] == "d"]
        for p, o in chosen:
            lane = self.lanes[(t, s, p)]
            lane.acked.add(o)
            lane.outstanding.pop(o, None)
            lane.count.pop(o, None)
            lane.extra.pop(o, None)

    def _finish(self, T, then: str) -> None:
        """Commit, abort or (``"open"``) leave ``T`` as it is, in the broker and the model."""
        if then == "commit":
            T.handle.commit()
            self._end(T, True, "commit")
        elif then == "abort":
            T.handle.abort()
            self._end(T, False, "abort")

    def _ack_in_txn(self, T, sub, chosen, cumulative):
        """Ack ``chosen`` [(p, offset)] of ``sub`` in ``T`` (cumulatively: one
        message) and check the outcome against the model; return whether it
        was accepted. Individually, a message pending in another open
        transaction, covered by another's cumulative ack, or already
        acknowledged conflicts; cumulatively, another transaction's pending
        ack at or below it, or its cumulative ack on the partition. A
        conflict raises TransactionConflictError and changes no ack (G7)."""
        t, s = sub
        msgs = [self.delivered[sub].get(po) or MessageId(t, *po) for po in chosen]
        T.subs.add(sub)                     # registered before the conflict check
        conflicts = {}                      # (p, offset) -> TxnIDs of the other holders (None: acknowledged)
        for p, o in chosen:
            key = (t, s, p)
            if cumulative:
                for U in self.live_txns():
                    if U is not T and (key in U.cum or any(x <= o for x in U.indiv.get(key, ()))):
                        conflicts.setdefault((p, o), set()).add(U.id)
            elif o in self.lanes[key].acked:
                conflicts[(p, o)] = {None}
            else:
                other = self.owner(key, o)
                if other is not None and other is not T:
                    conflicts[(p, o)] = {other.id}
        consumer = self.consumers[sub]
        if len(msgs) == 1 and not cumulative:
            msgs = msgs[0]         # ack(m, txn=): the README's per-message call (compiled)
        if conflicts:
            with pytest.raises(TransactionConflictError) as ei:
                if cumulative:
                    consumer.ack_cumulative(msgs[0], txn=T.handle)
                else:
                    consumer.ack(msgs, txn=T.handle)
            e = ei.value
            assert e.txn_id == T.id
            if cumulative:
                assert e.other in next(iter(conflicts.values())), (e.other, conflicts)
            else:
                where = (e.message_id.partition, e.message_id.offset)
                assert where in conflicts, f"conflict reported on {e.message_id}, expected one of {conflicts}"
                assert e.other in conflicts[where], (e.other, conflicts[where])
            return False
        if cumulative:
            consumer.ack_cumulative(msgs[0], txn=T.handle)
        else:
            consumer.ack(msgs, txn=T.handle)
        for p, o in chosen:
            key = (t, s, p)
            lane = self.lanes[key]
            if cumulative:
                T.cum[key] = max(T.cum.get(key, -1), o)
                for x in [x for x in lane.outstanding if x <= o]:
                    del lane.outstanding[x]
            elif self.owner(key, o) is not T:
                T.indiv[key].add(o)
                lane.outstanding.pop(o, None)
        return True

    def _cumulative_candidates(self, sub, among):
        """Where an acknowledged message lies against mark-delete (markers
        skipped or not) is not in the model: cumulative acks in a
        transaction only on unacknowledged messages."""
        t, s = sub
        return [po for po in among if po[1] not in self.lanes[(t, s, po[0])].acked]

    def _held(self, key, o, cumulative):
        """Whether an open transaction holds ``o`` (individually) or, for a
        cumulative ack at ``o``, anything at or below it on the lane."""
        if not cumulative:
            return self.owner(key, o) is not None
        return any(key in U.cum or any(x <= o for x in U.indiv.get(key, ())) for U in self.live_txns())

    @precondition(lambda self: self._any_delivered())
    @rule(data=st.data(), cumulative=st.booleans(), aim=st.sampled_from(["any", "held"]))
    def ack_in_txn(self, data, cumulative, aim):
        """Ack delivered messages (outstanding, pending here or elsewhere,
        acknowledged, waiting for redelivery) in a transaction; ``held``
        aims at messages an open transaction holds, to provoke conflicts."""
        self._step()
        subs = [k for k in SUB_KEYS if self.delivered[k]]
        if aim == "held":
            subs = [k for k in subs if any(self._held((k[0], k[1], p), o, cumulative) for p, o in self.delivered[k])]
            if not subs:
                return
        sub = data.draw(st.sampled_from(subs), label="sub")
        t, s = sub
        delivered = sorted(self.delivered[sub])
        if aim == "held":
            delivered = [(p, o) for p, o in delivered if self._held((t, s, p), o, cumulative)]
        if cumulative and SUB_INFO[s][0] == "shared":
            T = self._txn(data)
            m = self.delivered[sub][data.draw(st.sampled_from(delivered), label="message")]
            with pytest.raises(SubscriptionTypeError):
                self.consumers[sub].ack_cumulative(m, txn=T.handle)
            return
        if cumulative:
            cands = self._cumulative_candidates(sub, delivered)
            if not cands:
                return
            chosen = [data.draw(st.sampled_from(cands), label="message")]
        else:
            chosen = data.draw(st.lists(st.sampled_from(delivered), min_size=1, max_size=3, unique=True),
                               label="messages")
        holders = set()
        if aim == "held":                   # ack in another transaction than the holders
            for p, o in chosen:
                key = (t, s, p)
                holders.update(U for U in self.live_txns()
                               if o in U.indiv.get(key, ()) or (key in U.cum and (cumulative or U.cum[key] >= o))
                               or (cumulative and any(x <= o for x in U.indiv.get(key, ()))))
        self._ack_in_txn(self._txn(data, avoid=holders), sub, chosen, cumulative)

    @rule(data=st.data(), sub=st.sampled_from(SUB_KEYS), before=st.integers(0, 3),
          aim=st.sampled_from(["any", "next"]), then=st.sampled_from(["open", "commit", "abort", "abort"]),
          after=st.booleans())
    def ack_ahead_in_txn(self, data, sub, before, aim, then, after):
        """Ack by MessageId, in a transaction, messages this subscription may
        deliver but has not delivered in this broker life (ids kept from
        before a restart, or seen by another subscription): ``next`` aims at
        the ones right after the last fresh delivery. Pending, they are not
        delivered; committed, never; aborted, they are delivered once.
        Optionally receive_many(``before``) first and receive after."""
        self._step()
        t, s = sub
        if before:
            self._receive(sub, before)
        cands = [(p, o) for p in range(PARTS) for o in range(len(self.log[(t, p)]))
                 if (p, o) not in self.delivered[sub] and self.visible_to(s, t, p, o)]
        if aim == "next":
            cands = [(p, o) for p, o in cands if o < self.lanes[(t, s, p)].hw + 3]
        if not cands:
            return
        chosen = data.draw(st.lists(st.sampled_from(cands), min_size=1, max_size=2, unique=True), label="ids")
        T = self._txn(data)
        self._ack_in_txn(T, sub, chosen, False)
        self._finish(T, then)
        if after:
            self._receive(sub, 8)

    @rule(data=st.data(), sub=st.sampled_from(SUB_KEYS), k=st.integers(1, 4), cumulative=st.booleans(),
          then=st.sampled_from(["open", "commit", "commit", "abort"]))
    def process(self, data, sub, k, cumulative, then):
        """Consume-process-produce (G6): receive, send one output per input to
        the other topic in a transaction, ack the inputs in it (individually,
        or cumulatively per partition where the subscription allows), then
        commit, abort or leave it open. The output of an input is visible to
        READ_COMMITTED iff the input's ack took effect."""
        self._step()
        self._receive(sub, k)
        t, s = sub
        inputs = self.outstanding(sub)[:k]
        if not inputs:
            return
        T = self._txn(data)
        out = TOPICS[1 - TOPICS.index(t)]
        for p, o in inputs:
            value = b"out:" + self.delivered[sub][(p, o)].value
            mid = self.producers[out].send(value, partition=p, txn=T.handle)
            assert mid.offset == len(self.log[(out, p)])
            self.log[(out, p)].append(("d", value, T))
            T.parts.add((out, p))
            T.first.setdefault((out, p), mid.offset)
        if cumulative and SUB_INFO[s][0] != "shared":
            for p in sorted({p for p, _ in inputs}):
                last = max(po for po in inputs if po[0] == p)
                if self._cumulative_candidates(sub, [last]):
                    self._ack_in_txn(T, sub, [last], True)
        else:
            self._ack_in_txn(T, sub, inputs, False)
        self._finish(T, then)

    # -- rules: whole-topic readers and restarts ----------------------------------------------

    @precondition(lambda self: self.life_steps - self.last_fresh >= FRESH_READER_EVERY)
    @rule(t=st.sampled_from(TOPICS), iso=st.sampled_from(ISOLATIONS + ("out_of_order",)))
    def fresh_reader(self, t, iso):
        """A new subscription from the earliest position reads exactly the
        model's visible messages, in offset order per partition (G2, G3);
        out of order (shared, read_committed, allow_out_of_order_delivery)
        every plain or committed one, past open transactions, once each."""
        self._step()
        self.last_fresh = self.life_steps
        self.fresh_subs += 1
        ooo = iso == "out_of_order"
        c = self.broker.subscribe(t, f"fresh{self.fresh_subs}", "shared" if ooo else "exclusive",
                                  isolation="read_committed" if ooo else iso, initial_position="earliest",
                                  allow_out_of_order_delivery=ooo)
        got = {p: [] for p in range(PARTS)}
        while ms := c.receive_many(1000, timeout=0):
            for m in ms:
                got[m.partition].append((m.offset, m.value, m.txn_id, m.redelivery_count))
        c.unsubscribe()
        for p in range(PARTS):
            want = [(o, e[1], e[2].id if e[2] else None, 0) for o, e in enumerate(self.log[(t, p)])
                    if self.visible(t, p, o, "read_committed" if ooo else iso, ooo)]
            assert (sorted(got[p]) if ooo else got[p]) == want, \
                f"{iso} reader of {t}/{p}: got {got[p]}, expected {want}"

    @precondition(lambda self: self.life_steps >= REOPEN_EVERY)
    @rule()
    def reopen(self):
        """Close and reopen: recovery aborts every open transaction (an ABORT
        marker after its data, its pending acks dropped); what was
        outstanding comes again with redelivery count 0 (counts live in
        memory); acknowledgements stay."""
        self._step()
        was_open = self.open_txns()
        prepared = self.prepared_txns()
        old = self.txns[-1].handle if self.txns else None
        self.broker.close()
        self.broker = txmq.Broker(self.dir, fsync="never")
        recovered = 0
        for T in was_open:
            # Counted once per transaction that a partition (data) or a
            # subscription (pending acks) still held.
            recovered += bool(T.first or any(T.indiv.values()) or T.cum)
            self._end(T, False, "recovery")
        for lane in self.lanes.values():
            lane.outstanding.clear()
            lane.count.clear()
            lane.extra.clear()
            lane.hw = 0
        for d in self.delivered.values():
            d.clear()
        self.txns = prepared                # (a prepared transaction outlives its broker)
        for T in prepared:
            T.stale = True
        self.timed_out_this_life = 0
        self.life_steps = 0
        self.last_fresh = -FRESH_READER_EVERY
        stats = self.broker.stats()["transactions"]
        assert stats["recovered"] == {"committed": 0, "aborted": recovered}, (stats["recovered"], was_open)
        # (in TxnID order: (0,2) before (0,1026))
        assert [d["id"] for d in self.broker.transactions()] == [str(T.id) for T in sorted(prepared, key=lambda T: T.id)]
        if old is not None:
            with pytest.raises(BrokerClosedError):
                old.commit()
        self._connect()

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def transactions_match(self):
        want = {str(T.id): T for T in self.live_txns()}
        listed = self.broker.transactions()
        assert {d["id"] for d in listed} == set(want), (listed, want)
        for d in listed:
            T = want[d["id"]]
            assert d["state"] == T.state.upper(), d
            assert d["partitions"] == sorted(f"{t}/{p}" for t, p in T.parts), (d, T.parts)
            assert d["subscriptions"] == sorted(f"{t}/{s}" for t, s in T.subs), (d, T.subs)
        for T in self.txns:
            if not T.stale:
                assert T.handle.state is HANDLE_STATE[T.state], (T, T.handle.state)
        assert sorted(d["id"] for d in self.broker.prepared_transactions()) == \
            sorted(str(T.id) for T in self.prepared_txns())

    @invariant()
    def partitions_match(self):
        stats = self.broker.stats()
        assert stats["transactions"]["open"] == len(self.live_txns())
        assert stats["transactions"]["timed_out"] == self.timed_out_this_life
        for t, p in PARTITION_KEYS:
            ps = stats["topics"][t]["partitions"][p]
            assert ps["end_offset"] == len(self.log[(t, p)]), (t, p, ps)
            assert ps["max_read_position"] == self.mrp((t, p)), (t, p, ps, self.live_txns())
            assert ps["open_transactions"] == sum(1 for T in self.live_txns() if (t, p) in T.first), (t, p, ps)
            for s, _, iso in SUBS:
                key = (t, s, p)
                lane_stats = stats["topics"][t]["subscriptions"][s]["partitions"][p]
                assert lane_stats["unacked"] == len(self.lanes[key].outstanding), (key, lane_stats)
                # mark-delete never passes a message the model has not seen
                # acknowledged (markers and, under READ_COMMITTED, aborted data
                # may be passed over).
                for o, e in enumerate(self.log[(t, p)]):
                    if e[0] == "d" and o not in self.lanes[key].acked and not (
                            iso == "read_committed" and e[2] is not None and e[2].state == "aborted"):
                        assert lane_stats["mark_delete"] <= o, (key, lane_stats, o)
                        break
                if s in OUT_OF_ORDER:
                    # Exact: plain and committed messages not acknowledged,
                    # none of an open transaction.
                    want = sum(1 for o in range(len(self.log[(t, p)]))
                               if self.visible_to(s, t, p, o) and o not in self.lanes[key].acked)
                    assert lane_stats["backlog"] == want, (key, lane_stats, want)


PHASES = [Phase.explicit, Phase.reuse, Phase.generate]
if os.environ.get("TXMQ_MODEL_SHRINK") == "1":
    PHASES.append(Phase.shrink)
SETTINGS = settings(max_examples=EXAMPLES, stateful_step_count=STEPS_PER_EXAMPLE, deadline=None, phases=PHASES,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("lane_checks", [True, False], ids=["lane-checks", "compiled-paths"])
def test_transaction_state_model(lane_checks, monkeypatch):
    """The broker against the model; with the lane checks off too, as
    users run it: the compiled ack(m, txn=) and send paths then record
    what the checked path leaves to the general one."""
    monkeypatch.setattr(lane_invariant, "DEBUG", lane_checks and lane_invariant.DEBUG)
    TxnModel.steps = 0
    TxnModel.rule_counts = {}
    run_state_machine_as_test(TxnModel, settings=SETTINGS)
    assert TxnModel.steps >= MIN_STEPS, f"only {TxnModel.steps} steps ran: {TxnModel.rule_counts}"
