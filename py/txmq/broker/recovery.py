"""Opening a data directory: the broker's recovery of its topics,
subscriptions and transactions (docs/FORMAT.md, "Recovery";
docs/GUARANTEES.md)."""

from __future__ import annotations

import logging
import os

from txmq._txnlog import COMMITTED, COMMITTING, OPEN, PREPARED
from txmq.dispatch.subscription import Subscription, config_problem
from txmq.errors import CorruptLogError
from txmq.files import read_json, sync_dir
from txmq.storage import datadir
from txmq.storage.topic import Topic
from txmq.transactions import decision
from txmq.transactions.coordinator import TransactionCoordinator
from txmq.transactions.records import TxnID, TxnState

log = logging.getLogger("txmq.broker")



class Recovery:
    """The Broker's recovery on open (a mixin: the state is the Broker's)."""

    def _recover(self) -> None:
        names, problems = datadir.clean_topics(self.path, self.fsync != "never")
        for name in names:
            tdir = os.path.join(self.path, "topics", name)
            topic = Topic(tdir, name, Topic.load_config(tdir), self._partition_options, self._partition_opened)
            self._topics[name] = topic
            sdir = os.path.join(self.path, "subscriptions", name)
            subs, sub_problems = datadir.clean_subscriptions(sdir)
            problems += sub_problems
            for sub in subs:
                meta = _subscription_config(os.path.join(sdir, sub, datadir.SUBSCRIPTION_CONFIG))
                topic.subscriptions[sub] = Subscription(
                    self, topic, sub, os.path.join(sdir, sub), type=meta["type"],
                    isolation=meta["isolation"], initial_position=meta["initial_position"],
                    ack_timeout=None, nack_delay=1.0,
                    allow_out_of_order_delivery=meta.get("allow_out_of_order_delivery", False),
                    created_ms=meta.get("created_ms"))
        for problem in problems:
            log.warning("txmq: %s", problem)
        self.problems_on_open += problems

    def _recover_transactions(self) -> None:
        """Open the coordinators and end every unfinished transaction."""
        cdir = os.path.join(self.path, "coordinator")
        os.makedirs(cdir, exist_ok=True)
        existing = [int(n[3:-4]) for n in os.listdir(cdir)
                    if n.startswith("tc-") and n.endswith(".log") and n[3:-4].isdigit()]
        count = max([self.num_coordinators] + [i + 1 for i in existing])
        self._coordinators = [TransactionCoordinator(self, i, os.path.join(cdir, f"tc-{i}.log"), self.fsync,
                                                     self.prepared_timeout)
                              for i in range(count)]
        logged = {}                                # (hi, lo) -> entry, every coordinator
        records = {}                               # (hi, lo) -> decision record
        for tc in self._coordinators:
            own = {}                               # (a snapshot frame clears what it is given)
            txns = tc.replay(own)
            records.update(own)
            for words, entry in txns.items():
                if entry[0] == OPEN:               # undecided: abort it
                    tc.record_decision(words, False)
            logged.update(txns)

        def commits(words) -> bool:
            entry = logged.get(words)              # unknown to its coordinator: abort
            return entry is not None and entry[0] in (COMMITTING, COMMITTED)

        # Partitions open lazily: those that may hold a logged transaction's
        # data or marker (its participants, as its ADD_PARTITION frames
        # name them) are opened now, with those the subscriptions opened;
        # any other partition a crash left a transaction in (one whose
        # deferred ADD_PARTITION never went out, or was lost) learns its
        # fate when it opens (_partition_opened).
        for entry in logged.values():
            for topic, index in entry[3] or ():
                t = self._topics.get(topic)
                if t is not None and index < len(t.partitions):
                    t.open_partition(index)
        # A prepared transaction stays as it was: its outputs and acks held.
        prepared = {w: e for w, e in logged.items() if e[0] == PREPARED}
        self._repair({w: r for w, r in records.items() if commits(w)},
                     {w: records[w] for w in prepared if w in records})
        partitions = [p for t in self._topics.values() for p in t.opened()]
        subs = [s for t in self._topics.values() for s in t.subscriptions.values()]
        ended = self.recovered_transactions
        outcomes = {}
        for p in partitions:
            for hi, lo, _, _ in p.aborted.entries():
                self._saw(TxnID.from_words(hi, lo))
        held = [(p, TxnID.from_words(hi, lo)) for p in partitions for hi, lo, _, _ in p.ongoing.entries()]
        held += [(s.pending_acks, txn_id) for s in subs for txn_id in s.pending_acks.pending_txns()]
        held = [(x, txn_id) for x, txn_id in held if txn_id.words not in prepared]
        for participant, txn_id in held:
            self._saw(txn_id)
            commit = outcomes[txn_id] = commits(txn_id.words)
            participant.end_txn(txn_id, commit)
        for words, entry in prepared.items():
            self._restore_prepared(words, entry, records.get(words))
        for commit in outcomes.values():
            ended["committed" if commit else "aborted"] += 1
        self._recovered_ids.update(outcomes)
        # Durable outcomes (markers, cursor frames) before the logs forget them.
        for participant in {id(x): x for x, _ in held}.values():
            participant.flush()
        for tc in self._coordinators:
            tc.finish_recovery()
        if self.fsync != "never":
            sync_dir(cdir)

    def _repair(self, records: dict, prepared: dict) -> None:
        """Check the partitions and subscriptions against the decision
        records of committed and of prepared transactions ({words:
        record}) and put back what a power loss took from them: batches
        from their copies, acks from their ranges (txmq.transactions.decision)
        — into the cursors for a commit, held again as pending acks for a
        prepared transaction."""
        batches, acks = {}, []
        for held, found_in in ((False, records), (True, prepared)):
            for words, raw in found_in.items():
                txn_id = TxnID.from_words(*words)
                found = decision.decode(raw, self._coordinators[txn_id.coordinator].log.path)
                for key, refs in found.partitions.items():
                    batches.setdefault(key, []).extend(tuple(b) for b in refs)
                acks += [(txn_id if held else None, a) for a in found.acks]
        problems = []
        for (topic, index), refs in batches.items():
            t = self._topics.get(topic)
            if t is not None and index < len(t.partitions):
                problems += t.open_partition(index).repair(refs)
        for txn_id, a in acks:
            t = self._topics.get(a.topic)
            sub = None if t is None else t.subscriptions.get(a.subscription)
            if sub is None:
                continue
            if txn_id is None:
                sub.pending_acks.redo_commit(a.partition, a.cumulative, a.ranges)
            else:
                sub.pending_acks.redo_prepare(txn_id, a.partition, a.cumulative, a.ranges)
        for problem in problems:
            log.warning("txmq: %s", problem)
        self.problems_on_open += problems

    def _restore_prepared(self, words: tuple, entry: list, record) -> None:
        """Recovery: a transaction its coordinator log holds PREPARED is
        live again, held by its participants that still exist."""
        txn_id = TxnID.from_words(*words)
        self._saw(txn_id)
        participants = []
        for topic, index in entry[3] or ():
            t = self._topics.get(topic)
            if t is not None and index < len(t.partitions):
                participants.append(t.open_partition(index))
        for topic, name in entry[4] or ():
            t = self._topics.get(topic)
            sub = None if t is None else t.subscriptions.get(name)
            if sub is not None:
                participants.append(sub.pending_acks)
        self._coordinators[txn_id.coordinator].restore_prepared(words, entry, record, participants)

    def _partition_opened(self, p) -> None:
        """A partition opened after recovery (on first use): a transaction
        its files hold open is unknown to every coordinator (recovery ended
        those they log, in their participants), so it is aborted, as
        recovery aborts one; its transaction and producer ids are never
        handed out again."""
        if self._recovering:
            return
        for hi, lo, _, _ in p.aborted.entries():
            self._saw(TxnID.from_words(hi, lo))
        held = [TxnID.from_words(hi, lo) for hi, lo, _, _ in p.ongoing.entries()]
        held = [txn_id for txn_id in held if not self._is_prepared(txn_id)]
        for txn_id in held:
            self._saw(txn_id)
            p.end_txn(txn_id, False)
            if txn_id not in self._recovered_ids:       # (once, however many partitions held it)
                self._recovered_ids.add(txn_id)
                self.recovered_transactions["aborted"] += 1
        if held:
            p.flush()
        if self._producer_ids is not None:
            self._producer_ids.reserve_above(p.producers.max_producer_id())

    def _is_prepared(self, txn_id: TxnID) -> bool:
        """Whether ``txn_id`` is a live PREPARED transaction."""
        tc = self._coordinators[txn_id.coordinator] if txn_id.coordinator < len(self._coordinators) else None
        meta = None if tc is None else tc.txns.get(txn_id)
        return meta is not None and meta.state is TxnState.PREPARED

    def _saw(self, txn_id: TxnID) -> None:
        if txn_id.coordinator < len(self._coordinators):
            self._coordinators[txn_id.coordinator].saw(txn_id.sequence)


def _subscription_config(path: str) -> dict:
    """A subscription's ``subscription.json``; CorruptLogError (path,
    byte) when it is not one: its isolation level cannot be guessed."""
    meta = read_json(path)
    problem = config_problem(meta)
    if problem is not None:
        raise CorruptLogError(path, 0, problem)
    return meta
