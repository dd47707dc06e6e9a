"""Which attention kernel trains packed rows, and the per-forward arguments it needs.

A packed row holds several samples back to back; attention must stay inside each sample (a
block-diagonal causal mask). The implementations differ in how much of the T×T square they compute:

| name                | where       | how packing is handled                                              |
|---------------------|-------------|---------------------------------------------------------------------|
| `sdpa`              | CPU, GPU    | transformers builds a dense [T, T] block-diagonal mask from the      |
|                     |             | restarting position ids; on GPU that forces the memory-efficient     |
|                     |             | kernel over the full square (0.52× of the unpacked speed on an H100) |
| `flex_attention`    | GPU         | a BlockMask from the position ids: only diagonal blocks are computed |
|                     |             | (the kernel is compiled by torch on first use)                       |
| `flash_attention_2` | GPU         | the `flash-attn` package's varlen kernel (when it is installed),    |
|                     |             | given the same `cu_seqlens` as `varlen` (from the sample lengths)    |
| `varlen`            | GPU         | torch's own flash varlen kernel (`torch.nn.attention.varlen`,        |
|                     |             | torch >= 2.10): `cu_seqlens` from the sample lengths, no mask at all  |

`auto` (the default) = `flash_attention_2` if `flash_attn` is importable, else `varlen` if this torch
has it, else `flex_attention` on CUDA; `sdpa` on CPU (the dense mask of a short CPU row is cheap, and
`sdpa` is the fastest CPU path). Every implementation is tested for packed == each sample alone on
the machines where it can run (tests/unit/trainer/test_trainer_model.py, `gpu`-marked on CUDA).
"""

from __future__ import annotations

import importlib.util
import inspect
from typing import Any

import torch
from torch import Tensor

VARLEN = "gyre_varlen"  # the name registered with transformers' AttentionInterface
IMPLEMENTATIONS = ("auto", "sdpa", "eager", "flex_attention", "flash_attention_2", "varlen")


def _torch_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def resolve_attn_implementation(name: str, device: torch.device | str) -> str:
    """The transformers `attn_implementation` for config value `name` on `device` (see the module docstring)."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attn_implementation {name!r}: use one of {', '.join(IMPLEMENTATIONS)}")
    cuda = torch.device(device).type == "cuda"
    if name == "auto":
        if not cuda:
            return "sdpa"
        if importlib.util.find_spec("flash_attn") is not None:
            return "flash_attention_2"
        name = "varlen" if _torch_varlen() is not None else "flex_attention"
    if name == "varlen":
        if not cuda or _torch_varlen() is None:
            raise ValueError("attn_implementation 'varlen' needs CUDA and torch >= 2.10 (torch.nn.attention.varlen)")
        register_varlen()
        return VARLEN
    if name == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ValueError("attn_implementation 'flash_attention_2' needs the flash-attn package")
    return name


#: transformers' flash-attn implementations: given `cu_seq_lens_*` they run the varlen kernel over the flattened
#: rows. Without them they find the samples from the position ids only for ONE row (`_is_packed_sequence` requires
#: batch size 1): a micro-batch of several rows ran plain causal attention across the samples of each row.
_FLASH = ("flash_attention_2", "flash_attention_3")


def uses_varlen(model) -> bool:
    """True when the model's attention needs `varlen_kwargs` to keep the samples of packed rows apart."""
    return getattr(model.config, "_attn_implementation", None) in (VARLEN, *_FLASH)


def varlen_kwargs(row_lengths: list[Tensor], device: torch.device) -> dict[str, Any]:
    """Forward kwargs of a varlen model for B rows: every sample of every row is one sequence of the
    flattened (B·T) batch; transformers hands these kwargs to each attention call."""
    lengths = torch.cat([torch.as_tensor(r, dtype=torch.int32).cpu() for r in row_lengths])
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    torch.cumsum(lengths, 0, out=cu_seqlens[1:])
    longest = int(lengths.max()) if len(lengths) else 0
    cu_seqlens = cu_seqlens.to(device, non_blocking=True)
    return {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": longest, "max_length_k": longest}


# How this torch's varlen_attn spells causality, and whether it takes fewer KV heads (set at registration).
_VARLEN_CAUSAL: dict[str, Any] = {}
_VARLEN_NATIVE_GQA: list[bool] = []


def _varlen_forward(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers attention function: (B, H, T, D) q/k/v -> (B, T, H, D), causal within each sequence."""
    if attention_mask is not None or "cu_seq_lens_q" not in kwargs:
        raise ValueError(
            "the varlen attention trains packed rows only: call it through gyre_trainer.model.packed_logprobs "
            "(it passes cu_seq_lens_q/k), without an attention mask"
        )
    batch, heads, length, head_dim = query.shape
    kv_heads = key.shape[1]
    q = query.transpose(1, 2).reshape(batch * length, heads, head_dim)
    k = key.transpose(1, 2).reshape(batch * length, kv_heads, head_dim)
    v = value.transpose(1, 2).reshape(batch * length, kv_heads, head_dim)
    options = dict(_VARLEN_CAUSAL)
    if kv_heads != heads:
        if _VARLEN_NATIVE_GQA[0]:
            options["enable_gqa"] = True
        else:  # an older torch without native grouped-query support
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
    out = _torch_varlen()(
        q,
        k,
        v,
        kwargs["cu_seq_lens_q"],
        kwargs["cu_seq_lens_k"],
        kwargs["max_length_q"],
        kwargs["max_length_k"],
        scale=scaling,
        **options,
    )
    return out.reshape(batch, length, heads, head_dim), None


def register_varlen() -> None:
    """Register torch's varlen kernel with transformers under `VARLEN` (idempotent). Not registering a
    mask function for it is deliberate: transformers then skips mask creation altogether."""
    from transformers import AttentionInterface

    if not _VARLEN_CAUSAL:
        params = inspect.signature(_torch_varlen()).parameters
        # torch 2.10/2.11 spell causality `is_causal=True`; later versions `window_size=(-1, 0)`.
        _VARLEN_CAUSAL.update({"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True})
        _VARLEN_NATIVE_GQA.append("enable_gqa" in params)
    AttentionInterface.register(VARLEN, _varlen_forward)
