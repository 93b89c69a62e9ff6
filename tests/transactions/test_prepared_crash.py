"""Crash tests of prepared transactions (docs/GUARANTEES.md: G1, G4, G6 and
"Prepared transactions"): a real broker process runs prepared
consume-process-produce transactions (tests/workers/prepared_crash_worker.py)
and is SIGKILLed — by itself at a crash point of prepare or of the commit
and abort of a prepared transaction, or by this process at a random moment.
After every kill this process opens the directory, as the later owner the
worker's prepared transactions outlive, and checks from the data alone:

- a transaction whose prepare() returned is PREPARED still, unless its end
  was decided, and then it has the outcome the worker chose; one whose end
  returned has that outcome; one killed in prepare is PREPARED or never
  was (aborted by recovery): recovery never decides a prepared one;
- while PREPARED its outputs are invisible to read_committed and its inputs
  are held: not delivered again;
- this process then ends every PREPARED one as the worker would have;
  after that the committed outputs are exactly those of the transactions
  that committed, each once, and the inputs still to deliver are exactly
  the others (G6): each input is covered once or comes again.

The worker then runs again, until every input is covered exactly once.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

import txmq
from txmq import TxnState

import prepared_crash_worker as W
from killer import drain, read_lines, start_and_kill, worker, worker_env

WORKER = worker("prepared_crash_worker.py")
# (txn.prepare_recorded: the PREPARED frame is in the page cache, which SIGKILL keeps)
POINTS = ("txn.prepared", "txn.prepare_recorded", "txn.prepare_synced", "txn.decided", "txn.markers_half",
          "txn.applied")
INPUTS = {b"in-%04d" % i for i in range(W.INPUTS)}



def run(path, seed: int, out, crash_at: str | None = None) -> int:
    """Run the worker until it exits or a crash point kills it; its exit
    code (-9: killed)."""
    with open(out, "wb") as f:
        proc = subprocess.run([sys.executable, WORKER, str(path), str(seed)], stdout=f, stderr=subprocess.PIPE,
                              env=worker_env(crash_at), timeout=300)
    assert proc.returncode in (0, -9), proc.stderr.decode()[-3000:]
    return proc.returncode


class Seen:
    """What the worker's lines say of every transaction of every run."""

    def __init__(self):
        self.values = {}          # txn id -> its input values
        self.prepared = set()     # prepare() returned
        self.ended = set()        # its commit or abort returned
        self.resolved = set()     # ended by this process (after a kill left it prepared)

    def read(self, path) -> bool:
        done = False
        for ln in read_lines(path):
            kind, _, rest = ln.partition(" ")
            if kind == "B":
                txn, *vals = rest.split()
                self.values[txn] = {v.encode() for v in vals}
            elif kind == "P":
                self.prepared.add(rest)
            elif kind == "E":
                self.ended.add(rest)
            elif kind == "DONE":
                done = True
        return done


def check_and_resolve(path, seen: Seen, audit: int) -> set:
    """The checks of the module docstring after one run; returns the
    outputs committed so far."""
    with txmq.Broker(path, **W.OPTIONS) as b:
        prepared = {t["id"]: t for t in b.prepared_transactions()}
        assert set(prepared) <= set(seen.values), f"prepared transactions the worker never began: {prepared}"
        held = set()
        for txn, vals in seen.values.items():
            want = TxnState.COMMITTED if W.intended(txn) else TxnState.ABORTED
            outcome = b.prepared_outcome(txn)
            if txn in seen.ended or txn in seen.resolved:
                assert outcome is want, f"{txn}: ended as {want}, now {outcome}"
            elif txn in seen.prepared:
                assert outcome in (TxnState.PREPARED, want), f"{txn}: prepared, now {outcome}"
            else:
                assert outcome in (None, TxnState.PREPARED), f"{txn}: killed in prepare, now {outcome}"
            assert (outcome is TxnState.PREPARED) == (txn in prepared)
            if outcome is TxnState.PREPARED:
                assert prepared[txn]["xid"] == f"w{txn}"
                held |= vals
        # While prepared: outputs invisible, inputs held.
        c = b.subscribe("in", "s", type="shared")
        again = {m.value for m in drain(c)}
        c.close()
        assert not again & held, f"inputs of prepared transactions delivered again: {sorted(again & held)[:5]}"
        rc = b.subscribe("out", f"audit{audit}a", initial_position="earliest")
        before = [m.value for m in drain(rc)]
        assert not {v[4:] for v in before} & held, "outputs of a prepared transaction visible"
        # The later owner ends them as the worker would have.
        for txn in prepared:
            (b.commit_prepared if W.intended(txn) else b.abort_prepared)(txn)
            seen.resolved.add(txn)
        assert b.prepared_transactions() == []
        rc = b.subscribe("out", f"audit{audit}b", initial_position="earliest")
        outputs = [m.value for m in drain(rc)]
        assert len(outputs) == len(set(outputs)), "an output committed twice"
        committed = set()
        for txn, vals in seen.values.items():
            if b.prepared_outcome(txn) is TxnState.COMMITTED:
                committed |= vals
        produced = {v[4:] for v in outputs}
        assert produced == committed, (sorted(produced ^ committed)[:5])
        c = b.subscribe("in", "s", type="shared")
        left = {m.value for m in drain(c)}
        c.close()
        assert produced | left == INPUTS and not produced & left, "an input neither covered nor deliverable"
        assert b.stats()["transactions"]["open"] == 0
    return produced


def run_to_the_end(tmp_path, path, seen, rounds: int, audit: int) -> None:
    for i in range(rounds):
        out = tmp_path / f"final{audit}-{i}.out"
        assert run(path, 1000 + i, out) == 0
        done = seen.read(out)
        produced = check_and_resolve(path, seen, audit * 100 + i)
        if done and produced == INPUTS:
            return
    raise AssertionError(f"inputs left after {rounds} runs")


@pytest.mark.parametrize("point", POINTS)
def test_kill_at_each_step_of_prepare_and_commit_prepared(tmp_path, point):
    path = tmp_path / "d"
    W.setup(str(path))
    seen = Seen()
    for nth, visit in enumerate((2, 5, 9)):
        out = tmp_path / f"run{visit}.out"
        assert run(path, visit, out, f"{point}@{visit}") == -9, f"{point}@{visit} was never reached"
        seen.read(out)
        check_and_resolve(path, seen, nth)
    run_to_the_end(tmp_path, path, seen, 4, 9)


def test_kill_at_random_moments(tmp_path):
    seed = int(os.environ.get("TXMQ_CRASH_SEED", "0")) or random.randrange(1 << 30)
    rng = random.Random(seed)
    path = tmp_path / "d"
    W.setup(str(path))
    seen = Seen()
    for run in range(8):
        out = tmp_path / f"run{run}.out"
        code, err, exited = start_and_kill([sys.executable, WORKER, str(path), str(rng.randrange(1 << 30))],
                                           worker_env(), out, rng, p_after_ready=0.8, after_ready=(0.0, 0.4))
        assert code in (0, -9), f"seed {seed}: worker failed: {err[-3000:]}"
        seen.read(out)
        check_and_resolve(path, seen, run)
    run_to_the_end(tmp_path, path, seen, 4, 99)
