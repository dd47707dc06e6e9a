"""LoRA (`gyre_trainer.lora`, peft): adapters-only training, merged weights that reload in transformers
and equal base + adapter, and the adapter alone in PEFT's format."""

from __future__ import annotations

from types import SimpleNamespace

import peft
import pytest
import torch
from gyre.config.trainer import OptimConfig
from gyre.lora import split_lora
from gyre_trainer.lora import apply_lora, merged_state_dict
from gyre_trainer.optim import build_optimizer

CFG = SimpleNamespace(rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])


def lora_model(tiny_model):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), CFG)
    with torch.no_grad():  # peft starts B at zero (a no-op adapter): give it a real delta
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


def test_only_adapters_train_and_the_base_stays_bit_identical(tiny_model):
    model = lora_model(tiny_model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2))
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(trainable)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(3, 1000, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == trainable


def test_merged_weights_reload_in_transformers_and_equal_base_plus_adapter(tiny_model, tmp_path):
    from gyre_trainer.publish import write_hf_folder
    from transformers import AutoModelForCausalLM

    model = lora_model(tiny_model).eval()
    merged = merged_state_dict(model.state_dict(), CFG)
    base_names = set(AutoModelForCausalLM.from_pretrained(tiny_model).state_dict())
    assert set(merged) == base_names
    write_hf_folder(tmp_path / "merged", merged, model.get_base_model().config, tiny_model)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = torch.randint(3, 1000, (2, 24))
    with torch.no_grad():
        expected = model(input_ids=ids).logits  # base + adapter, computed by peft
        got = reloaded(input_ids=ids).logits
        peft_merged = model.merge_and_unload()(input_ids=ids).logits
    assert torch.allclose(got, expected, atol=1e-5, rtol=0)
    assert torch.allclose(got, peft_merged, atol=1e-5, rtol=0)


def test_adapter_alone_is_published_in_peft_format_and_reapplies_to_the_base(tiny_model, tmp_path):
    from gyre.transport import FolderStore
    from gyre.weights import WeightStore
    from gyre_trainer.publish import STEP_RECORD, WeightPublisher
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = lora_model(tiny_model).eval()
    store = FolderStore(tmp_path / "weights")
    version = WeightPublisher(store, tiny_model, 2).publish_adapter(5, model.state_dict(), CFG, {"step": 5})
    folder = version.path
    manifest = WeightStore(tmp_path / "weights").verify(5, version.digest)
    assert set(manifest.files) == {"adapter_model.safetensors", "adapter_config.json", STEP_RECORD}
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    reloaded = peft.PeftModel.from_pretrained(base, folder).eval()
    ids = torch.randint(3, 1000, (1, 20))
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5, rtol=0)
    _, adapters = split_lora(load_file(folder / "adapter_model.safetensors"))
    assert set(adapters) == {
        f"model.layers.{i}.{m}" for i in range(4) for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
    }


def test_merged_weights_keep_a_peft_adapter_folder_that_peft_loads_onto_the_base(tiny_model, tmp_path):
    """A merged LoRA version (`lora.publish = "merged"`, the default) is two exports: the folder, a full model that
    transformers and vLLM load, and its `lora/`, the trained adapter, which peft (and `vllm serve --lora-modules`)
    load onto the base. `lora/` held the tensors without `adapter_config.json`: no loader took it."""
    from gyre.transport import FolderStore
    from gyre.weights import WeightStore
    from gyre_trainer.lora import adapter_state_dict
    from gyre_trainer.publish import WeightPublisher
    from transformers import AutoModelForCausalLM

    model = lora_model(tiny_model).eval()
    state = model.state_dict()
    publisher = WeightPublisher(FolderStore(tmp_path / "weights"), tiny_model, 2)
    version = publisher.publish(3, merged_state_dict(state, CFG), model.get_base_model().config, {"step": 3},
                                adapter=adapter_state_dict(state), lora_cfg=CFG)  # fmt: skip
    manifest = WeightStore(tmp_path / "weights").verify(3, version.digest)
    assert {"lora/adapter_model.safetensors", "lora/adapter_config.json"} <= set(manifest.files)
    ids = torch.randint(3, 1000, (1, 20))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(version.path, dtype=torch.float32).eval()
        base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        adapter = peft.PeftModel.from_pretrained(base, version.path / "lora").eval()
        assert torch.allclose(merged(input_ids=ids).logits, expected, atol=1e-5, rtol=0)
        assert torch.allclose(adapter(input_ids=ids).logits, expected, atol=1e-5, rtol=0)


def test_loraplus_gives_lora_b_its_own_lr_and_the_schedule_keeps_the_ratio(tiny_model):
    from gyre_trainer.optim import build_scheduler

    model = lora_model(tiny_model)
    cfg = OptimConfig(lr=1e-3, warmup_steps=2)
    optimizer = build_optimizer(model, cfg, lora_b_lr_ratio=16.0)
    scheduler = build_scheduler(optimizer, cfg, None)
    names = {id(p): n for n, p in model.named_parameters()}
    b_groups = [g for g in optimizer.param_groups if any(".lora_B." in names[id(p)] for p in g["params"])]
    assert len(b_groups) == 1 and all(".lora_B." in names[id(p)] for p in b_groups[0]["params"])
    assert optimizer.param_groups[0]["lr"] == 5e-4  # the logged lr is the base one (warm-up 1/2)
    assert b_groups[0]["lr"] == 16 * 5e-4
    # AdamW's first update moves every parameter with a gradient by its group's lr
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    ids = torch.randint(3, 1000, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    scheduler.step()
    for name, p in model.named_parameters():
        if name in before:
            expected = 16 * 5e-4 if ".lora_B." in name else 5e-4
            assert (p - before[name]).abs().max().item() == pytest.approx(expected, rel=1e-3), name
    assert b_groups[0]["lr"] == 16 * optimizer.param_groups[0]["lr"] == 16 * 1e-3


def test_loraplus_ratio_one_keeps_the_plain_groups(tiny_model):
    model = lora_model(tiny_model)
    plain = build_optimizer(model, OptimConfig(lr=1e-3))
    same = build_optimizer(model, OptimConfig(lr=1e-3), lora_b_lr_ratio=1.0)
    assert [len(g["params"]) for g in plain.param_groups] == [len(g["params"]) for g in same.param_groups]
    assert {g["lr"] for g in same.param_groups} == {1e-3}


def test_an_adapter_on_lm_head_merges_into_weights_that_reload_equal(tiny_model, tmp_path):
    from gyre_trainer.publish import write_hf_folder
    from transformers import AutoModelForCausalLM

    cfg = SimpleNamespace(rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "lm_head"])
    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    assert any("lm_head.lora_B" in n for n, p in model.named_parameters() if p.requires_grad)
    merged = merged_state_dict(model.state_dict(), cfg)
    base = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    assert set(merged) == set(base) and not torch.equal(merged["lm_head.weight"], base["lm_head.weight"])
    write_hf_folder(tmp_path / "merged", merged, model.get_base_model().config, tiny_model)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = torch.randint(3, 1000, (2, 24))
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5, rtol=0)


def test_an_adapter_on_a_tied_lm_head_is_refused_naming_the_key(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    tied = LlamaForCausalLM(config)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    cfg = SimpleNamespace(rank=2, alpha=4.0, dropout=0.0, target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match=r"trainer\.lora\.target_modules: 'lm_head' is tied"):
        apply_lora(tied, cfg)
    apply_lora(tied, SimpleNamespace(rank=2, alpha=4.0, dropout=0.0, target_modules=["q_proj"]))  # the rest still works


def test_wrapping_a_model_in_lora_warns_nothing_its_user_cannot_act_on(tiny_model):
    """peft reads transformers' deprecated `is_gradient_checkpointing`: every LoRA run's log had its FutureWarning."""
    import warnings

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_lora(model, CFG)
    assert not [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
