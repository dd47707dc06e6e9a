"""Turn a rollout's model calls into one training sequence (token ids, loss mask, inference log-probs).

The rule (shared with the trainer through `gyre.batch`):

    sequence = turn_1.prompt_token_ids + turn_1.completion_token_ids
    for each later turn k:
        if turn_k.prompt_token_ids starts with the sequence:
            append the rest of turn_k's prompt (environment / tool tokens: mask False, log-prob 0.0)
            append turn_k.completion_token_ids (mask True, their inference log-probs)
        else:
            reject turn k: the sequence ends after turn k-1 ("drift")

Why: the trainer must see exactly the tokens the model sampled, with the log-probs they were sampled at.
Between turns the conversation is re-rendered by the chat template and re-tokenised by the server; usually
that reproduces the earlier tokens exactly (the completion includes `<|im_end|>`, the template adds the same
text after it), but a BPE merge across the boundary or a re-serialised tool call can change them. Splicing
anyway would train on tokens the model never sampled (or miss ones it did), so the sample is cut at the last
turn that is provably consistent and the rollout is flagged.
"""

from __future__ import annotations

from gyre.envs.types import Turn


class SequenceBuilder:
    """Accumulates turns; `add(turn)` returns False (and changes nothing) when the turn would break the rule."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.loss_mask: list[bool] = []
        self.logprobs: list[float] = []
        self.prompt_len = 0
        self.num_turns = 0
        self.version_min: int | None = None
        self.version_max: int | None = None

    def extends(self, turn: Turn) -> bool:
        """True iff `turn` can be appended: it is the first, or its prompt starts with the current sequence."""
        n = len(self.token_ids)
        return self.num_turns == 0 or (len(turn.prompt_token_ids) >= n and turn.prompt_token_ids[:n] == self.token_ids)

    def divergence(self, turn: Turn) -> int:
        """Where `turn`'s prompt first differs from the sequence so far (its length when it is a shorter prefix)."""
        prompt, n = turn.prompt_token_ids, min(len(turn.prompt_token_ids), len(self.token_ids))
        return next((i for i in range(n) if prompt[i] != self.token_ids[i]), n)

    def add(self, turn: Turn) -> bool:
        if not self.extends(turn):
            return False
        new_context = turn.prompt_token_ids[len(self.token_ids) :]
        if self.num_turns == 0:
            self.prompt_len = len(new_context)
        self.token_ids += new_context
        self.loss_mask += [False] * len(new_context)
        self.logprobs += [0.0] * len(new_context)
        self.token_ids += turn.completion_token_ids
        self.loss_mask += [True] * len(turn.completion_token_ids)
        self.logprobs += turn.completion_logprobs
        self.num_turns += 1
        lo, hi = turn.policy_version_min, turn.policy_version_max
        self.version_min = lo if self.version_min is None else min(self.version_min, lo)
        self.version_max = hi if self.version_max is None else max(self.version_max, hi)
        return True
