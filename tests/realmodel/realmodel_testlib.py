"""Helpers of the real-model tests (a uniquely named module: `from conftest import` would pick whichever
test folder's conftest.py was imported first)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from support.models import hub_cache_layout  # noqa: F401 (the real-model tests import it from here)

ROOT = Path(__file__).resolve().parents[2]


def gyre(*args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`gyre ARGS` in a child process (threads capped: the machine is shared)."""
    env = {**os.environ, "OMP_NUM_THREADS": "2", **(env or {})}
    return subprocess.run([sys.executable, "-m", "gyre.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)  # fmt: skip
