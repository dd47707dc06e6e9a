"""The distillation teacher: its log-prob of every token of a student's rollout (docs/algorithms.md).

One request per sample: the whole training sequence (prompt and every turn, as the student saw and sampled it)
as the prompt of the teacher's tokens-in route (`/inference/v1/generate`, or `/v1/completions` with a token-id
prompt) with `prompt_logprobs: 0` and one generated token; entry t of the answer's `prompt_logprobs` is the
teacher's log_softmax(logits)[token t] given tokens < t (temperature 1, vLLM's rule). The teacher must share the
student's tokenizer (the token ids are sent as they are).
"""

from __future__ import annotations

import math

from gyre.config.endpoint import TeacherConfig
from gyre.endpoint import Endpoint, EndpointError

#: a log-prob a little above 0 is rounding; anything beyond is not a log-probability
LOGPROB_MAX = 1e-3


class TeacherError(EndpointError):
    """The teacher's answer cannot be used (missing or misaligned prompt log-probs, impossible values)."""


def teacher_logprobs_from(entries, token_ids: list[int]) -> list[float]:
    """[0.0] + the teacher's log-prob of token_ids[t] for t >= 1, from vLLM's `prompt_logprobs` shape."""
    if not isinstance(entries, list) or len(entries) != len(token_ids):
        got = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise TeacherError(f"teacher: {got} prompt log-probs for {len(token_ids)} tokens")
    values = [0.0]
    for t in range(1, len(token_ids)):
        try:
            value = float(entries[t][str(token_ids[t])]["logprob"])
        except (KeyError, TypeError, ValueError):
            raise TeacherError(f"teacher: no prompt log-prob for token {token_ids[t]} at position {t}") from None
        if not (math.isfinite(value) and value <= LOGPROB_MAX):
            raise TeacherError(f"teacher: log-prob {value} at position {t} is not a log-probability")
        values.append(value)
    return values


class Teacher:
    """The teacher endpoint; `stats` counts its calls (orchestrator step events and metrics)."""

    def __init__(self, config: TeacherConfig):
        self.config = config
        self.endpoint = Endpoint(config, name="teacher")
        self.stats = self.endpoint.stats

    async def logprobs(self, token_ids: list[int]) -> list[float]:
        """The teacher's log-prob of each token of `token_ids` given the ones before (0.0 for the first)."""
        model = await self.endpoint.model()
        if self.config.route == "generate":
            params = {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
            request = {"model": model, "token_ids": token_ids, "sampling_params": params}
            body = await self.endpoint.post("/inference/v1/generate", request)
            entries = body.get("prompt_logprobs") if isinstance(body, dict) else None
        else:
            body = await self.endpoint.post("/v1/completions", {"model": model, "prompt": token_ids, "max_tokens": 1,
                                                                "temperature": 0.0, "prompt_logprobs": 0})  # fmt: skip
            try:
                entries = body["choices"][0]["prompt_logprobs"]
            except (KeyError, IndexError, TypeError):
                entries = None
        return teacher_logprobs_from(entries, token_ids)

    async def aclose(self) -> None:
        await self.endpoint.aclose()
