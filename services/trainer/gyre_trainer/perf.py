"""Model FLOPs utilisation: FLOPs per token, the device's peak, and a meter.

FLOPs per trained token (forward + backward), as PaLM (appendix B), torchtitan and PRIME-RL count them:

    6·N + 12·L·H·T

- N = non-embedding parameters: every matmul weight (attention, MLP, the LM head) and the norms,
  but NOT the input embedding, which is a table lookup, not a matmul. For an untied model that
  is all parameters minus vocab·hidden; a tied model's head still counts once.
- 12·L·H·T: attention scores and the weighted sum (QKᵀ and AV, 2·H·T multiply-adds = 4·H·T FLOPs per token
  and layer, ×3 for forward + backward), H = num_heads·head_dim, T = the attended context. Like
  torchtitan we do not halve it for the causal mask. With packing a token only attends within its
  own sample, so pass `effective_seq_len(sample_lengths)` (Σl²/Σl) as T, not the row length.

LoRA (the base frozen, adapters on the decoder layers' linear layers): the frozen weights still pass the
gradient on (2 of their 6 FLOPs per parameter) but get no weight gradient, so a token costs 4·N + 6·N_adapter +
12·L·H·T; 6·N put a LoRA run's MFU 27–38 % too high (torch's FlopCounterMode on a tiny model). The first
layer's inputs need no gradient (frozen embeddings), which this still counts: ~1/L of the 4·N's backward half.

PRIME-RL counts differently, and its figure is printed beside ours by `gyre bench trainer` to compare
with its published numbers (`primerl_flops_per_token`): 6·N_mm + 12·L·hidden·seq_len, where N_mm are
the matmul parameters (q, k, v, o, MLP, LM head), the attention width is `hidden_size` (not
heads·head_dim: 1024 vs 2048 for Qwen3-0.6B) and seq_len is the ROW length, as if every token
attended to a whole row: for packed rows it counts attention work the kernels never do.

Peak: a table of dense (no sparsity) bf16/fp16 tensor-core peaks by GPU name (vendor datasheets;
the same figures torchtitan and PRIME-RL use); an unknown GPU, or fp32 on a GPU, is MEASURED with a
large matmul once per process. A CPU has no datasheet tensor peak and a matmul measured in a busy
process mostly measures the load (it made CPU MFU read 40–97 %), so CPUs use a documented nominal
peak instead: `CPU_PEAK_FLOPS_PER_THREAD` (32 FLOP/cycle — two 8-lane fp32 FMA units, AVX2 — at
3 GHz = 96 GFLOP/s) times torch's thread count. CPU MFU is therefore comparable between runs on one
machine, not a hardware utilisation to quote.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# (regex on torch.cuda.get_device_name(), dense bf16/fp16 FLOP/s). First match wins: specific names first.
GPU_PEAK_BF16: tuple[tuple[str, float], ...] = (
    (r"H100.*NVL", 835e12),
    (r"H100.*PCIe", 756e12),
    (r"H100|GH200", 989e12),
    (r"H200.*NVL", 835e12),
    (r"H200", 989e12),
    (r"B200", 2250e12),
    (r"A100", 312e12),
    (r"L40S", 362e12),
    (r"L40\b", 181e12),
    (r"\bL4\b", 121e12),
    (r"\bA10\b", 125e12),
    (r"MI300X|MI325X", 1307e12),
    (r"MI250X", 191.5e12),  # per GCD (one torch device)
)


def gpu_peak_flops(device_name: str) -> float | None:
    """Dense bf16/fp16 peak of a GPU from its `torch.cuda.get_device_name()`, None if not in the table."""
    for pattern, flops in GPU_PEAK_BF16:
        if re.search(pattern, device_name):
            return flops
    return None


def non_embedding_params(hf_config) -> int:
    """N for a Llama-style decoder (Llama, Mistral, Qwen2/3): attention, gated MLP, norms, LM head.

    Qwen2 (and Qwen2.5, same `model_type`) always has q/k/v biases and no `attention_bias` key; Qwen3 adds an
    RMSNorm over each head's queries and keys (`q_norm`, `k_norm`). Checked against the real transformers models.
    """
    c = hf_config
    hidden, layers, vocab = c.hidden_size, c.num_hidden_layers, c.vocab_size
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    model_type = getattr(c, "model_type", "")
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o and k, v
    if getattr(c, "attention_bias", False) or model_type == "qwen2":
        attn += heads * head_dim + 2 * kv_heads * head_dim  # q, k, v biases
    if getattr(c, "attention_bias", False):
        attn += hidden  # o bias (Llama, Qwen3; Qwen2's o_proj has none)
    mlp = 3 * hidden * c.intermediate_size
    if getattr(c, "mlp_bias", False):
        mlp += 2 * c.intermediate_size + hidden
    norms = 2 * hidden + (2 * head_dim if model_type == "qwen3" else 0)  # Qwen3: q_norm, k_norm
    return layers * (attn + mlp + norms) + hidden + vocab * hidden  # + final norm + LM head


def flops_per_token(hf_config, seq_len: float, num_params: int | None = None, *, adapter_params: int = 0) -> float:
    """6·N + 12·L·H·T (see the module docstring); `num_params` overrides the analytic N (e.g. MoE).

    `adapter_params` > 0: a LoRA run training that many adapter parameters on the frozen N,
    4·N + 6·adapter_params + 12·L·H·T."""
    n = num_params if num_params is not None else non_embedding_params(hf_config)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    attention_width = hf_config.num_attention_heads * head_dim
    weights = 4.0 * n + 6.0 * adapter_params if adapter_params else 6.0 * n
    return weights + 12.0 * hf_config.num_hidden_layers * attention_width * seq_len


def primerl_flops_per_token(hf_config, seq_len: float) -> float:
    """PRIME-RL's FLOPs per token (see the module docstring): 6·N_mm + 12·L·hidden·seq_len."""
    c = hf_config
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    per_layer = c.hidden_size * head_dim * (2 * heads + 2 * kv_heads) + 3 * c.intermediate_size * c.hidden_size
    matmul_params = c.num_hidden_layers * per_layer + c.vocab_size * c.hidden_size
    return 6.0 * matmul_params + 12.0 * c.num_hidden_layers * c.hidden_size * seq_len


def effective_seq_len(sample_lengths: Sequence[int]) -> float:
    """Token-weighted mean attended length Σl²/Σl: the T of `flops_per_token` for packed samples."""
    lengths = [int(x) for x in sample_lengths]
    total = sum(lengths)
    return sum(x * x for x in lengths) / total if total else 0.0


_MEASURED: dict[tuple, float] = {}


def measure_matmul_peak(
    device: torch.device, dtype: torch.dtype, size: int | None = None, seconds: float = 0.3
) -> float:
    """Best FLOP/s of square matmuls over about `seconds` (after a warm-up)."""
    size = size or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    a @ b
    sync()
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        sync()
        best = max(best, 4 * 2 * size**3 / (time.perf_counter() - start))
    return best


CPU_PEAK_FLOPS_PER_THREAD = 96e9  # nominal, see the module docstring


def peak_flops(device: torch.device | str, dtype: torch.dtype) -> float:
    """Peak FLOP/s the MFU denominator uses: the datasheet table for known GPUs in bf16/fp16, the
    nominal CPU peak times torch's threads on a CPU, else a measured matmul peak, cached for the
    process (per device and dtype)."""
    device = torch.device(device)
    if device.type == "cpu":
        return CPU_PEAK_FLOPS_PER_THREAD * torch.get_num_threads()
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        table = gpu_peak_flops(torch.cuda.get_device_name(device))
        if table is not None:
            return table
    key = (str(device), dtype, torch.get_num_threads())
    if key not in _MEASURED:
        _MEASURED[key] = measure_matmul_peak(device, dtype)
    return _MEASURED[key]


@dataclass
class MFUReading:
    tokens_per_s: float
    mfu: float


class MFUMeter:
    """Turns (tokens, seconds) of training into tokens/s and MFU in 0..1 (model FLOPs / peak FLOPs).

    `world_size` devices share the work: MFU divides by world_size·peak, tokens are the global count.
    Keeps running totals so `total()` is the whole run's average.
    """

    def __init__(self, flops_per_token: float, peak_flops: float, world_size: int = 1):
        if flops_per_token <= 0 or peak_flops <= 0 or world_size < 1:
            raise ValueError("MFUMeter: flops_per_token, peak_flops and world_size must be positive")
        self.flops_per_token = flops_per_token
        self.peak = peak_flops * world_size
        self.tokens = 0.0
        self.seconds = 0.0

    def reading(self, tokens: float, seconds: float) -> MFUReading:
        """tokens/s and MFU of one interval (0 when no time passed)."""
        rate = tokens / seconds if seconds > 0 else 0.0
        return MFUReading(tokens_per_s=rate, mfu=rate * self.flops_per_token / self.peak)

    def update(self, tokens: float, seconds: float) -> MFUReading:
        """Record one step and return its reading."""
        self.tokens += tokens
        self.seconds += seconds
        return self.reading(tokens, seconds)

    def total(self) -> MFUReading:
        return self.reading(self.tokens, self.seconds)
