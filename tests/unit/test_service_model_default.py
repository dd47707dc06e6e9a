"""A service started by hand (`gyre trainer`, `gyre inference`, `gyre sft` without an experiment file) loads
`{output_dir}/model` when model.name is unset, where `gyre rl` creates the model: it loaded `outputs/run/model`
whatever the output_dir (another run's model, or a folder the user never chose). A missing one stops it before
anything starts, naming the key and how to create a model; `--help` says both."""

from __future__ import annotations

import subprocess
import sys

import pytest
from gyre.config import load_config
from gyre.config.inference import InferenceConfig
from gyre.config.trainer import SFTConfig, TrainerConfig

CONFIGS = [(TrainerConfig, []), (InferenceConfig, []), (SFTConfig, ["--data.fake"])]


@pytest.mark.parametrize(("cls", "argv"), CONFIGS)
def test_an_unset_model_name_is_the_output_dirs_model(cls, argv, tmp_path, monkeypatch):
    assert load_config(cls, [*argv, "--output-dir", str(tmp_path)]).model.name == str(tmp_path / "model")
    assert load_config(cls, argv).model.name == "outputs/run/model"  # the default output_dir's
    monkeypatch.setenv("GYRE_OUTPUT_DIR", str(tmp_path / "env"))
    assert load_config(cls, argv).model.name == str(tmp_path / "env" / "model")
    # set anywhere, it wins
    assert load_config(cls, [*argv, "--model.name", "org/model"]).model.name == "org/model"
    (tmp_path / "x.toml").write_text('[model]\nname = "from/file"\ndtype = "float32"\n')
    assert load_config(cls, [*argv, "@", str(tmp_path / "x.toml")]).model.name == "from/file"
    monkeypatch.setenv("GYRE_MODEL__NAME", "from/env")
    assert load_config(cls, [*argv, "--model.dtype", "float32"]).model.name == "from/env"


@pytest.mark.parametrize("command", ["inference", "trainer"])
def test_a_missing_model_folder_stops_the_service_naming_the_key_and_how_to_create_one(command, tmp_path):
    run = subprocess.run([sys.executable, "-m", "gyre.cli", command, "--output-dir", str(tmp_path / "b")],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert f"gyre {command}: error: model.name = '{tmp_path / 'b' / 'model'}'" in run.stderr
    assert "does not exist" in run.stderr and "gyre model init" in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").rglob("*.jsonl"))  # nothing started


@pytest.mark.parametrize("command", ["inference", "trainer", "sft"])
def test_help_says_the_default_model_and_how_to_create_one(command):
    run = subprocess.run([sys.executable, "-m", "gyre.cli", command, "--help"], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    line = run.stdout[run.stdout.index("--model.name") :].split("--model.dtype")[0]
    assert "{output_dir}/model" in line and "gyre model init --output-dir DIR" in line and "gyre model import" in line


@pytest.mark.parametrize(("cls", "argv"), CONFIGS)
def test_the_model_given_by_its_name_alone(cls, argv, tmp_path):
    # `--model Qwen/Qwen3-0.6B` (vLLM's, PRIME-RL's) and `model = "..."` were "Input should be a valid dictionary"
    assert load_config(cls, [*argv, "--model", "org/m"]).model.name == "org/m"
    (tmp_path / "x.toml").write_text('model = "from/file"\n')
    assert load_config(cls, [*argv, "@", str(tmp_path / "x.toml")]).model.name == "from/file"
    # with another model key from another source: the name was silently lost ({dtype} replaced the string)
    model = load_config(cls, [*argv, "@", str(tmp_path / "x.toml"), "--model.dtype", "float32"]).model
    assert (model.name, model.dtype) == ("from/file", "float32")
    model = load_config(cls, [*argv, "--model.dtype", "float32", "--model", "org/m"]).model
    assert (model.name, model.dtype) == ("org/m", "float32")


def test_gyre_rl_takes_the_model_by_name_and_refuses_it_in_a_section(tmp_path):
    from gyre.config import ConfigError
    from gyre.config.rl import RLConfig
    from gyre.local.launcher import Launcher

    assert load_config(RLConfig, ["--model", "org/m"]).model.name == "org/m"
    cfg = load_config(RLConfig, ["--trainer.model", "x", "--model.init-preset", "tiny", "--output-dir", str(tmp_path)])
    with pytest.raises(ConfigError, match=r"^config key 'trainer.model.name': gyre rl gives every service the same"):
        Launcher(cfg).validate()  # a string slipped past the check, replacing the launcher's model


@pytest.mark.parametrize(
    "argv",
    [
        ["--model", '{"dtype": "bfloat16"}', "--model.name", "Q/x"],  # as the chart writes a server's args
        ["--model.name", "Q/x", "--model", '{"dtype": "bfloat16"}'],
        ["--model", "Q/x", "--model.dtype", "bfloat16"],
    ],
)
def test_a_model_table_given_whole_merges_with_the_models_other_options(argv):
    # the shorthand took '{"dtype": ...}' for the name: the chart's teacher server lost its dtype (ran at auto)
    cfg = load_config(InferenceConfig, argv)
    assert (cfg.model.name, cfg.model.dtype) == ("Q/x", "bfloat16")
