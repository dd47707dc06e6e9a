"""Next-token sampling for a batch of rows, on the device, with no host round trip inside a step.

`sample` is a fixed sequence of tensor ops with no data-dependent shapes and no host synchronisation, so
the torch engine captures it in a CUDA graph together with the model's decode step (model_runner.py).
Per row it applies, in this order: the token bitmask (disallowed tokens at -inf: a structured output's, and
`allowed_token_ids`), the sparse biases (`logit_bias`, -inf on the stop ids before `min_tokens` and on the last
token of a `bad_words` entry whose other tokens the row just generated), the penalties (`Penalties`:
vLLM's repetition, frequency and presence penalties), the temperature; the reported log-probs are
`log_softmax` of that (T = 1 for greedy rows, those with T < 1e-5 as in vLLM). Then, for the draw only:
min-p and top-k, then top-p (nucleus) of what those two kept, renormalised (vLLM's order), and one inverse-CDF
draw with the row's uniform. The filters decide which tokens may be drawn but are NOT renormalised into the
reported log-prob: with no bias, mask or penalty it is exactly `log_softmax(logits / T)`, what the trainer
recomputes (importance ratio 1 on the same weights).

Randomness: row r's uniform is a pure function of (its sequence's seed, how many tokens that sequence
has generated) — SplitMix64, computed on the host in numpy for the whole batch at once (a handful of
vector ops, cheaper than as many tiny device kernels) and uploaded with the step's other inputs. A
sequence's tokens therefore never depend on which other rows share the batch, on preemption and
recompute, or on the device.

Inverse-CDF: the first token whose cumulative weight exceeds `uniform * total`. Without top-k/top-p/
min-p the CDF is walked in vocabulary order (no sort: sorting [B, V] costs more than the rest of a CPU
decode step); with them, in order of decreasing probability (`filtered=True`, one sort). A row that asks
for no filter walks vocabulary order in either variant, so its tokens never depend on its batch mates'.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
TOP_LOGPROBS = 20  # the most alternatives a request may ask for (the API's bound)
# A temperature below this is greedy (vLLM's _SAMPLING_EPS): logits / 1e-40 overflow float32 to inf, and the draw
# and the reported log-prob of such a row were NaN (an empty answer, log-probs null)
GREEDY_BELOW = 1e-5


def uniforms(seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """SplitMix64 of (seed, counter) as float32 uniforms in [0, 1) (uint64 arithmetic wraps in numpy)."""
    with np.errstate(over="ignore"):
        z = seeds.astype(np.uint64) + (counters.astype(np.uint64) + np.uint64(1)) * GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return ((z >> np.uint64(40)).astype(np.float32)) * np.float32(2.0**-24)


@dataclass(frozen=True)
class Penalties:
    """vLLM's sampling penalties of R rows, applied as vLLM's sampler does (after the biases, before the temperature):
    a token seen in the row's prompt or output has its logit divided by `repetition` [R] when positive, multiplied by
    it otherwise; then `frequency` [R] times the token's count in the output and `presence` [R] once if it occurs
    there are subtracted. `output_counts` [R, V] float32 counts each token in the row's generated tokens so far,
    `seen` [R, V] bool marks the tokens of its prompt and output. A row at repetition 1, frequency 0, presence 0 is
    left bit for bit as it was (x / 1, x * 1 and x - 0 are exact)."""

    output_counts: torch.Tensor
    seen: torch.Tensor
    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.where(self.seen, self.repetition[:, None], torch.ones_like(x))
        x = torch.where(x > 0, x / scale, x * scale)
        x = x - self.frequency[:, None] * self.output_counts
        return x - self.presence[:, None] * (self.output_counts > 0).to(x.dtype)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    uniform: torch.Tensor,
    *,
    top_p: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    bias_ids: torch.Tensor | None = None,
    bias_values: torch.Tensor | None = None,
    bitmask: torch.Tensor | None = None,
    penalties: Penalties | None = None,
    top_n: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One token per row of `logits` [R, V].

    `temperature` [R] (below GREEDY_BELOW, 0 too: greedy), `uniform` [R] in [0, 1); when given: `top_p` [R] in
    (0, 1], `top_k` [R] (0 = off), `min_p` [R] (0 = off) (all three together: the filtered path, one sort), `bias_ids` /
    `bias_values` [R, W] (added with scatter_add; pad with id 0, value 0), `bitmask` [R, ceil(V / 32)] int32
    (bit j of word i = token 32 i + j may be sampled), `penalties` (rows may differ; never inside a CUDA graph: the
    engine runs a step with any penalised row eagerly). Returns (tokens [R] int64, their log-probs [R],
    the `top_n` most likely tokens' log-probs [R, top_n] and ids, or None when top_n = 0).
    """
    x = logits.float()
    vocab = x.shape[-1]
    if bitmask is not None:
        bits = torch.arange(32, device=x.device, dtype=torch.int32)
        allowed = ((bitmask[:, :, None] >> bits) & 1).flatten(1)[:, :vocab].bool()
        x = x.masked_fill(~allowed, float("-inf"))
    if bias_ids is not None:
        x = x.scatter_add(1, bias_ids, bias_values)
    if bitmask is not None:
        # A row that min_tokens left with no token the grammar allows keeps the grammar's tokens, all at logit 0:
        # the grammar wins.
        dead = ~torch.isfinite(x).any(dim=-1, keepdim=True)
        x = torch.where(dead & allowed, torch.zeros_like(x), x)
    if penalties is not None:
        x = penalties.apply(x)
    greedy = temperature < GREEDY_BELOW
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)
    logprobs = torch.log_softmax(x / scale[:, None], dim=-1)
    probs = logprobs.exp()
    if top_p is None:
        tokens = _inverse_cdf(probs, uniform)
    else:
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(vocab, device=x.device)[None, :]
        keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
        keep &= sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
        # top-p comes last, over what top-k and min-p left, renormalised (vLLM: min-p, top-k, then top-p of the
        # renormalised rest). Those two keep a prefix of the sorted row, so its cumsum is the kept cumsum; keep a
        # token while the mass strictly before it is below top_p of the kept mass: the most likely token stays.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        kept_mass = (sorted_probs * keep).sum(dim=-1, keepdim=True)
        keep &= mass_before < top_p[:, None] * kept_mass
        tokens = order.gather(1, _inverse_cdf(sorted_probs * keep, uniform)[:, None])[:, 0]
        # A row that filters nothing draws in vocabulary order, as in the unfiltered variant: its token must not
        # depend on whether a batch mate asked for top-k/top-p/min-p (the same uniform walks another CDF here).
        unfiltered = (top_p >= 1) & (top_k <= 0) & (min_p <= 0)
        tokens = torch.where(unfiltered, _inverse_cdf(probs, uniform), tokens)
    tokens = torch.where(greedy, x.argmax(dim=-1), tokens)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    if top_n:
        top_values, top_ids = logprobs.topk(top_n, dim=-1)
        return tokens, chosen, top_values, top_ids
    return tokens, chosen, None, None


def _inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose running sum of (non-negative) `weights` exceeds uniform * total.

    The target is kept strictly below the total, so the index found has a positive weight (the CDF rises
    there); should float rounding still pick a zero weight, the row's most likely token is taken."""
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniform[:, None].to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    index = torch.searchsorted(cdf, target.contiguous(), right=True).clamp_(max=weights.shape[-1] - 1)
    picked = weights.gather(1, index)
    return torch.where(picked > 0, index, weights.argmax(dim=-1, keepdim=True))[:, 0]


def bias_entries(logit_bias, stop_ids, suppress_stops: bool, bad_words=(), output=()) -> list[tuple[int, float]]:
    """A row's sparse biases: its `logit_bias`, -inf on its stop ids while `min_tokens` holds them back, and vLLM's
    `bad_words` (token sequences): -inf on a word's last token when the row's `output` ends with the word's other
    tokens (a one-token word: always). A word of several tokens that does not apply keeps its entry as (0, 0.0), which
    adds nothing: the row's width stays the same at every step, so the buffers never grow (and graphs are never
    recaptured) as the output goes on."""
    entries = list(logit_bias)
    if suppress_stops:
        entries += [(token, float("-inf")) for token in sorted(stop_ids)]
    for word in bad_words:
        prefix = word[:-1]
        ends_with = not prefix or (len(output) >= len(prefix) and tuple(output[-len(prefix) :]) == prefix)
        entries.append((word[-1], float("-inf")) if ends_with else (0, 0.0))
    return entries


def allowed_bitmask(token_ids, vocab: int) -> np.ndarray:
    """`allowed_token_ids` as one row of a token bitmask: int32 words, bit j of word i = token 32 i + j allowed."""
    words = np.zeros((vocab + 31) // 32, dtype=np.uint32)
    ids = np.fromiter(token_ids, dtype=np.int64)
    np.bitwise_or.at(words, ids // 32, np.left_shift(np.uint32(1), (ids % 32).astype(np.uint32)))
    return words.view(np.int32)
