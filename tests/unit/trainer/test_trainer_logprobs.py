"""Chunked next-token log-probs: the values and exact gradients of the whole-logits computation,
at any chunk size, and a memory bound on CUDA (long rows never hold their [T, vocab] logits)."""

from __future__ import annotations

import pytest
import torch
from gyre_trainer.logprobs import next_token_logprobs
from gyre_trainer.model import packed_logprobs


def reference(hidden, weight, targets, temperature):
    """The unchunked path: full logits, log-softmax, gather; entropy from the softmax."""
    scaled = (hidden @ weight.t()).to(torch.promote_types(hidden.dtype, torch.float32)) / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def inputs(n=37, hidden_size=16, vocab=50, dtype=torch.float64, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, hidden_size, generator=gen, dtype=torch.float64).to(device, dtype)
    weight = torch.randn(vocab, hidden_size, generator=gen, dtype=torch.float64).to(device, dtype)
    targets = torch.randint(0, vocab, (n,), generator=gen).to(device)
    return hidden.requires_grad_(), weight.requires_grad_(), targets


@pytest.mark.parametrize("chunk", [1, 5, 36, 37, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_values_and_gradients_equal_the_whole_logits_path(chunk, temperature):
    hidden, weight, targets = inputs()
    upstream = torch.randn(len(targets), dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    lp, entropy = next_token_logprobs(hidden, weight, targets, temperature, chunk)
    (lp * upstream).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    ref_lp, ref_entropy = reference(hidden, weight, targets, temperature)
    (ref_lp * upstream).sum().backward()
    torch.testing.assert_close(lp, ref_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy, ref_entropy.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads[0], hidden.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[1], weight.grad, rtol=1e-10, atol=1e-12)
    assert not entropy.requires_grad


def test_bfloat16_model_gets_float32_logprobs_close_to_the_reference():
    hidden, weight, targets = inputs(n=64, hidden_size=32, vocab=300, dtype=torch.bfloat16)
    lp, entropy = next_token_logprobs(hidden, weight, targets, 1.0, chunk=16)
    assert lp.dtype == torch.float32 and entropy.dtype == torch.float32
    lp.sum().backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    grads = hidden.grad.float(), weight.grad.float()
    hidden.grad = weight.grad = None
    ref_lp, _ = reference(hidden, weight, targets, 1.0)
    ref_lp.sum().backward()
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(grads[0], hidden.grad.float(), rtol=0.02, atol=0.02)
    torch.testing.assert_close(grads[1], weight.grad.float(), rtol=0.02, atol=0.02)


def test_packed_logprobs_do_not_depend_on_the_chunk(tiny_llama64):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1024, (2, 40), generator=gen)
    positions = torch.cat([torch.arange(25), torch.arange(15)]).repeat(2, 1)
    lengths = [torch.tensor([25, 15])] * 2
    results = []
    for chunk in (7, 4096):
        lp, ent = packed_logprobs(tiny_llama64, ids, positions, lengths, 0.8, chunk_tokens=chunk)
        lp.sum().backward()
        grad = torch.cat([p.grad.flatten() for p in tiny_llama64.parameters()])
        tiny_llama64.zero_grad(set_to_none=True)
        results.append((lp.detach(), ent, grad))
    for a, b in zip(results[0], results[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_bad_chunk_is_rejected():
    hidden, weight, targets = inputs()
    with pytest.raises(ValueError, match="chunk"):
        next_token_logprobs(hidden, weight, targets, 1.0, chunk=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_long_row_never_holds_its_whole_logits_on_gpu():
    """16k tokens × a 151,936-entry vocabulary: the whole float32 logits alone would be 10 GB."""
    n, vocab = 16384, 151936
    hidden, weight, targets = inputs(n=n, hidden_size=1024, vocab=vocab, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    lp, _ = next_token_logprobs(hidden, weight, targets, 1.0, chunk=2048)
    lp.sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    whole_logits = n * vocab * 4
    assert extra < whole_logits / 2, f"peak {extra / 2**30:.1f} GiB above the inputs"
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_kernels_equal_the_eager_ones_on_gpu():
    hidden, weight, targets = inputs(n=300, hidden_size=64, vocab=5000, dtype=torch.bfloat16, device="cuda")
    for entropy_grad in (False, True):  # the entropy bonus's kernel variant too
        results = []
        for compiled in (False, True):
            lp, entropy = next_token_logprobs(hidden, weight, targets, 0.7, chunk=128, compiled=compiled,
                                              entropy_grad=entropy_grad)  # fmt: skip
            (lp.sum() + (0.5 * entropy.sum() if entropy_grad else 0.0)).backward()
            results.append((lp.detach(), entropy.detach(), hidden.grad.float(), weight.grad.float()))
            hidden.grad = weight.grad = None
        for eager, compiled in zip(*results, strict=True):
            torch.testing.assert_close(compiled, eager, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("chunk", [1, 7, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_entropy_gradient_equals_autograd_on_the_whole_logits(chunk, temperature):
    """With entropy_grad the entropies carry dH/dlogits = −p·(log p + H)/T: a loss on both outputs has the
    gradient autograd gives on the full logits (the entropy bonus, loss.entropy_coeff)."""
    hidden, weight, targets = inputs()
    gen = torch.Generator().manual_seed(2)
    up_lp, up_h = (torch.randn(len(targets), dtype=torch.float64, generator=gen) for _ in range(2))
    lp, entropy = next_token_logprobs(hidden, weight, targets, temperature, chunk, entropy_grad=True)
    assert entropy.requires_grad
    ((lp * up_lp).sum() + (entropy * up_h).sum()).backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    ref_lp, ref_entropy = reference(hidden, weight, targets, temperature)
    ((ref_lp * up_lp).sum() + (ref_entropy * up_h).sum()).backward()
    torch.testing.assert_close(grads[0], hidden.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[1], weight.grad, rtol=1e-10, atol=1e-12)

    hidden.grad = weight.grad = None  # the entropy alone in the loss (no log-prob term)
    _, entropy = next_token_logprobs(hidden, weight, targets, temperature, chunk, entropy_grad=True)
    (entropy * up_h).sum().backward()
    alone = hidden.grad.clone()
    hidden.grad = weight.grad = None
    (reference(hidden, weight, targets, temperature)[1] * up_h).sum().backward()
    torch.testing.assert_close(alone, hidden.grad, rtol=1e-10, atol=1e-12)


def test_the_fused_kernels_entropy_gradient_equals_the_eager_one():
    """The torch.compile'd kernel's formula (run here uncompiled, on CPU) agrees with the in-place one."""
    from gyre_trainer.logprobs import _chunk_logit_grads, _chunk_stats, _fused_chunk_logit_grads

    hidden, weight, targets = inputs(dtype=torch.float32)
    logits = (hidden @ weight.t()).detach()
    _, entropies, log_norm = _chunk_stats(logits, targets, 0.7)
    gen = torch.Generator().manual_seed(3)
    grad, grad_h = (torch.randn(len(targets), generator=gen) for _ in range(2))
    eager = _chunk_logit_grads(logits, targets, log_norm, grad, 0.7, entropies, grad_h)
    fused = _fused_chunk_logit_grads(logits, targets, log_norm, grad, 0.7, entropies, grad_h)
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(eager, _chunk_logit_grads(logits, targets, log_norm, grad, 0.7))


def test_packed_entropy_gradient_is_the_same_on_the_whole_logits_path(tiny_llama64):
    """A model whose head the chunked path cannot take over (logits post-processed) gets the entropy's gradient
    from autograd on its logits; both paths agree."""
    from gyre_trainer.model import _LOGITS_CHANGED

    rng = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 1000, (20,), generator=rng)
    lengths = [8, 12]
    positions = torch.cat([torch.arange(n) for n in lengths])
    grads = []
    for plain in (False, True):
        setattr(tiny_llama64, _LOGITS_CHANGED, plain)
        tiny_llama64.zero_grad(set_to_none=True)
        _, entropy = packed_logprobs(tiny_llama64, ids, positions, lengths, 0.8, entropy_grad=True)
        entropy.sum().backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in tiny_llama64.parameters() if p.grad is not None]))
    delattr(tiny_llama64, _LOGITS_CHANGED)
    tiny_llama64.zero_grad(set_to_none=True)
    assert grads[0].norm() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-9, atol=1e-12)
    with torch.no_grad():
        _, detached = packed_logprobs(tiny_llama64, ids, positions, lengths)
    assert not detached.requires_grad
