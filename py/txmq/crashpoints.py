"""Named crash points for the crash tests.

``TXMQ_CRASH_AT=name[,name...]`` in the environment makes the process kill
itself with SIGKILL when it reaches one of those points (``name@n``: at the
n-th time it gets there). Unset, :func:`reached` is one set lookup.

Points: ``txn.prepared`` (what the commit or the prepare covers is read,
outputs too large for a copy synced, no decision yet), ``txn.recorded``
(the decision record written, not synced), ``txn.prepare_recorded`` (a
prepare's PREPARED frame written, not synced), ``txn.prepare_synced`` (it
is durable, ``prepare()`` has not returned), ``txn.decided`` (decision
durable, no marker written; for ``commit_async``, in the coordinator's
flusher thread; also the commit or abort of a prepared transaction), ``txn.markers_half``
(after the first participant applied the outcome), ``txn.applied`` (every
participant applied, final record not written); half messages:
``half.stored`` (half message stored, local transaction not run),
``half.local_done`` (local transaction ran, outcome not recorded),
``half.committing`` (COMMITTING framed and in the table, message not
appended), ``half.appended`` (appended, record not settled),
``half.check_counted`` (check counts framed, checker not asked),
``half.discarding`` (DISCARDING framed, not in the check-max topic);
staged ingest: ``ingest.appended`` (staged messages appended in their
transaction, not committed), ``ingest.committed`` (committed, staging not
removed); topics: ``topic.created_partitions`` (the topic's folder made,
``topic.json`` not written; partition folders come with their first use), ``topic.delete_renamed`` (the topic's folder
renamed as deleted, its subscriptions not yet); ``txmq.twophase``:
``twophase.before_prepare``, ``twophase.between_prepares`` (txmq's side
prepared, PostgreSQL's not), ``twophase.prepared`` (both prepared, no
decision), ``twophase.decided`` (txmq's side committed, PostgreSQL's
not), ``twophase.between_commits`` (both committed, the outcome not yet
forgotten).
"""

from __future__ import annotations

import os
import signal

_POINTS: dict[str, int] = {}
for item in filter(None, os.environ.get("TXMQ_CRASH_AT", "").split(",")):
    name, _, nth = item.partition("@")
    _POINTS[name.strip()] = int(nth) if nth else 1


ARMED = bool(_POINTS)     # hot paths test this before calling reached()


def reached(name: str) -> None:
    """SIGKILL this process if ``name`` is armed and this is its n-th visit."""
    if _POINTS and name in _POINTS:
        _POINTS[name] -= 1
        if _POINTS[name] <= 0:
            os.kill(os.getpid(), signal.SIGKILL)
