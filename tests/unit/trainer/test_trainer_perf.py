"""FLOPs per token, peak FLOP/s and the MFU meter."""

from __future__ import annotations

import pytest
import torch
from gyre_trainer import perf
from gyre_trainer.perf import MFUMeter, effective_seq_len, flops_per_token, gpu_peak_flops, non_embedding_params
from transformers import LlamaConfig, LlamaForCausalLM


def counted_non_embedding(model) -> int:
    """Stored parameters minus the input embedding table (a tied head is counted once, as the head)."""
    total = sum(p.numel() for p in model.parameters())
    if model.config.tie_word_embeddings:
        return total  # the shared matrix is the LM head's; the lookup costs no matmul
    return total - model.get_input_embeddings().weight.numel()


def test_non_embedding_params_of_the_tiny_model(tiny_llama):
    assert non_embedding_params(tiny_llama.config) == counted_non_embedding(tiny_llama)


@pytest.mark.parametrize(
    "overrides",
    [
        {"num_key_value_heads": 2, "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True},
        {"num_key_value_heads": 1, "head_dim": 48, "tie_word_embeddings": False},
    ],
)
def test_non_embedding_params_of_gqa_bias_and_tied_variants(overrides):
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        **overrides,
    )
    assert non_embedding_params(config) == counted_non_embedding(LlamaForCausalLM(config))


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "qwen3-attention-bias", "mistral"])
def test_non_embedding_params_of_the_other_supported_families(kind):
    # Qwen2/2.5 has q/k/v biases without an `attention_bias` key, Qwen3 a q_norm and k_norm per layer: both were
    # left out of N
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, _, variant = kind.partition("-")
    extra = {"attention_bias": True} if variant else {}
    config = AutoConfig.for_model(
        model_type, vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=False, **extra,
    )  # fmt: skip
    assert non_embedding_params(config) == counted_non_embedding(AutoModelForCausalLM.from_config(config))


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_flops_per_token_equal_torchs_count_of_a_real_forward_and_backward(model_type):
    """An independent count: torch's FlopCounterMode over the forward and backward of a row of T tokens (eager
    attention computes the whole T×T square, as the formula counts it). Norms hold parameters but no matmul."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type, vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    tokens = 48
    ids = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    # heads·head_dim = 128 is not hidden_size = 64: the attention term takes the former
    assert counter.get_total_flops() / tokens == flops_per_token(config, tokens) - 6 * norms


def test_lora_flops_per_token_leave_out_the_frozen_weights_gradients():
    """A LoRA run (every linear layer of the decoder, the default targets) against FlopCounterMode: frozen weights
    pass the gradient on but get none themselves. 6·N read 27 % too high here; what remains is the first layer's
    input-side gradient, which autograd skips (the embeddings are frozen) and the formula counts (~1/L of 2·N)."""
    from types import SimpleNamespace

    from gyre_trainer.lora import apply_lora
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
    )  # fmt: skip
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model = apply_lora(model, SimpleNamespace(rank=4, alpha=8.0, dropout=0.0, target_modules=targets))
    tokens = 48
    ids = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    measured = counter.get_total_flops() / tokens
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
    lora = flops_per_token(config, tokens, non_embedding_params(config) - norms, adapter_params=adapter)
    assert abs(lora - measured) / measured < 0.035
    assert flops_per_token(config, tokens) - 6 * norms > 1.25 * measured  # what a LoRA run was credited with


def test_flops_per_token_formula():
    config = LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4
    )
    n = non_embedding_params(config)
    assert flops_per_token(config, 100) == 6 * n + 12 * 3 * 64 * 100
    assert flops_per_token(config, 0, num_params=10) == 60


def test_effective_seq_len_weights_each_token_by_its_own_sample():
    assert effective_seq_len([4]) == 4
    assert effective_seq_len([2, 6]) == pytest.approx((4 + 36) / 8)  # 5, not the row's 8 nor the mean 4
    assert effective_seq_len([]) == 0


def test_gpu_peak_table_matches_device_names():
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert gpu_peak_flops("NVIDIA H100 NVL") == 835e12
    assert gpu_peak_flops("NVIDIA H200") == 989e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert gpu_peak_flops("NVIDIA L40S") == 362e12
    assert gpu_peak_flops("NVIDIA L4") == 121e12
    assert gpu_peak_flops("NVIDIA A10") == 125e12
    assert gpu_peak_flops("NVIDIA GeForce GTX 1080") is None  # not in the table: measured instead


def test_cpu_peak_is_the_documented_nominal_figure_not_a_measurement(monkeypatch):
    monkeypatch.setattr(perf, "measure_matmul_peak", lambda *a, **k: pytest.fail("CPU peaks are not measured"))
    threads = torch.get_num_threads()
    assert perf.peak_flops("cpu", torch.float32) == perf.CPU_PEAK_FLOPS_PER_THREAD * threads == 96e9 * threads


def test_primerl_formula_on_the_qwen3_shape():
    """Qwen3-0.6B: 596M matmul parameters (tied head counted once), attention width = hidden = 1024."""
    from transformers import Qwen3Config

    config = Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
    )  # fmt: skip
    matmul = 28 * (1024 * 128 * (2 * 16 + 2 * 8) + 3 * 3072 * 1024) + 151936 * 1024
    assert perf.primerl_flops_per_token(config, 8192) == 6 * matmul + 12 * 28 * 1024 * 8192
    assert 5.9e8 < matmul < 6.0e8


def test_measured_matmul_peak_is_a_plausible_rate():
    peak = perf.measure_matmul_peak(torch.device("cpu"), torch.float32, size=256, seconds=0.05)
    assert 1e8 < peak < 1e14  # between a 2010 laptop core and a whole modern server


def test_mfu_meter_by_hand():
    meter = MFUMeter(flops_per_token=1e6, peak_flops=1e10, world_size=2)
    reading = meter.update(tokens=4000, seconds=2.0)
    assert reading.tokens_per_s == 2000
    assert reading.mfu == pytest.approx(2000 * 1e6 / 2e10)
    meter.update(tokens=2000, seconds=2.0)
    assert meter.total().tokens_per_s == 1500
    assert meter.reading(10, 0.0).mfu == 0.0
    with pytest.raises(ValueError):
        MFUMeter(0.0, 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_peak_comes_from_the_table_or_a_measurement():
    peak = perf.peak_flops("cuda", torch.bfloat16)
    table = gpu_peak_flops(torch.cuda.get_device_name())
    assert peak == table if table else peak > 1e12
