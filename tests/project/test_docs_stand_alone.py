"""The project's files stand on their own: none cites a design document or
a folder outside the repository."""

from __future__ import annotations

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUTSIDE = ("DESIGN.md", "STYLE.md", "../shared")


def tracked_text_files() -> list:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [p for p in out.split() if p.endswith((".py", ".pyx", ".pxd", ".md", ".toml", ".cfg"))
            and os.path.isfile(os.path.join(ROOT, p))]


def test_no_file_cites_what_users_do_not_have():
    cited = []
    for path in tracked_text_files():
        if path == "tests/project/test_docs_stand_alone.py":
            continue
        with open(os.path.join(ROOT, path), encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if any(word in line for word in OUTSIDE):
                    cited.append(f"{path}:{n}: {line.strip()[:100]}")
    assert not cited, "\n".join(cited)
