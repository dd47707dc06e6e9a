"""`gyre sft --lora`: adapters only, the base frozen. The result is the merged model (what `gyre rl`, inference and
`from_pretrained` load) with the adapter alone in `lora/` (PEFT's files); checkpoints hold the adapter and its
optimizer state, and a resumed LoRA SFT ends with exactly the weights of a straight one (test_sft_run.py)."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from gyre.config import ConfigError, load_config
from gyre.config.trainer import SFTConfig
from gyre.events import read_events
from gyre_trainer import sft, sft_data
from trainer_testlib import LORA, PYTHON, REPO, child_env, load_weights, sft_args

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("isolated_torch_state")]


def test_a_lora_sft_learns_changes_only_its_targets_and_its_adapter_loads_in_peft(tiny_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    args = sft_args(tiny_model, tmp_path, **{"data.env": "reverse_text", "data.num-examples": 64, "max-steps": 8,
                                             "optim.lr": 2e-2, "lora": LORA})  # fmt: skip
    assert sft.run(load_config(SFTConfig, args)) == 0
    losses = [r["loss"] for r in read_events(tmp_path / "events" / sft.SFT_STEPS)]
    assert sum(losses[-2:]) / 2 < losses[0] - 0.5, losses

    base, merged = load_weights(tiny_model), load_weights(tmp_path / "sft")
    assert merged.keys() == base.keys()  # the base model's own names: no peft prefixes, no adapter tensors
    targets = ("q_proj", "v_proj", "down_proj")
    for name, weight in base.items():
        changed = not torch.equal(merged[name], weight)
        assert changed == name.endswith(tuple(f"{t}.weight" for t in targets)), name

    # the adapter alone: peft on the base model computes what the merged model does
    ids = torch.tensor([[5, 17, 29, 41, 53, 65]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(tmp_path / "sft")(ids).logits
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), tmp_path / "sft" / "lora")
        got = adapted(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    config = json.loads((tmp_path / "sft" / "lora" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and sorted(config["target_modules"]) == sorted(targets)


def test_a_lora_sft_under_torchrun_trains_what_one_process_trains(tiny_model, tmp_path):
    """Two FSDP2 ranks (gloo) of a LoRA SFT: the same losses, gradient norms and adapter as one process, the shards'
    adapters gathered into one PEFT folder and one merged model."""
    from safetensors.torch import load_file

    one, two = tmp_path / "one", tmp_path / "two"
    extra = {"data.fake": "true", "data.num-examples": 32, "max-steps": 3, "lora": LORA}
    assert sft.run(load_config(SFTConfig, sft_args(tiny_model, one, **extra))) == 0
    cmd = [PYTHON, "-m", "gyre_trainer.torchrun", "--standalone", "--nproc-per-node=2", "-m", "gyre_trainer.sft",
           *sft_args(tiny_model, two, **extra)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "returned a view tensor" not in run.stderr  # FSDP2's warning at every forward, of the head's "logits"
    alone, sharded = ([v for r in read_events(out / "events" / sft.SFT_STEPS) for v in (r["loss"], r["grad_norm"])]
                      for out in (one, two))  # fmt: skip
    assert len(alone) == 6 and sharded == pytest.approx(alone, rel=1e-5)
    for file in ("sft/lora/adapter_model.safetensors", "sft/model.safetensors"):
        alone, sharded = load_file(one / file), load_file(two / file)
        assert alone.keys() == sharded.keys()
        for name, weight in alone.items():
            torch.testing.assert_close(sharded[name], weight, rtol=1e-5, atol=1e-6, msg=name)


def test_a_rerun_with_another_adapter_is_refused_naming_the_key(tiny_model, tmp_path, capsys):
    common = {"data.env": "reverse_text", "data.num-examples": 40, "ckpt.interval": 1, "max-steps": 2}
    assert sft.main(sft_args(tiny_model, tmp_path, **common, lora=LORA)) == 0
    state = tmp_path / "checkpoints" / "sft" / "step_2" / "state"  # the adapter and its moments alone
    model_bytes = sum(t.numel() * t.element_size() for t in load_weights(tmp_path / "sft").values())
    assert sum(f.stat().st_size for f in state.iterdir()) < model_bytes / 4
    other = json.dumps({**json.loads(LORA), "rank": 8})
    capsys.readouterr()
    assert sft.main(sft_args(tiny_model, tmp_path, **{**common, "max-steps": 3}, lora=other)) == 2
    err = capsys.readouterr().err
    assert "config key 'lora.rank'" in err and "4" in err and "8" in err


def test_publish_is_no_sft_setting():
    # an SFT publishes nothing: its result is the merged model with the adapter beside it
    with pytest.raises(ConfigError, match=r"^config key 'lora.publish': unknown key"):
        load_config(SFTConfig, ["--data.fake", "true", "--lora.publish", "adapter"])


def test_a_target_that_names_no_layer_is_one_error_line_before_the_data_loads(tiny_model, tmp_path, capsys,
                                                                              monkeypatch):  # fmt: skip
    # it was a traceback once the data had been tokenized and the model loaded
    monkeypatch.setattr(sft_data, "load_conversations", lambda *a: pytest.fail("the data was read"))
    args = sft_args(tiny_model, tmp_path, **{"data.fake": "true", "max-steps": 1})
    assert sft.main([*args, "--lora.target-modules", '["q_proj", "v_prj"]']) == 2
    err = capsys.readouterr().err
    assert err.startswith("gyre sft: error: config key 'lora.target_modules': 'v_prj' names no layer of the model "
                          "(did you mean 'v_proj'?)"), err  # fmt: skip
    assert "Traceback" not in err
