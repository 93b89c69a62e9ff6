"""The guide's example (docs/examples/test_pipeline_gates.py) runs as a
user would run it: pytest on that folder, with txmq's pytest plugin (the
suite also collects the folder itself, so its gates hold today). A copy
whose ceiling is one below today's count fails naming the gate."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "docs", "examples")


def run_pytest(folder: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "txmq.testing.pytest_plugin",
           "--benchmark-disable", "--rootdir", folder, "-c", os.devnull, *extra, folder]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=folder)


def test_the_example_fails_when_a_count_goes_over_its_ceiling(tmp_path):
    folder = tmp_path / "examples"
    shutil.copytree(EXAMPLES, folder)
    gates_file = folder / "perf_gates.toml"
    text = gates_file.read_text()
    tightened = re.sub(r"(\[\[count\]\]\nname = \"python calls per pipeline step of 100 messages\"\nceiling = )(\d+)",
                       lambda m: m.group(1) + str(int(m.group(2)) - 1), text)
    assert tightened != text
    gates_file.write_text(tightened)
    r = run_pytest(str(folder), "-k", "calls_per_message")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "python calls per pipeline step of 100 messages" in r.stdout
    assert re.search(r"\b1 failed\b", r.stdout), r.stdout
