"""Load the policy and compute log-probs of packed rows in which attention never crosses samples.

Packing: a row holds several samples back to back and `position_ids` restart at 0 at every
sample. We pass those position ids WITHOUT an attention mask; transformers (>= 4.54, the `masking_utils`
path every modern decoder uses) then detects the restarts and builds a block-diagonal causal mask
for sdpa/eager/flex, and flash-attention uses them as varlen boundaries. The test
`test_packed_equals_unpacked` proves on the real model that a packed row's log-probs equal each
sample run alone; if a model class bypassed that path the test is what would catch it.

Alignment (docs/architecture.md): logprob[t] = log p(input_ids[t] | the tokens before t in the same
sample) at the given temperature, and exactly 0 at each sample's first token (nothing precedes it).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from gyre.config.shared import ModelConfig
from torch import Tensor

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """`auto` -> cuda when available, else cpu."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` = float32 on CPU (bf16 matmuls are slow there), bfloat16 on GPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}: use auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def load_model(
    model_cfg: ModelConfig,
    device: str | torch.device = "auto",
    dtype: torch.dtype | None = None,
    *,
    activation_checkpointing: bool = False,
    attn_implementation: str = "sdpa",
):
    """The HF causal LM in `model_cfg.name`, on `device`, in training mode, without a KV cache.

    `dtype` overrides `model_cfg.dtype`. With `activation_checkpointing`, every decoder layer's
    activations are recomputed in backward (non-reentrant checkpointing, which FSDP2 supports).
    """
    from transformers import AutoModelForCausalLM

    device = resolve_device(device)
    dtype = dtype or resolve_dtype(model_cfg.dtype, device)
    path = Path(model_cfg.name)
    # A hub id is "org/name"; anything else that does not exist is a missing local folder.
    if not path.exists() and (path.is_absolute() or model_cfg.name.startswith(".") or model_cfg.name.count("/") > 1):
        raise FileNotFoundError(f"model folder {path} does not exist (create one with `gyre model init`)")
    model = AutoModelForCausalLM.from_pretrained(model_cfg.name, dtype=dtype, attn_implementation=attn_implementation)
    model.config.use_cache = False
    if activation_checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x; the old name warns
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model.to(device).train()


def load_tokenizer(model_cfg: ModelConfig):
    """The tokenizer saved next to the model (weights published by the trainer carry it along)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_cfg.name)


def _as_lengths(lengths, device: torch.device) -> Tensor:
    if isinstance(lengths, Tensor):
        return lengths.to(device=device, dtype=torch.long)
    return torch.as_tensor(np.asarray(lengths, dtype=np.int64), device=device)


def packed_logprobs(
    model,
    input_ids: Tensor,
    position_ids: Tensor,
    sample_lengths: Tensor | Sequence[Tensor] | Sequence[int],
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Log-probs (with grad) and entropies (detached) of packed rows; shapes equal `input_ids`'s.

    `input_ids`/`position_ids`: (T,) for one row or (B, T) for B rows of equal length (pad a short
    row with an extra padding "sample" whose positions also restart at 0). `sample_lengths`: the
    row's lengths, or a sequence of B per-row lengths; each row's lengths sum to T.
    logprob[t] = log softmax(logits[t−1] / temperature)[input_ids[t]] within a sample, 0 at every
    sample's first token; entropy[t] is the entropy of that same distribution (0 at first tokens).
    Log-probs are computed in float32 (float64 for a float64 model) whatever the model's dtype.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    single_row = input_ids.dim() == 1
    ids = input_ids.unsqueeze(0) if single_row else input_ids
    pos = position_ids.unsqueeze(0) if single_row else position_ids
    rows = [sample_lengths] if single_row else list(sample_lengths)
    if ids.shape != pos.shape or len(rows) != ids.shape[0]:
        raise ValueError(
            f"packed_logprobs: input_ids {tuple(ids.shape)}, position_ids {tuple(pos.shape)} "
            f"and {len(rows)} rows of sample_lengths disagree"
        )
    starts = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
    for row, lengths in enumerate(rows):
        lengths = _as_lengths(lengths, ids.device)
        if int(lengths.sum()) != ids.shape[1]:
            total = int(lengths.sum())
            raise ValueError(f"packed_logprobs: row {row} sample_lengths sum to {total}, not {ids.shape[1]}")
        starts[row, torch.cumsum(lengths, 0) - lengths] = True

    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    # Position t−1 predicts token t; at a sample's first token that "prediction" comes from the
    # previous sample and is discarded below.
    scaled = logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    targets = ids[:, 1:].long().unsqueeze(-1)
    log_norm = torch.logsumexp(scaled, dim=-1)
    next_lp = scaled.gather(-1, targets).squeeze(-1) - log_norm
    with torch.no_grad():
        probs = torch.softmax(scaled, dim=-1)
        next_entropy = log_norm - (probs * scaled).sum(-1)
    zero = torch.zeros_like(next_lp[:, :1])
    logprobs = torch.where(starts, 0.0, torch.cat([zero, next_lp], dim=1))
    entropy = torch.where(starts, 0.0, torch.cat([zero.detach(), next_entropy], dim=1))
    if single_row:
        return logprobs.squeeze(0), entropy.squeeze(0)
    return logprobs, entropy
