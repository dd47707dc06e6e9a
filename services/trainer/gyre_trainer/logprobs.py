"""Next-token log-probs and entropies straight from the last hidden states, a chunk of tokens at a time.

Why: the obvious path materialises the whole row's logits, `[T, vocab]`, then float32 copies of them
for log-softmax and softmax. With Qwen3's vocabulary (151,936) a 16k-token row needs ~10 GB per
float32 copy and ran out of memory on an 80 GB GPU. Here the LM head runs on `chunk` tokens at a
time; the backward recomputes each chunk's logits instead of keeping them (one extra head matmul,
about 9 % of a 0.6B model's step), so memory for the head is O(chunk · vocab) whatever T is.

Numerics are those of the unchunked path: the head matmul runs in the model's dtype (like
`lm_head(hidden)`), its output is promoted to float32 (float64 for a float64 model) before the
temperature, log-sum-exp and softmax, and the gradient w.r.t. the logits is cast back to the model's
dtype before the two backward matmuls, as autograd does for `logits.float()`. The weight gradient
is accumulated over chunks in float32. Gradients are exact: d logp[t] / d logits[t] =
(onehot(target) − softmax) / temperature (tested against autograd on the full logits).

Entropies carry a gradient only when asked (`entropy_grad`, the entropy bonus `loss.entropy_coeff`): with
s = logits / temperature, p = softmax(s) and H = −Σ p·log p, d H / d logits = −p·(log p + H) / temperature.
Unasked, the backward is the log-probs' alone (no extra float buffer per chunk).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _chunk_stats(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """(log-prob of the target, entropy, log-normaliser) per row of one chunk's logits."""
    scaled = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    log_norm = torch.logsumexp(scaled, dim=-1)
    logprobs = scaled.gather(-1, targets[:, None]).squeeze(-1) - log_norm
    probs = (scaled - log_norm[:, None]).exp_()
    entropies = log_norm - probs.mul_(scaled).sum(-1)  # in place: one float buffer besides `scaled`
    return logprobs, entropies, log_norm


def _chunk_logit_grads(
    logits: Tensor,
    targets: Tensor,
    log_norm: Tensor,
    grad: Tensor,
    temperature: float,
    entropies: Tensor | None = None,
    grad_entropy: Tensor | None = None,
) -> Tensor:
    """d(grad · logprob + grad_entropy · entropy)/d logits, in the logits' dtype:
    (grad · (onehot(target) − p) − grad_entropy · p · (log p + H)) / temperature."""
    scaled = logits.to(log_norm.dtype) / temperature
    g = grad[:, None].to(log_norm.dtype)
    if grad_entropy is None:
        grads = scaled.sub_(log_norm[:, None]).exp_().mul_(-g)  # in place on the float copy
    else:
        log_p = scaled.sub_(log_norm[:, None])
        probs = log_p.exp()  # the one extra buffer the entropy's gradient needs
        gh = grad_entropy[:, None].to(log_norm.dtype)
        # −p·(g + gh·(log p + H)), in place on log p
        grads = probs.mul_(log_p.add_(entropies[:, None].to(log_norm.dtype)).mul_(gh).add_(g)).neg_()
    grads.scatter_add_(-1, targets[:, None], g)
    return grads.div_(temperature).to(logits.dtype)


def _fused_chunk_stats(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    # Out-of-place on purpose: torch.compile fuses it into kernels that read the logits once.
    scaled = logits.float() / temperature
    log_norm = torch.logsumexp(scaled, dim=-1)
    logprobs = scaled.gather(-1, targets[:, None]).squeeze(-1) - log_norm
    entropies = log_norm - (torch.exp(scaled - log_norm[:, None]) * scaled).sum(-1)
    return logprobs, entropies, log_norm


def _fused_chunk_logit_grads(
    logits: Tensor,
    targets: Tensor,
    log_norm: Tensor,
    grad: Tensor,
    temperature: float,
    entropies: Tensor | None = None,
    grad_entropy: Tensor | None = None,
) -> Tensor:
    scaled = logits.float() / temperature
    log_p = scaled - log_norm[:, None]
    probs = torch.exp(log_p)
    onehot = torch.arange(logits.shape[-1], device=logits.device)[None, :] == targets[:, None]
    grads = (onehot.float() - probs) * grad[:, None].float()
    if grad_entropy is not None:
        grads = grads - probs * (log_p + entropies[:, None].float()) * grad_entropy[:, None].float()
    return (grads / temperature).to(logits.dtype)


_COMPILED: dict[str, object] = {}


def _kernels(compiled: bool):
    """Eager (in place, lean on memory) or torch.compile'd (fused, fast on a GPU) chunk kernels."""
    if not compiled:
        return _chunk_stats, _chunk_logit_grads
    if not _COMPILED:
        _COMPILED["stats"] = torch.compile(_fused_chunk_stats, dynamic=True)
        _COMPILED["grads"] = torch.compile(_fused_chunk_logit_grads, dynamic=True)
    return _COMPILED["stats"], _COMPILED["grads"]


class ChunkedNextTokenLogprobs(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], targets [N]) -> (logprobs [N], entropies [N]); entropies carry a
    gradient only with `entropy_grad`."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, chunk: int, compiled: bool,
                entropy_grad: bool = False):  # fmt: skip
        stats, _ = _kernels(compiled)
        parts = [
            stats(hidden[start : start + chunk] @ weight.t(), targets[start : start + chunk], temperature)
            for start in range(0, hidden.shape[0], chunk)
        ]
        if not parts:  # no token to predict: rows of one token (a rank holding only the packer's padding rows)
            empty = hidden.new_zeros(0, dtype=torch.promote_types(hidden.dtype, torch.float32))
            parts = [(empty, empty, empty)]
        logprobs, entropies, log_norms = (torch.cat(column) for column in zip(*parts, strict=True))
        ctx.save_for_backward(hidden, weight, targets, log_norms, entropies if entropy_grad else None)
        ctx.temperature, ctx.chunk, ctx.compiled = temperature, chunk, compiled
        # an unused output's gradient stays None (not a tensor of zeros): the entropy's term is then skipped
        ctx.set_materialize_grads(False)
        if not entropy_grad:
            ctx.mark_non_differentiable(entropies)
        return logprobs, entropies

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor | None, grad_entropies: Tensor | None):
        hidden, weight, targets, log_norms, entropies = ctx.saved_tensors
        _, logit_grads = _kernels(ctx.compiled)
        if grad_logprobs is None:  # only the entropy is in the loss
            grad_logprobs = torch.zeros_like(log_norms)
        if entropies is None:
            grad_entropies = None
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=log_norms.dtype, device=weight.device) if need_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, hidden.shape[0])
            h = hidden[start:end]
            # The chunk's logits are recomputed rather than kept (see the module docstring).
            entropy_args = () if grad_entropies is None else (entropies[start:end], grad_entropies[start:end])
            grads = logit_grads(h @ weight.t(), targets[start:end], log_norms[start:end], grad_logprobs[start:end],
                                ctx.temperature, *entropy_args)  # fmt: skip
            if need_hidden:
                grad_hidden[start:end] = grads @ weight
            if need_weight:
                grad_weight += (grads.t() @ h).to(grad_weight.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def next_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk: int = 2048,
    compiled=False,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor]:
    """log softmax(hidden @ weightᵀ / temperature)[targets] and the entropy of that distribution, per row.

    `hidden` [..., H] and `targets` [...] share leading dims; results have the shape of `targets`.
    `compiled` uses torch.compile'd chunk kernels (a GPU's fast path; the first call compiles).
    `entropy_grad`: the entropies carry a gradient too (else they are constants).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    shape = targets.shape
    logprobs, entropies = ChunkedNextTokenLogprobs.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        targets.reshape(-1).long(),
        float(temperature),
        int(chunk),
        bool(compiled),
        bool(entropy_grad),
    )
    return logprobs.reshape(shape), entropies.reshape(shape)
