"""`gyre rl` checks LoRA's target_modules against the model before anything starts: a typo ("v_prj") or an
adapter on a tied output layer was refused only by the trainer, when it loaded the model after Redis, inference
and the orchestrator had started. The check builds the model's skeleton (no weights), from a model folder or from
the preset a launch will create."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from gyre.config import ConfigError, load_config
from gyre.config.rl import RLConfig

ROOT = Path(__file__).resolve().parents[2]
CI = ["@", str(ROOT / "configs/ci.toml")]


def validate(out: Path, *argv: str, config: list[str] = CI) -> None:
    from gyre.local.launcher import Launcher

    Launcher(load_config(RLConfig, [*config, *argv, "--output-dir", str(out)])).validate()


def lora(*targets: str) -> list[str]:
    return ["--trainer.lora", json.dumps({"rank": 8, "target_modules": list(targets)})]


def test_a_misspelt_target_of_the_preset_model_is_named_with_the_layer_it_resembles(tmp_path):
    with pytest.raises(ConfigError) as refused:
        validate(tmp_path / "run", *lora("q_proj", "v_prj"))
    message = str(refused.value)
    assert message.startswith("config key 'trainer.lora.target_modules': 'v_prj' names no layer of the model")
    assert "did you mean 'v_proj'?" in message and "down_proj" in message
    assert not (tmp_path / "run").exists()  # nothing was created


def test_targets_that_name_layers_pass_as_do_the_defaults(tmp_path):
    validate(tmp_path / "a", *lora("q_proj", "v_proj"))
    validate(tmp_path / "b", "--trainer.lora", '{"rank": 8}')
    validate(tmp_path / "c", *lora("self_attn.o_proj", "mlp"))  # peft matches a module's last parts


def test_a_model_folder_is_checked_on_its_own_layers(tmp_path, tiny_model):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    argv = ["--model.name", str(model)]  # an existing folder: its own layers, not the preset's
    validate(tmp_path / "ok", *argv, *lora("up_proj"))
    with pytest.raises(ConfigError, match=r"^config key 'trainer.lora.target_modules': 'up_prj' names no layer"):
        validate(tmp_path / "run", *argv, *lora("up_prj"))


def test_an_adapter_on_a_tied_output_layer_is_refused_at_launch(tmp_path):
    # the Qwen3 shape ties lm_head to the embeddings; its skeleton takes no memory (meta device)
    with pytest.raises(ConfigError, match=r"'trainer.lora.target_modules': 'lm_head' is tied to the input embeddings"):
        validate(tmp_path / "run", "--model.init-preset", "qwen3-0.6b", *lora("q_proj", "lm_head"))


def test_a_runs_own_targets_name_that_runs_key(tmp_path):
    recipe = tmp_path / "two.toml"
    recipe.write_text(
        (ROOT / "configs/ci.toml").read_text()
        + '\n[trainer.lora]\nrank = 8\n\n[[runs]]\nname = "alpha"\n\n[[runs]]\nname = "beta"\n'
        + 'trainer = { lora = { rank = 4, target_modules = ["q_proj", "gate_prj"] } }\n'
    )
    with pytest.raises(ConfigError, match=r"^config key 'runs.1.trainer.lora.target_modules': 'gate_prj' names no"):
        validate(tmp_path / "run", config=["@", str(recipe)])
