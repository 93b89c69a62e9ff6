"""Every Python example of README.md runs as printed, in a fresh folder."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")


def python_blocks() -> list:
    with open(README) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


def test_the_readme_has_python_examples():
    assert python_blocks()


@pytest.mark.parametrize("i", range(len(python_blocks())))
def test_readme_example_runs_as_printed(tmp_path, i):
    code = python_blocks()[i]
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
