"""Running Python as another, unprivileged user from a test run as root:
the interpreter (and its packages) hard-linked where that user can reach
it (a Python under ``/root`` is not), and a wrapper that runs it.
tests/spark/test_spark_cluster.py runs its Spark worker with it,
tests/spark/test_spark_flight.py a task that cannot open the data directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest


def relocate_python(root: str) -> str:
    """This interpreter and its packages, hard-linked under ``root`` (a
    copy across file systems), and a wrapper script that runs it: the path
    other users run Python by."""
    base = os.path.join(root, "python")
    if subprocess.run(["cp", "-al", sys.prefix, base], capture_output=True).returncode != 0:
        shutil.rmtree(base, ignore_errors=True)
        subprocess.run(["cp", "-a", sys.prefix, base], check=True)
    exe = os.path.join(base, os.path.relpath(os.path.realpath(sys.executable), sys.prefix))
    if not os.path.exists(exe):
        pytest.skip(f"running as another user needs a plain interpreter, not a virtual environment ({sys.prefix})")
    wrapper = os.path.join(root, "python.sh")
    with open(wrapper, "w") as f:
        # A pyenv-built interpreter finds libpython through a RUNPATH under
        # the original prefix, which the other user cannot reach.
        f.write(f'#!/bin/sh\nLD_LIBRARY_PATH="{base}/lib${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}" '
                f'exec "{exe}" "$@"\n')
    os.chmod(wrapper, 0o755)
    return wrapper


def others_can_enter(path: str) -> bool:
    """Every directory from / to ``path`` is searchable by other users."""
    path = os.path.abspath(path)
    while True:
        if not os.stat(path).st_mode & 0o001:
            return False
        if path == "/":
            return True
        path = os.path.dirname(path)
