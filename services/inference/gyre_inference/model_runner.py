"""The torch engine's model side: the paged KV cache, prefill and decode forwards, device sampling, and
CUDA graphs of the whole decode step.

Design (docs/inference.md, "Torch backend"): our own compact forward over the transformers model's own
modules (embeddings, norms, projections, rotary embedding, MLP, head), not transformers' forward with a
registered attention function. The weights stay the model's parameters (same names, swapped in place),
the LoRA adapter bank's forward hooks on the linear layers still fire, and every tensor of the step is
ours: the step is a fixed sequence of kernels over static buffers, captured once per batch-size bucket
as a CUDA graph and replayed with one launch. It fixes the families supported: Llama, Mistral, Qwen2
(no sliding window) and Qwen3 (q/k norms).

Decode step inputs live in static per-row buffers (`step_buffers.StepBuffers`): token, position, the cache slot its
key/value go to, context length, sampling parameters and the row's uniform, plus a per-row block table,
sparse biases and (structured outputs) a token bitmask. A row's CARRY flag makes the step take its input
token from the previous step's sample, still on the device (`out_tokens`), instead of from the host: the
engine can launch step n+1 before it has read step n's tokens (its overlapped loop, engine_loop.py). The
host fills their pinned mirrors and uploads them in a few copies per step; the graph reads them. One
forward graph per (rows, width) and one sampler graph per (rows, variant): the sampler's variants (top-k/
top-p/min-p sort, bitmask, top log-probs, biases) are chosen by the host from what the batch's rows ask,
so a plain RL batch never pays for them.
Rows beyond the live ones (the bucket's padding, finished rows) point at the null block 0 and compute
garbage nobody reads. The sampled tokens, their log-probs and top alternatives come back in one copy,
enqueued with the step (`launch`) and read when the host needs them (`collect`): `decode` = both at once.

On CPU (or `cuda_graphs=False`) the same step runs eagerly: one code path, tested on CPU.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from gyre_inference import paged_attention
from gyre_inference.sampling import TOP_LOGPROBS, sample
from gyre_inference.step_buffers import (
    CARRY,
    CONTEXT,
    IDS,
    MIN_P,
    POSITIONS,
    SLOTS,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    UNIFORM,
    StepBuffers,
    power_of_two,
)

log = logging.getLogger(__name__)

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
BLOCK_SIZE = 16
MIN_WIDTH_BLOCKS = 4  # the torch decode path's narrowest gather (64 positions)


def check_supported(config) -> None:
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        raise ValueError(f"the torch backend supports model types {', '.join(SUPPORTED)}; this model is {kind!r}")
    if getattr(config, "use_sliding_window", False) or (kind == "mistral" and getattr(config, "sliding_window", None)):
        raise ValueError("the torch backend supports full attention only; this model uses a sliding window")


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * dtype.itemsize


def buckets(max_rows: int) -> list[int]:
    """Batch sizes a decode graph is captured for: 1, 2, 4, 8, then every 16 up to 128, then every 32."""
    sizes = [1, 2, 4, 8, *range(16, 129, 16), *range(160, max_rows + 32, 32)]
    return sorted({min(size, max_rows) for size in sizes})


@dataclass(frozen=True)
class LaunchedStep:
    """A decode step enqueued on the device whose outputs the host has not read yet (`ModelRunner.launch`)."""

    rows: int
    outputs: list[torch.Tensor]  # the host buffers its outputs are copied to
    events: tuple | None  # CUDA: (start, end) events; end is recorded after the copy to `outputs`
    seconds: float  # CPU: how long the (eager, already finished) step took


@dataclass(frozen=True)
class Variant:
    """What a sampler graph computes beyond temperature sampling (chosen per step from the rows' needs)."""

    filtered: bool = False  # top-k / top-p / min-p (one sort over the vocabulary)
    masked: bool = False  # a structured-output token bitmask
    top_n: int = 0  # top log-probs reported (0 or TOP_LOGPROBS)
    bias_width: int = 0  # sparse bias entries per row (0 = none)
    # vLLM's penalties (sampling.Penalties): such a step runs eagerly, never as CUDA graphs (their per-row counts are
    # written between steps by ops of their own; the graphs stay as they were for every other step)
    penalised: bool = False


def _eps(norm) -> float:
    return getattr(norm, "variance_epsilon", None) or norm.eps


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The RMSNorm of Llama/Qwen (float32 statistics, the weight applied in the input's dtype)."""
    y = x.float()
    return weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class TorchOps:
    """The fused decode step's operations in plain torch: the reference the Triton kernels are checked
    against (triton_kernels.self_check), and a CPU-testable stand-in for them (same layer wiring)."""

    name = "torch"

    def decode_attention(self, q, k_cache, v_cache, table, context, scale):
        return paged_attention.decode_attention(q, k_cache, v_cache, table, context, scale)

    def add_rms_norm(self, delta, residual, weight, eps):
        summed = residual if delta is None else residual + delta
        return _rms_norm(summed, weight, eps), summed

    def rope_and_write(self, q, k, v, cos, sin, q_weight, k_weight, eps, k_cache, v_cache, slots):
        if q_weight is not None:
            q, k = _rms_norm(q, q_weight, eps), _rms_norm(k, k_weight, eps)
        cos, sin = cos[:, None, :], sin[:, None, :]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        _, _, kv_heads, dim = k_cache.shape
        k_cache.view(-1, kv_heads, dim).index_copy_(0, slots, k)
        v_cache.view(-1, kv_heads, dim).index_copy_(0, slots, v)
        return q

    def silu_mul(self, gate, up):
        return torch.nn.functional.silu(gate) * up


class ModelRunner:
    """Paged KV cache + prefill + the decode step of one causal LM (see the module docstring)."""

    def __init__(self, model, *, rows: int, num_blocks: int, max_model_len: int, cuda_graphs: bool,
                 block_size: int = BLOCK_SIZE):  # fmt: skip
        check_supported(model.config)
        self.model, self.rows, self.block_size = model, rows, block_size
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        base = model.model
        self._layers = list(base.layers)
        first = self._layers[0].self_attn
        self._rope = sys.modules[type(first).__module__].apply_rotary_pos_emb
        config = model.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scale = first.scaling
        self.vocab = model.lm_head.out_features
        self.num_blocks = num_blocks
        self.max_blocks = -(-max_model_len // block_size) + 1
        shape = (num_blocks, block_size, self.kv_heads, self.head_dim)
        # On CPU blocks are zeroed when first handed out (kv_cache.BlockPool), so untouched memory stays unmapped.
        make = torch.zeros if self.device.type == "cuda" else torch.empty
        self.k_cache = [make(shape, dtype=self.dtype, device=self.device) for _ in self._layers]
        self.v_cache = [make(shape, dtype=self.dtype, device=self.device) for _ in self._layers]
        self._zeroed = 0 if make is torch.empty else num_blocks
        self.zero_blocks(1)  # the null block
        self.inputs = StepBuffers(rows, self.max_blocks, self.vocab, self.device)
        self.logits = torch.zeros(rows, self.vocab, dtype=self.dtype, device=self.device)
        pin = self.device.type == "cuda"
        self.out_tokens = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.out_logprobs = torch.zeros(rows, device=self.device)
        self.out_top_values = torch.zeros(rows, TOP_LOGPROBS, device=self.device)
        self.out_top_ids = torch.zeros(rows, TOP_LOGPROBS, dtype=torch.long, device=self.device)
        # Two sets of host outputs (and timing events), used by alternate steps: step n+1's copy may land while
        # the host still reads step n's.
        self._host_out = [[torch.zeros_like(t, device="cpu", pin_memory=pin) for t in self._outputs()] for _ in "ab"]
        self.hidden_size = config.hidden_size
        self.ops = None  # fused decode ops (TorchOps / triton_kernels.TritonOps); None: the model's own modules
        self.paged_kernel = False  # True: the fused step; attention reads each row's table, no width in the key
        self._forward_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._sampler_graphs: dict[tuple[int, Variant], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.steps = 0
        self.device_seconds = 0.0  # time inside the step's graphs/kernels (CUDA events on a GPU)
        self.captures, self.capture_seconds = 0, 0.0  # CUDA graphs captured, and the time it took
        # decode steps replayed as CUDA graphs (the others ran eagerly: no graphs, or a penalised step); tests read it
        self.replays = 0
        self._events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if pin else None
                        for _ in "ab"]  # fmt: skip

    def _outputs(self):
        return self.out_tokens, self.out_logprobs, self.out_top_values, self.out_top_ids

    def zero_blocks(self, upto: int) -> None:
        """Zero blocks < `upto` not zeroed yet (CPU: in chunks, as the pool first hands them out)."""
        if upto <= self._zeroed:
            return
        end = min(self.num_blocks, max(upto, self._zeroed + 256))
        for cache in (*self.k_cache, *self.v_cache):
            cache[self._zeroed : end].zero_()
        self._zeroed = end

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block `dst` takes the content of `src`, in every layer."""
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for cache in (*self.k_cache, *self.v_cache):
            cache.index_copy_(0, dst, cache.index_select(0, src))

    def clear_graphs(self) -> None:
        # The graphs read the old buffers; their memory pool goes with them (capturing into the pool of
        # graphs that no longer exist trips the CUDA caching allocator).
        self._forward_graphs.clear()
        self._sampler_graphs.clear()
        self._pool = None

    # ---- the model ------------------------------------------------------------------------------
    def _layer_qkv(self, block, hidden, positions_cos_sin):
        attn = block.self_attn
        n = hidden.shape[0]
        x = block.input_layernorm(hidden)
        q = attn.q_proj(x).view(n, self.heads, 1, self.head_dim)
        k = attn.k_proj(x).view(n, self.kv_heads, 1, self.head_dim)
        v = attn.v_proj(x).view(n, self.kv_heads, self.head_dim)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = positions_cos_sin
        q, k = self._rope(q, k, cos, sin)
        return q[:, :, 0], k[:, :, 0], v

    def _layer_out(self, block, hidden, attention):
        hidden = hidden + block.self_attn.o_proj(attention.reshape(hidden.shape[0], self.heads * self.head_dim))
        return hidden + block.mlp(block.post_attention_layernorm(hidden))

    def _embed(self, ids, positions):
        base = self.model.model
        hidden = base.embed_tokens(ids)  # [n, hidden]: every token is its own row (adapter hooks: one slot each)
        return hidden, base.rotary_emb(hidden[:, None], positions[:, None])  # cos/sin [n, 1, head_dim]

    def _write(self, layer: int, slots, k, v) -> None:
        self.k_cache[layer].view(-1, self.kv_heads, self.head_dim).index_copy_(0, slots, k)
        self.v_cache[layer].view(-1, self.kv_heads, self.head_dim).index_copy_(0, slots, v)

    def prefill(self, ids, positions, slots, layout: paged_attention.PrefillLayout, keep) -> torch.Tensor:
        """Run the new tokens (flat, CPU tensors) of a prefill, writing their keys/values to `slots`; the final
        (normed) hidden states at the flat indices `keep` (each sequence's last token, and every token of the
        sequences whose prompt log-probs are asked), for the output head."""
        ids, positions = ids.to(self.device, non_blocking=True), positions.to(self.device, non_blocking=True)
        slots = slots.to(self.device, non_blocking=True)
        hidden, cos_sin = self._embed(ids, positions)
        for layer, block in enumerate(self._layers):
            q, k, v = self._layer_qkv(block, hidden, cos_sin)
            self._write(layer, slots, k, v)
            out = paged_attention.prefill_attention(q, self.k_cache[layer], self.v_cache[layer], layout, self.scale)
            hidden = self._layer_out(block, hidden, out)
        return self.model.model.norm(hidden[keep.to(self.device)])

    @property
    def supports_fused(self) -> bool:
        """The fused step knows these layers: SiLU-gated MLPs, RMSNorms, an even head dimension."""
        block = self._layers[0]
        return (getattr(self.model.config, "hidden_act", None) == "silu" and self.head_dim % 2 == 0
                and all(hasattr(block.mlp, name) for name in ("gate_proj", "up_proj", "down_proj")))  # fmt: skip

    def use_ops(self, ops) -> None:
        """Run the decode step fused, with `ops` (graphs are captured again)."""
        self.ops, self.paged_kernel = ops, True
        self.clear_graphs()

    def _input_ids(self, rows: int) -> torch.Tensor:
        """The step's input tokens: a carried row's is the previous step's sample, still in `out_tokens` when this
        forward runs (stream order: the sampler of step n, then this forward of step n+1, then its sampler)."""
        ints = self.inputs.ints
        return torch.where(ints[CARRY, :rows] != 0, self.out_tokens[:rows], ints[IDS, :rows])

    def _decode_forward(self, rows: int, width: int) -> None:
        if self.ops is not None:
            return self._fused_decode_forward(rows)
        ints = self.inputs.ints
        hidden, cos_sin = self._embed(self._input_ids(rows), ints[POSITIONS, :rows])
        slots, context = ints[SLOTS, :rows], ints[CONTEXT, :rows]
        table = self.inputs.table[:rows, :width]
        for layer, block in enumerate(self._layers):
            q, k, v = self._layer_qkv(block, hidden, cos_sin)
            self._write(layer, slots, k, v)
            out = paged_attention.decode_attention(q, self.k_cache[layer], self.v_cache[layer], table, context,
                                                   self.scale)  # fmt: skip
            hidden = self._layer_out(block, hidden, out)
        torch.matmul(self.model.model.norm(hidden), self.model.lm_head.weight.t(), out=self.logits[:rows])

    def _fused_decode_forward(self, rows: int) -> None:
        """The same step with the residual add folded into each RMSNorm, q/k norms + rotary + the cache write
        in one op, attention over each row's own blocks, and the MLP's activation fused."""
        ops, ints, heads, kv_heads, dim = self.ops, self.inputs.ints, self.heads, self.kv_heads, self.head_dim
        hidden, (cos, sin) = self._embed(self._input_ids(rows), ints[POSITIONS, :rows])
        cos, sin = cos[:, 0].contiguous(), sin[:, 0].contiguous()
        slots, context, table = ints[SLOTS, :rows], ints[CONTEXT, :rows], self.inputs.table[:rows]
        delta, residual = None, hidden
        for layer, block in enumerate(self._layers):
            attn, mlp = block.self_attn, block.mlp
            norm = block.input_layernorm
            x, residual = ops.add_rms_norm(delta, residual, norm.weight, _eps(norm))
            q = attn.q_proj(x).view(rows, heads, dim)
            k = attn.k_proj(x).view(rows, kv_heads, dim)
            v = attn.v_proj(x).view(rows, kv_heads, dim)
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            q = ops.rope_and_write(
                q, k, v, cos, sin, None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight,
                0.0 if q_norm is None else _eps(q_norm), self.k_cache[layer], self.v_cache[layer], slots,
            )  # fmt: skip
            out = ops.decode_attention(q, self.k_cache[layer], self.v_cache[layer], table, context, self.scale)
            delta = attn.o_proj(out.view(rows, heads * dim))
            norm = block.post_attention_layernorm
            x, residual = ops.add_rms_norm(delta, residual, norm.weight, _eps(norm))
            delta = mlp.down_proj(ops.silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))
        norm = self.model.model.norm
        x, _ = ops.add_rms_norm(delta, residual, norm.weight, _eps(norm))
        torch.matmul(x, self.model.lm_head.weight.t(), out=self.logits[:rows])

    def _sample(self, rows: int, variant: Variant) -> None:
        inputs = self.inputs
        floats, ints = inputs.floats, inputs.ints
        tokens, chosen, top_values, top_ids = sample(
            self.logits[:rows], floats[TEMPERATURE, :rows], floats[UNIFORM, :rows],
            top_p=floats[TOP_P, :rows] if variant.filtered else None,
            top_k=ints[TOP_K, :rows] if variant.filtered else None,
            min_p=floats[MIN_P, :rows] if variant.filtered else None,
            bias_ids=inputs.bias_ids[:rows, : variant.bias_width] if variant.bias_width else None,
            bias_values=inputs.bias_values[:rows, : variant.bias_width] if variant.bias_width else None,
            bitmask=inputs.bitmask[:rows] if variant.masked else None,
            penalties=inputs.penalties.select(slice(0, rows)) if variant.penalised else None,
            top_n=variant.top_n,
        )  # fmt: skip
        self.out_tokens[:rows].copy_(tokens)
        self.out_logprobs[:rows].copy_(chosen)
        if variant.top_n:
            self.out_top_values[:rows].copy_(top_values)
            self.out_top_ids[:rows].copy_(top_ids)

    # ---- the step -------------------------------------------------------------------------------
    def bucket(self, rows: int) -> int:
        return next(size for size in buckets(self.rows) if size >= rows)

    def width(self, longest_context: int) -> int:
        """Blocks the torch decode path gathers per row: with CUDA graphs a power of two covering the longest
        context (a graph per width), else just the blocks covering it."""
        if self.paged_kernel:
            return 0
        blocks = -(-longest_context // self.block_size)
        if not self.cuda_graphs:  # no graph to reuse: gather exactly what is needed
            return blocks
        return min(self.max_blocks, power_of_two(blocks, MIN_WIDTH_BLOCKS))

    def launch(self, rows: int, width: int, variant: Variant) -> LaunchedStep:
        """Enqueue the decode step on the first `rows` rows (a bucket): the upload of the inputs the host wrote,
        the forward and sampler (graphs on CUDA), and the copy of the sampled tokens, their log-probs and top
        log-probs to host memory; returns without waiting for any of it on CUDA (on CPU it has run)."""
        slot = self.steps % 2
        events, host = self._events[slot], self._host_out[slot]
        self.inputs.upload(rows, variant.masked)
        if events is not None:
            events[0].record()
        started = time.perf_counter()
        if not self.cuda_graphs or variant.penalised:
            self._decode_forward(rows, width)
            self._sample(rows, variant)
        else:
            # The forward is replayed before the sampler graph is captured: capturing runs the sampler once (its
            # warm-up), which overwrites `out_tokens`, where the forward reads the carried rows' input tokens.
            forward = self._forward_graphs.get((rows, width))
            if forward is None:
                forward = self._forward_graphs[(rows, width)] = self._capture(lambda: self._decode_forward(rows, width))
            forward.replay()
            sampler = self._sampler_graphs.get((rows, variant))
            if sampler is None:
                sampler = self._sampler_graphs[(rows, variant)] = self._capture(lambda: self._sample(rows, variant))
            sampler.replay()
            self.replays += 1
        outputs = self._outputs() if variant.top_n else self._outputs()[:2]
        host = host[: len(outputs)]
        for target, source in zip(host, outputs, strict=True):
            target[:rows].copy_(source[:rows], non_blocking=True)
        self.steps += 1
        if events is not None:
            events[1].record()
        return LaunchedStep(rows, host, events, time.perf_counter() - started)

    def collect(self, step: LaunchedStep) -> tuple[np.ndarray, ...]:
        """Wait for a launched step and return its outputs as host arrays (valid until the step after next is
        launched: alternate steps share a set of host buffers)."""
        if step.events is not None:
            step.events[1].synchronize()
            self.device_seconds += step.events[0].elapsed_time(step.events[1]) / 1000
        elif self.device.type == "cuda":  # no timing events: never the case today, but never read unfinished copies
            torch.cuda.current_stream(self.device).synchronize()
        else:
            self.device_seconds += step.seconds
        return tuple(t[: step.rows].numpy() for t in step.outputs)

    def capture_all(self, variant: Variant | None = None) -> int:
        """Run the decode step of every batch-size bucket once on idle rows, capturing its graphs on CUDA (vLLM
        captures at start too): no request then waits ~0.1 s for a capture, and none runs beside a weight
        swap's reads. Only for the fused step, whose graphs are keyed by rows alone (the torch path's also by
        width, captured on first use). Idle rows read and write only the null block and nobody reads their
        samples, so this changes no later output (tested). Returns the number of buckets."""
        device_seconds = self.device_seconds
        sizes = buckets(self.rows)
        for rows in sizes:
            self.collect(self.launch(rows, self.width(1), variant or Variant()))
        self.device_seconds = device_seconds  # not decode time anybody asked for
        return len(sizes)

    def decode(self, rows: int, width: int, variant: Variant) -> tuple[np.ndarray, ...]:
        """Run the decode step on the first `rows` rows and wait for it (the synchronous loop): `launch` + `collect`."""
        return self.collect(self.launch(rows, width, variant))

    def _capture(self, run) -> torch.cuda.CUDAGraph:
        started = time.perf_counter()
        graph = self._capture_graph(run)
        self.captures += 1
        self.capture_seconds += time.perf_counter() - started
        return graph

    def _capture_graph(self, run) -> torch.cuda.CUDAGraph:
        # Warm up on a side stream (as PyTorch's docs require); the writes are the step's own, so running it
        # again is harmless (same key/value into the same slots, same outputs).
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local, not the default "global": graphs are captured lazily while worker threads read weight
        # swaps and adapters onto the GPU, and their cudaMalloc is legal beside a capture on our own stream.
        # Under "global" it raised "operation not permitted when stream is capturing" in the reader and broke
        # the capture (CUBLAS_STATUS_EXECUTION_FAILED), failing a whole batch (H200 loop, 2026-11-26).
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            run()
        self._pool = graph.pool()
        return graph
