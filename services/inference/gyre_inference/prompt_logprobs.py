"""Prompt log-probs (vLLM's `prompt_logprobs`) from the hidden states a prefill already computed.

For a prompt t_0 .. t_{n-1}, entry i > 0 is log_softmax(logits_{i-1})[t_i], the log-prob of prompt token i given
the tokens before it, with its rank (1 = most likely) and the k most likely alternatives; entry 0 is None (nothing
precedes the first token). Raw model log-probs at temperature 1, whatever the request's temperature, as vLLM's.

The output head runs over the prompt in chunks of positions, so a long prompt never holds a [n, vocab] float32
tensor at once (a 4k-token prompt with a 150k vocabulary would be 2.4 GB).
"""

from __future__ import annotations

import torch

from gyre_inference.backend import PromptLogprob, PromptLogprobs

CHUNK = 256  # prompt positions per head + log_softmax: 256 x 150k x 4 bytes = 154 MB at most


def prompt_logprobs(hidden: torch.Tensor, head, prompt: list[int], k: int, chunk: int = CHUNK) -> PromptLogprobs:
    """Entries for `prompt` from `hidden` [len(prompt) - 1, H], the hidden states of positions 0 .. n-2 (each one
    predicts the next prompt token), and the model's output `head` (hidden -> logits)."""
    targets = torch.tensor(prompt[1:], dtype=torch.long, device=hidden.device)
    entries: list[PromptLogprob | None] = [None]
    for start in range(0, len(targets), chunk):
        logprobs = torch.log_softmax(head(hidden[start : start + chunk]).float(), dim=-1)
        wanted = targets[start : start + chunk]
        chosen = logprobs.gather(1, wanted[:, None])
        ranks = (logprobs > chosen).sum(dim=-1) + 1
        values, ids = logprobs.topk(k, dim=-1) if k else (None, None)
        chosen, ranks = chosen[:, 0].tolist(), ranks.tolist()
        values, ids = (values.tolist(), ids.tolist()) if k else ([()] * len(chosen), [()] * len(chosen))
        for row in range(len(chosen)):
            top = tuple(zip(ids[row], values[row], strict=True))
            entries.append(PromptLogprob(chosen[row], ranks[row], top))
    return tuple(entries)


def to_vllm(entries: PromptLogprobs, prompt: list[int], token_text) -> list[dict[str, dict] | None]:
    """vLLM's JSON shape: per prompt position None (the first) or {"<token id>": {"logprob", "rank",
    "decoded_token"}}, the prompt token first, then the top alternatives (`token_text(id)` names a token)."""
    out: list[dict[str, dict] | None] = [None] * min(1, len(entries))
    for token, entry in zip(prompt[1:], entries[1:], strict=True):
        ranked = {str(token): {"logprob": entry.logprob, "rank": entry.rank, "decoded_token": token_text(token)}}
        for rank, (alternative, logprob) in enumerate(entry.top, start=1):
            ranked.setdefault(str(alternative), {"logprob": logprob, "rank": rank,
                                                 "decoded_token": token_text(alternative)})  # fmt: skip
        out.append(ranked)
    return out
