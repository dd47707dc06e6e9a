"""The trainer with `lora`: adapters-only checkpoints, merged published weights, exact resume (2 + 2 == 4)."""

from __future__ import annotations

import pytest
import torch
from gyre.streams import BatchStream
from torch.distributed.checkpoint import FileSystemReader
from trainer_testlib import load_weights, push_batches, run_in_process, trained_steps, trainer_args

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("isolated_torch_state")]

MORE = '["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]'
LORA = {"lora.rank": 4, "lora.alpha": 8, "ckpt.interval": 2, "optim.lr": 1e-2, "optim.warmup-steps": 3}


def train(tiny_model, out, redis_url, run_id, max_steps, **extra) -> None:
    assert run_in_process(trainer_args(tiny_model, out, redis_url, run_id, max_steps, **{**LORA, **extra})) == 0


def test_lora_checkpoints_adapters_publishes_merged_and_resumes_exactly(tiny_model, redis_url, unique_run_id, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for suffix in ("-straight", ""):
        push_batches(BatchStream(redis_url, unique_run_id + suffix), range(1, 5))
    train(tiny_model, straight, redis_url, unique_run_id + "-straight", 4)
    train(tiny_model, resumed, redis_url, unique_run_id, 2)
    train(tiny_model, resumed, redis_url, unique_run_id, 4, **{"ckpt.resume-step": -1})
    assert trained_steps(resumed) == [1, 2, 3, 4]

    # checkpoints hold the adapters only (the frozen base is the base model)
    keys = FileSystemReader(str(resumed / "checkpoints/trainer/step_2/state")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys)

    # published weights are a plain merged model: the base's names, changed only where adapters sit
    base = load_weights(tiny_model)
    published = load_weights(resumed / "weights/step_4")
    assert published.keys() == base.keys()
    changed = {k for k in base if not torch.equal(base[k], published[k])}
    adapted = tuple(
        f"{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    )
    assert changed and all(k.endswith(adapted) for k in changed)
    straight_weights = load_weights(straight / "weights/step_4")
    for name in base:
        assert torch.equal(published[name], straight_weights[name]), name


@pytest.mark.parametrize("publish", ["merged", "adapter"])
def test_a_lora_run_without_checkpoints_resumes_from_its_published_adapter(
    tiny_model, redis_url, unique_run_id, tmp_path, publish
):
    """No checkpoint (ckpt.interval unset, the default): a restarted LoRA run restores its adapter from the
    newest published version (merged weights keep the adapter beside them, under a subfolder loaders do not
    read; an adapter version is the adapter), trains on from there and trains no step twice."""
    from gyre.config import load_config
    from gyre.config.trainer import TrainerConfig
    from gyre_trainer import dist
    from gyre_trainer.lora import adapter_state_dict, merged_state_dict
    from gyre_trainer.publish import RESUME_ADAPTER
    from gyre_trainer.service import Trainer
    from safetensors.torch import load_file

    out = tmp_path / publish
    push_batches(BatchStream(redis_url, unique_run_id), range(1, 4))
    opts = {**{k: v for k, v in LORA.items() if k != "ckpt.interval"}, "lora.publish": publish}
    argv = trainer_args(tiny_model, out, redis_url, unique_run_id, 2, **opts)
    assert run_in_process(argv) == 0
    assert trained_steps(out) == [1, 2] and not (out / "checkpoints/trainer/step_2").exists()
    version = out / "weights/step_2"
    kept = load_file(version / (RESUME_ADAPTER if publish == "merged" else "adapter_model.safetensors"))
    if publish == "merged":  # what inference loads: the folder's own *.safetensors, the merged model alone
        assert sorted(p.name for p in version.glob("*.safetensors")) == ["model.safetensors"]

    restarted = Trainer(load_config(TrainerConfig, argv), dist.init_distributed("cpu"))
    restarted._start_servers()  # what `run` does up to the training loop
    try:
        restarted._build()
        plan = restarted._resume()
        state = dist.full_state_dict(restarted.model, restarted.ctx)
    finally:
        restarted._close()
    assert (plan.trained_step, plan.weights_step, plan.checkpoint_step) == (2, 2, None)
    restored = adapter_state_dict(state)
    assert restored.keys() == kept.keys() and all(torch.equal(restored[k], kept[k]) for k in kept)
    if publish == "merged":
        merged, published = merged_state_dict(state, restarted.cfg.lora), load_weights(version)
        assert all(torch.equal(merged[k], published[k]) for k in published)

    assert run_in_process(trainer_args(tiny_model, out, redis_url, unique_run_id, 3, **opts)) == 0
    assert trained_steps(out) == [1, 2, 3]


@pytest.mark.parametrize("newest", ["published", "checkpoint"])
def test_a_lora_run_relaunched_with_another_adapter_shape_is_told_which_key(
    tiny_model, redis_url, unique_run_id, tmp_path, newest
):
    """The same output folder with another `lora.rank` or `lora.target_modules` than it was trained with:
    the restart stops before training with the key and the run's own value, and nothing is trained;
    whether its newest state is a published adapter or a checkpoint (where DCP failed with a page of size
    mismatches, or dropped the adapters of modules the relaunch no longer targets)."""
    out = tmp_path / "run"
    push_batches(BatchStream(redis_url, unique_run_id), range(1, 4))
    opts = (
        {**LORA, "ckpt.interval": 1}
        if newest == "checkpoint"
        else {k: v for k, v in LORA.items() if k != "ckpt.interval"}
    )
    assert run_in_process(trainer_args(tiny_model, out, redis_url, unique_run_id, 1, **opts)) == 0
    relaunches = {
        "set trainer.lora.rank = 4": {**opts, "lora.rank": 8},
        "other modules than trainer.lora.target_modules": {**opts, "lora.target-modules": '["q_proj"]'},
        # one module more: its adapter would start from scratch beside the trained ones
        "other modules than trainer.lora.target_modules gives: missing": {**opts, "lora.target-modules": MORE},
    }
    for message, changed in relaunches.items():
        with pytest.raises(ValueError, match=message):
            run_in_process(trainer_args(tiny_model, out, redis_url, unique_run_id, 3, **changed))
    assert trained_steps(out) == [1]
    assert (out / "checkpoints/trainer/step_1").exists() == (newest == "checkpoint")


def lora_lrs(optimizer, model) -> dict[str, set[float]]:
    """{"A": lrs lora_A parameters train with, "B": the same for lora_B} of a built optimizer."""
    names = {id(p): n for n, p in model.named_parameters()}
    lrs: dict[str, set[float]] = {"A": set(), "B": set()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            lrs["B" if ".lora_B." in names[id(p)] else "A"].add(group["lr"])
    return lrs


def test_loraplus_ratio_reaches_the_single_run_and_each_multirun_optimizer(
    tiny_model, redis_url, unique_run_id, tmp_path
):
    from gyre.config import load_config
    from gyre.config.trainer import TrainerConfig
    from gyre_trainer import dist
    from gyre_trainer.multirun import MultiRunTrainer
    from gyre_trainer.service import Trainer

    common = {"model": {"name": str(tiny_model)}, "redis": {"url": redis_url}, "device": "cpu",
              "optim": {"lr": 1e-3}, "metrics": {"port": 0}, "server": {"port": 0}}  # fmt: skip
    lora = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    single = Trainer(
        load_config(TrainerConfig, [], **common, lora={**lora, "lr_ratio_b": 16}), dist.init_distributed("cpu")
    )
    single._build()
    assert lora_lrs(single.run_state.optimizer, single.model) == {"A": {1e-3}, "B": {1.6e-2}}

    runs = [
        {"name": f"{unique_run_id}-plus", "output_dir": str(tmp_path / "plus"), "lora": {**lora, "lr_ratio_b": 8}},
        {"name": f"{unique_run_id}-plain", "output_dir": str(tmp_path / "plain")},
    ]
    cfg = load_config(TrainerConfig, [], **common, lora={**lora, "publish": "adapter"}, runs=runs)
    multi = MultiRunTrainer(cfg, dist.init_distributed("cpu"))
    multi.model = multi._load_base_model()
    try:
        plus, plain = multi.add_run(cfg.runs[0]), multi.add_run(cfg.runs[1])
        assert lora_lrs(plus.optimizer, multi.model) == {"A": {1e-3}, "B": {8e-3}}
        assert lora_lrs(plain.optimizer, multi.model) == {"A": {1e-3}, "B": {1e-3}}
    finally:
        multi._close()
