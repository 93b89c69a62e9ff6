"""Output of the crash-test workers (the subprocesses the crash tests kill),
shared by them: lines written whole, so a SIGKILL cuts at most the tail of
the last one (the drivers drop a line without its newline)."""

from __future__ import annotations

import os
import sys
import threading


class Out:
    """One ``os.write`` per line, under a lock (threads share stdout)."""

    def __init__(self):
        self.fd = sys.stdout.fileno()
        self.lock = threading.Lock()

    def line(self, text: str) -> None:
        data = (text + "\n").encode()
        with self.lock:
            while data:
                n = os.write(self.fd, data)
                data = data[n:]


def fail(msg: str) -> None:
    """Report a broken guarantee and exit with status 3 (no cleanup: the
    data directory stays as it is for the driver to inspect)."""
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()
    os._exit(3)
