"""Repository hygiene that CI would otherwise only catch late."""

from __future__ import annotations

import subprocess
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_test_module_basenames_are_unique():
    # pytest's default (prepend) import mode imports test modules by basename: two test_x.py in
    # different folders make the whole collection fail.
    files = subprocess.run(["git", "ls-files", "tests"], cwd=ROOT, capture_output=True, text=True, check=True)
    names = [Path(f).name for f in files.stdout.split() if Path(f).name.startswith("test_") and f.endswith(".py")]
    dupes = [n for n, c in Counter(names).items() if c > 1]
    assert not dupes, f"rename these test modules: {dupes}"


def test_top_level_layout():
    for path in (
        "services",
        "proto",
        "charts",
        "deploy",
        "libs",
        "tests",
        "Makefile",
        "README.md",
        "Dockerfile.trainer",
        "Dockerfile.inference",
        "Dockerfile.orchestrator",
        "docs/architecture.md",
    ):
        assert (ROOT / path).exists(), path
