"""Start a worker process and SIGKILL it at a random moment, and read what
it wrote (shared by the crash tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import txmq

SETTLE_TIMEOUT = 90.0     # a bound on a worker starting on a loaded 2-core machine, not a speed check

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELPERS = os.path.join(TESTS, "helpers")     # this module's folder, which the workers import from
WORKERS = os.path.join(TESTS, "workers")


def worker(name: str) -> str:
    """The path of the worker script ``name`` (tests/workers/), which a test
    launches with ``sys.executable``."""
    path = os.path.join(WORKERS, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    return path


def worker_env(crash_at: str | None = None) -> dict:
    """The environment of a worker: this one, with the txmq under test
    first on its path, and the crash points ``crash_at`` armed
    (``TXMQ_CRASH_AT``; None: none)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(txmq.__path__[0])] + [x for x in [os.environ.get("PYTHONPATH")] if x]))
    env.pop("TXMQ_CRASH_AT", None)
    if crash_at:
        env["TXMQ_CRASH_AT"] = crash_at
    return env


def start_and_kill(argv, env, out_path, rng, *, p_after_ready: float, after_ready: tuple,
                   anytime: tuple = (0.0, 0.6)):
    """Run ``argv`` with stdout to ``out_path``. With probability
    ``p_after_ready`` wait for its ``READY`` line, then a uniform delay in
    ``after_ready`` seconds; else a delay in ``anytime`` (start-up, recovery
    or work). Then SIGKILL it unless it already exited.

    Returns (return code, stderr text, exited by itself: before the kill,
    or during it with status 0)."""
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.PIPE, env=env)
    try:
        if rng.random() < p_after_ready:
            deadline = time.monotonic() + SETTLE_TIMEOUT
            while b"READY\n" not in out_path.read_bytes()[:64]:
                if proc.poll() is not None:
                    break
                assert time.monotonic() < deadline, "worker never became ready"
                time.sleep(0.005)
            time.sleep(rng.uniform(*after_ready))
        else:
            time.sleep(rng.uniform(*anytime))
        exited = proc.poll() is not None
        if not exited:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=SETTLE_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        err = proc.stderr.read().decode()
        proc.stderr.close()
    # A SIGKILL sent while the worker was already exiting (unmapping its
    # segments, closing its files) leaves its status 0: it ran to its end.
    return proc.returncode, err, exited or proc.returncode == 0


def read_lines(path) -> list:
    """The lines a worker wrote whole (a line without its newline was cut
    by the kill)."""
    return path.read_bytes().decode().split("\n")[:-1]


def drain(consumer, batch: int = 5000) -> list:
    """Every message the consumer can receive right now."""
    out = []
    while True:
        ms = consumer.receive_many(batch, timeout=0)
        if not ms:
            return out
        out.extend(ms)
