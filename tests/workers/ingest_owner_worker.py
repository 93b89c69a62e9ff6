"""The owner of a data directory for the staged-ingest crash test: opens
the broker (so requests come through its control socket; while a
requester holds the directory to finish a commit itself, it waits),
prints READY and serves until it is killed (by the test, or by
TXMQ_CRASH_AT)."""

import sys
import time

import txmq
from txmq.errors import DataDirLockedError

while True:
    try:
        broker = txmq.Broker(sys.argv[1], fsync=sys.argv[2])
        break
    except DataDirLockedError:
        time.sleep(0.01)
print("READY", flush=True)
while True:
    time.sleep(1)
