"""Attention over the paged KV cache, in plain torch (CPU and GPU; the Triton decode kernel in
triton_kernels.py replaces `decode_attention` on CUDA when it passes its self-check at load).

Cache layout (per layer, keys and values alike): `[num_blocks, block_size, kv_heads, head_dim]`; a row's
token at position p is at `cache[table[p // block_size], p % block_size]`.

- Decode: one query per row. The row's blocks are gathered (`cache[table[:, :width]]`, a fixed width in
  blocks so the step has static shapes) and `scaled_dot_product_attention` reads positions < the row's
  context length (boolean mask), grouped-query heads included.
- Prefill: the new tokens of several sequences, packed flat [T, heads, head_dim], each attending to its
  own cached prefix (prefix-cache hits) and to its earlier new tokens. Their keys were already written to
  the cache, so each sequence's keys are gathered from it, and queries are padded per sequence: one SDPA
  call per layer with a [n, 1, Lq, Lk] mask (`PrefillLayout`, built once per prefill on the host).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, context: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # fmt: skip
    """q [R, heads, D], table [R, width] block ids, context [R] lengths -> [R, heads, D]."""
    rows, heads, _ = q.shape
    _, page, kv_heads, dim = k_cache.shape
    index = table.reshape(-1).long()  # index_select on 2-d views: several times faster than indexing on CPU
    blocks = k_cache.shape[0]
    keys = k_cache.view(blocks, -1).index_select(0, index).view(rows, -1, kv_heads, dim).transpose(1, 2)
    values = v_cache.view(blocks, -1).index_select(0, index).view(rows, -1, kv_heads, dim).transpose(1, 2)
    visible = torch.arange(keys.shape[2], device=q.device)[None, :] < context[:, None]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], keys, values, attn_mask=visible[:, None, None, :], scale=scale,
        enable_gqa=heads != keys.shape[1],
    )  # fmt: skip
    return out[:, :, 0, :]


@dataclass
class PrefillLayout:
    """How the flat new tokens of a prefill map onto padded per-sequence attention (device tensors)."""

    query_index: torch.Tensor  # [n, Lq] flat token index of each padded query (T = a zero pad row)
    key_slots: torch.Tensor  # [n, Lk] flat cache slot of each key position of each sequence
    mask: torch.Tensor  # [n, 1, Lq, Lk] True = may attend
    out_index: torch.Tensor  # [T] where each flat token's output sits in the [n * Lq] padded output

    @classmethod
    def build(cls, starts: list[int], new: list[int], tables: list[list[int]], block_size: int,
              device: torch.device) -> PrefillLayout:  # fmt: skip
        """Sequence i has `starts[i]` cached tokens, then `new[i]` new ones (flat, in order), blocks `tables[i]`."""
        n, lq, lk = len(new), max(new), max(s + q for s, q in zip(starts, new, strict=True))
        total = sum(new)
        query_index = torch.full((n, lq), total, dtype=torch.long)
        key_slots = torch.zeros(n, lk, dtype=torch.long)
        mask = torch.zeros(n, 1, lq, lk, dtype=torch.bool)
        mask[:, :, :, 0] = True  # pad queries see one key (a fully masked row would give NaN)
        out_index = torch.empty(total, dtype=torch.long)
        offset = 0
        columns = torch.arange(lk)
        for i, (start, count, table) in enumerate(zip(starts, new, tables, strict=True)):
            query_index[i, :count] = torch.arange(offset, offset + count)
            out_index[offset : offset + count] = torch.arange(i * lq, i * lq + count)
            length = start + count
            blocks = torch.tensor(table, dtype=torch.long)
            positions = columns[:length]
            key_slots[i, :length] = blocks[positions // block_size] * block_size + positions % block_size
            # query j (position start + j) sees keys at positions <= start + j
            mask[i, 0, :count, :] = columns[None, :] <= (start + torch.arange(count))[:, None]
            offset += count
        return cls(*(t.to(device, non_blocking=True) for t in (query_index, key_slots, mask, out_index)))


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: PrefillLayout,
                      scale: float) -> torch.Tensor:  # fmt: skip
    """q [T, heads, D] (flat new tokens) -> [T, heads, D]."""
    total, heads, dim = q.shape
    padded = torch.cat([q, q.new_zeros(1, heads, dim)])[layout.query_index]  # [n, Lq, heads, D]
    kv_heads = k_cache.shape[2]
    n, lk = layout.key_slots.shape
    slots = layout.key_slots.view(-1)
    keys = k_cache.view(-1, kv_heads, dim).index_select(0, slots).view(n, lk, kv_heads, dim).transpose(1, 2)
    values = v_cache.view(-1, kv_heads, dim).index_select(0, slots).view(n, lk, kv_heads, dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        padded.transpose(1, 2), keys, values, attn_mask=layout.mask, scale=scale, enable_gqa=heads != kv_heads
    )  # [n, heads, Lq, D]
    return out.transpose(1, 2).reshape(-1, heads, dim)[layout.out_index]
