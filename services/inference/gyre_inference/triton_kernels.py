"""Triton kernels for the torch engine's decode step on CUDA (the step is launch-bound, not math-bound).

A decode step of a 28-layer model in plain torch is ~60 kernels per layer: RMSNorm alone is eight
(casts, power, mean, rsqrt, products), rotary embedding and Qwen3's q/k norms some twenty more, and the
paged attention gathers every row's blocks into a padded copy before `scaled_dot_product_attention`.
Inside a CUDA graph each kernel still costs a few microseconds, which at batch 64 is most of the step.
These kernels cut a layer to ~12:

- `paged_decode_attention`: one program per (row, kv head) walks the row's block table up to its context
  length (online softmax, grouped-query heads together), reading only the row's own blocks: no gather,
  no padding to a common width, so a step's graph does not depend on the context length;
- `add_rms_norm`: the residual add and the next RMSNorm in one pass;
- `rope_and_write`: Qwen3's q/k RMSNorm, the rotary embedding, and the write of the new key/value into
  the cache at each token's slot;
- `silu_mul`: the MLP's activation.

Safety (no GPU where this is developed): `install` swaps them in only after a self-check on the device
against the torch path they replace (model_runner.TorchOps); any error or mismatch logs a warning and
keeps the torch path. The kernels are checked on CPU with Triton's interpreter (TRITON_INTERPRET=1) and
on a GPU by the `gpu` tests (test_inference_triton_kernels.py).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path serves
    triton = None

if triton is not None:

    @triton.jit
    def _paged_decode(Q, K, V, OUT, TABLE, CONTEXT, scale, q_row, q_head, o_row, o_head, k_block, k_token, k_head,
                      table_row, GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                      PAGE: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        kv = tl.program_id(1)
        context = tl.load(CONTEXT + row)
        g = tl.arange(0, GP)
        d = tl.arange(0, BD)
        n = tl.arange(0, BN)
        heads = kv * GROUP + g
        qmask = (g < GROUP)[:, None] & (d < D)[None, :]
        q = tl.load(Q + row * q_row + heads[:, None] * q_head + d[None, :], mask=qmask, other=0.0)
        m = tl.full([GP], float("-inf"), tl.float32)
        total = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, BD], tl.float32)
        for start in range(0, context, BN):
            pos = start + n
            valid = pos < context
            block = tl.load(TABLE + row * table_row + pos // PAGE, mask=valid, other=0).to(tl.int64)
            offset = block * k_block + (pos % PAGE) * k_token + kv * k_head
            kvmask = valid[:, None] & (d < D)[None, :]
            k = tl.load(K + offset[:, None] + d[None, :], mask=kvmask, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(valid[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(V + offset[:, None] + d[None, :], mask=kvmask, other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        out = acc / total[:, None]
        tl.store(OUT + row * o_row + heads[:, None] * o_head + d[None, :], out.to(OUT.dtype.element_ty), mask=qmask)

    @triton.jit
    def _add_rms_norm(X, R, W, OUT, R_OUT, eps, H: tl.constexpr, BH: tl.constexpr, HAS_X: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BH)
        mask = h < H
        r = tl.load(R + row * H + h, mask=mask, other=0.0).to(tl.float32)
        if HAS_X:
            r += tl.load(X + row * H + h, mask=mask, other=0.0).to(tl.float32)
            tl.store(R_OUT + row * H + h, r.to(R_OUT.dtype.element_ty), mask=mask)
        scale = tl.rsqrt(tl.sum(r * r, 0) / H + eps)
        w = tl.load(W + h, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + row * H + h, (r * scale * w).to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_and_write(Q, K, V, COS, SIN, QW, KW, Q_OUT, K_CACHE, V_CACHE, SLOTS, eps, q_row, k_row, v_row,
                        cos_row, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                        NORM: tl.constexpr):  # fmt: skip
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        d = tl.arange(0, HALF)
        c1 = tl.load(COS + token * cos_row + d).to(tl.float32)
        c2 = tl.load(COS + token * cos_row + HALF + d).to(tl.float32)
        s1 = tl.load(SIN + token * cos_row + d).to(tl.float32)
        s2 = tl.load(SIN + token * cos_row + HALF + d).to(tl.float32)
        is_q = head < HEADS
        kv_head = head - HEADS
        if is_q:
            source = Q + token * q_row + head * 2 * HALF
            weight = QW
        else:
            source = K + token * k_row + kv_head * 2 * HALF
            weight = KW
        x1 = tl.load(source + d).to(tl.float32)
        x2 = tl.load(source + HALF + d).to(tl.float32)
        if NORM:
            scale = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / (2 * HALF) + eps)
            x1 = x1 * scale * tl.load(weight + d).to(tl.float32)
            x2 = x2 * scale * tl.load(weight + HALF + d).to(tl.float32)
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
        # Names bound in both branches of a runtime `if` must have one type in Triton (a pointer here, an int
        # offset there did not compile), so each branch has its own.
        if is_q:
            q_out = Q_OUT + token * HEADS * 2 * HALF + head * 2 * HALF
            tl.store(q_out + d, o1.to(Q_OUT.dtype.element_ty))
            tl.store(q_out + HALF + d, o2.to(Q_OUT.dtype.element_ty))
        else:
            slot = tl.load(SLOTS + token).to(tl.int64)
            cache_offset = slot * KV_HEADS * 2 * HALF + kv_head * 2 * HALF
            tl.store(K_CACHE + cache_offset + d, o1.to(K_CACHE.dtype.element_ty))
            tl.store(K_CACHE + cache_offset + HALF + d, o2.to(K_CACHE.dtype.element_ty))
            value = V + token * v_row + kv_head * 2 * HALF
            tl.store(V_CACHE + cache_offset + d, tl.load(value + d))
            tl.store(V_CACHE + cache_offset + HALF + d, tl.load(value + HALF + d))

    @triton.jit
    def _silu_mul(GATE, UP, OUT, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        gate = tl.load(GATE + offsets, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(UP + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + offsets, (gate / (1 + tl.exp(-gate)) * up).to(OUT.dtype.element_ty), mask=mask)


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


class TritonOps:
    """The decode step's fused operations (same signatures as model_runner.TorchOps)."""

    name = "triton"

    def decode_attention(self, q, k_cache, v_cache, table, context, scale):
        """q [R, heads, D] (contiguous per row), caches [blocks, page, kv_heads, D], table [R, >= blocks used]."""
        rows, heads, dim = q.shape
        kv_heads = k_cache.shape[2]
        group = heads // kv_heads
        out = torch.empty_like(q)
        _paged_decode[(rows, kv_heads)](
            q, k_cache, v_cache, out, table, context, scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), table.stride(0), GROUP=group,
            GP=max(16, _next_power_of_two(group)), D=dim, BD=max(16, _next_power_of_two(dim)), PAGE=k_cache.shape[1],
            BN=64, IEEE=q.dtype == torch.float32,
        )  # fmt: skip
        return out

    def add_rms_norm(self, delta, residual, weight, eps):
        """(RMSNorm(residual + delta) * weight, residual + delta); delta None: just the norm of `residual`."""
        rows, hidden = residual.shape
        out = torch.empty_like(residual)
        summed = residual if delta is None else torch.empty_like(residual)
        _add_rms_norm[(rows,)](delta if delta is not None else residual, residual, weight, out, summed, eps,
                               H=hidden, BH=_next_power_of_two(hidden), HAS_X=delta is not None)  # fmt: skip
        return out, summed

    def rope_and_write(self, q, k, v, cos, sin, q_weight, k_weight, eps, k_cache, v_cache, slots):
        """q [N, heads, D], k/v [N, kv_heads, D] (each row contiguous), cos/sin [N, D]: the rotated q; the rotated
        (and, with weights, RMS-normed) k and v written to the caches at `slots`."""
        tokens, heads, dim = q.shape
        kv_heads = k.shape[1]
        out = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device)
        norm = q_weight is not None
        _rope_and_write[(tokens, heads + kv_heads)](
            q, k, v, cos, sin, q_weight if norm else q, k_weight if norm else k, out, k_cache, v_cache, slots, eps,
            q.stride(0), k.stride(0), v.stride(0), cos.stride(0), HEADS=heads, KV_HEADS=kv_heads, HALF=dim // 2,
            NORM=norm,
        )  # fmt: skip
        return out

    def silu_mul(self, gate, up):
        out = torch.empty_like(gate)
        n = gate.numel()
        _silu_mul[(triton.cdiv(n, 1024),)](gate, up, out, n, BLOCK=1024)
        return out


def install(runner) -> bool:
    """Use the Triton kernels in `runner`'s decode step if Triton imports and they match the torch path on the
    device (False, with a warning naming the reason, otherwise)."""
    if triton is None:
        log.info("triton is not installed: the decode step uses the torch attention path")
        return False
    from gyre_inference.model_runner import TorchOps

    try:
        if not runner.supports_fused:
            raise ValueError("the model's layers are not the shapes the fused kernels handle")
        self_check(TritonOps(), TorchOps(), runner)
    except Exception as error:
        log.warning("the Triton decode kernels are not used (%s: %s): the torch path serves", type(error).__name__,
                    error)  # fmt: skip
        return False
    runner.use_ops(TritonOps())
    return True


def self_check(ops, reference, runner, rows: int = 5) -> None:
    """Run each fused op and its torch counterpart on random inputs of the runner's shapes; raise on mismatch."""
    device, dtype = runner.device, runner.dtype
    heads, kv_heads, dim, page = runner.heads, runner.kv_heads, runner.head_dim, runner.block_size
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device=device).to(dtype)

    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    blocks = 12
    k_cache, v_cache = randn(blocks, page, kv_heads, dim), randn(blocks, page, kv_heads, dim)
    table = torch.randperm(blocks - 1, generator=generator, device=device)[: rows * 2].view(rows, 2).int() + 1
    context = torch.tensor([1, page, page + 3, 2 * page, 7][:rows], device=device)
    q = randn(rows, heads, dim)
    got = ops.decode_attention(q, k_cache, v_cache, table, context, dim**-0.5)
    want = reference.decode_attention(q, k_cache, v_cache, table, context, dim**-0.5)
    _close("paged decode attention", got, want, tolerance)
    hidden = runner.hidden_size
    delta, residual, weight = randn(rows, hidden), randn(rows, hidden), randn(hidden)
    for got, want in zip(ops.add_rms_norm(delta, residual, weight, 1e-6),
                         reference.add_rms_norm(delta, residual, weight, 1e-6), strict=True):  # fmt: skip
        _close("add + RMSNorm", got, want, tolerance)
    _close("RMSNorm", ops.add_rms_norm(None, residual, weight, 1e-6)[0],
           reference.add_rms_norm(None, residual, weight, 1e-6)[0], tolerance)  # fmt: skip
    angles = randn(rows, dim // 2).float()
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    k, v = randn(rows, kv_heads, dim), randn(rows, kv_heads, dim)
    slots = torch.tensor([3, 17, 40, 41, 90][:rows], device=device)
    for weights in ((None, None), (randn(dim), randn(dim))):
        caches = [torch.zeros(blocks, page, kv_heads, dim, dtype=dtype, device=device) for _ in range(4)]
        got = ops.rope_and_write(q, k, v, cos, sin, *weights, 1e-6, caches[0], caches[1], slots)
        want = reference.rope_and_write(q, k, v, cos, sin, *weights, 1e-6, caches[2], caches[3], slots)
        _close("rotary embedding (q)", got, want, tolerance)
        _close("rotary embedding (k written)", caches[0], caches[2], tolerance)
        _close("value written", caches[1], caches[3], 0)
    gate, up = randn(rows, 3 * hidden), randn(rows, 3 * hidden)
    _close("SiLU x up", ops.silu_mul(gate, up), reference.silu_mul(gate, up), tolerance)


def _close(what: str, got: torch.Tensor, want: torch.Tensor, tolerance: float) -> None:
    error = (got.float() - want.float()).abs().max().item()
    scale = max(1.0, want.float().abs().max().item())
    if not error <= tolerance * scale:
        raise ValueError(f"{what}: off by {error:.3g} from the torch path (tolerance {tolerance * scale:.3g})")
