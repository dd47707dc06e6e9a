"""`python -m gyre_trainer.export`: a trainer checkpoint as a Hugging Face folder that transformers (and peft, for
the adapter of a LoRA run) load, equal to the weights the trainer published for that step."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from gyre.streams import BatchStream
from trainer_testlib import PYTHON, child_env, load_weights, push_batches, run_in_process, trainer_args

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("isolated_torch_state")]


def export(argv, to, *extra) -> subprocess.CompletedProcess:
    cmd = [PYTHON, "-m", "gyre_trainer.export", *argv, "--to", str(to), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=300)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_checkpoint_exports_to_a_folder_transformers_loads_equal_to_the_published_weights(
    tiny_model, redis_url, unique_run_id, tmp_path, lora
):
    from gyre.config import load_config
    from gyre.config.trainer import TrainerConfig
    from gyre_trainer.export import export_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    push_batches(BatchStream(redis_url, unique_run_id), range(1, 3))
    extra = {"ckpt.interval": 1, **({"lora.rank": 4, "lora.alpha": 8, "optim.lr": 1e-2} if lora else {})}
    argv = trainer_args(tiny_model, out, redis_url, unique_run_id, 2, **extra)
    assert run_in_process(argv) == 0

    to = export_checkpoint(load_config(TrainerConfig, argv), None, tmp_path / "hf")  # the newest: step 2
    exported, published = load_weights(to), load_weights(out / "weights/step_2")
    assert exported.keys() == published.keys()
    assert all(torch.equal(exported[k], published[k]) for k in published), "export != published weights step 2"
    assert json.loads((to / "gyre_step.json").read_text())["step"] == 2
    assert json.loads((out / "checkpoints/trainer/step_2/progress.json").read_text())["dtype"] == "float32"
    model = AutoModelForCausalLM.from_pretrained(to, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(to)
    ids = torch.tensor([tokenizer("hello world")["input_ids"] or [5, 6]])
    if lora:  # the adapter alone, onto the base, gives the merged model's outputs
        import peft

        base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        adapted = peft.PeftModel.from_pretrained(base, to / "lora").eval()
        with torch.no_grad():
            assert torch.allclose(adapted(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5, rtol=0)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]

    # the CLI: one line naming the mistake, exit 2, nothing written
    missing = export(argv, tmp_path / "hf-9", "--step", "9")
    assert missing.returncode == 2 and "--step 9: no such checkpoint" in missing.stderr + missing.stdout
    assert "have [1, 2]" in missing.stderr + missing.stdout and not (tmp_path / "hf-9").exists()
    taken = export(argv, to, "--step", "1")
    assert taken.returncode == 2 and "exists: export into a new folder" in taken.stderr + taken.stdout


def test_the_export_dtype_is_the_training_dtype_not_a_lora_adapters_float32():
    from gyre_trainer.export import training_dtype

    # a bf16 LoRA run on a GPU (model.dtype auto): its checkpoint holds float32 adapters and records bfloat16
    assert training_dtype("auto", "bfloat16", {torch.float32}) == torch.bfloat16
    assert training_dtype("float16", "bfloat16", {torch.float32}) == torch.float16  # model.dtype given: it wins
    assert training_dtype("auto", None, {torch.bfloat16}) == torch.bfloat16  # a checkpoint from before the record
    assert training_dtype("auto", None, {torch.bfloat16, torch.float32}) == torch.float32


def test_a_step_with_no_checkpoint_but_a_published_version_names_that_folder(tiny_model, tmp_path):
    """The demo keeps no checkpoint (no --ckpt) but publishes its versions as HF folders: `gyre export outputs/demo
    --step 120` said only "no such checkpoint (have none)", as if the step's model were lost."""
    from gyre.config import load_config
    from gyre.config.trainer import TrainerConfig
    from gyre_trainer.export import ExportError, export_checkpoint

    out = tmp_path / "run"
    (out / "weights/step_3").mkdir(parents=True)
    (out / "weights/step_3/config.json").write_text("{}")
    cfg = load_config(TrainerConfig, trainer_args(tiny_model, out, "redis://127.0.0.1:1/0", "r", 3))
    with pytest.raises(ExportError) as published:
        export_checkpoint(cfg, 3, tmp_path / "hf")
    assert f"{out / 'weights/step_3'} is that version published, a Hugging Face folder already" in str(published.value)
    with pytest.raises(ExportError) as gone:  # a version pruned too: no folder to point at
        export_checkpoint(cfg, 2, tmp_path / "hf")
    assert "have none; keep some with trainer.ckpt.interval" in str(gone.value) and "published" not in str(gone.value)
    assert not (tmp_path / "hf").exists()
