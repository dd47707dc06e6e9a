"""`gyre rl` checks settings against the model's config before anything starts (no weights are read: the model
folder's config, or that of the preset the launch will create):
- LoRA's target_modules: a typo ("v_prj") or an adapter on a tied output layer was refused only by the trainer, when
  it loaded the model after Redis, inference and the orchestrator had started (checked on the model's skeleton);
- the completion budget: a sampling.max_tokens the served context cannot hold with any prompt had every task refused
  as too long (and, until the scheduler's fix, skipped for ever)."""

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


def two_runs(tmp_path: Path, beta: str) -> list[str]:
    """ci.toml as a multi-run experiment: runs alpha and beta (with `beta`, a line of its own keys) on one adapter."""
    recipe = tmp_path / "two.toml"
    runs = '\n[trainer.lora]\nrank = 8\n\n[[runs]]\nname = "alpha"\n\n[[runs]]\nname = "beta"\n'
    recipe.write_text((ROOT / "configs/ci.toml").read_text() + runs + beta + "\n")
    return ["@", str(recipe)]


def lora(*targets: str) -> list[str]:
    return ["--trainer.lora", json.dumps({"rank": 8, "target_modules": list(targets)})]


def test_a_misspelt_target_of_the_preset_model_is_named_with_the_layer_it_resembles(tmp_path):
    with pytest.raises(ConfigError) as refused:
        validate(tmp_path / "run", *lora("q_proj", "v_prj"))
    message = str(refused.value)
    assert message.startswith("config key 'trainer.lora.target_modules': 'v_prj' names no layer of the model")
    assert "did you mean 'v_proj'?" in message and "down_proj" in message
    assert not (tmp_path / "run").exists()  # nothing was created


def test_the_sft_warm_ups_adapter_is_checked_too(tmp_path):
    sft = json.dumps({"max_steps": 2, "data": {"env": "reverse_text"}, "lora": {"target_modules": ["o_prj"]}})
    with pytest.raises(ConfigError, match=r"^config key 'sft.args.lora.target_modules': 'o_prj' names no layer"):
        validate(tmp_path / "run", "--sft.args", sft)


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


def test_a_model_transformers_cannot_build_alone_is_left_to_the_trainer(tmp_path, tiny_model):
    # a custom architecture (here a config AutoModelForCausalLM has no class for): the launch goes on, no traceback
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "config.json").write_text(
        json.dumps({"model_type": "t5", "d_model": 64, "num_layers": 1, "max_position_embeddings": 1024})
    )
    validate(tmp_path / "run", "--model.name", str(model), *lora("v_prj"))


def test_an_adapter_on_a_tied_output_layer_is_refused_at_launch(tmp_path):
    # the Qwen3 shape ties lm_head to the embeddings; its skeleton takes no memory (meta device)
    with pytest.raises(ConfigError, match=r"'trainer.lora.target_modules': 'lm_head' is tied to the input embeddings"):
        validate(tmp_path / "run", "--model.init-preset", "qwen3-0.6b", *lora("q_proj", "lm_head"))


def test_a_runs_own_targets_name_that_runs_key(tmp_path):
    beta = 'trainer = { lora = { rank = 4, target_modules = ["q_proj", "gate_prj"] } }'
    with pytest.raises(ConfigError, match=r"^config key 'runs.1.trainer.lora.target_modules': 'gate_prj' names no"):
        validate(tmp_path / "run", config=two_runs(tmp_path, beta))


def test_a_completion_budget_the_context_cannot_hold_is_refused_naming_the_key(tmp_path):
    # the tiny preset's context is 1024 tokens: 1024 completion tokens leave none for the prompt
    with pytest.raises(ConfigError) as refused:
        validate(tmp_path / "run", "--orchestrator.sampling.max-tokens", "1024")
    message = str(refused.value)
    assert message.startswith("config key 'orchestrator.sampling.max_tokens': 1024 completion tokens leave no room")
    assert "context of 1024 tokens" in message
    assert not (tmp_path / "run").exists()
    validate(tmp_path / "fits", "--orchestrator.sampling.max-tokens", "1000")


def test_the_served_context_is_inferences_max_model_len_when_set(tmp_path):
    argv = ["--inference.engine.max-model-len", "512"]
    with pytest.raises(ConfigError, match=r"'orchestrator.sampling.max_tokens': 600 .* context of 512 tokens"):
        validate(tmp_path / "run", *argv, "--orchestrator.sampling.max-tokens", "600")
    validate(tmp_path / "ok", *argv, "--orchestrator.sampling.max-tokens", "500")


def test_a_max_model_len_beyond_the_models_context_is_refused_and_vllm_derives_its_own(tmp_path):
    with pytest.raises(ConfigError, match=r"^config key 'inference.engine.max_model_len': engine.max_model_len 2048 "
                                          r"exceeds the model's context 1024"):  # fmt: skip
        validate(tmp_path / "run", "--inference.engine.max-model-len", "2048")
    # vLLM may serve more than max_position_embeddings (rope scaling): its own rule, not checked here
    validate(tmp_path / "vllm", "--inference.backend", "vllm", "--orchestrator.sampling.max-tokens", "1024")


def test_a_mix_entrys_own_budget_and_a_runs_own_table_are_named(tmp_path):
    mix = json.dumps(
        [{"name": "reverse_text"}, {"name": "reverse_text", "label": "long", "sampling": {"max_tokens": 2048}}]
    )
    with pytest.raises(ConfigError, match=r"^config key 'orchestrator.env.1.sampling.max_tokens': 2048 completion"):
        validate(tmp_path / "mix", "--orchestrator.env", mix)
    evaluated = json.dumps({"name": "reverse_text", "eval": {"interval": 2, "max_tokens": 1500}})
    with pytest.raises(ConfigError, match=r"^config key 'orchestrator.env.eval.max_tokens': 1500 completion"):
        validate(tmp_path / "eval", "--orchestrator.env", evaluated, "--orchestrator.eval.interval", "2")
    beta = "orchestrator = { sampling = { max_tokens = 4096 } }"
    with pytest.raises(ConfigError, match=r"^config key 'runs.1.orchestrator.sampling.max_tokens': 4096 completion"):
        validate(tmp_path / "run", config=two_runs(tmp_path, beta))
