"""`gyre export RUN_DIR`: a `gyre rl` run's checkpoint as a Hugging Face folder, named by the run's folder alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def gyre(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "gyre.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=cwd)


def test_gyre_export_of_a_run_folder_equals_the_weights_the_run_published(tmp_path):
    from safetensors.torch import load_file

    # launched with a relative output_dir and no model.name: its base model is runs/demo/model, relative to tmp_path
    rl = gyre("rl", "@", str(ROOT / "configs/ci.toml"), "--output-dir", "runs/demo", "--max-steps", "2", "--ckpt",
              "--trainer.ckpt.interval", "1", cwd=tmp_path)  # fmt: skip
    assert rl.returncode == 0, rl.stderr[-4000:]
    run = tmp_path / "runs/demo"

    # exported from another directory: the run's folder is all it is told (its saved trainer config is read)
    exported = gyre("export", str(run), "--step", "1", "--to", str(tmp_path / "hf"), cwd=ROOT)
    assert exported.returncode == 0, exported.stderr[-4000:]
    got, published = load_file(tmp_path / "hf/model.safetensors"), load_file(run / "weights/step_1/model.safetensors")
    assert got.keys() == published.keys() and all((got[k] == published[k]).all() for k in published)
    assert json.loads((tmp_path / "hf/gyre_step.json").read_text())["step"] == 1
    assert (tmp_path / "hf/config.json").is_file()

    missing = gyre("export", str(run), "--step", "9", "--to", str(tmp_path / "hf-9"), cwd=ROOT)
    assert missing.returncode == 2 and "--step 9: no such checkpoint" in missing.stderr + missing.stdout
    assert not (tmp_path / "hf-9").exists()
