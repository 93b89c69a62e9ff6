"""Half messages (docs/FORMAT.md, "Half messages"; docs/GUARANTEES.md G10) against a small reference model.

A Hypothesis rule-based state machine drives one broker's half messages
and a pure-Python model side by side:

- ``send_in_transaction`` to two topics from three producer groups, the
  local transaction answering COMMIT, ROLLBACK, UNKNOWN, something that is
  not a LocalTransactionState (taken as UNKNOWN) or raising (UNKNOWN);
- ``end_transaction`` on known ids (every state) and unknown ones (never
  stored, or compacted away): InvalidHalfStateError exactly when the model
  says the message is unknown or already ended the other way, None when it
  ended the same way, a MessageId when it commits now;
- the answer a message's checker gives (COMMIT / ROLLBACK / UNKNOWN / raise),
  checkers coming and going per group (a group without a live checker is
  never checked and nothing is counted for it);
- the clock: the half log and the half store get a fake clock, so store
  times and check rounds (``broker.check_half_messages()``, which uses the
  store's clock) are exact, and no test sleeps;
- check rounds: each due PREPARED message of a group with a checker is
  counted and asked once, or discarded to ``txmq.half-check-max`` once it
  has had ``half_max_checks``; ``resume_half_checks`` (all or some ids,
  some of them invalid: then nothing changes);
- compaction (``maybe_compact`` with ``half_retention=0`` and the frame
  threshold lowered), which forgets resolved records below the first live
  one and deletes whole half-log segments (4 KiB here);
- close and reopen, optionally after scribbling over random bytes of
  ``<data>/half/statetable``: the table must be rebuilt exactly.

After every step: each real topic holds exactly the model's committed
messages, each once; the check-max topic exactly the discard events;
``stats()["half"]`` has the model's counts by state (COMMITTING settles
lazily, so committing + committed), first half id, record count, and this
broker life's checks and discards.

Default run: 60 examples of up to 80 steps (~4,000 steps, under 10 s); the slow
variant: 400 examples of up to 120 steps.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

import txmq
import txmq.storage.half_messages
from txmq import LocalTransactionState as S
from txmq import _half
from txmq.errors import InvalidHalfStateError
from txmq.message import MessageId

TOPICS = {"orders": 2, "audit": 1}
GROUPS = ("g0", "g1", "g2")
MAX_CHECKS = 2
CHECK_MAX = txmq.storage.half_messages.CHECK_MAX_TOPIC
ANSWERS = ("commit", "rollback", "unknown", "raise")
LOCAL_ANSWERS = ANSWERS + ("garbage",)
STATE = {"commit": S.COMMIT, "rollback": S.ROLLBACK, "unknown": S.UNKNOWN}
RESOLVED = ("committed", "rolled_back", "discarded")

EXAMPLES, STEPS = 60, 80
MIN_STEPS = 2500                     # Hypothesis ends some examples early
SLOW_EXAMPLES, SLOW_STEPS = 400, 120


class MHalf:
    """The model of one half message."""

    def __init__(self, half_id, value, topic, group, store_s):
        self.half_id = half_id
        self.value = value
        self.topic = topic
        self.group = group
        self.store_s = store_s
        self.state = "prepared"
        self.checks = 0
        self.answer = "unknown"      # what its group's checkers answer

    def __repr__(self):
        return f"MHalf({self.half_id}, {self.value!r}, {self.state}, checks={self.checks}, {self.answer})"


class HalfModel(RuleBasedStateMachine):
    steps = 0
    rule_counts: dict = {}

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="txmq-halfmodel-")
        self.now_ms = 1_700_000_000_000     # fixed: store times (whole seconds) must not depend on when it runs
        self.msgs: dict[int, MHalf] = {}
        self.base = 0                 # first half id the broker still knows
        self.next_id = 0              # the next half id (= the half log's end)
        self.committed = {t: Counter() for t in TOPICS}
        self.dead = Counter()         # values in the check-max topic (one per discard)
        self.serial = 0
        self.broker = None
        self._open()
        for t, n in TOPICS.items():
            self.broker.create_topic(t, n)

    # -- the broker ----------------------------------------------------------------

    def _open(self):
        self.broker = txmq.Broker(self.dir, fsync="never", segment_bytes_max=4096, half_check_interval=3600.0,
                                  half_check_immunity=0.0, half_max_checks=MAX_CHECKS, half_retention=0.0)
        half = self.broker._half
        half.log.clock = lambda: self.now_ms
        half.clock = lambda: self.now_ms / 1000
        self.senders = {}             # (topic, group) -> HalfProducer without a checker
        self.checkers = {g: [] for g in GROUPS}    # live HalfProducers with a checker
        self.asked = []               # half ids the checkers were asked, this round
        self.life_checks = 0
        self.life_discards = 0

    def teardown(self):
        if self.broker is not None:
            self.broker.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _step(self, name):
        cls = type(self)
        cls.steps += 1
        cls.rule_counts[name] = cls.rule_counts.get(name, 0) + 1

    def _sender(self, topic, group):
        hp = self.senders.get((topic, group))
        if hp is None:
            hp = self.senders[(topic, group)] = self.broker.half_producer(topic, group)
        return hp

    def _check_cb(self, m):
        self.asked.append(m.txn_id)
        answer = self.msgs[m.txn_id].answer
        if answer == "raise":
            raise RuntimeError("checker failed")
        return STATE[answer]

    # -- model helpers ----------------------------------------------------------------

    def _commit(self, mh):
        mh.state = "committed"
        self.committed[mh.topic][mh.value] += 1

    def _discard(self, mh):
        mh.state = "discarded"
        self.dead[mh.value] += 1
        self.life_discards += 1

    def _live(self):
        return [i for i in range(self.base, self.next_id)]

    # -- rules -------------------------------------------------------------------------

    @rule(topic=st.sampled_from(sorted(TOPICS)), group=st.sampled_from(GROUPS),
          answer=st.sampled_from(LOCAL_ANSWERS), keyed=st.booleans())
    def send(self, topic, group, answer, keyed):
        self._step("send")
        self.serial += 1
        value = b"v%06d" % self.serial
        key = b"k%d" % (self.serial % 5) if keyed else None
        seen = []

        def local(m, arg):
            seen.append((m.value, m.txn_id, arg))
            if answer == "raise":
                raise RuntimeError("local transaction failed")
            return "yes" if answer == "garbage" else STATE[answer]

        r = self._sender(topic, group).send_in_transaction(value, local, arg=self.serial, key=key)
        assert seen == [(value, self.next_id, self.serial)], seen
        assert r.half_id == self.next_id, (r, self.next_id)
        mh = self.msgs[r.half_id] = MHalf(r.half_id, value, topic, group, self.now_ms // 1000)
        self.next_id += 1
        if answer == "commit":
            assert r.state is S.COMMIT and isinstance(r.message_id, MessageId) and r.message_id.topic == topic, r
            self._commit(mh)
        elif answer == "rollback":
            assert r.state is S.ROLLBACK and r.message_id is None, r
            mh.state = "rolled_back"
        else:
            assert r.state is S.UNKNOWN and r.message_id is None, r

    @rule(data=st.data(), state=st.sampled_from(sorted(STATE)))
    def end_transaction(self, data, state):
        self._step("end_transaction")
        pool = self._live() or [0]
        unknown = [self.next_id, self.next_id + 7] + ([self.base - 1] if self.base > 0 else [])
        half_id = data.draw(st.sampled_from(pool) | st.sampled_from(unknown), label="half_id")
        hp = self._sender(data.draw(st.sampled_from(sorted(TOPICS)), label="via"), "g0")
        mh = self.msgs.get(half_id) if self.base <= half_id < self.next_id else None
        if mh is None:
            expect = "error"
        elif state == "unknown" or mh.state == {"commit": "committed", "rollback": "rolled_back"}[state]:
            expect = None
        elif mh.state == "prepared":
            expect = state
        else:
            expect = "error"
        if expect == "error":
            with pytest.raises(InvalidHalfStateError):
                hp.end_transaction(half_id, STATE[state])
            return
        got = hp.end_transaction(half_id, STATE[state])
        if expect == "commit":
            assert isinstance(got, MessageId) and got.topic == mh.topic, got
            self._commit(mh)
        else:
            assert got is None, (half_id, state, got, mh)
            if expect == "rollback":
                mh.state = "rolled_back"

    @precondition(lambda self: self.next_id > self.base)
    @rule(data=st.data(), answer=st.sampled_from(ANSWERS))
    def set_checker_answer(self, data, answer):
        self._step("set_checker_answer")
        self.msgs[data.draw(st.sampled_from(self._live()), label="half_id")].answer = answer

    @rule(group=st.sampled_from(GROUPS), topic=st.sampled_from(sorted(TOPICS)))
    def add_checker(self, group, topic):
        self._step("add_checker")
        if len(self.checkers[group]) < 2:
            self.checkers[group].append(self.broker.half_producer(topic, group, checker=self._check_cb))

    @rule(group=st.sampled_from(GROUPS))
    def remove_checker(self, group):
        self._step("remove_checker")
        if self.checkers[group]:
            self.checkers[group].pop(0).close()

    @rule(ms=st.sampled_from([0, 300, 1000, 1700, 2500]))
    def advance_clock(self, ms):
        self._step("advance_clock")
        self.now_ms += ms

    @rule()
    def check_round(self):
        self._step("check_round")
        cutoff = math.floor(self.now_ms / 1000 - 1 - 0.0)
        asks = []
        for i in self._live():
            mh = self.msgs[i]
            if mh.state != "prepared" or mh.store_s > cutoff or not self.checkers[mh.group]:
                continue
            if mh.checks >= MAX_CHECKS:
                self._discard(mh)
                continue
            mh.checks += 1
            asks.append(mh)
        self.asked = []
        sent = self.broker.check_half_messages()
        assert sent == len(asks), (sent, asks)
        assert self.asked == [mh.half_id for mh in asks], (self.asked, asks)
        self.life_checks += len(asks)
        for mh in asks:
            if mh.answer == "commit":
                self._commit(mh)
            elif mh.answer == "rollback":
                mh.state = "rolled_back"

    @rule(data=st.data(), every=st.booleans())
    def resume(self, data, every):
        self._step("resume")
        discarded = [i for i in self._live() if self.msgs[i].state == "discarded"]
        if every:
            got = self.broker.resume_half_checks()
            wanted = discarded
        else:
            pool = self._live() + [self.next_id]
            wanted = data.draw(st.lists(st.sampled_from(pool), max_size=3) if pool else st.just([]), label="ids")
            if any(i not in discarded for i in wanted):
                before = self.broker.stats()["half"]["by_state"]
                with pytest.raises(InvalidHalfStateError):
                    self.broker.resume_half_checks(wanted)
                assert self.broker.stats()["half"]["by_state"] == before
                return
            got = self.broker.resume_half_checks(wanted)
            wanted = sorted(set(wanted))
        assert got == wanted, (got, wanted)
        for i in wanted:
            self.msgs[i].state = "prepared"
            self.msgs[i].checks = 0

    @rule()
    def compact(self):
        self._step("compact")
        now = self.now_ms / 1000
        base = self.base
        while base < self.next_id and self.msgs[base].state in RESOLVED and self.msgs[base].store_s <= now:
            base += 1
        saved = txmq.storage.half_messages.COMPACT_MIN_FRAMES
        txmq.storage.half_messages.COMPACT_MIN_FRAMES = 0          # compact now, however few frames
        try:
            assert self.broker._half.maybe_compact(now)
        finally:
            txmq.storage.half_messages.COMPACT_MIN_FRAMES = saved
        for i in range(self.base, base):
            del self.msgs[i]
        self.base = base
        half = self.broker._half
        assert half.redo.frames_since_snapshot == 1
        assert half.log.start_offset <= base, (half.log.start_offset, base)

    @rule(data=st.data(), damage=st.sampled_from(["none", "none", "records", "header"]))
    def reopen(self, data, damage):
        self._step("reopen")
        self.broker.close()
        table = os.path.join(self.dir, "half", "statetable")
        n = self.next_id - self.base
        size = _half.HEADER_SIZE + n * _half.RECORD_SIZE
        with open(table, "rb") as f:
            good = f.read(size)
        assert len(good) == size
        changed = set()
        if damage != "none":
            # checked header bytes: magic + version, record size, base
            header = [*range(0, 5), *range(8, 12), *range(16, 24)]
            spots = header if damage == "header" else list(range(_half.HEADER_SIZE, size))
            if spots:
                raw = bytearray(good)
                for _ in range(data.draw(st.integers(1, 12), label="bytes")):
                    pos = data.draw(st.sampled_from(spots), label="pos")
                    raw[pos] = data.draw(st.integers(0, 255), label="byte")
                changed = {i for i in range(size) if raw[i] != good[i]}
                with open(table, "r+b") as f:
                    f.write(raw)
        self._open()
        s = self.broker.stats()["half"]
        with open(table, "rb") as f:
            assert f.read(size) == good, "state table not rebuilt exactly"
        if any(i < _half.HEADER_SIZE for i in changed):
            assert s["table_records_rebuilt_on_open"] == n
            assert any("header" in p for p in s["problems_on_open"]), s["problems_on_open"]
        else:
            records = {(i - _half.HEADER_SIZE) // _half.RECORD_SIZE for i in changed}
            assert s["table_records_rebuilt_on_open"] == len(records), (s, records)
            if records:
                assert any("differed" in p for p in s["problems_on_open"]), s["problems_on_open"]
            else:
                assert s["problems_on_open"] == [], s["problems_on_open"]
        assert s["found_on_open"] == 0 and s["recommitted_on_open"] == 0, s

    # -- invariants --------------------------------------------------------------------

    def _values(self, topic):
        t = self.broker._topics.get(topic)
        if t is None:
            return Counter()
        return Counter(m[2] for p in t.partitions for m in p.read(p.start_offset, 1 << 20))

    @invariant()
    def matches_the_model(self):
        for topic in TOPICS:
            got = self._values(topic)
            assert got == self.committed[topic], (topic, got, self.committed[topic])
        assert self._values(CHECK_MAX) == self.dead
        if not self.dead:
            assert CHECK_MAX not in self.broker.topics()
        s = self.broker.stats()["half"]
        by = s["by_state"]
        want = Counter(self.msgs[i].state for i in self._live())
        got = {"prepared": by["prepared"], "committed": by["committing"] + by["committed"],
               "rolled_back": by["rolled_back"], "discarded": by["discarding"] + by["discarded"]}
        assert got == {k: want.get(k, 0) for k in got}, (got, want)
        assert (s["first_half_id"], s["records"]) == (self.base, self.next_id - self.base), s
        assert s["checks_sent"] == self.life_checks, (s["checks_sent"], self.life_checks)
        assert s["discarded"] == self.life_discards, (s["discarded"], self.life_discards)
        assert s["live_checker_groups"] == sum(1 for g in GROUPS if self.checkers[g]), s
        table = self.broker._half.table
        for i in self._live():
            _, _, store_s, ghash, state, checks = table.get(i)
            mh = self.msgs[i]
            assert (store_s, ghash, checks) == (mh.store_s, txmq.storage.half_messages.group_hash(mh.group), mh.checks), (mh, checks)


PHASES = [Phase.explicit, Phase.reuse, Phase.generate]
if os.environ.get("TXMQ_MODEL_SHRINK") == "1":
    PHASES.append(Phase.shrink)


def _run(examples, steps, min_steps):
    HalfModel.steps = 0
    HalfModel.rule_counts = {}
    run_state_machine_as_test(HalfModel, settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, phases=PHASES,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]))
    assert HalfModel.steps >= min_steps, f"only {HalfModel.steps} steps ran: {HalfModel.rule_counts}"
    for name in ("send", "end_transaction", "check_round", "resume", "compact", "reopen"):
        assert HalfModel.rule_counts.get(name, 0) > 0, HalfModel.rule_counts


def test_half_messages_match_the_model():
    _run(EXAMPLES, STEPS, MIN_STEPS)


@pytest.mark.slow
def test_half_messages_match_the_model_long():
    _run(SLOW_EXAMPLES, SLOW_STEPS, SLOW_EXAMPLES * SLOW_STEPS // 2)
