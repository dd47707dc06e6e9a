"""Helpers of the real-model tests (a uniquely named module: `from conftest import` would pick whichever
test folder's conftest.py was imported first)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REVISION = "0123456789abcdef0123456789abcdef01234567"


def gyre(*args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`gyre ARGS` in a child process (threads capped: the machine is shared)."""
    env = {**os.environ, "OMP_NUM_THREADS": "2", **(env or {})}
    return subprocess.run([sys.executable, "-m", "gyre.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)  # fmt: skip


def hub_cache_layout(folder: Path, cache: Path, repo: str = "org/model") -> Path:
    """Lay `folder` out as the Hugging Face hub cache does; return the snapshot folder.

    `models--org--model/blobs/<sha256>` hold the bytes, `snapshots/<revision>/<file>` are relative symlinks
    to them (`../../blobs/<sha256>`) and `refs/main` names the revision."""
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / REVISION
    (repo_dir / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(folder.iterdir()):
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, repo_dir / "blobs" / digest)
        (snapshot / file.name).symlink_to(Path("../../blobs") / digest)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(REVISION)
    return snapshot
