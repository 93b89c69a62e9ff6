"""The processes ``txmq demo`` kills: how the demo starts, watches and
SIGKILLs them, and their entry point.

    python -m txmq.demo.worker bank DIR SEED REQUESTS RUN
    python -m txmq.demo.worker windows DIR RUN

A worker opens the data directory (it is the broker's one writer while it
runs), does its scenario's work (:mod:`txmq.demo.bank`,
:mod:`txmq.demo.windows`) and reports on stdout, one whole line per
``os.write`` so that a kill cuts at most the last line:

- ``READY <json>``: the broker is open; what opening it recovered;
- ``S <json>``: a status, every ``STATUS_S`` seconds;
- ``DONE <json>``: the work is finished and the broker closed.

Any error ends it with exit status 3 and the traceback on stderr.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback

import txmq
from txmq.demo import bank, windows

STATUS_S = 0.05
ERROR_EXIT = 3
WAIT_S = 120.0          # longest a worker may take to finish once it is no longer killed


class Reporter:
    """The worker's side of the protocol: whole lines on stdout, under a
    lock (threads share it)."""

    def __init__(self):
        self._fd = sys.stdout.fileno()
        self._lock = threading.Lock()

    def line(self, kind: str, obj) -> None:
        data = f"{kind} {json.dumps(obj, separators=(',', ':'))}\n".encode()
        with self._lock:
            while data:
                data = data[os.write(self._fd, data):]

    def every(self, status_cb, stop: threading.Event) -> threading.Thread:
        """Report ``status_cb()`` every STATUS_S seconds until ``stop``."""
        def run():
            while not stop.wait(STATUS_S):
                self.line("S", status_cb())
        t = threading.Thread(target=run, name="txmq-demo-status", daemon=True)
        t.start()
        return t


class Worker:
    """A worker process as the demo sees it: the last status it reported,
    and a SIGKILL."""

    def __init__(self, argv: list):
        env = dict(os.environ)
        here = os.path.dirname(os.path.dirname(os.path.abspath(txmq.__file__)))
        env["PYTHONPATH"] = os.pathsep.join([here] + [p for p in [env.get("PYTHONPATH")] if p])
        self.argv = [sys.executable, "-m", "txmq.demo.worker", *map(str, argv)]
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        self.ready = None
        self.status: dict = {}
        self.done = None
        self.killed = False
        self._err: list = []
        self._reader = threading.Thread(target=self._read, name="txmq-demo-reader", daemon=True)
        self._reader.start()
        self._err_reader = threading.Thread(target=lambda: self._err.append(self.proc.stderr.read()),
                                            name="txmq-demo-stderr", daemon=True)
        self._err_reader.start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            if not raw.endswith(b"\n"):
                break                   # cut by the kill
            kind, _, body = raw.decode().rstrip("\n").partition(" ")
            obj = json.loads(body)
            if kind == "READY":
                self.ready = obj
            elif kind == "S":
                self.status = obj
            elif kind == "DONE":
                self.done = obj
                self.status = obj

    def running(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no handler runs, nothing is flushed or closed."""
        if self.running():
            self.proc.send_signal(signal.SIGKILL)
            self.killed = True
        self.proc.wait()
        self._reader.join()

    def wait(self, timeout: float = WAIT_S) -> int:
        """Wait for the exit; a worker that exits with an error, or takes
        too long, is a demo that cannot go on (RuntimeError)."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"{' '.join(self.argv[2:])} did not finish in {timeout:.0f} s") from None
        self._reader.join()
        self._err_reader.join()
        if code != 0 or self.done is None:
            err = b"".join(self._err).decode(errors="replace").strip()
            raise RuntimeError(f"{' '.join(self.argv[2:])} exited with status {code}:\n{err}")
        return code


def run_and_kill(argv: list, when_cb, progress_cb=None) -> dict:
    """Start a worker, SIGKILL it as soon as ``when_cb(status)`` is true,
    start it again and let it finish. Returns what both runs reported:
    ``{"killed_status", "killed", "restart_ready", "done"}``. When the first
    run finishes before the condition came true, it was not killed
    (``killed`` False) and is not started again."""
    first = Worker(argv + [1])
    deadline = time.monotonic() + WAIT_S
    try:
        while first.running() and time.monotonic() < deadline:
            if first.status and when_cb(first.status):
                break
            if progress_cb:
                progress_cb(first.status)
            time.sleep(STATUS_S / 10)
        if time.monotonic() >= deadline:
            raise RuntimeError(f"{' '.join(first.argv[2:])} did not reach its kill point in {WAIT_S:.0f} s")
        first.kill()
    finally:
        if first.running():
            first.kill()
    killed_status = dict(first.status)
    if not first.killed:
        first.wait()
        return {"killed": False, "killed_status": killed_status, "restart_ready": None, "done": first.done}
    second = Worker(argv + [2])
    deadline = time.monotonic() + WAIT_S
    try:
        while second.running() and time.monotonic() < deadline:
            if progress_cb:
                progress_cb(second.status)
            time.sleep(STATUS_S / 2)
        second.wait(max(deadline - time.monotonic(), 0.1))
    finally:
        if second.running():
            second.kill()
    return {"killed": True, "killed_status": killed_status, "restart_ready": second.ready, "done": second.done}


def main(argv: list) -> int:
    try:
        scenario, args = argv[0], argv[1:]
        if scenario == "bank":
            data, seed, requests, run = args[0], int(args[1]), int(args[2]), int(args[3])
            bank.worker(data, seed, requests, run, Reporter())
        elif scenario == "windows":
            windows.worker(args[0], int(args[1]), Reporter())
        else:
            raise ValueError(f"unknown scenario {scenario!r}")
    except BaseException:
        sys.stderr.write(traceback.format_exc())
        sys.stderr.flush()
        os._exit(ERROR_EXIT)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
